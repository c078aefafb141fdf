"""Plain-text tables of the benchmarks' reports."""

from __future__ import annotations

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
