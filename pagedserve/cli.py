"""The `pagedserve` command line.

    pagedserve up --prefill 1 --decode 1        # the cluster (see pagedserve/launch.py)
    pagedserve down --ray-address auto          # stop the workers of `up --detach-workers`
    pagedserve status [--json]                  # pools, workers, load (pagedserve/admin_cli.py)
    pagedserve scale --prefill 2 --decode 3     # resize a running `up` cluster
    pagedserve generate "The capital of France is" --max-tokens 16 --temperature 0
    pagedserve generate --chat "What is the capital of France?"
    pagedserve chat --system "You are concise."  # interactive; streams tokens as they come

`generate` and `chat` talk to a router through the generated gRPC stubs
(router/client.py); the address is --address, else $PAGEDSERVE_ADDRESS, else
127.0.0.1:50051 (the router's default port); the API key (a router started with
--api-key or --api-keys-file wants one) is --api-key, else $PAGEDSERVE_API_KEY.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from pagedserve import __version__
from pagedserve.router.config import DEFAULT_PORT

DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_PORT}"
# One default for `generate`, `chat` and `up --demo` (they had 128, 256 and 64): room
# for a whole chat answer of a small model, which mostly ends at EOS well before.
DEFAULT_MAX_TOKENS = 256
CHAT_COMMANDS = "/exit or /quit to leave, /reset to forget the conversation"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "up":  # the launcher parses its own options (and --help)
        from pagedserve import launch

        return launch.main(argv[1:])
    if argv and argv[0] == "down":
        from pagedserve import launch

        return launch.down_main(argv[1:])
    if argv and argv[0] in ("status", "scale"):  # the operator's commands (Admin service)
        from pagedserve import admin_cli

        return admin_cli.main(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    if args.cmd == "generate":
        return generate(args)
    if args.cmd == "chat":
        return chat(args)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", help="start a router and Ray-managed workers (pagedserve up --help)")
    sub.add_parser("down", help="stop the workers of `pagedserve up --detach-workers`")
    sub.add_parser("status", help="pools, workers, load and KV use (pagedserve status --help)")
    sub.add_parser("scale", help="resize the pools: pagedserve scale --prefill N --decode M")
    gen = sub.add_parser("generate", help="complete one prompt, streaming the text")
    gen.add_argument("prompt", help="the text to continue (a user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a chat message")
    gen.add_argument("--system", default=None, help="a system message (with --chat)")
    _add_common(gen)
    ch = sub.add_parser("chat", help=f"an interactive chat ({CHAT_COMMANDS})")
    ch.add_argument("--system", default=None, help="the system message")
    _add_common(ch)
    return parser


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("PAGEDSERVE_ADDRESS", DEFAULT_ADDRESS))
    p.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDSERVE_API_KEY") or None,
        help="the router's API key (default: $PAGEDSERVE_API_KEY)",
    )
    p.add_argument("--timeout", type=float, default=None, help="deadline per request, seconds")
    # issue 11: planes
    p.add_argument(
        "--ssl-ca-certs",
        default=os.environ.get("PAGEDSERVE_SSL_CA_CERTS"),
        type=_existing_file,
        help="TLS: the CA file (PEM) that signed the router's --ssl-certfile (default: plaintext)",
    )
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("-n", type=int, default=None, help="samples (generate only)")
    p.add_argument("--cache-salt", default="")
    p.add_argument("-v", "--verbose", action="store_true", help="print usage after each answer")


def _existing_file(path: str) -> str:
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{path!r} does not exist or is not a file")
    return path


def _sampling(args: argparse.Namespace) -> dict[str, object]:
    out = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        n=args.n,
    )
    if args.ignore_eos:
        out["ignore_eos"] = True
    return {k: v for k, v in out.items() if v is not None}


def _fail(e, out: TextIO, address: str = "") -> int:
    import grpc

    if isinstance(e, grpc.RpcError):
        from pagedserve.router.client import explain

        hint = explain(e, address)
        hint = f" ({hint})" if hint else ""
        print(f"\nerror: {e.code().name}: {e.details()}{hint}", file=out)
    else:
        print(f"\nerror: {e}", file=out)
    return 1


def generate(args: argparse.Namespace) -> int:
    import grpc

    from pagedserve.router.client import Client

    inputs: dict[str, object] = {"prompt": args.prompt}
    if args.chat:
        turns = [{"role": "system", "content": args.system}] if args.system else []
        inputs = {"messages": [*turns, {"role": "user", "content": args.prompt}]}
    stdout, stderr = sys.stdout, sys.stderr
    with Client(
        args.address, timeout=args.timeout, api_key=args.api_key, ssl_ca_certs=args.ssl_ca_certs
    ) as client:
        try:
            if (args.n or 1) > 1:  # samples arrive interleaved: print each one whole
                for c in client.collect(**inputs, cache_salt=args.cache_salt, **_sampling(args)):
                    print(f"--- sample {c.index} ({c.finish_reason.value}) ---", file=stdout)
                    print(c.text, file=stdout)
                return 0
            last = None
            for r in client.generate(**inputs, cache_salt=args.cache_salt, **_sampling(args)):
                stdout.write(r.text)
                stdout.flush()
                last = r
            stdout.write("\n")
            if args.verbose and last is not None:
                _print_usage(last, stderr)
        except (grpc.RpcError, ValueError, TypeError) as e:
            return _fail(e, stderr, args.address)
    return 0


def chat(args: argparse.Namespace) -> int:
    """Reads user turns line by line; streams each answer; keeps the conversation."""
    import grpc

    from pagedserve.router.client import Client

    stdin, stdout, stderr = sys.stdin, sys.stdout, sys.stderr
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = list(system)
    interactive = stdin.isatty()
    if interactive:
        print(f"pagedserve chat with {args.address} ({CHAT_COMMANDS})", file=stderr)
    sampling = _sampling(args)
    sampling.pop("n", None)
    with Client(
        args.address, timeout=args.timeout, api_key=args.api_key, ssl_ca_certs=args.ssl_ca_certs
    ) as client:
        while True:
            if interactive:
                stdout.write("you> ")
                stdout.flush()
            try:
                line = stdin.readline()
            except KeyboardInterrupt:
                break
            if not line:
                break
            text = line.strip()
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = list(system)
                continue
            if not text:
                continue
            history.append({"role": "user", "content": text})
            stdout.write("assistant> ")
            stdout.flush()
            call = client.generate(messages=history, cache_salt=args.cache_salt, **sampling)
            answer, last = [], None
            try:
                for r in call:
                    answer.append(r.text)
                    stdout.write(r.text)
                    stdout.flush()
                    last = r
            except KeyboardInterrupt:  # stop this answer, keep chatting
                call.cancel()
                stdout.write(" [stopped]")
            except grpc.RpcError as e:
                history.pop()
                _fail(e, stderr, args.address)
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED):
                    return 1  # every next turn would fail the same way
                continue
            stdout.write("\n")
            if args.verbose and last is not None:
                _print_usage(last, stderr)
            history.append({"role": "assistant", "content": "".join(answer)})
    return 0


def _print_usage(last, out: TextIO) -> None:
    from pagedserve.common.runtime.protocol import FINISH_FROM_PB

    reason = FINISH_FROM_PB[last.finish_reason].value
    u = last.usage
    print(
        f"[{reason}; prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached), "
        f"completion {u.completion_tokens} tokens]",
        file=out,
    )


if __name__ == "__main__":
    sys.exit(main())
