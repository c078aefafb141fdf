"""The .proto files and their generated stubs (scripts/gen_proto.py).

The stubs in pagedserve/v1 are build outputs: these tests fail when they are missing
or differ from what the .proto files generate now (stale), and hold the .proto files
to the project's rule that every message, field, enum value, service and RPC carries
a comment.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent


def _load_gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_proto = _load_gen_proto()
STUB_MODULES = [
    f"pagedserve.v1.{p.stem}{suffix}"
    for p in gen_proto.proto_files()
    for suffix in ("_pb2", "_pb2_grpc")
]


def test_the_design_proto_files_exist():
    names = {p.name for p in gen_proto.proto_files()}
    assert {"generation.proto", "kvtransfer.proto", "worker.proto"} <= names


def test_in_tree_stubs_match_a_fresh_generation():
    # Regenerates into a temporary directory and compares byte for byte.
    diff = gen_proto.differences(ROOT)
    assert diff == [], f"stale or missing stubs {diff}: run `python scripts/gen_proto.py`"


@pytest.mark.parametrize("name", STUB_MODULES)
def test_stubs_import(name):
    module = importlib.import_module(name)
    assert module.__name__ == name


def test_generate_is_idempotent_and_notices_a_newer_proto(tmp_path):
    assert gen_proto.generate(tmp_path) is True
    outputs = gen_proto.expected_outputs(gen_proto.proto_files(), tmp_path)
    assert all(o.exists() for o in outputs)
    assert gen_proto.generate(tmp_path) is False  # up to date: nothing rewritten
    # An output older than the .proto files counts as stale.
    os.utime(outputs[0], (0, 0))
    assert gen_proto.generate(tmp_path) is True
    # A stub whose .proto is gone is removed.
    orphan = tmp_path / "pagedserve" / "v1" / "gone_pb2.py"
    orphan.write_text("# stale\n")
    assert gen_proto.generate(tmp_path) is False
    assert not orphan.exists()


def test_check_mode_reports_a_hand_edited_stub(tmp_path):
    assert gen_proto.main(["--out", str(tmp_path)]) == 0
    assert gen_proto.main(["--check", "--out", str(tmp_path)]) == 0
    stub = tmp_path / "pagedserve" / "v1" / "generation_pb2.py"
    stub.write_text(stub.read_text() + "# edited\n")
    assert gen_proto.main(["--check", "--out", str(tmp_path)]) == 1


def test_script_runs_as_a_command(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "pagedserve" / "v1" / "worker_pb2_grpc.py").exists()


def test_generate_request_round_trips():
    from pagedserve.v1 import generation_pb2 as pb

    req = pb.GenerateRequest(
        request_id="req-1",
        messages=pb.ChatMessages(
            messages=[
                pb.ChatMessage(role="system", content="Be brief."),
                pb.ChatMessage(role="user", content="Capital of France?"),
            ]
        ),
        sampling=pb.SamplingParams(
            max_tokens=32,
            temperature=0.0,
            top_p=0.9,
            top_k=-1,
            min_p=0.05,
            repetition_penalty=1.1,
            seed=1234,
            stop=["\n\n", "END"],
            stop_token_ids=[2, 7],
            ignore_eos=True,
            n=1,
            logprobs=0,
        ),
        cache_salt="tenant-a",
    )
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.WhichOneof("input") == "messages"
    assert [(m.role, m.content) for m in back.messages.messages] == [
        ("system", "Be brief."),
        ("user", "Capital of France?"),
    ]
    s = back.sampling
    # temperature 0 (greedy) and logprobs 0 are present, not confused with "unset".
    assert s.HasField("temperature") and s.temperature == 0.0
    assert s.HasField("logprobs") and s.logprobs == 0
    assert (s.max_tokens, s.top_k, s.seed, s.n) == (32, -1, 1234, 1)
    assert list(s.stop) == ["\n\n", "END"] and list(s.stop_token_ids) == [2, 7]


def test_unset_sampling_fields_have_no_presence():
    from pagedserve.v1 import generation_pb2 as pb

    back = pb.GenerateRequest.FromString(pb.GenerateRequest(prompt="hi").SerializeToString())
    assert not back.HasField("request_id")
    assert not back.HasField("sampling")
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "logprobs"):
        assert not back.sampling.HasField(name), name


def test_input_is_a_oneof():
    from pagedserve.v1 import generation_pb2 as pb

    req = pb.GenerateRequest(prompt="text")
    req.prompt_token_ids.ids.extend([1, 2, 3])  # setting another member clears prompt
    assert req.WhichOneof("input") == "prompt_token_ids"
    assert req.prompt == ""


def test_generate_response_final_message_round_trips():
    from pagedserve.v1 import generation_pb2 as pb

    resp = pb.GenerateResponse(
        request_id="r",
        index=1,
        token_ids=[5, 6],
        text=" Paris",
        logprobs=[
            pb.TokenLogprobs(
                token_id=5, logprob=-0.5, rank=1, top=[pb.TopLogprob(token_id=5, logprob=-0.5)]
            ),
            pb.TokenLogprobs(token_id=6, logprob=-1.5, rank=2),
        ],
        finish_reason=pb.FINISH_REASON_STOP,
        stop_string=".",
        usage=pb.Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=8),
    )
    back = pb.GenerateResponse.FromString(resp.SerializeToString())
    assert back == resp
    assert back.WhichOneof("stop_matched") == "stop_string"
    assert pb.FinishReason.Name(back.finish_reason) == "FINISH_REASON_STOP"


def test_services_expose_the_engine_verbs():
    # The RPCs the design needs, with their types and streaming (services may grow).
    from pagedserve.v1 import generation_pb2, kvtransfer_pb2, worker_pb2

    expected = {
        (generation_pb2, "Generation"): {
            "Generate": ("GenerateRequest", "GenerateResponse", True),
            "GetModelInfo": ("GetModelInfoRequest", "ModelInfo", False),
        },
        (worker_pb2, "Prefill"): {
            "Prefill": ("PrefillRequest", "KVHandle", False),
            "ReleaseLease": ("ReleaseLeaseRequest", "ReleaseLeaseResponse", False),
        },
        (worker_pb2, "Decode"): {
            "Decode": ("DecodeRequest", "DecodeStep", True),
            "Abort": ("AbortRequest", "AbortResponse", False),
        },
        (worker_pb2, "WorkerStatus"): {"GetStats": ("GetStatsRequest", "WorkerStats", False)},
        (kvtransfer_pb2, "KVTransfer"): {"PullBlocks": ("PullRequest", "KVChunk", True)},
    }
    for (module, service), rpcs in expected.items():
        methods = module.DESCRIPTOR.services_by_name[service].methods_by_name
        for name, (request, response, streaming) in rpcs.items():
            m = methods[name]
            assert (m.input_type.name, m.output_type.name, m.server_streaming) == (
                request,
                response,
                streaming,
            ), f"{service}.{name}"


def _descriptor_set(tmp_path: Path) -> descriptor_pb2.FileDescriptorSet:
    out = tmp_path / "set.pb"
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{ROOT / 'proto'}",
        "--include_source_info",
        f"--descriptor_set_out={out}",
        *[str(p) for p in gen_proto.proto_files()],
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _declarations(fd: descriptor_pb2.FileDescriptorProto):
    """(source path, name) of every message, field, enum, enum value, service and RPC."""
    for i, msg in enumerate(fd.message_type):
        yield from _message_declarations(msg, (4, i), msg.name)
    for i, enum in enumerate(fd.enum_type):
        yield (5, i), enum.name
        for j, value in enumerate(enum.value):
            yield (5, i, 2, j), f"{enum.name}.{value.name}"
    for i, service in enumerate(fd.service):
        yield (6, i), service.name
        for j, method in enumerate(service.method):
            yield (6, i, 2, j), f"{service.name}.{method.name}"


def _message_declarations(msg, path, name):
    yield path, name
    for j, field in enumerate(msg.field):
        yield (*path, 2, j), f"{name}.{field.name}"
    for j, nested in enumerate(msg.nested_type):
        yield from _message_declarations(nested, (*path, 3, j), f"{name}.{nested.name}")


def test_every_declaration_carries_a_comment(tmp_path):
    missing = []
    for fd in _descriptor_set(tmp_path).file:
        comments = {
            tuple(loc.path): loc.leading_comments.strip() for loc in fd.source_code_info.location
        }
        missing += [
            f"{fd.name}: {name}" for path, name in _declarations(fd) if not comments.get(path)
        ]
    assert missing == []
