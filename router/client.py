"""A small synchronous client of the router's public API (the generated stubs).

    >>> with Client("127.0.0.1:50051") as c:
    ...     print(c.complete("The capital of France is", max_tokens=8, temperature=0))
    ...     for r in c.generate(messages=[{"role": "user", "content": "Hi"}]):
    ...         print(r.text, end="", flush=True)

Sampling options are SamplingParams' field names; only those given are sent, so the
server's defaults apply to the rest. Nothing is validated here beyond the input
choice: the server's INVALID_ARGUMENT says what is wrong (`grpc.RpcError`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.common.api.outputs import Completion
from pagedserve.common.runtime.grpc_options import CHANNEL_OPTIONS
from pagedserve.common.runtime.protocol import FINISH_FROM_PB, logprobs_from_pb, usage_from_pb
from pagedserve.common.runtime.tls import channel, client_channel_credentials
from pagedserve.v1 import generation_pb2 as gen_pb
from pagedserve.v1 import generation_pb2_grpc

SAMPLING_FIELDS = frozenset(gen_pb.SamplingParams.DESCRIPTOR.fields_by_name)


# The router names the worker a failure happened on: "decode worker d0 (host:port): ...".
_NAMES_WORKER = re.compile(r"\b(?:decode|prefill) worker \S+ \(")
_CONNECT_FAILED = ("failed to connect", "connection refused", "dns resolution failed")


def explain(e: grpc.RpcError, address: str) -> str:
    """What a failed call's status means for the user, or "" when its message says it.

    Read from the status code and the router's message, never guessed from a word:
    a worker's failure relayed by a live router mentions connections too.
    """
    code, details = e.code(), (e.details() or "")
    lower = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE:
        if _NAMES_WORKER.search(details):
            return (
                "the router is up; the worker named above failed or became unreachable "
                "while serving the request: retry"
            )
        if details.startswith("no live"):
            return "the router is up but has no live worker for this request: start workers"
        if "handshake failed" in lower:
            return (
                f"TLS with {address} failed: give --ssl-ca-certs the CA that signed the "
                "router's certificate (which must name this host), or drop it if the "
                "router serves plaintext"
            )
        if "socket closed" in lower:
            return f"{address} closed the connection: if the router serves TLS, give --ssl-ca-certs"
        if any(s in lower for s in _CONNECT_FAILED):
            return f"cannot reach the router at {address}: is one running? (`pagedserve up`)"
        return f"the connection to the router at {address} failed: retry"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (
            "the router requires an API key: pass --api-key or set PAGEDSERVE_API_KEY"
            if details.startswith("missing")
            else "the router did not accept this API key: check --api-key / PAGEDSERVE_API_KEY"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "the request's deadline passed before it finished (raise --timeout)"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if "larger than max" in lower:
            return "the request is larger than the router accepts: shorten it"
        if details.startswith("tenant "):
            return "your API key's concurrency limit is reached: wait for a request to end"
        return "the cluster is at capacity: retry later"
    if code == grpc.StatusCode.INTERNAL and _NAMES_WORKER.search(details):
        return "a worker failed while running the request (named above): retry"
    return ""


def build_request(
    prompt: str | None = None,
    *,
    messages: Iterable[Mapping[str, str]] | None = None,
    token_ids: Iterable[int] | None = None,
    request_id: str | None = None,
    cache_salt: str = "",
    **sampling: object,
) -> gen_pb.GenerateRequest:
    """A GenerateRequest; raises ValueError unless exactly one input is given and
    TypeError for an unknown sampling option."""
    given = [
        name
        for name, v in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
        if v is not None
    ]
    if len(given) != 1:
        raise ValueError(
            f"give exactly one of prompt, messages and token_ids, got {given or 'none'}"
        )
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling option(s) {unknown}; known: {sorted(SAMPLING_FIELDS)}")
    req = gen_pb.GenerateRequest(cache_salt=cache_salt)
    if request_id is not None:
        req.request_id = request_id
    if prompt is not None:
        req.prompt = prompt
    elif token_ids is not None:
        req.prompt_token_ids.ids.extend(token_ids)
        req.prompt_token_ids.SetInParent()
    else:
        assert messages is not None
        turns = [gen_pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        req.messages.messages.extend(turns)
        req.messages.SetInParent()
    req.sampling.SetInParent()
    for name, value in sampling.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids"):
            values = [value] if isinstance(value, (str, int)) else list(value)  # type: ignore[arg-type]
            getattr(req.sampling, name).extend(values)
        else:
            setattr(req.sampling, name, value)
    return req


class Client:
    def __init__(
        self,
        address: str,
        timeout: float | None = None,
        api_key: str | None = None,
        *,
        ssl_ca_certs: str | None = None,
    ) -> None:
        """timeout: default deadline of every call in seconds (None = no deadline);
        api_key: sent as `authorization: Bearer <key>` on every call (router/auth.py).

        ssl_ca_certs: TLS to a router started with --ssl-certfile, checked against this
        CA file (PEM); None = plaintext. The router's certificate must name the host
        in `address` (subjectAltName).
        """
        self.address = address
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        creds = client_channel_credentials(ssl_ca_certs) if ssl_ca_certs else None
        self.channel = channel(address, creds, CHANNEL_OPTIONS)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Iterable[Mapping[str, str]] | None = None,
        token_ids: Iterable[int] | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
        timeout: float | None = None,
        **sampling: object,
    ) -> Iterator[gen_pb.GenerateResponse]:
        """Streams responses as they come. The returned call is an iterator with
        `.cancel()` (which aborts the request on every worker); errors surface as
        `grpc.RpcError` while iterating."""
        req = build_request(
            prompt,
            messages=messages,
            token_ids=token_ids,
            request_id=request_id,
            cache_salt=cache_salt,
            **sampling,
        )
        return self.stub.Generate(
            req,
            timeout=timeout if timeout is not None else self.timeout,
            metadata=self.metadata,
        )

    def collect(self, *args: object, **kwargs: object) -> list[Completion]:
        """Runs `generate(...)` to the end; one Completion per sample, by index."""
        out: dict[int, Completion] = {}
        for r in self.generate(*args, **kwargs):  # type: ignore[arg-type]
            c = out.setdefault(r.index, Completion(r.index))
            c.text += r.text
            c.token_ids += r.token_ids
            c.logprobs += [logprobs_from_pb(lp) for lp in r.logprobs]
            c.num_messages += 1
            if r.finish_reason:
                c.finish_reason = FINISH_FROM_PB[r.finish_reason]
                c.usage = usage_from_pb(r.usage)
                which = r.WhichOneof("stop_matched")
                if which is not None:
                    c.stop_reason = getattr(r, which)
        return [out[i] for i in sorted(out)]

    def complete(self, *args: object, **kwargs: object) -> str:
        """The text of a single-sample request (use `collect` for n > 1)."""
        if (kwargs.get("n") or 1) != 1:
            raise ValueError("complete() returns one text: use collect() when n > 1")
        return self.collect(*args, **kwargs)[0].text

    def model_info(self) -> gen_pb.ModelInfo:
        return self.stub.GetModelInfo(
            gen_pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self.metadata
        )

    def health(self, service: str = "") -> int:
        """The HealthCheckResponse status of `service` ("" = the router as a whole)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=self.timeout,
            metadata=self.metadata,
        ).status

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
