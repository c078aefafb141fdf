"""A standalone router: `python -m pagedserve.router --model DIR --port 50051`.

Workers join it by heartbeat (WorkerConfig.registry_address = this address). The
launcher (`pagedserve up`) runs the same router in its own process instead.

SIGTERM or Ctrl-C drains (router/server.py `Router.drain`): new requests get
UNAVAILABLE, health reports NOT_SERVING, the streams in flight get
`--shutdown-grace-s` to finish (a second signal ends the grace at once); then the
process exits 0. Workers outlive it and register again with whichever router next
serves at the address they dial.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

from pagedserve.router.config import DEFAULT_HTTP_PORT, DEFAULT_PORT, PrefixRouting, RouterConfig
from pagedserve.router.server import serve


def build_parser() -> argparse.ArgumentParser:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="python -m pagedserve.router", description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the default model)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-inflight", type=int, default=d.max_inflight)
    p.add_argument("--max-queued", type=int, default=d.max_queued)
    p.add_argument("--worker-timeout-s", type=float, default=d.worker_timeout_s)
    p.add_argument("--disagg-min-prompt-tokens", type=int, default=d.disagg_min_prompt_tokens)
    p.add_argument("--lease-ttl-ms", type=int, default=None)
    p.add_argument("--transfer-failure-policy", choices=["recompute", "fail"], default=None)
    p.add_argument(
        "--redis-url", default=None, help="shared prefix index + worker registry (else embedded)"
    )
    pr = d.prefix
    p.add_argument(
        "--no-prefix-routing", action="store_true", help="route by load only (no index lookups)"
    )
    p.add_argument("--no-prefix-pull", action="store_true", help="never pull a prefix")
    p.add_argument("--prefix-load-weight", type=float, default=pr.load_weight)
    p.add_argument("--prefill-tokens-per-s", type=float, default=pr.prefill_tokens_per_s)
    p.add_argument("--transfer-bytes-per-s", type=float, default=pr.transfer_bytes_per_s)
    p.add_argument(
        "--metrics-port", type=int, default=None, help="Prometheus /metrics port (0 = any free)"
    )
    p.add_argument(
        "--metrics-compat",
        choices=["vllm"],
        default=None,
        help="also export vLLM-named series (vllm:*) for vLLM's dashboards",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=25.0,
        help="on SIGTERM/Ctrl-C: seconds the streams in flight get to finish",
    )
    p.add_argument("--log-level", default="INFO")
    # issue 12: http
    add_http_flags(p)
    return p


def add_http_flags(p: argparse.ArgumentParser) -> None:
    """--http-port / --no-http (the OpenAI-compatible API; `pagedserve up` uses these too)."""
    p.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help="OpenAI-compatible HTTP API port on --host (0 = any free)",
    )
    p.add_argument("--no-http", action="store_true", help="do not serve the HTTP API")


def http_port(args: argparse.Namespace) -> int | None:
    """RouterConfig.http_port from the flags of add_http_flags."""
    return None if args.no_http else args.http_port


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")
    config = RouterConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        max_model_len=args.max_model_len,
        max_inflight=args.max_inflight,
        max_queued=args.max_queued,
        worker_timeout_s=args.worker_timeout_s,
        disagg_min_prompt_tokens=args.disagg_min_prompt_tokens,
        lease_ttl_ms=args.lease_ttl_ms,
        transfer_failure_policy=args.transfer_failure_policy,
        redis_url=args.redis_url,
        metrics_port=args.metrics_port,
        metrics_compat=args.metrics_compat,
        http_port=http_port(args),  # issue 12: http
        prefix=PrefixRouting(
            enabled=not args.no_prefix_routing,
            pull=not args.no_prefix_pull,
            load_weight=args.prefix_load_weight,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            transfer_bytes_per_s=args.transfer_bytes_per_s,
        ),
    )
    # serve() handles SIGTERM and SIGINT itself (drain, then return).
    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        asyncio.run(serve(config, shutdown_grace_s=args.shutdown_grace_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
