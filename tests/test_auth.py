"""API keys, tenants, the tenant's cache salt and per-tenant limits (issue 11, 3 and 6).

Unit tests of router/auth.py (the keys file, the comparison, the salt), then a real
router with a keys file and a real in-process decode worker on the tiny checkpoint,
over gRPC on loopback: refused without a key before any work, one tenant cannot see
another's cache through `cached_tokens`, a tenant's limit and its release, the
client and the CLI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac

import grpc
import pytest
from builders import one_torch_thread  # noqa: F401 (autouse fixture)
from router_fixtures import (
    ROUTER_CONFIG,
    decode_stream_held,
    start_cluster,
    tiny_engine_config,
    wait_for,
)

from pagedserve import cli, launch
from pagedserve.common.api.limits import ConfigError
from pagedserve.router import __main__ as router_main
from pagedserve.router import auth
from pagedserve.router.auth import (
    INVALID_KEY,
    MISSING_KEY,
    OPEN_TENANT,
    Authenticator,
    AuthError,
    Tenant,
    TenantLimitExceeded,
    TenantLimits,
    keyed_tenant,
    load_keys_file,
)
from pagedserve.router.client import Client
from pagedserve.router.config import RouterConfig
from pagedserve.router.frontend import ModelFrontend
from pagedserve.v1 import generation_pb2 as gen_pb

GREEDY = dict(temperature=0.0, ignore_eos=True)
KEYS = {"alpha": "key-alpha-0123456789", "beta": "key-beta-0123456789"}
GAMMA_KEY = "key-gamma-0123456789"  # tenant gamma: at most one request at a time
KEYS_FILE = f"""\
# key tenant [max_inflight]
{KEYS["alpha"]} alpha

