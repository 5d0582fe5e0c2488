"""Stalls: on 2 cores a llama.cpp decode now and then runs 5-30x slower for a while (another process's burst, the
threads' wake-ups), and a prompt timed then reads as a speedup or a loss that is not there. A prompt whose time per
token on any side (a variant, the target alone, or a llama.cpp run beside them) is over STALL_FACTOR times that
side's median over the bench is timed again, once; the report lists each re-timed prompt, the sides that were over,
and those still over after the new timing."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

STALL_FACTOR = 3.0
PEER_FIELDS = ("llama_cpp", "llama_cpp_defaults")  # llama.cpp's runs beside a variant (bench.config.BASELINES)


def seconds_per_token(row: dict[str, Any]) -> dict[str, float]:
    """Each side's decode seconds per token on this prompt (the median run's)."""
    sides = {}
    for name, figures in row["variants"].items():
        if figures["tokens"]:
            sides[name] = figures["decode_seconds"] / figures["tokens"]
        for field in PEER_FIELDS:
            peer = figures.get(field)
            if peer and peer["tokens"]:
                sides[f"{name} ({field})"] = peer["seconds"] / peer["tokens"]
    return sides


def stalled(rows: list[dict[str, Any]]) -> dict[int, list[str]]:
    """The prompts (their index in `rows`) with a side over STALL_FACTOR times that side's median, and those sides."""
    return over_median([seconds_per_token(row) for row in rows])


def over_median(per_row: list[dict[str, float]]) -> dict[int, list[str]]:
    """Of each prompt's seconds per token by side: the prompts with a side over STALL_FACTOR times its median."""
    names = {side for sides in per_row for side in sides}
    medians = {side: statistics.median(sides[side] for sides in per_row if side in sides) for side in names}
    found = {}
    for index, sides in enumerate(per_row):
        over = sorted(side for side, seconds in sides.items() if seconds > STALL_FACTOR * medians[side])
        if over:
            found[index] = over
    return found


def retime_stalls(
    rows: list[dict[str, Any]], retime: Callable[[int], dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows with every stalled prompt timed again (`retime(index)` gives its new row), and what was re-timed."""
    found = stalled(rows)
    rows = [retime(index) if index in found else row for index, row in enumerate(rows)]
    still = stalled(rows)
    return rows, [
        {"prompt": rows[index]["prompt"], "sides": sides, "still_over": still.get(index, [])}
        for index, sides in found.items()
    ]


def stall_lines(retimed: list[dict[str, Any]]) -> list[str]:
    if not retimed:
        return ["", f"Stalls: no prompt had a side over {STALL_FACTOR:g}x its median time per token."]
    still = [entry for entry in retimed if entry["still_over"]]
    listed = "; ".join(f"prompt {entry['prompt'] + 1}: {', '.join(entry['sides'])}" for entry in retimed)
    return [
        "",
        f"Stalls: {len(retimed)} prompts re-timed (a side over {STALL_FACTOR:g}x its median time per token): "
        f"{listed}. Still over after re-timing: {len(still)}"
        + (f" ({', '.join(str(entry['prompt'] + 1) for entry in still)})." if still else "."),
    ]
