"""Two planes, TLS and mutual TLS (issue 11), over real gRPC on loopback.

The router's public port serves only Generation, health and reflection; the workers'
Registry and the embedded PrefixIndex live on its internal listener. Certificates are
made here at test time with trustme (never committed): one CA for the public port, one
for the internal plane, and a stranger CA whose certificates must be refused. They all
name 127.0.0.1 and localhost, the hosts the tests dial.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest
import trustme
from builders import tiny_checkpoint
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from router_fixtures import MAX_MODEL_LEN, ROUTER_CONFIG, Cluster, tiny_engine_config, wait_for

from pagedserve.common.api.limits import ConfigError
from pagedserve.common.api.sampling_params import SamplingParams
from pagedserve.common.core.llm import LLM
from pagedserve.common.runtime.grpc_options import HEARTBEAT_CHANNEL_OPTIONS
from pagedserve.common.runtime.prefix_index.base import IndexUnavailableError
from pagedserve.common.runtime.prefix_index.remote import RemotePrefixIndex
from pagedserve.common.runtime.tls import (
    TLSFiles,
    client_channel_credentials,
    internal_channel_credentials,
)
from pagedserve.router.client import Client, explain
from pagedserve.router.config import RouterConfig
from pagedserve.router.server import start_router_in_thread
from pagedserve.v1 import admin_pb2, index_pb2, kvtransfer_pb2, worker_pb2, worker_pb2_grpc

HOSTS = ("127.0.0.1", "localhost")
MAX_TOKENS = 12
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PUBLIC_SERVICES = {
    "pagedserve.v1.Generation",
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
}


@dataclasses.dataclass(frozen=True)
class Certs:
    public: TLSFiles  # the router's public port (certfile + keyfile)
    public_ca: str  # what its clients trust
    internal: TLSFiles  # router and workers: mutual TLS
    stranger: TLSFiles  # a certificate from another CA (trusting the internal CA)
    stranger_ca: str


def _issue(ca: trustme.CA, where: Path, name: str) -> tuple[str, str]:
    cert = ca.issue_cert(*HOSTS)
    certfile, keyfile = where / f"{name}.crt", where / f"{name}.key"
    certfile.write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(keyfile))
    return str(certfile), str(keyfile)


def _ca_file(ca: trustme.CA, where: Path, name: str) -> str:
    path = where / f"{name}-ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    where = tmp_path_factory.mktemp("certs")
    public_ca, internal_ca, stranger_ca = trustme.CA(), trustme.CA(), trustme.CA()
    internal_ca_file = _ca_file(internal_ca, where, "internal")
    return Certs(
        public=TLSFiles(*_issue(public_ca, where, "public")),
        public_ca=_ca_file(public_ca, where, "public"),
        internal=TLSFiles(*_issue(internal_ca, where, "internal"), internal_ca_file),
        # It knows the internal CA (a CA certificate is no secret) but its own
        # certificate is not signed by it: the servers must refuse it.
        stranger=TLSFiles(*_issue(stranger_ca, where, "stranger"), internal_ca_file),
        stranger_ca=_ca_file(stranger_ca, where, "stranger"),
    )


@pytest.fixture(scope="module")
def reference():
    llm = LLM(
        str(tiny_checkpoint("llama")), dtype="float32", num_blocks=64, max_model_len=MAX_MODEL_LEN
    )
    return lambda ids: llm.generate([ids], SamplingParams(**GREEDY))[0].completions[0].token_ids


def ids(start: int, length: int) -> list[int]:
    return [3 + (start + 7 * i) % 310 for i in range(length)]


# -- two planes ---------------------------------------------------------------------------


def _internal_methods() -> list[tuple[str, bool]]:
    """(path, server-streaming) of every method of every internal service."""
    methods = []
    for module in (worker_pb2, index_pb2, kvtransfer_pb2, admin_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                methods.append((f"/{service.full_name}/{m.name}", m.server_streaming))
    return methods


def _call_raw(channel: grpc.Channel, path: str, streaming: bool) -> grpc.RpcError | None:
    """Calls `path` with an empty message; the error it ends with, or None."""
    try:
        if streaming:
            list(channel.unary_stream(path)(b"", timeout=5))
        else:
            channel.unary_unary(path)(b"", timeout=5)
    except grpc.RpcError as e:
        return e
    return None


def _services(channel: grpc.Channel) -> set[str]:
    return set(ProtoReflectionDescriptorDatabase(channel).get_services())


@pytest.fixture(scope="module")
def bare_router():
    config = RouterConfig(port=0, model=str(tiny_checkpoint("llama")), max_model_len=MAX_MODEL_LEN)
    with start_router_in_thread(config) as router:
        yield router


def test_internal_services_are_unimplemented_on_the_public_port(bare_router):
    methods = _internal_methods()
    names = {path.split("/")[1] for path, _ in methods}
    assert {
        "pagedserve.v1.Registry",
        "pagedserve.v1.Prefill",
        "pagedserve.v1.Decode",
        "pagedserve.v1.WorkerStatus",
        "pagedserve.v1.PrefixIndex",
        "pagedserve.v1.KVTransfer",
        "pagedserve.v1.Admin",
    } <= names
    assert bare_router.address != bare_router.internal_address
    with grpc.insecure_channel(bare_router.address) as ch:
        for path, streaming in methods:
            e = _call_raw(ch, path, streaming)
            assert e is not None and e.code() == grpc.StatusCode.UNIMPLEMENTED, path
        assert _services(ch) == PUBLIC_SERVICES
        stub = worker_pb2_grpc.RegistryStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Heartbeat(worker_pb2.HeartbeatRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with Client(bare_router.address, timeout=10) as c:  # the public API answers there
        assert c.model_info().model_name == "llama-0"


def test_internal_listener_serves_registry_index_admin_and_health_only(bare_router):
    with grpc.insecure_channel(bare_router.internal_address) as ch:
        assert _services(ch) == {
            "pagedserve.v1.Registry",
            "pagedserve.v1.PrefixIndex",
            "pagedserve.v1.Admin",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        }
        # Served (the router answers, and refuses this stranger model): not UNIMPLEMENTED.
        stats = worker_pb2.WorkerStats(worker_id="x", model_name="other@1")
        with pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.RegistryStub(ch).Heartbeat(
                worker_pb2.HeartbeatRequest(stats=stats), timeout=5
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no workers
        generate = "/pagedserve.v1.Generation/GetModelInfo"
        e = _call_raw(ch, generate, streaming=False)
        assert e is not None and e.code() == grpc.StatusCode.UNIMPLEMENTED
    assert bare_router.internal_address.startswith("127.0.0.1:")  # loopback by default
    assert bare_router.call(lambda r: r.registry.workers()) == []


# -- configuration --------------------------------------------------------------------------


def test_tls_files_are_checked_where_configured(tmp_path, certs):
    with pytest.raises(ConfigError, match="TLS certfile '.*/missing.crt' does not exist"):
        TLSFiles(str(tmp_path / "missing.crt"), certs.internal.keyfile)
    with pytest.raises(ConfigError, match="TLS needs a certificate and its key"):
        TLSFiles(certfile=certs.internal.certfile)
    with pytest.raises(ConfigError, match="internal_tls .mutual TLS. needs a CA file"):
        RouterConfig(port=0, internal_tls=certs.public)  # no CA: cannot check peers


def internal_flags(files: TLSFiles) -> list[str]:
    return [
        *("--internal-ssl-certfile", str(files.certfile)),
        *("--internal-ssl-keyfile", str(files.keyfile)),
        *("--internal-ssl-ca-certs", str(files.ca_certs)),
    ]


def test_router_and_launcher_take_the_tls_flags(certs, capsys):
    from pagedserve import launch
    from pagedserve.router import __main__ as router_main

    public = [
        "--ssl-certfile",
        str(certs.public.certfile),
        "--ssl-keyfile",
        str(certs.public.keyfile),
    ]
    argv = [*public, *internal_flags(certs.internal), "--internal-port", "0"]
    config, _ = router_main.parse_config(argv)
    assert (config.public_tls, config.internal_tls) == (certs.public, certs.internal)
    assert (config.internal_host, config.internal_port) == ("127.0.0.1", 0)
    assert router_main.parse_config([])[0].internal_tls is None  # plaintext by default

    spec, _ = launch.parse_spec([*argv, "--ssl-ca-certs", certs.public_ca])
    cluster = launch.Cluster(spec)
    router = cluster.router_config()
    assert router.internal_tls == certs.internal and router.internal_port == 0
    assert router.public_tls == dataclasses.replace(certs.public, ca_certs=certs.public_ca)
    assert cluster.worker_config("decode", 0, "127.0.0.1:1").internal_tls == certs.internal
    default, _ = launch.parse_spec([])  # `pagedserve up` with no configuration
    assert (default.internal_host, default.internal_port) == ("127.0.0.1", 50052)
    assert default.public_tls is None and default.internal_tls is None

    for parse in (router_main.parse_config, launch.parse_spec):
        for half, message in (
            (internal_flags(certs.internal)[:4], "needs a CA file"),
            (public[:2], "TLS needs a certificate and its key"),
        ):
            with pytest.raises(SystemExit) as exit_:
                parse(half)
            assert exit_.value.code == 2
            assert message in capsys.readouterr().err


# -- TLS and mutual TLS ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def secure(certs):
    """Router (TLS public port, mTLS internal) + 1 prefill + 1 decode with mTLS, moving
    KV between them over gRPC and publishing to the router's index."""
    engine = tiny_engine_config()
    config = dataclasses.replace(
        ROUTER_CONFIG,
        model=engine.model,
        public_tls=certs.public,
        internal_tls=certs.internal,
        http_port=0,  # the OpenAI-compatible API: HTTPS with the public certificate
    )
    cluster = Cluster(start_router_in_thread(config), engine)
    try:
        for wid, pool in (("p0", "prefill"), ("d0", "decode")):
            cluster.add_worker(
                wid,
                pool,
                internal_tls=certs.internal,
                kv_transport="grpc",
                index_address=cluster.internal_address,
            )
        yield cluster
    finally:
        cluster.stop()


