"""The OpenAI-compatible HTTP API (router/openai_api.py) through the real `openai` SDK.

A router with its HTTP API on a free loopback port, one prefill and one decode worker
on the tiny float32 checkpoint (tests/router_fixtures.py), shared by the module.
Greedy answers over HTTP are compared with the gRPC API's for the same request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import urllib.error
import urllib.request

import openai
import pytest
from router_fixtures import MAX_MODEL_LEN, ROUTER_CONFIG, engine_held, start_cluster, wait_for

from pagedserve.router.client import Client

GREEDY = dict(temperature=0.0)
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(dataclasses.replace(ROUTER_CONFIG, http_port=0), {"prefill": 1, "decode": 1})
    yield c
    c.stop()


@pytest.fixture(scope="module")
def http_address(cluster) -> str:
    server = cluster.router.router.http
    assert server is not None
    return server.address


@pytest.fixture(scope="module")
def model(cluster) -> str:
    return cluster.router.router.frontend.model_name


@pytest.fixture(scope="module")
def api(http_address):
    with openai.OpenAI(
        base_url=f"http://{http_address}/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        yield client


@pytest.fixture()
def grpc_client(cluster):
    with cluster.client() as c:
        yield c


def raw_post(address: str, path: str, body: bytes, read: int | None = None) -> bytes:
    """A plain HTTP/1.1 POST on a socket; reads the whole answer, or `read` bytes then
    closes the connection (a client that goes away)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        s.sendall(head.encode() + body)
        data = b""
        while read is None or len(data) < read:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        return data


# -- completions ----------------------------------------------------------------------


def test_completion_greedy_equals_grpc(api, model, grpc_client):
    prompt = "The quick brown fox jumps over the lazy dog because"
    got = api.completions.create(model=model, prompt=prompt, max_tokens=12, **GREEDY)
    (want,) = grpc_client.collect(prompt, max_tokens=12, **GREEDY)
    assert got.object == "text_completion" and got.model == model
    assert len(got.choices) == 1
    choice = got.choices[0]
    assert choice.text == want.text and choice.finish_reason == "length"
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12


def test_completion_stream_equals_non_stream_and_reports_usage(api, model):
    prompt = "Once upon a time there was"
    whole = api.completions.create(model=model, prompt=prompt, max_tokens=10, **GREEDY)
    chunks = list(
        api.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    last = chunks[-1]  # the usage chunk: no choices
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_n_samples_seed_and_token_prompt(api, model):
    got = api.completions.create(
        model=model, prompt=[5, 6, 7, 8, 9], max_tokens=6, n=3, temperature=1.0, seed=11
    )
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    assert got.usage.prompt_tokens == 5 and got.usage.completion_tokens == 18
    again = api.completions.create(
        model=model, prompt=[5, 6, 7, 8, 9], max_tokens=6, n=3, temperature=1.0, seed=11
    )
    assert [c.text for c in again.choices] == [c.text for c in got.choices]  # seeded


def test_completion_prompt_batch_numbers_choices_prompt_by_prompt(api, model, grpc_client):
    prompts = ["Red sky at night", "An apple a day"]
    got = api.completions.create(model=model, prompt=prompts, max_tokens=5, **GREEDY)
    assert [c.index for c in sorted(got.choices, key=lambda c: c.index)] == [0, 1]
    for c in got.choices:
        (want,) = grpc_client.collect(prompts[c.index], max_tokens=5, **GREEDY)
        assert c.text == want.text


def test_completion_stop_string(api, model, grpc_client):
    prompt = "The quick brown fox jumps over the lazy dog because"
    (full,) = grpc_client.collect(prompt, max_tokens=12, **GREEDY)
    stop = full.text[4:7]  # a piece of what greedy produces
    assert stop
    got = api.completions.create(model=model, prompt=prompt, max_tokens=12, stop=[stop], **GREEDY)
    choice = got.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full.text[: full.text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_completion_logprobs(api, model, grpc_client):
    prompt = "Water is"
    got = api.completions.create(model=model, prompt=prompt, max_tokens=4, logprobs=3, **GREEDY)
    (want,) = grpc_client.collect(prompt, max_tokens=4, logprobs=3, **GREEDY)
    lp = got.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-6)
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    # Greedy: each token is the most likely one of its step.
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[tok] == pytest.approx(value) and value == pytest.approx(max(top.values()))
    assert "".join(lp.tokens) == got.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


# -- chat -----------------------------------------------------------------------------


def test_chat_greedy_equals_grpc(api, model, grpc_client):
    got = api.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=10, **GREEDY
    )
    (want,) = grpc_client.collect(messages=MESSAGES, max_tokens=10, **GREEDY)
    assert got.object == "chat.completion"
    msg = got.choices[0].message
    assert msg.role == "assistant" and msg.content == want.text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == 10


