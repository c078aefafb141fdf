"""`pagedserve status` and `pagedserve scale`: the operator's commands on a running cluster.

    pagedserve status                      # a table of pools and workers
    pagedserve status --json               # the same, as JSON (Admin.GetClusterStatus)
    pagedserve scale --prefill 2 --decode 3

Both call the router's Admin service (router/admin.py) on its internal listener, whose
address is --address, else $PAGEDSERVE_ADMIN_ADDRESS, else 127.0.0.1:50052 (`pagedserve
up`'s default internal port). Light like the client: grpc and the stubs, no engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TextIO

import grpc
from google.protobuf import json_format

from pagedserve.common.runtime.tls import TLSFiles, internal_channel_credentials
from pagedserve.common.runtime.tls import channel as tls_channel
from pagedserve.v1 import admin_pb2, admin_pb2_grpc, worker_pb2

DEFAULT_ADMIN_ADDRESS = "127.0.0.1:50052"
POOL_NAMES = {worker_pb2.WORKER_POOL_PREFILL: "prefill", worker_pb2.WORKER_POOL_DECODE: "decode"}


def build_parser(cmd: str) -> argparse.ArgumentParser:
    if cmd == "status":
        p = argparse.ArgumentParser(
            prog="pagedserve status", description="pools, workers, load and KV use of a cluster"
        )
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    else:
        p = argparse.ArgumentParser(
            prog="pagedserve scale",
            description="resize the pools of a running `pagedserve up` cluster; leaving "
            "workers finish their requests first",
        )
        p.add_argument("--prefill", type=int, default=None, help="prefill workers wanted")
        p.add_argument("--decode", type=int, default=None, help="decode workers wanted (>= 1)")
        p.add_argument(
            "--drain-timeout-s",
            type=float,
            default=0.0,
            help="how long a leaving worker may take to finish (0 = the cluster's shutdown grace)",
        )
    p.add_argument(
        "--address",
        default=os.environ.get("PAGEDSERVE_ADMIN_ADDRESS", DEFAULT_ADMIN_ADDRESS),
        help="the router's internal address (default $PAGEDSERVE_ADMIN_ADDRESS or %(default)s)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds (default: 10 / none)")
    tls = p.add_argument_group(
        "mutual TLS",
        "when the cluster runs with --internal-ssl-*: a certificate of its internal CA",
    )
    tls.add_argument("--internal-ssl-certfile", default=None)
    tls.add_argument("--internal-ssl-keyfile", default=None)
    tls.add_argument("--internal-ssl-ca-certs", default=None)
    return p


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    given = (args.internal_ssl_certfile, args.internal_ssl_keyfile, args.internal_ssl_ca_certs)
    if not any(given):
        return None
    files = TLSFiles(*given)
    files.require_ca("pagedserve status/scale over mutual TLS")
    return internal_channel_credentials(files)


def main(cmd: str, argv: list[str], out: TextIO = sys.stdout) -> int:
    args = build_parser(cmd).parse_args(argv)
    if cmd == "scale" and args.prefill is None and args.decode is None:
        print("pagedserve scale: give --prefill N and/or --decode M", file=sys.stderr)
        return 2
    try:
        creds = _credentials(args)
    except ValueError as e:  # ConfigError: a missing or half-given file
        print(f"pagedserve {cmd}: {e}", file=sys.stderr)
        return 2
    with tls_channel(args.address, creds) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            if cmd == "status":
                status = stub.GetClusterStatus(
                    admin_pb2.GetClusterStatusRequest(), timeout=args.timeout or 10.0
                )
                out.write(status_json(status) if args.json else status_table(status))
                return 0
            req = admin_pb2.ScaleRequest(drain_timeout_s=args.drain_timeout_s)
            if args.prefill is not None:
                req.prefill = args.prefill
            if args.decode is not None:
                req.decode = args.decode
            res = stub.Scale(req, timeout=args.timeout)
        except grpc.RpcError as e:
            print(
                f"pagedserve {cmd}: {args.address}: {e.code().name}: {e.details()}", file=sys.stderr
            )
            return 1
    out.write(scale_summary(res))
    return 0


def status_json(status: admin_pb2.ClusterStatus) -> str:
    d = json_format.MessageToDict(
        status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return json.dumps(d, indent=2) + "\n"


def status_table(status: admin_pb2.ClusterStatus) -> str:
    """One line for the router, one per worker, and a line per pool with its totals."""
    lines = [
        f"model {status.model_name}  router {status.router_address}  requests "
        f"{status.requests_inflight}/{status.max_inflight} running, "
        f"{status.requests_queued}/{status.max_queued} queued",
        "",
    ]
    head = ("POOL", "WORKER", "ADDRESS", "RUN", "WAIT", "KV USE", "FREE/TOTAL", "LEASES")
    head += ("HIT RATE", "PREEMPT", "BEAT", "STATE")
    rows = [head]
    pools: dict[str, list[worker_pb2.WorkerStats]] = {}
    for w, age in zip(status.workers, status.heartbeat_age_s, strict=True):
        pool = POOL_NAMES.get(w.pool, "colocated")
        pools.setdefault(pool, []).append(w)
        rows.append(
            (
                pool,
                w.worker_id,
                w.address,
                str(w.num_running),
                str(w.num_waiting),
                f"{w.kv_usage:.0%}",
                f"{w.num_free_blocks}/{w.num_total_blocks}",
                str(w.open_leases),
                _rate(w.prefix_hit_tokens, w.prefix_query_tokens),
                str(w.num_preemptions),
                f"{age:.1f}s",
                "draining" if w.draining else "serving",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(n) for c, n in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append("")
    for pool, ws in pools.items():
        total = sum(w.num_total_blocks for w in ws)
        used = sum(w.kv_usage * w.num_total_blocks for w in ws)
        lines.append(
            f"{pool}: {len(ws)} worker(s), {sum(w.num_running for w in ws)} running, "
            f"{sum(w.num_waiting for w in ws)} waiting, KV {used / total if total else 0:.0%} "
            f"of {total} blocks, hit rate "
            + _rate(sum(w.prefix_hit_tokens for w in ws), sum(w.prefix_query_tokens for w in ws))
        )
    if not status.workers:
        lines.append("no worker registered")
    return "\n".join(lines) + "\n"


def scale_summary(res: admin_pb2.ScaleResponse) -> str:
    parts = [f"now {res.prefill} prefill + {res.decode} decode worker(s)"]
    if res.started:
        parts.append(f"started {', '.join(res.started)}")
    if res.stopped:
        parts.append(f"stopped {', '.join(res.stopped)}")
    if res.cut:
        parts.append(f"cut at the drain timeout (requests failed): {', '.join(res.cut)}")
    return "; ".join(parts) + "\n"


def _rate(hits: int, queries: int) -> str:
    return f"{hits / queries:.0%}" if queries else "-"
