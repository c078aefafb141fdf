"""The layering, as a running process sees it (the import-graph side is `make lint`).

The router process and the client CLI must not load torch (nor anything of the
engine): each check runs in a fresh interpreter, since this one has torch loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.builders import tiny_checkpoint

ENGINE = ("torch", "triton", "safetensors", "pagedserve.common.core")


def loaded_after(code: str) -> list[str]:
    """Which ENGINE modules (or their submodules) `code` left in sys.modules."""
    probe = (
        f"{code}\nimport json, sys\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {ENGINE!r} "
        f"or m.startswith('pagedserve.common.core'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_client_loads_no_torch():
    assert loaded_after("import pagedserve.router.client") == []


def test_the_lease_release_call_the_router_shares_loads_no_torch():
    assert loaded_after("import pagedserve.common.runtime.leases") == []


def test_the_router_serving_a_model_loads_no_torch():
    """Importing the router's server and tokenizing a chat request against a real
    (tiny) checkpoint: the tokenizer is the torch-free fast one."""
    ckpt = tiny_checkpoint("llama")
    code = (
        "import pagedserve.router.server\n"
        "from pagedserve.router.config import RouterConfig\n"
        "from pagedserve.router.frontend import ModelFrontend\n"
        "from pagedserve.v1 import generation_pb2 as gen_pb\n"
        f"f = ModelFrontend(RouterConfig(model={str(ckpt)!r}))\n"
        "r = f.resolve(gen_pb.GenerateRequest(prompt='hello world'))\n"
        "assert r.prompt_token_ids, r\n"
    )
    assert loaded_after(code) == []


def test_router_and_engine_tokenize_alike():
    """One tokenizer loader for both sides: the engine's ids equal the router's."""
    from pagedserve.common.api.tokenizer import load_tokenizer
    from pagedserve.common.core.loader import load_model

    ckpt = tiny_checkpoint("llama")
    engine_tok = load_model(str(ckpt)).tokenizer
    router_tok = load_tokenizer(ckpt)
    text = "The capital of France is Paris, of Italy Rome."
    assert engine_tok.encode(text) == router_tok.encode(text)
    assert type(engine_tok) is type(router_tok)
