"""gRPC channel and server options shared by the router, the workers and the client.

One place, so that both ends of every connection agree on keepalive: a client that
pings more often than its server permits is cut off by the server ("too_many_pings").

Keepalive is what notices a dead peer on an idle or silent connection (a cut link,
a host that vanished without a FIN): every `KEEPALIVE_TIME_MS` each side sends an
HTTP/2 PING; no ACK within `KEEPALIVE_TIMEOUT_MS` closes the transport, and every
call on it fails with UNAVAILABLE. So a silent peer is detected within about
time + timeout (20 s), on top of the per-call deadlines and the router's idle
timeout on Decode streams (router/config.py). The ACKs are answered by gRPC's core,
not by Python, so a worker busy in a long step still answers them.

Plain constants, no imports: the router and the client use them without pulling in
the engine.
"""

from __future__ import annotations

KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 10_000
# What a server accepts: pings at most this often, also on connections without calls
# (a client's channel to an idle worker keeps pinging). Below KEEPALIVE_TIME_MS, so
# the clients above are never struck.
MIN_RECV_PING_INTERVAL_MS = 5_000
# KV chunks are <= 1 MiB; prompts of the largest contexts still fit one message.
MAX_MESSAGE_BYTES = 64 << 20

_KEEPALIVE: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    # 0 = no limit on pings sent while no data flows (a silent Decode stream is
    # exactly the case keepalive is for).
    ("grpc.http2.max_pings_without_data", 0),
]

# Client channels (router -> workers, client -> router, worker -> worker).
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *_KEEPALIVE,
]

# Servers (workers' internal servers; the router's public server replaces the receive
# limit by what its largest valid request needs, see router/server.py).
SERVER_OPTIONS: list[tuple[str, int]] = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_RECV_PING_INTERVAL_MS),
]

# A worker's channel to its router (heartbeats): reconnect within a few seconds of the
# router coming back (gRPC's default backoff grows to 120 s, so a worker could stay
# unregistered for two minutes after a router restart).
MAX_RECONNECT_BACKOFF_MS = 2_000
HEARTBEAT_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
]

# The historical name (channels and servers used one list before keepalive).
GRPC_OPTIONS = CHANNEL_OPTIONS


def with_option(options: list[tuple[str, int]], name: str, value: int) -> list[tuple[str, int]]:
    """`options` with `name` set to `value` (replaced, not duplicated)."""
    return [(k, v) for k, v in options if k != name] + [(name, value)]
