"""The `pagedserve` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("kv-waste", help="paged vs contiguous KV allocation, side by side")
    args = parser.parse_args(argv)
    if args.cmd == "kv-waste":
        from benchmarks import kv_waste  # noqa: PLC0415

        return kv_waste.main([])
    return 2


if __name__ == "__main__":
    sys.exit(main())