def test_tls_client_gets_the_plaintext_tokens_end_to_end_with_a_kv_pull(secure, certs, reference):
    prompt = ids(100, 40)  # > disagg_min_prompt_tokens: prefill on p0, KV pulled by d0
    decode = secure.workers["d0"]
    pulls_before = decode.kv_transport.stats.snapshot().pulls.get("grpc", 0)
    with Client(secure.address, timeout=60, ssl_ca_certs=certs.public_ca) as c:
        (got,) = c.collect(token_ids=prompt, **GREEDY)
    assert got.token_ids == reference(prompt)
    assert decode.kv_transport.stats.snapshot().pulls.get("grpc", 0) == pulls_before + 1
    # The prefill worker published its blocks over mTLS to the router's index.
    wait_for(
        lambda: secure.router.call(lambda r: "p0" in r.prefix.index().workers()),
        what="p0 to publish its blocks to the embedded index",
    )
    secure.wait_quiescent()


def test_plaintext_or_wrongly_trusting_clients_are_refused_on_the_tls_port(secure, certs):
    for client, hint in (
        (Client(secure.address, timeout=10), "if the router serves TLS, give --ssl-ca-certs"),
        (
            Client(secure.address, timeout=10, ssl_ca_certs=certs.stranger_ca),  # another CA
            "give --ssl-ca-certs the CA that signed the router's certificate",
        ),
    ):
        with client, pytest.raises(grpc.RpcError) as err:
            client.model_info()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert hint in explain(err.value, secure.address)
    with Client(secure.address, timeout=10, ssl_ca_certs=certs.public_ca) as c:
        assert c.model_info().model_name == "llama-0"


