"""Network namespaces for partition tests: hosts, links to cut, real processes, proxies.

    lab = NetLab.create("ps1234")              # pytest.skip if `ip netns add` is refused
    r, p = lab.add_ns("r"), lab.add_ns("p")
    link = lab.link(r, "192.0.2.1", p, "192.0.2.2")   # a veth pair, a /30 each side
    proc = lab.start(p, SCRIPT, config)         # python -c SCRIPT inside namespace p
    lab.down(link.b); lab.up(link.b)            # cut / restore a cable
    lab.shape(link.b, "1mbit", "32kbit", "400ms")   # tbf on what that end sends
    fwd = lab.forward(None, ("127.0.0.1", 0), r, ("127.0.0.1", 50051))  # root -> r
    lab.close()                                 # processes, proxies, qdiscs, namespaces

Hosts talk over point-to-point veth pairs with addresses from 192.0.2.0/24
(TEST-NET-1, never routed); no namespace forwards packets, so traffic stays on the
links made here. Veths between the root namespace and a namespace do not pass
traffic on this sandbox's kernel (ARP never resolves), veths between two namespaces
do: every party of a test lives in a namespace of its own, and the test process
reaches them through a `Forwarder` whose far socket is created inside the target
namespace (a thread that `setns()`es there: a socket belongs to the namespace of
the thread that created it).

`Forwarder` is also the fault-injecting TCP proxy (this kernel has no netem):
`delay_s` before each forwarded read, `blackhole` (hold every byte both ways, as
total packet loss does; TCP delivers it all once it ends), `reset()` (RST every
open connection).

Everything made is recorded and removed in `close()`: processes by the PID started
here (stdin closed, then SIGTERM, then SIGKILL), proxies, qdiscs, namespaces (their
veths go with them). Names carry a tag (pid-derived) so concurrent runs never meet.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=20)


def in_netns(ns: str | None, fn: Callable[[], T]) -> T:
    """`fn()` on a thread inside namespace `ns` (None: this process's own)."""
    if ns is None:
        return fn()
    box: dict[str, object] = {}

    def run() -> None:
        try:
            fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, name=f"netns-{ns}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


@dataclass(frozen=True)
class End:
    ns: str
    dev: str
    address: str


@dataclass(frozen=True)
class Link:
    a: End
    b: End


class ControlledProcess:
    """A subprocess driven over stdin/stdout: it prints `READY ...` once up, then
    answers each command line with one `STATE <json>` (or `ERROR ...`) line."""

    def __init__(self, proc: subprocess.Popen, name: str) -> None:
        self.proc = proc
        self.name = name
        self.lines: queue.Queue[str] = queue.Queue()
        self.ready = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put("EOF")

    def _answer(self, timeout: float) -> str:
        while True:
            line = self.lines.get(timeout=timeout)
            if line.startswith(("READY", "STATE", "ERROR", "EOF")):
                return line

    def wait_ready(self, timeout: float = 120.0) -> str:
        line = self._answer(timeout)
        if not line.startswith("READY"):
            raise RuntimeError(f"{self.name} did not start: {line}")
        self.ready = line.partition(" ")[2]
        return self.ready

    def command(self, text: str, timeout: float = 30.0):
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        line = self._answer(timeout)
        if not line.startswith("STATE"):
            raise AssertionError(f"{self.name}: {text!r} -> {line}")
        return json.loads(line.partition(" ")[2])

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful (stdin closed), then SIGTERM, then SIGKILL: our own PID only."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout)
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class Forwarder:
    """TCP from `listen` (in namespace `listen_ns`) to `target` (in `target_ns`), with
    faults on demand (see the module docstring)."""

    def __init__(
        self,
        listen_ns: str | None,
        listen: tuple[str, int],
        target_ns: str | None,
        target: tuple[str, int],
    ) -> None:
        self.target_ns = target_ns
        self.target = target
        self.delay_s = 0.0
        self.blackhole = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._server = in_netns(listen_ns, lambda: socket.create_server(listen))
        self.address = self._server.getsockname()[:2]
        threading.Thread(target=self._accept, name="forwarder", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            try:
                upstream = in_netns(
                    self.target_ns, lambda: socket.create_connection(self.target, timeout=5)
                )
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if self.delay_s:
                    time.sleep(self.delay_s)
                while self.blackhole.is_set():
                    time.sleep(0.02)
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def reset(self) -> None:
        """Abort every open connection, both ways.

        A close() would not do: a socket another thread is blocked reading stays open
        until that read returns. shutdown() wakes the readers (the peers see the
        connection end), and with SO_LINGER 0 the final close sends a RST."""
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        self._server.close()
        self.blackhole.clear()
        self.reset()


@dataclass
class NetLab:
    tag: str
    namespaces: list[str] = field(default_factory=list)
    shaped: list[End] = field(default_factory=list)
    processes: list[ControlledProcess] = field(default_factory=list)
    forwarders: list[Forwarder] = field(default_factory=list)

    @classmethod
    def create(cls, tag: str) -> NetLab:
        """An empty lab; pytest.skip where network namespaces are refused."""
        lab = cls(tag)
        probe = f"{tag}probe"
        done = _run("ip", "netns", "add", probe, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot create a network namespace here: {done.stderr.strip()}")
        _run("ip", "netns", "del", probe, check=False)
        return lab

    def add_ns(self, name: str) -> str:
        ns = f"{self.tag}{name}"
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def link(self, a_ns: str, a_addr: str, b_ns: str, b_addr: str, bits: int = 30) -> Link:
        """A veth pair between two namespaces, each end addressed and up."""
        a = End(a_ns, f"{a_ns[-6:]}-{b_ns[-6:]}"[:15], a_addr)
        b = End(b_ns, f"{b_ns[-6:]}-{a_ns[-6:]}"[:15], b_addr)
        _run("ip", "link", "add", a.dev, "netns", a.ns, "type", "veth", "peer", "name", b.dev,
             "netns", b.ns)  # fmt: skip
        for end in (a, b):
            _run("ip", "-n", end.ns, "addr", "add", f"{end.address}/{bits}", "dev", end.dev)
            _run("ip", "-n", end.ns, "link", "set", end.dev, "up")
        return Link(a, b)

    def add_local(self, ns: str, address: str) -> None:
        """An extra address on the namespace's loopback (a proxy can listen on it)."""
        _run("ip", "-n", ns, "addr", "add", f"{address}/32", "dev", "lo")

    # -- faults ---------------------------------------------------------------------------

    def down(self, end: End) -> None:
        _run("ip", "-n", end.ns, "link", "set", end.dev, "down")

    def up(self, end: End) -> None:
        _run("ip", "-n", end.ns, "link", "set", end.dev, "up")

    def shape(self, end: End, rate: str, burst: str, latency: str) -> None:
        """A token bucket on what `end` sends."""
        _run("tc", "-n", end.ns, "qdisc", "add", "dev", end.dev, "root", "tbf", "rate", rate,
             "burst", burst, "latency", latency)  # fmt: skip
        self.shaped.append(end)

    def unshape(self, end: End) -> None:
        _run("tc", "-n", end.ns, "qdisc", "del", "dev", end.dev, "root", check=False)
        with contextlib.suppress(ValueError):
            self.shaped.remove(end)

    # -- processes and proxies ------------------------------------------------------------

    def start(self, ns: str, script: str, config: dict, env: dict[str, str] | None = None):
        """`python -c script JSON(config)` inside namespace `ns`."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", script, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        p = ControlledProcess(proc, f"{ns}:{config.get('worker_id', 'router')}")
        self.processes.append(p)
        return p

    def forward(
        self,
        listen_ns: str | None,
        listen: tuple[str, int],
        target_ns: str | None,
        target: tuple[str, int],
    ) -> Forwarder:
        f = Forwarder(listen_ns, listen, target_ns, target)
        self.forwarders.append(f)
        return f

    def close(self) -> None:
        """Stops our processes and proxies, removes qdiscs and namespaces (veths go too)."""
        for p in reversed(self.processes):
            p.stop()
        self.processes.clear()
        for f in self.forwarders:
            f.close()
        self.forwarders.clear()
        for end in list(self.shaped):
            self.unshape(end)
        for ns in reversed(self.namespaces):
            _run("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()
