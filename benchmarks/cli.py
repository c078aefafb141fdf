"""Pieces the benchmarks' command lines share: on/off switch flags, plain-text tables."""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def print_rows(title: str | None, head: str, lines: Iterable[str]) -> None:
    """The title (if any), a header line, a rule as wide as it, then the rows' lines
    (formatted by the caller, aligned with `head`)."""
    if title is not None:
        print(title)
    print(head)
    print("-" * len(head))
    for line in lines:
        print(line)


def add_on_off(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    """`flag` takes on, off, or both (the runs alternate between them); default on."""
    parser.add_argument(
        flag, nargs="+", default=["on"], choices=["on", "off"], help=f"{help}: on, off, or both"
    )