def _heartbeat(address: str, creds: grpc.ChannelCredentials | None, stats) -> None:
    if creds is None:
        ch = grpc.insecure_channel(address, options=HEARTBEAT_CHANNEL_OPTIONS)
    else:
        ch = grpc.secure_channel(address, creds, options=HEARTBEAT_CHANNEL_OPTIONS)
    with ch:
        worker_pb2_grpc.RegistryStub(ch).Heartbeat(
            worker_pb2.HeartbeatRequest(stats=stats), timeout=5
        )


def test_a_worker_with_another_cas_certificate_cannot_register(secure, certs):
    stats = secure.workers["d0"].stats()
    stats.worker_id = "rogue"  # a real worker's report, under another name
    for creds in (None, internal_channel_credentials(certs.stranger)):
        with pytest.raises(grpc.RpcError) as err:
            _heartbeat(secure.internal_address, creds, stats)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not secure.registered("rogue")
    # Nor publish to the index.
    rogue_index = RemotePrefixIndex(
        secure.internal_address, credentials=internal_channel_credentials(certs.stranger)
    )
    with pytest.raises(IndexUnavailableError, match="UNAVAILABLE"):
        rogue_index.heartbeat("rogue", 10.0)
    rogue_index.close()
    assert "rogue" not in secure.router.call(lambda r: r.prefix.index().workers())
    # The same heartbeat with the internal CA's certificate registers: the refusal was
    # the certificate's.
    _heartbeat(secure.internal_address, internal_channel_credentials(certs.internal), stats)
    assert secure.registered("rogue")
    assert secure.router.call(lambda r: r.registry.goodbye("rogue"))
    assert sorted(secure.router.live_worker_ids()) == ["d0", "p0"]