def test_chat_stream_roles_text_logprobs_and_usage(api, model, grpc_client):
    (want,) = grpc_client.collect(messages=MESSAGES, max_tokens=8, logprobs=2, **GREEDY)
    chunks = list(
        api.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=8,
            stream=True,
            logprobs=True,
            top_logprobs=2,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == want.text
    entries = [
        e for c in with_choices if c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in entries] == pytest.approx(
        [x.logprob for x in want.logprobs], abs=1e-6
    )
    assert all(len(e.top_logprobs) == 2 for e in entries)
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_n_samples_and_min_tokens(api, model, grpc_client):
    got = api.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, n=2, temperature=0.8, seed=3
    )
    assert sorted(c.index for c in got.choices) == [0, 1]
    assert got.usage.completion_tokens == 10
    # min_tokens: the token greedy picks first is a stop token id, masked for 3 tokens.
    (first,) = grpc_client.collect(messages=MESSAGES, max_tokens=1, **GREEDY)
    stop_id = first.token_ids[0]
    plain = api.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=6,
        extra_body={"stop_token_ids": [stop_id]},
        **GREEDY,
    )
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 1
    held = api.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=6,
        extra_body={"stop_token_ids": [stop_id], "min_tokens": 3},
        **GREEDY,
    )
    assert held.usage.completion_tokens >= 3


def test_penalties_reach_the_sampler(api, model):
    # A frequency penalty of 2 changes what greedy repeats; the same request without
    # penalty (tiny random model) repeats tokens.
    prompt = [3, 3, 3, 3]
    plain = api.completions.create(model=model, prompt=prompt, max_tokens=16, logprobs=0, **GREEDY)
    tokens = plain.choices[0].logprobs.tokens
    assert len(set(tokens)) < len(tokens), "the tiny model should repeat itself greedily"
    penalized = api.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=16,
        logprobs=0,
        frequency_penalty=2.0,
        presence_penalty=2.0,
        **GREEDY,
    )
    assert penalized.choices[0].logprobs.tokens != tokens


# -- errors ---------------------------------------------------------------------------


def test_bad_request_is_400_in_openai_shape(api, model):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=model, prompt="hi", max_tokens=4, temperature=-1.0)
    assert e.value.status_code == 400
    assert "temperature must be >= 0" in e.value.message
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="n must be 1 when temperature is 0"):
        api.chat.completions.create(model=model, messages=MESSAGES, n=2, max_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError, match="exceeds max_model_len"):
        api.completions.create(model=model, prompt="hi", max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty must be in"):
        api.completions.create(model=model, prompt="hi", max_tokens=2, frequency_penalty=3)
    with pytest.raises(openai.BadRequestError, match="logit_bias is not supported"):
        api.completions.create(model=model, prompt="hi", max_tokens=2, logit_bias={"5": 1.0})


def test_bad_streaming_request_is_an_http_error_not_a_stream(api, model):
    with pytest.raises(openai.BadRequestError, match="top_p must be in"):
        api.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=2, top_p=0.0, stream=True
        )


def test_bad_json_and_types_are_400(http_address):
    answer = raw_post(http_address, "/v1/completions", b"{not json")
    assert answer.startswith(b"HTTP/1.1 400")
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert set(body["error"]) == {"message", "type", "param", "code"}
    answer = raw_post(http_address, "/v1/completions", b'{"prompt": "x", "max_tokens": "many"}')
    assert answer.startswith(b"HTTP/1.1 400")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["param"] == "max_tokens"


