"""The one way this project connects to Redis, and the one way it reads Redis errors.

Every Redis client (the prefix index of the router and of the workers, the worker
registry of both) is made by :func:`connect_redis`, so all of them get the same URL
rules, socket timeouts, health checks and client names, and every Redis error becomes
an :class:`IndexUnavailableError` through :func:`redis_errors`.

Decisions
---------
- Socket timeouts on connect *and* on every read (``socket_timeout_s``, 0.5 s by
  default): a Redis that accepts but never answers (``CLIENT PAUSE``, a stuck
  server, a black-holed link) costs one timeout per call, never a hang.
- One immediate retry (no backoff): rides over a connection the server closed (a
  restart) without stretching an outage into seconds. Every call of ours is safe to
  run twice. Callers back off themselves, measured from the end of the failed call
  (faults.Backoff).
- ``health_check_interval_s``: a connection idle that long is PINGed before use, so a
  connection the server dropped while idle is replaced instead of failing a call.
- ``client_name`` (``CLIENT SETNAME``): ``CLIENT LIST`` on the server tells the
  router's connections from each worker's. An ACL user therefore needs
  ``+client|setname`` (without it every call fails with NoPermissionError, which
  names the command).
- Every ``redis.RedisError`` means "the index cannot serve this now", not only
  connection errors: a ``ResponseError`` (READONLY after a failover, OOM under
  ``maxmemory``, NOPERM from an ACL, WRONGTYPE from a key someone overwrote) must
  not escape into a loop that would die of it. The message keeps the class and the
  server's words so an operator can act on it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pagedserve.common.runtime.prefix_index.base import IndexUnavailableError, check_ttl

SCHEMES = ("redis://", "rediss://", "unix://")
DEFAULT_SOCKET_TIMEOUT_S = 0.5
DEFAULT_HEALTH_CHECK_INTERVAL_S = 10.0
# Redis words a missing password oddly ("HELLO must be called with the client already
# authenticated"): say what to do.
AUTH_HINT = (
    " (Redis refused the credentials: give the user and password in the URL, "
    "redis://USER:PASSWORD@HOST:PORT/DB)"
)


def redact_url(url: str) -> str:
    """``url`` with every password replaced by ``***`` (for messages and logs).

    Both places redis-py reads a password from are masked: the userinfo
    (``redis://user:secret@host``, ``redis://:secret@host``) and the query string
    (``?password=secret``). Host and port are kept as written (IPv6 brackets too).
    Anything that does not parse as a URL is replaced whole: a message never shows
    what might be a secret.
    """
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:
        return "<unparsable redis url>"
    netloc, query_text = parts.netloc, parts.query
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}"
    if any(k == "password" for k, _ in query):
        masked = [(k, "***" if k == "password" else v) for k, v in query]
        query_text = urlencode(masked, safe="*/")
    if (netloc, query_text) == (parts.netloc, parts.query):
        return url
    # Assembled by hand: urlunsplit would drop the empty authority of unix:///path.
    out = f"{parts.scheme}://{netloc}{parts.path}"
    return (
        out
        + (f"?{query_text}" if query_text else "")
        + (f"#{parts.fragment}" if parts.fragment else "")
    )


def check_url(url: object) -> str:
    """``url`` if it is a Redis URL; the error shows it with its password masked."""
    if not isinstance(url, str) or not url.startswith(SCHEMES):
        shown = redact_url(url) if isinstance(url, str) else repr(url)
        raise ValueError(f"redis url must start with redis://, rediss:// or unix://: {shown!r}")
    return url


def check_namespace(namespace: object) -> str:
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace must be a non-empty string, got {namespace!r}")
    if any(c in "{}" or c.isspace() for c in namespace) or not namespace.isprintable():
        raise ValueError(f"namespace must be printable without braces or spaces: {namespace!r}")
    return namespace


def client_name(*parts: str) -> str:
    """A ``CLIENT SETNAME`` name: ``pagedserve-<parts>``, only characters Redis allows."""
    return re.sub(r"[^A-Za-z0-9._:-]", "_", "-".join(("pagedserve", *parts)))[:128]


def connect_redis(
    url: str,
    *,
    name: str,
    socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
    health_check_interval_s: float = DEFAULT_HEALTH_CHECK_INTERVAL_S,
    **connection_options: Any,
) -> redis.Redis:
    """A client for ``url`` (``redis://[user[:password]@]host[:port][/db]``,
    ``rediss://...`` for TLS, ``unix://path``) with this project's settings.

    Nothing is sent until the first command, so a process can start while Redis is
    down. ``connection_options`` (TLS files, say) override the defaults and go to
    ``redis.Redis.from_url``, as do options in the URL's query string.
    """
    check_url(url)
    check_ttl(socket_timeout_s)
    check_ttl(health_check_interval_s)
    options: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_timeout_s,
        "socket_keepalive": True,
        "health_check_interval": health_check_interval_s,
        "client_name": name,
        "retry": Retry(NoBackoff(), 1),
    }
    options.update(connection_options)
    return redis.Redis.from_url(url, **options)


@contextmanager
def redis_errors(describe: str, what: str) -> Iterator[None]:
    """Turns any Redis error inside the block into :class:`IndexUnavailableError`.

    ``describe`` names the client ("redis prefix index redis://h:1/0 (namespace 'm')"),
    ``what`` the operation; both appear in the message.
    """
    try:
        yield
    except redis.RedisError as exc:
        hint = AUTH_HINT if isinstance(exc, redis.AuthenticationError) else ""
        raise IndexUnavailableError(
            f"{describe} unavailable during {what}: {type(exc).__name__}: {exc}{hint}"
        ) from exc
