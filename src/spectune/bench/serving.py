"""Which way `spectune serve --mode auto` would decode on this machine, by the bench's own figures: the best
draft variant at the exact settings, or the target alone at llama.cpp's fastest settings (runtime/mode.py), by the
same rule; and what that yields beside llama-server at its defaults, where --peer timed it."""

from __future__ import annotations

from typing import Any

from spectune.bench.summary import totals
from spectune.layout import TARGET
from spectune.runtime.mode import faster

FASTEST = "target_fastest"  # the target alone at llama.cpp's fastest settings: a bench row beside the variants


def decode_speed(figures: list[dict[str, Any]]) -> float:
    """Tokens over decode seconds, summed over the prompts (each prompt's median run)."""
    tokens, seconds = totals(figures)
    return tokens / seconds if seconds else 0.0


def serving_choice(rows: list[dict[str, Any]], variants: list[str]) -> dict[str, Any] | None:
    """The mode serving would choose and its speed; None where the bench had no fastest row (exact off: the
    target alone already ran at llama.cpp's fastest settings)."""
    if not rows or FASTEST not in rows[0]["variants"]:
        return None
    speeds = {name: decode_speed([row["variants"][name] for row in rows]) for name in variants}
    fastest = decode_speed([row["variants"][FASTEST] for row in rows])
    best = max(speeds, key=lambda name: speeds[name]) if speeds else None
    mode = faster(speeds[best], fastest) if best else "fastest"
    choice: dict[str, Any] = {
        "mode": mode,
        "best_variant": best,
        "best_variant_tokens_per_second": speeds.get(best or "", 0.0),
        "fastest_tokens_per_second": fastest,
        "exact_target_tokens_per_second": decode_speed([row["variants"][TARGET] for row in rows]),
    }
    baselines = [row["variants"][TARGET].get("llama_cpp_defaults") for row in rows]
    if all(baselines):  # llama.cpp's tokens count the end token: ours the same way (produced), over the same span
        chosen = [row["variants"][best if mode == "speculative" else FASTEST] for row in rows]
        ours = sum(v["produced"] for v in chosen) / sum(v["decode_seconds"] for v in chosen)
        theirs = sum(b["tokens"] for b in baselines) / sum(b["seconds"] for b in baselines)
        choice["over_llama_server_defaults"] = ours / theirs
    return choice


def serving_lines(choice: dict[str, Any] | None) -> list[str]:
    if choice is None:
        return []
    chosen = (
        f"speculative with {choice['best_variant']}"
        if choice["mode"] == "speculative"
        else "the target alone at llama.cpp's fastest settings"
    )
    line = (
        f"Serving here: `spectune serve --mode auto` would decode **{chosen}** (target alone at the fastest settings "
        f"{choice['fastest_tokens_per_second']:.1f} tok/s, at the exact settings "
        f"{choice['exact_target_tokens_per_second']:.1f}; best variant "
        f"{choice['best_variant']} {choice['best_variant_tokens_per_second']:.1f} tok/s)"
    )
    if "over_llama_server_defaults" in choice:
        line += f", {choice['over_llama_server_defaults']:.2f}x llama-server at its defaults (in-process timing)"
    return ["", line + "."]
