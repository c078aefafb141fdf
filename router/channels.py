"""The router's gRPC channels to its workers: one per address, closed once unneeded.

Channels keep HTTP/2 keepalive (common/runtime/grpc_options.py), so a silently cut
link fails its calls within ~20 s even where no timer would. Channels to workers that
left the registry are closed once their last call ended (`WorkerChannels.use`): Ray
restarts workers on new ports, so the map would otherwise only grow.

On the router's event loop only (no locks).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from pagedserve.common.runtime.grpc_options import CHANNEL_OPTIONS
from pagedserve.common.runtime.tls import aio_channel
from pagedserve.router.registry import WorkerRegistry


@dataclass(eq=False)
class WorkerChannels:
    """One channel per worker address (gRPC reconnects it), counted while in use.

    `spawn` runs a coroutine in the background (the router's, so that `stop` waits for
    the closes); `counters` gets "channels_closed". `credentials`: mutual TLS to the
    workers (common/runtime/tls.py internal_channel_credentials), None = plaintext.
    """

    registry: WorkerRegistry
    counters: collections.Counter[str]
    spawn: Callable[[Coroutine[Any, Any, Any]], None]
    credentials: grpc.ChannelCredentials | None = None
    open: dict[str, grpc.aio.Channel] = field(default_factory=dict, init=False)
    _users: collections.Counter[str] = field(default_factory=collections.Counter, init=False)

    def get(self, address: str) -> grpc.aio.Channel:
        """The channel to `address`, opened if needed; calls take it through `use`."""
        ch = self.open.get(address)
        if ch is None:
            ch = aio_channel(address, self.credentials, CHANNEL_OPTIONS)
            self.open[address] = ch
        return ch

    @contextlib.contextmanager
    def use(self, address: str) -> Iterator[grpc.aio.Channel]:
        """The channel to `address`, counted as in use until the block ends."""
        ch = self.get(address)
        self._users[address] += 1
        try:
            yield ch
        finally:
            self._users[address] -= 1
            if self._users[address] <= 0:
                del self._users[address]
                self.prune(address)

    def prune(self, address: str) -> None:
        """Closes the channel to `address` if no live worker has it and no call uses it."""
        if self._users.get(address) or address not in self.open:
            return
        if any(w.address == address for w in self.registry.workers()):
            return
        ch = self.open.pop(address)
        self.counters["channels_closed"] += 1
        self.spawn(ch.close())

    async def close_all(self) -> None:
        for ch in self.open.values():
            await ch.close()
        self.open.clear()