def test_unknown_model_is_404(api):
    with pytest.raises(openai.NotFoundError) as e:
        api.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"


def test_admission_refusal_is_429(cluster, api, model):
    admission = cluster.router.router.admission
    saved = (admission.max_inflight, admission.max_queued)
    cluster.router.call(lambda r: setattr(r.admission, "max_inflight", 0))
    cluster.router.call(lambda r: setattr(r.admission, "max_queued", 0))
    try:
        with pytest.raises(openai.RateLimitError) as e:
            api.completions.create(model=model, prompt="hi", max_tokens=2)
        assert e.value.status_code == 429
    finally:
        cluster.router.call(lambda r: setattr(r.admission, "max_inflight", saved[0]))
        cluster.router.call(lambda r: setattr(r.admission, "max_queued", saved[1]))


# -- disconnects ----------------------------------------------------------------------


def ended(cluster, code: str) -> float:
    """How many Generate calls the router's metrics saw end with `code`."""
    reg = cluster.router.router.metrics.registry
    model = cluster.router.router.frontend.model_name
    value = reg.get_sample_value(
        "pagedserve:router_requests_total", {"model_name": model, "code": code}
    )
    return value or 0.0


def test_disconnect_mid_stream_returns_every_block(cluster, http_address, model):
    cluster.wait_quiescent()
    body = json.dumps(
        {
            "model": model,
            "prompt": "A long story begins",
            "max_tokens": 200,
            "temperature": 0.7,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    before = cluster.router.call(lambda r: r.counters["requests"])
    cancelled = ended(cluster, "CANCELLED")
    # Held after 40 decode steps (events well over 600 bytes, whatever text the tokens
    # make): still running when the client goes, on any machine; only the disconnect's
    # cancel can end it.
    with engine_held(cluster.pool("decode"), after_steps=40):
        head = raw_post(http_address, "/v1/completions", body, read=600)  # a few chunks, gone
        assert head.startswith(b"HTTP/1.1 200") and b"data: " in head
        wait_for(lambda: not cluster.router.call(lambda r: r.active_requests), what="its end")
    cluster.wait_quiescent()
    assert cluster.router.call(lambda r: r.counters["requests"]) == before + 1
    assert ended(cluster, "CANCELLED") == cancelled + 1  # cut short, not run to the end


def test_disconnect_before_the_answer_cancels_a_non_streaming_request(cluster, http_address, model):
    # A prompt under disagg_min_prompt_tokens: the decode worker prefills it itself, so
    # the request is on that worker, generating, when the client goes away.
    cluster.wait_quiescent()
    body = json.dumps(
        {"model": model, "prompt": "Hi there", "max_tokens": 240, "ignore_eos": True}
    ).encode()
    (decode,) = cluster.pool("decode")
    cancelled = ended(cluster, "CANCELLED")
    host, port = http_address.rsplit(":", 1)
    # Held after its first step: still generating when the client goes, on any machine.
    with engine_held([decode]):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            wait_for(lambda: decode.loop.call(lambda e: bool(e.requests)), what="generation")
        wait_for(lambda: not cluster.router.call(lambda r: r.active_requests), what="its end")
    cluster.wait_quiescent()
    assert ended(cluster, "CANCELLED") == cancelled + 1  # cut short, not run to the end


# -- the other endpoints --------------------------------------------------------------


def test_models_health_and_metrics(api, model, http_address):
    models = api.models.list()
    assert [m.id for m in models.data] == [model]
    with urllib.request.urlopen(f"http://{http_address}/health", timeout=10) as r:
        assert r.status == 200
    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "pagedserve:" in text
    assert 'code="OK"' in text  # the HTTP requests above went through the router's metrics


def test_serving_benchmark_drives_the_http_api(cluster, http_address):
    from benchmarks.serving import Arrival, Phase, RequestSpec, run_phase

    specs = [RequestSpec("short", tuple(range(5, 5 + 10 + i)), 6) for i in range(3)]
    phase = Phase("http", tuple(Arrival(0.0, s) for s in specs))
    run = run_phase(f"http://{http_address}", phase, concurrency=2, timeout_s=60.0)
    assert [r.error for r in run.records] == [None] * 3
    assert [r.output_tokens for r in run.records] == [6, 6, 6]  # counted by token ids
    assert all(r.success and r.chunk_times for r in run.records)
    # The time cap cancels what still runs: the server aborts it, the blocks return.
    # Held after 8 decode steps (tokens streamed), it still runs when the cap comes;
    # the cap only has to outlast its way there (milliseconds; held.wait checks it).
    long = Phase("cap", (Arrival(0.0, RequestSpec("long", tuple(range(5, 15)), 240)),))
    with engine_held(cluster.pool("decode"), after_steps=8) as held:
        capped = run_phase(f"http://{http_address}", long, timeout_s=1.0)
        held.wait(0)
    assert not capped.records[0].success
    assert capped.records[0].chunk_times  # it was streaming when cut
    wait_for(lambda: not cluster.router.call(lambda r: r.active_requests), what="request to end")
    cluster.wait_quiescent()


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(api, model):
    got = api.chat.completions.create(
        model=model, messages=MESSAGES, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens + got.usage.completion_tokens == MAX_MODEL_LEN


def test_drain_ends_http_streams_with_an_error_event_and_refuses_new_ones_503(model):
    # A cluster of its own: a drained router stays drained.
    c = start_cluster(dataclasses.replace(ROUTER_CONFIG, http_port=0), {"decode": 1})
    try:
        address = c.router.router.http.address
        client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="x", max_retries=0)
        # Held after 40 steps (text enough for a first chunk: the detokenizer may hold
        # back a token's text): still streaming when drained, on any machine.
        with engine_held(c.pool("decode"), after_steps=40):
            stream = client.completions.create(
                model=model,
                prompt="Hi there",
                max_tokens=240,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            chunks = iter(stream)
            next(chunks)  # streaming
            drain = asyncio.run_coroutine_threadsafe(c.router.router.drain(0.0), c.router.loop)
            with pytest.raises(openai.APIError, match="shutting down"):
                for _ in chunks:
                    pass
            assert drain.result(30) == 1  # the stream was cut
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=model, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and "shutting down" in e.value.message
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"http://{address}/health", timeout=10)
        assert health.value.code == 503
        c.wait_quiescent()
    finally:
        c.stop()


def test_api_keys_apply_to_http_as_to_grpc():
    """A router with an API key: HTTP without it or with a wrong one is 401 in OpenAI's
    shape (before any work); with it, the same completion as over gRPC."""
    keyed = start_cluster(
        dataclasses.replace(ROUTER_CONFIG, http_port=0, api_key="sk-right"), {"decode": 1}
    )
    try:
        address = keyed.router.router.http.address
        name = keyed.router.router.frontend.model_name
        with (
            openai.OpenAI(base_url=f"http://{address}/v1", api_key="sk-wrong", max_retries=0) as c,
            pytest.raises(openai.AuthenticationError) as e,
        ):
            c.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
        assert e.value.body["message"] == "invalid API key"
        # No Authorization header at all (the SDK always sends one): a plain POST.
        body = json.dumps({"model": name, "prompt": "hi", "max_tokens": 2}).encode()
        head, _, payload = raw_post(address, "/v1/completions", body).partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0].endswith(b"401 Unauthorized")
        assert json.loads(payload)["error"]["message"].startswith("missing API key")
        with (
            openai.OpenAI(base_url=f"http://{address}/v1", api_key="sk-wrong", max_retries=0) as c,
            pytest.raises(openai.AuthenticationError),
        ):
            c.models.list()  # /v1/models needs the key too (as gRPC's GetModelInfo)
        assert keyed.router.call(lambda r: r.counters["requests"]) == 0  # nothing ran
        assert keyed.router.call(lambda r: r.counters["unauthenticated"]) == 3
        with openai.OpenAI(base_url=f"http://{address}/v1", api_key="sk-right") as c:
            assert [m.id for m in c.models.list()] == [name]
            got = c.completions.create(model=name, prompt="hello", max_tokens=4, temperature=0)
        with Client(keyed.address, api_key="sk-right") as g:
            want = "".join(r.text for r in g.generate(prompt="hello", max_tokens=4, temperature=0))
        assert got.choices[0].text == want
        keyed.wait_quiescent()
    finally:
        keyed.stop()