def test_a_caller_without_a_client_certificate_cannot_call_a_worker(secure, certs):
    worker = secure.workers["p0"]
    server_only = client_channel_credentials(certs.internal.ca_certs)  # no client cert
    request = worker_pb2.PrefillRequest(
        request=worker_pb2.TokenizedRequest(request_id="x", prompt_token_ids=ids(1, 20))
    )
    for ch in (
        grpc.insecure_channel(worker.address),
        grpc.secure_channel(worker.address, server_only),
        grpc.secure_channel(worker.address, internal_channel_credentials(certs.stranger)),
    ):
        with ch:
            with pytest.raises(grpc.RpcError) as err:
                worker_pb2_grpc.PrefillStub(ch).Prefill(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            decode = worker_pb2_grpc.DecodeStub(ch).Decode(
                worker_pb2.DecodeRequest(request=request.request), timeout=5
            )
            with pytest.raises(grpc.RpcError) as err:
                list(decode)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(worker.address, internal_channel_credentials(certs.internal)) as ch:
        stats = worker_pb2_grpc.WorkerStatusStub(ch).GetStats(
            worker_pb2.GetStatsRequest(), timeout=5
        )
    assert stats.worker_id == "p0"
    secure.wait_quiescent()


def test_status_over_mutual_tls_needs_the_internal_certificate(secure, certs, capsys):
    """`pagedserve status` against an mTLS cluster: with the internal CA's certificate it
    reads the cluster; plaintext, or another CA's certificate, is refused."""
    import io
    import json

    from pagedserve import admin_cli

    files = certs.internal
    mtls = ["--internal-ssl-certfile", files.certfile, "--internal-ssl-keyfile", files.keyfile]
    mtls += ["--internal-ssl-ca-certs", files.ca_certs]
    out = io.StringIO()
    argv = ["--json", "--address", secure.internal_address]
    assert admin_cli.main("status", [*argv, *mtls], out=out) == 0
    assert sorted(w["worker_id"] for w in json.loads(out.getvalue())["workers"]) == ["d0", "p0"]
    stranger = [a if a != files.certfile else certs.stranger.certfile for a in mtls]
    stranger = [a if a != files.keyfile else certs.stranger.keyfile for a in stranger]
    for extra in ([], stranger):
        assert admin_cli.main("status", [*argv, *extra], out=io.StringIO()) == 1
        assert "UNAVAILABLE" in capsys.readouterr().err
    assert admin_cli.main("status", [*argv, *mtls[:4]], out=io.StringIO()) == 2  # no CA
    assert "needs a CA file" in capsys.readouterr().err


def test_a_worker_on_all_interfaces_advertises_a_name_its_certificate_can_carry(certs):
    """Under mutual TLS a worker listening on 0.0.0.0 advertises its FQDN (certificates
    name hosts, deploy/'s cover the headless Service names), not its pod IP."""
    import socket

    from pagedserve.common.runtime.worker import WorkerConfig
    from pagedserve.worker import auto_advertise_host

    config = WorkerConfig(worker_id="d0", pool="decode", host="0.0.0.0", advertise_host="auto")
    secured = dataclasses.replace(config, internal_tls=certs.internal)
    assert auto_advertise_host(secured) == socket.getfqdn()


def test_the_http_api_is_https_with_the_public_certificate(secure, certs):
    """With TLS on the public port the OpenAI-compatible API is HTTPS too (same files):
    nothing public answers in plaintext beside it."""
    import ssl

    import httpx2 as httpx  # the openai SDK's HTTP client
    import openai

    http = secure.router.router.http
    assert http.scheme == "https"
    name = secure.router.router.frontend.model_name

    def sdk(scheme: str, ca: str | None = None) -> openai.OpenAI:
        """The SDK on `scheme`, trusting `ca` (the system's roots when None)."""
        trust = ssl.create_default_context(cafile=ca) if ca else True
        return openai.OpenAI(
            base_url=f"{scheme}://{http.address}/v1",
            api_key="x",
            http_client=httpx.Client(verify=trust),
            max_retries=0,
        )

    with sdk("https", certs.public_ca) as c:
        got = c.completions.create(model=name, prompt="hello", max_tokens=3, temperature=0)
        assert got.usage.completion_tokens == 3
    # Plaintext HTTP to the TLS port, and a client that trusts another CA.
    for c in (sdk("http"), sdk("https", certs.stranger_ca)):
        with c, pytest.raises(openai.APIConnectionError):
            c.models.list()
    secure.wait_quiescent()
