"""A small client of the router's OpenAI-compatible HTTP API for benchmarks/serving.py.

`benchmarks/serving.py --api openai` drives the cluster through POST /v1/completions
(streamed, token-id prompts) instead of gRPC. This client has the shape serving.py's
request loop already uses for the gRPC `Client`: `generate(...)` returns an iterator
of per-chunk messages with `token_ids` and `finish_reason` (generation.proto's enum)
and a `cancel()`; a refused or failed request raises `HTTPCallError`, a grpc.RpcError
with the matching status code, so the loop records both APIs' failures alike.

Decisions:
- The standard library's http.client, one connection per request (one thread per
  request in serving.py): no client library's per-chunk parsing in what is measured,
  like vLLM's benchmark client (aiohttp, raw SSE lines).
- Token counts come from vLLM's `return_token_ids` (each chunk's generated ids), so
  ITL and TPOT count tokens, not text chunks.
- `cancel()` shuts the socket down: the server sees the disconnect and aborts the
  request on its workers (router/openai_api.py).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import grpc

from pagedserve.v1 import generation_pb2 as gen_pb

_FINISH = {
    "length": gen_pb.FINISH_REASON_LENGTH,
    "stop": gen_pb.FINISH_REASON_STOP,
    "abort": gen_pb.FINISH_REASON_ABORT,
}
_CODE_OF_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class HTTPCallError(grpc.RpcError):
    """A failed HTTP request, shaped as a gRPC error (code(), details())."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass
class Chunk:
    """One streamed chunk: its tokens and, on a sample's last, why it ended."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = gen_pb.FINISH_REASON_UNSPECIFIED
    text: str = ""


class StreamCall:
    """One streamed completion: iterate for its chunks; `cancel()` from any thread."""

    def __init__(self, host: str, port: int, body: dict, timeout: float | None) -> None:
        self._conn = http.client.HTTPConnection(host, port, timeout=timeout)
        self._cancelled = threading.Event()
        self._body = json.dumps(body).encode()

    def cancel(self) -> None:
        self._cancelled.set()
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed
                sock.shutdown(socket.SHUT_RDWR)

    def __iter__(self) -> Iterator[Chunk]:
        try:
            yield from self._chunks()
        except (OSError, http.client.HTTPException) as e:
            if self._cancelled.is_set():
                raise HTTPCallError(grpc.StatusCode.CANCELLED, "cancelled by the client") from e
            if isinstance(e, TimeoutError):
                raise HTTPCallError(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)) from e
            raise HTTPCallError(grpc.StatusCode.UNAVAILABLE, f"{type(e).__name__}: {e}") from e
        finally:
            self._conn.close()

    def _chunks(self) -> Iterator[Chunk]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        self._conn.request("POST", "/v1/completions", body=self._body, headers=headers)
        resp = self._conn.getresponse()
        if resp.status != 200:
            raise _error(resp.status, resp.read())
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            event = json.loads(data)
            if "error" in event:  # the stream failed after it started
                raise _error(500, data)
            for choice in event.get("choices", ()):
                yield Chunk(
                    token_ids=list(choice.get("token_ids") or ()),
                    finish_reason=_FINISH.get(choice.get("finish_reason") or "", 0),
                    text=choice.get("text", ""),
                )
        raise ConnectionError("the stream ended before its `data: [DONE]`")


def _error(status: int, body: bytes) -> HTTPCallError:
    try:
        err = json.loads(body)["error"]
        message = err.get("message", "")
        code = {
            "service_unavailable_error": grpc.StatusCode.UNAVAILABLE,
            "internal_error": grpc.StatusCode.INTERNAL,
        }.get(err.get("type", ""))
    except (ValueError, KeyError, TypeError):
        message, code = body.decode(errors="replace")[:500], None
    if code is None:
        code = _CODE_OF_STATUS.get(status, grpc.StatusCode.INTERNAL)
    return HTTPCallError(code, f"HTTP {status}: {message}")


class OpenAIStreamClient:
    """`Client`'s streaming shape over the HTTP API at `address` ("host:port" or
    "http://host:port")."""

    def __init__(self, address: str, model: str | None = None) -> None:
        hostport = address.removeprefix("http://").rstrip("/")
        host, port = hostport.rsplit(":", 1)
        self.host = host.strip("[]")
        self.port = int(port)
        self.model = model

    def generate(
        self,
        *,
        token_ids: Iterable[int],
        max_tokens: int,
        temperature: float = 1.0,
        ignore_eos: bool = False,
        timeout: float | None = None,
    ) -> StreamCall:
        body: dict = {
            "prompt": list(token_ids),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": ignore_eos,
            "stream": True,
            "return_token_ids": True,
        }
        if self.model is not None:
            body["model"] = self.model
        return StreamCall(self.host, self.port, body, timeout)

    def close(self) -> None:
        pass

    def __enter__(self) -> OpenAIStreamClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_client(address: str):
    """The gRPC Client for "host:port", this HTTP client for "http://host:port"."""
    if address.startswith("http://"):
        return OpenAIStreamClient(address)
    from pagedserve.router.client import Client

    return Client(address)
