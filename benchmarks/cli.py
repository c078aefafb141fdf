"""Pieces the benchmarks' command lines share: on/off switch flags, plain-text tables."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a switch is resolved, not for the table helpers
    import torch


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


def engine_switches(args: argparse.Namespace, dtype: torch.dtype) -> list[tuple[str, str, str]]:
    """(kernel, prepack, fused) for every combination of --kernel, --prepack and --fused
    that differs for `dtype` on the CPU: a switch the model ignores for it (prepacking
    where `model.can_prepack` is False, the fused ops where `model.can_fuse` is) takes
    only its first value."""
    import torch

    from pagedserve.common.core.model import can_fuse, can_prepack

    cpu = torch.device("cpu")
    prepack = args.prepack if can_prepack(dtype, cpu) else args.prepack[:1]
    fused = args.fused if can_fuse(dtype, cpu) else args.fused[:1]
    return [(k, pk, f) for k in args.kernel for pk in prepack for f in fused]
