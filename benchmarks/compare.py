"""Two results of the same bench side by side (compare-llama-bench's job): a committed one and a fresh one made by
its command, or two builds, machines or settings. Every figure the two share is listed with its change; a figure
beyond its spread (what reruns of an unchanged bench move it by: none for counts of identical answers, a little for
acceptance, more for wall-clock times on 2 cores) is flagged, and the exit status is 1 where any is.

Reads a pair's bench (`spectune bench`, benchmarks/speculative.py: every variant's summary) and a serving bench
(benchmarks/serving.py), plain or gzipped.

Usage: python benchmarks/compare.py COMMITTED.json FRESH.json
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spectune.bench.report import read_result

# figure -> (how far a rerun may move it, relative to the first value; 0: not at all)
SPREAD = {
    "identical": 0.0,
    "acceptance": 0.03,
    "mean_accepted_len": 0.03,
    "predicted_speedup_gpu": 0.03,
    "aggregate_speedup": 0.10,
    "aggregate_speedup_over_llama_cpp": 0.10,
    "aggregate_speedup_over_llama_cpp_defaults": 0.10,
    "median_tokens_per_second": 0.10,
    "total_ratio_to_llama_server": 0.05,
    "median_ttft_ms": 0.10,
    "ratio_to_llama_server": 0.10,
    "p50_ttft_ms": 0.20,
    "errors": 0.0,
    "median_first_audio_ms": 0.15,
}
PER_PROMPT = {"prompts", "rows", "turns", "summary_per_pass", "retimed", "still_stalled", "profile"}


def figures(node: Any, path: str = "") -> Iterator[tuple[str, str, float]]:
    """(where, figure, value) of every figure SPREAD knows, outside the per-prompt rows."""
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        where = f"{path}/{key}" if path else key
        if key in SPREAD and isinstance(value, int | float) and not isinstance(value, bool):
            yield where, key, float(value)
        elif key not in PER_PROMPT:
            yield from figures(value, where)


def compare(committed: dict, fresh: dict) -> list[tuple[str, float, float, bool]]:
    """(where, committed, fresh, within its spread) for every figure both hold."""
    theirs = {where: value for where, _, value in figures(fresh)}
    rows = []
    for where, key, value in figures(committed):
        if where in theirs:
            new = theirs[where]
            moved = abs(new - value) / abs(value) if value else abs(new)
            rows.append((where, value, new, moved <= SPREAD[key] + 1e-12))
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.rsplit("Usage: ", 1)[1].strip(), file=sys.stderr)
        return 2
    committed, fresh = (read_result(Path(path)) for path in argv)
    rows = compare(committed, fresh)
    if not rows:
        print(f"{argv[0]} and {argv[1]} share no figure: not the same bench", file=sys.stderr)
        return 2
    print(f"| figure | {argv[0]} | {argv[1]} | change | |\n|---|---|---|---|---|")
    for where, old, new, within in rows:
        change = f"{new / old:.3f}x" if old else f"{new - old:+g}"
        print(f"| {where} | {old:.4g} | {new:.4g} | {change} | {'' if within else 'beyond its spread'} |")
    beyond = sum(not within for *_, within in rows)
    print(f"\n{len(rows)} figures, {beyond} beyond their spread")
    return 1 if beyond else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
