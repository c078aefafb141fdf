"""The Admin service (router/admin.py) and its commands (pagedserve/admin_cli.py):
`pagedserve status` from a running router, and a worker that drains before it leaves.

Scaling a `pagedserve up` cluster through Ray is tested in test_cluster.py (it owns
the module's Ray instance); here the router has in-process workers and no scaler.
"""

from __future__ import annotations

import io
import json
import threading

import pytest
from router_fixtures import ROUTER_CONFIG, engine_held, start_cluster, wait_for

from pagedserve import admin_cli
from pagedserve.router.admin import cluster_status
from pagedserve.v1 import admin_pb2, worker_pb2


def admin_address(c) -> str:
    """Where the router serves Admin (its internal listener)."""
    return c.router.router.internal_address


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(ROUTER_CONFIG, {"prefill": 1, "decode": 2})
    yield c
    c.stop()


def run_cli(cmd: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = admin_cli.main(cmd, list(args), out=out)
    return rc, out.getvalue()


def test_status_lists_every_worker_from_the_running_router(cluster):
    with cluster.client() as client:
        list(client.generate(token_ids=list(range(3, 60)), max_tokens=4, temperature=0.0))

    def status_json() -> dict:
        rc, text = run_cli("status", "--json", "--address", admin_address(cluster))
        assert rc == 0
        return json.loads(text)

    # The stats are each worker's last heartbeat: one after the request counts it.
    wait_for(lambda: sum(int(w["prefix_query_tokens"]) for w in status_json()["workers"]) > 0)
    status = status_json()
    assert status["router_address"] == cluster.address
    assert status["scalable"] is False  # no launcher owns these workers
    ids = [(w["pool"], w["worker_id"]) for w in status["workers"]]
    assert ids == [
        ("WORKER_POOL_PREFILL", "p0"),
        ("WORKER_POOL_DECODE", "d0"),
        ("WORKER_POOL_DECODE", "d1"),
    ]
    assert all(w["num_total_blocks"] == 128 for w in status["workers"])
    assert len(status["heartbeat_age_s"]) == 3

    rc, table = run_cli("status", "--address", admin_address(cluster))
    assert rc == 0
    lines = table.splitlines()
    assert lines[2].split()[:4] == ["POOL", "WORKER", "ADDRESS", "RUN"]
    assert [ln.split()[1] for ln in lines[3:6]] == ["p0", "d0", "d1"]
    assert all(ln.split()[-1] == "serving" for ln in lines[3:6])
    assert "prefill: 1 worker(s)" in table and "decode: 2 worker(s)" in table


def test_scale_without_a_launcher_says_what_to_do_instead(cluster, capsys):
    rc, _ = run_cli("scale", "--decode", "3", "--address", admin_address(cluster))
    assert rc == 1
    err = capsys.readouterr().err
    assert "FAILED_PRECONDITION" in err and "kubectl scale" in err
    assert run_cli("scale", "--address", admin_address(cluster))[0] == 2  # nothing asked


def test_a_draining_worker_finishes_its_stream_and_takes_no_new_request(cluster):
    """drain(): the router stops choosing the worker at once, its stream runs to the end."""
    tokens: list[int] = []
    errors: list[BaseException] = []
    first = threading.Event()

    def stream() -> None:
        try:
            with cluster.client() as client:
                for resp in client.generate(
                    token_ids=list(range(5, 40)), max_tokens=150, temperature=0.0, ignore_eos=True
                ):
                    tokens.extend(resp.token_ids)
                    first.set()
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)
            first.set()

    # Held after its first decode step until another request was served elsewhere: the
    # stream is in flight while its worker drains, on any machine.
    with engine_held(cluster.pool("decode")) as held:
        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        wid = held.wait()  # the stream's decode worker (the other one is not held)
        leaving = cluster.workers[wid]
        assert leaving.loop.call(lambda e: e.stats().num_running) == 1
        result: list[bool] = []
        drainer = threading.Thread(target=lambda: result.append(leaving.drain(timeout_s=60)))
        drainer.start()

        def decode_candidates() -> list[str]:
            return cluster.router.call(
                lambda r: [w.worker_id for w in r.registry.candidates("decode")]
            )

        wait_for(lambda: wid not in decode_candidates(), what=f"the router to stop choosing {wid}")
        assert decode_candidates(), "the other decode worker still takes requests"
        with cluster.client() as client:  # served elsewhere while the stream goes on
            out = list(client.generate(token_ids=list(range(7, 30)), max_tokens=3, temperature=0.0))
            assert sum(len(r.token_ids) for r in out) == 3
        assert leaving.loop.call(lambda e: e.stats().num_running) == 1  # still in flight
        held.release()  # now it runs to its end
    t.join(120)
    drainer.join(120)
    assert not errors
    assert len(tokens) == 150
    assert result == [True]  # emptied, nothing cut
    status = cluster.router.call(cluster_status)
    mine = next(w for w in status.workers if w.worker_id == wid)
    assert mine.draining and mine.pool == worker_pb2.WORKER_POOL_DECODE
    cluster.remove(wid)  # stop(): Goodbye; the router forgets it
    wait_for(lambda: not cluster.registered(wid), what=f"{wid} to leave the registry")
    cluster.wait_quiescent()
    cluster.add_worker(wid, "decode")  # the module's cluster as it was


def test_status_table_shape():
    w = worker_pb2.WorkerStats(worker_id="d0", pool=worker_pb2.WORKER_POOL_DECODE)
    w.address, w.draining = "127.0.0.1:9", True
    w.num_running, w.num_waiting, w.kv_usage = 2, 1, 0.25
    w.num_free_blocks, w.num_total_blocks = 96, 128
    w.prefix_query_tokens, w.prefix_hit_tokens = 200, 50
    status = admin_pb2.ClusterStatus(
        model_name="m",
        router_address="127.0.0.1:1",
        requests_inflight=3,
        max_inflight=64,
        max_queued=8,
        workers=[w],
        heartbeat_age_s=[0.25],
    )
    lines = admin_cli.status_table(status).splitlines()
    assert lines[0] == "model m  router 127.0.0.1:1  requests 3/64 running, 0/8 queued"
    assert lines[3].split() == [
        "decode", "d0", "127.0.0.1:9", "2", "1", "25%", "96/128", "0", "25%", "0", "0.2s",
        "draining",
    ]  # fmt: skip
    assert (
        lines[-1] == "decode: 1 worker(s), 2 running, 1 waiting, KV 25% of 128 blocks, hit rate 25%"
    )