{KEYS["beta"]}  beta
{GAMMA_KEY} gamma 1
"""


def ids(start: int, length: int) -> list[int]:
    """A prompt of distinct-looking ids inside the tiny vocabulary (320)."""
    return [3 + (start + 7 * i) % 310 for i in range(length)]


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


# -- the keys file ---------------------------------------------------------------------


def write(tmp_path, text: str, name: str = "keys") -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def test_keys_file_maps_keys_to_tenants_with_their_limits(tmp_path):
    keys = load_keys_file(write(tmp_path, KEYS_FILE + "key-gamma-2 gamma\n"))
    assert keys == {
        KEYS["alpha"]: keyed_tenant("alpha"),
        KEYS["beta"]: keyed_tenant("beta"),
        GAMMA_KEY: keyed_tenant("gamma", 1),
        "key-gamma-2": keyed_tenant("gamma", 1),  # a second key of gamma shares its limit
    }


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("k1 a\nk2 b\nk1 c\n", r"keys:3: duplicate key \(first on line 1\)"),
        ("# c\nk1 a\nk2\n", r"keys:3: expected 'KEY TENANT \[MAX_INFLIGHT\]', got 1 fields"),
        ("k1 a 2 x\n", r"keys:1: expected .* got 4 fields"),
        ("k1 a 0\n", r"keys:1: MAX_INFLIGHT must be a positive integer, got '0'"),
        ("k1 a many\n", r"keys:1: MAX_INFLIGHT must be a positive integer, got 'many'"),
        ("k1 a/b\n", r"keys:1: tenant 'a/b' must be 1-64 letters"),
        ("kéy a\n", r"keys:1: a key must be printable ASCII without spaces"),
        ("k1 a 2\nk2 a 3\n", r"keys:2: tenant 'a' has max_inflight 2 \(line 1\)"),
        ("# nothing\n\n", r"holds no key: the API would be open"),
    ],
)
def test_a_bad_keys_file_is_refused_naming_the_line(tmp_path, text, error):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=error) as err:
        Authenticator.from_config(None, path)
    assert "k1" not in str(err.value)  # never the key itself


def test_a_missing_keys_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        Authenticator.from_config(None, str(tmp_path / "nope"))


def test_api_key_is_tenant_default_and_may_join_a_file(tmp_path):
    a = Authenticator.from_config("solo-key", None)
    assert a.authenticate(bearer("solo-key")) == keyed_tenant("default")
    a = Authenticator.from_config("solo-key", write(tmp_path, KEYS_FILE))
    assert a.authenticate(bearer("solo-key")).name == "default"
    assert a.authenticate(bearer(GAMMA_KEY)).name == "gamma"
    with pytest.raises(ConfigError, match="api_key is also a key in"):
        Authenticator.from_config(GAMMA_KEY, write(tmp_path, KEYS_FILE))
    with pytest.raises(ConfigError, match="printable ASCII"):
        Authenticator.from_config("two words", None)
    assert "solo-key" not in repr(RouterConfig(api_key="solo-key"))


# -- authenticating --------------------------------------------------------------------


def test_no_key_configured_is_open():
    a = Authenticator.from_config(None, None)
    assert a.open
    assert a.authenticate(None) is OPEN_TENANT
    assert a.authenticate(bearer("anything")) is OPEN_TENANT


def test_missing_wrong_and_malformed_keys_are_refused(tmp_path):
    a = Authenticator.from_config(None, write(tmp_path, KEYS_FILE))
    for metadata, message in [
        (None, MISSING_KEY),
        ([("x-other", "1")], MISSING_KEY),
        (bearer("key-alpha-012345678"), INVALID_KEY),  # a prefix of a key
        (bearer(KEYS["alpha"] + "9"), INVALID_KEY),
        ([("authorization", KEYS["alpha"])], "must be 'Bearer <key>'"),
        ([("authorization", "Basic " + KEYS["alpha"])], "must be 'Bearer <key>'"),
        (bearer(KEYS["alpha"]) + bearer(KEYS["beta"]), "one 'authorization' metadata entry"),
    ]:
        with pytest.raises(AuthError, match=message):
            a.authenticate(metadata)
    assert a.authenticate([("authorization", f"bearer  {KEYS['beta']} ")]).name == "beta"


def test_every_key_is_compared_in_constant_time_without_early_exit(tmp_path, monkeypatch):
    a = Authenticator.from_config(None, write(tmp_path, KEYS_FILE))
    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(x: bytes, y: bytes) -> bool:
        calls.append((len(x), len(y)))
        return real(x, y)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    for key in (KEYS["alpha"], "short", "x" * 500):  # the first key, a miss, a long miss
        calls.clear()
        with contextlib.suppress(AuthError):
            a.authenticate(bearer(key))
        assert calls == [(32, 32)] * 3  # all three keys, digests of equal length


# -- the tenant's cache salt -----------------------------------------------------------


def test_the_tenant_decides_the_salt_and_the_client_only_splits_it():
    a, b, ab = keyed_tenant("a"), keyed_tenant("b"), keyed_tenant("ab")
    assert OPEN_TENANT.cache_salt(None) is None  # open: today's hashes
    assert OPEN_TENANT.cache_salt("") is None
    assert OPEN_TENANT.cache_salt("s") == "s"
    salts = [
        a.cache_salt(None),
        a.cache_salt("s"),
        a.cache_salt("b"),
        b.cache_salt(None),
        b.cache_salt("s"),
        ab.cache_salt(None),
        ab.cache_salt(""),
    ]
    assert a.cache_salt("") == a.cache_salt(None)  # the proto cannot tell them apart
    assert len(set(salts)) == len(salts) - 1  # ab's "" and None are one
    # The client cannot reach another tenant's salt, not even by sending it verbatim.
    assert a.cache_salt(b.cache_salt(None)) != b.cache_salt(None)
    assert all(s is not None and len(s) == 64 for s in salts)


def test_tenant_limits_count_and_release():
    limits = TenantLimits()
    g = keyed_tenant("g", 2)
    free = keyed_tenant("f")
    for _ in range(2):
        limits.acquire(g)
    with pytest.raises(TenantLimitExceeded, match="tenant 'g' has 2 requests running"):
        limits.acquire(g)
    for _ in range(5):
        limits.acquire(free)
    limits.release(g)
    limits.acquire(g)
    for t in (g, g, *[free] * 5):
        limits.release(t)
    assert not limits.inflight


def test_the_largest_valid_request_fits_the_public_message_limit():
    """router/server.py receives at most max_request_bytes: every request the limits
    accept must fit (the router refuses larger ones unparsed: test_router_limits)."""
    cfg = dataclasses.replace(ROUTER_CONFIG, model=tiny_engine_config().model)
    frontend = ModelFrontend(cfg)
    limit = frontend.max_request_bytes()
    big = dict(request_id="r" * cfg.max_request_id_bytes, cache_salt="s" * cfg.max_cache_salt_bytes)
    sampling = gen_pb.SamplingParams(max_tokens=1, stop=["x" * 64] * 16)
    prompts = [
        gen_pb.GenerateRequest(prompt="p" * cfg.max_prompt_bytes, **big, sampling=sampling),
        gen_pb.GenerateRequest(
            prompt_token_ids=gen_pb.TokenIds(ids=[2**31 - 1] * frontend.max_model_len),
            **big,
            sampling=sampling,
        ),
        gen_pb.GenerateRequest(
            messages=gen_pb.ChatMessages(
                messages=[
                    gen_pb.ChatMessage(role="u", content="c" * (cfg.max_prompt_bytes // 256 - 1))
                ]
                * cfg.max_messages
            ),
            **big,
            sampling=sampling,
        ),
    ]
    for request in prompts:
        assert request.ByteSize() <= limit, request.WhichOneof("input")


# -- a real router with keys -----------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "keys"
    path.write_text(KEYS_FILE)
    path.chmod(0o600)
    config = dataclasses.replace(ROUTER_CONFIG, api_keys_file=str(path), metrics_port=0)
    c = start_cluster(config, {"decode": 1})  # one worker: every tenant lands on its cache
    yield c
    c.stop()


def client_of(cluster, tenant: str | None, timeout: float = 60.0) -> Client:
    key = {**KEYS, "gamma": GAMMA_KEY}[tenant] if tenant else None
    return Client(cluster.address, timeout=timeout, api_key=key)


def router_is_clean(cluster) -> None:
    wait_for(
        lambda: (
            cluster.router.call(
                lambda r: (
                    r.admission.inflight,
                    len(r.active_requests),
                    dict(r.dispatcher.tenant_limits.inflight),
                )
            )
            == (0, 0, {})
        ),
        what="the router's slots, ids and tenant counts to return",
    )
    cluster.wait_quiescent()


def scrape(cluster, name: str, **labels: str) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    address = cluster.router.call(lambda r: r.metrics.server.address)
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                return s.value
    return 0.0


def test_no_or_wrong_key_is_unauthenticated_before_any_work(keyed, monkeypatch):
    frontend = keyed.router.call(lambda r: r.frontend)
    touched: list[str] = []
    for name in ("precheck", "tokenize"):
        real = getattr(frontend, name)
        monkeypatch.setattr(
            frontend, name, lambda *a, _n=name, _f=real: (touched.append(_n), _f(*a))[1]
        )
    before = keyed.router.call(lambda r: (r.counters["requests"], r.counters["unauthenticated"]))
    cases = [(None, MISSING_KEY), ("key-nobody", INVALID_KEY)]
    for key, message in cases:
        with Client(keyed.address, timeout=30, api_key=key) as c:
            for call in (lambda: c.collect(prompt="hello", max_tokens=2), c.model_info):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert err.value.details() == message
            assert c.health() == 1  # health stays open (load balancers probe it)
    after = keyed.router.call(lambda r: (r.counters["requests"], r.counters["unauthenticated"]))
    assert after == (before[0], before[1] + 4)  # the handler never started
    assert touched == []  # nothing was parsed for sizes, nothing tokenized
    # The metrics saw no request either (refusals before the handler are counted apart).
    assert scrape(keyed, "pagedserve:router_requests_received_total") == after[0]
    assert scrape(keyed, "pagedserve:router_requests_total", code="UNAUTHENTICATED") == 0
    with client_of(keyed, "alpha") as c:
        assert c.model_info().model_name == "llama-0"
        assert c.collect(prompt="hello", max_tokens=2, **GREEDY)[0].usage.completion_tokens == 2
    assert touched == ["precheck", "tokenize"]
    router_is_clean(keyed)


def test_an_oversized_request_is_refused_before_authentication(keyed):
    limit = keyed.router.call(lambda r: r.frontend.max_request_bytes())
    before = keyed.router.call(lambda r: (r.counters["requests"], r.counters["unauthenticated"]))
    with Client(keyed.address, timeout=30) as c, pytest.raises(grpc.RpcError) as err:
        c.collect(prompt="hi", cache_salt="s" * limit)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.value.details()
    after = keyed.router.call(lambda r: (r.counters["requests"], r.counters["unauthenticated"]))
    assert after == before  # gRPC refused it before the handler ran


def test_a_tenant_never_hits_another_tenants_cache(keyed):
    prompt = ids(100, 65)  # 4 full blocks of 16 before the last token
    cached = 64
    for salt in ("", "shared-salt"):
        prompt = [prompt[0] + 1, *prompt[1:]]  # fresh per round
        with client_of(keyed, "alpha") as a, client_of(keyed, "beta") as b:
            first = a.collect(token_ids=prompt, cache_salt=salt, max_tokens=2, **GREEDY)[0]
            assert first.usage.cached_tokens == 0
            # Same prompt, same client salt, same (only) worker: beta computes its own.
            other = b.collect(token_ids=prompt, cache_salt=salt, max_tokens=2, **GREEDY)[0]
            assert other.usage.cached_tokens == 0
            assert other.token_ids == first.token_ids  # same answer, only not shared
            again = a.collect(token_ids=prompt, cache_salt=salt, max_tokens=2, **GREEDY)[0]
            assert again.usage.cached_tokens == cached
            # beta has its own blocks now
            mine = b.collect(token_ids=prompt, cache_salt=salt, max_tokens=2, **GREEDY)[0]
            assert mine.usage.cached_tokens == cached
            # alpha's other client salt splits alpha's cache further
            split = a.collect(token_ids=prompt, cache_salt=salt + "x", max_tokens=2, **GREEDY)
            assert split[0].usage.cached_tokens == 0
    router_is_clean(keyed)


def test_a_tenant_at_its_limit_is_refused_and_gets_its_slot_back(keyed):
    long = dict(max_tokens=200, **GREEDY)
    with client_of(keyed, "gamma") as g, client_of(keyed, "beta") as b:
        # gamma's stream held at its first message: running, on any machine.
        with decode_stream_held() as held:
            stream = g.generate(token_ids=ids(300, 8), **long)
            held.wait()  # running
            with pytest.raises(grpc.RpcError) as err:
                g.collect(token_ids=ids(400, 8), max_tokens=2)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details().startswith(
                "tenant 'gamma' has 1 requests running or queued, its limit (max_inflight 1)"
            )
            assert b.collect(token_ids=ids(500, 8), max_tokens=2, **GREEDY)  # others go on
            stream.cancel()
            wait_for(
                lambda: (
                    keyed.router.call(lambda r: r.dispatcher.tenant_limits.inflight["gamma"]) == 0
                ),
                what="gamma's slot to return after the cancel",
            )
        # A request that fails after admission (a token id outside the vocabulary is
        # found while tokenizing) returns its slot too, as does one that finishes.
        with pytest.raises(grpc.RpcError) as err:
            g.collect(token_ids=[10_000], max_tokens=2)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for k in range(2):
            assert g.collect(token_ids=ids(600 + k, 8), max_tokens=2, **GREEDY)
    router_is_clean(keyed)


def test_request_ids_are_per_tenant(keyed):
    """Two tenants may use the same request_id at once (neither learns the other's ids
    are in flight); each gets its own id back; a tenant reusing its own in-flight id is
    refused as before."""
    long = dict(max_tokens=100, **GREEDY)
    with client_of(keyed, "alpha") as a, client_of(keyed, "beta") as b:
        # alpha's stream held at its first message: in flight, on any machine.
        with decode_stream_held() as held:
            stream = a.generate(token_ids=ids(700, 8), request_id="shared-id", **long)
            held.wait()
            got = list(
                b.generate(token_ids=ids(800, 8), request_id="shared-id", max_tokens=3, **GREEDY)
            )
            assert {r.request_id for r in got} == {"shared-id"}
            assert sum(len(r.token_ids) for r in got) == 3
            with pytest.raises(grpc.RpcError) as err:
                a.collect(token_ids=ids(900, 8), request_id="shared-id", max_tokens=2)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request_id 'shared-id' is already in flight" in err.value.details()
            assert "alpha" not in err.value.details()  # the client's own id, as it sent it
        rest = list(stream)
        assert {r.request_id for r in rest} == {"shared-id"}
        assert sum(len(r.token_ids) for r in rest) == 100
    router_is_clean(keyed)


def test_cli_sends_the_key_and_explains_a_refusal(keyed, monkeypatch, capsys):
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    argv = ["generate", "hello", "--address", keyed.address, "--max-tokens", "2"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"error: UNAUTHENTICATED: {MISSING_KEY}" in err
    assert "pass --api-key or set PAGEDSERVE_API_KEY" in err
    assert cli.main([*argv, "--api-key", "wrong"]) == 1
    assert "did not accept this API key" in capsys.readouterr().err
    monkeypatch.setenv("PAGEDSERVE_API_KEY", KEYS["beta"])
    assert cli.main([*argv, "--temperature", "0"]) == 0
    router_is_clean(keyed)


def test_router_flags_default_to_the_environment_and_refuse_a_bad_file(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    monkeypatch.setenv("PAGEDSERVE_API_KEYS_FILE", write(tmp_path, KEYS_FILE))
    config, _ = router_main.parse_config([])
    assert (config.api_key, config.api_keys_file) == ("from-env", str(tmp_path / "keys"))
    spec, _ = launch.parse_spec([])  # `pagedserve up`: the same flags, the same defaults
    assert spec.router_options["api_key"] == "from-env"
    assert launch.demo_key(spec) == "from-env"
    monkeypatch.delenv("PAGEDSERVE_API_KEY")
    assert launch.demo_key(launch.parse_spec([])[0]) == KEYS["alpha"]  # the file's first key
    bad = write(tmp_path, "k1 a\nk1 b\n", "bad")
    for parse in (router_main.parse_config, launch.parse_spec):
        with pytest.raises(SystemExit):
            parse(["--api-keys-file", bad])
        assert "bad:2: duplicate key (first on line 1)" in capsys.readouterr().err
    monkeypatch.delenv("PAGEDSERVE_API_KEYS_FILE")
    config, _ = router_main.parse_config([])
    assert (config.api_key, config.api_keys_file) == (None, None)


def test_tenant_is_frozen_and_its_salt_is_its_name():
    t = keyed_tenant("acme", 3)
    assert t == Tenant("acme", salt="acme", max_inflight=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.name = "other"  # type: ignore[misc]
