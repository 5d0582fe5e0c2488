"""A bench's summary per variant, from its per-prompt rows: the aggregate speedup and the totals behind it, τ and
acceptance pooled over the prompts, a caller's waits, the predictions here and on a GPU, and llama.cpp beside ours."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spectune.bench.config import BASELINES, BenchConfig, draft_length
from spectune.gpu.card import reference_card
from spectune.gpu.predict import on_card_of_steps
from spectune.layout import TARGET
from spectune.runtime.draft_model import DRAFT
from spectune.runtime.ngram import NGRAM
from spectune.runtime.profile import gguf_weights
from spectune.speedup import (
    first_sentence_ratio,
    pooled_by_position,
    speedup_of_steps,
    step_cost_ratio,
    verify_ratio_at,
)

# What benchmarks/speculative.py and benchmarks/gpu/bench.py keep of each draft's summary.
SUMMARY_KEYS = (
    "n",
    "draft_max",
    "identical",
    "exact",
    "aggregate_speedup",
    "total_tokens",
    "total_seconds",
    "target_total_seconds",
    "ttfs_ms",
    "target_ttfs_ms",
    "ttft_ms",
    "target_ttft_ms",
    "cold_ttft_ms",
    "target_cold_ttft_ms",
    "cold_ttfs_ms",
    "cold_ttfs_first_clause_alone_ms",
    "target_cold_ttfs_ms",
    "first_words_prompts",
    "mean_speedup",
    "best_speedup",
    "worst_speedup",
    "acceptance",
    "acceptance_by_position",
    "mean_accepted_len",
    "cost_ratio",
    "verify_ratio",
    "mean_drafted_per_step",
    "draft_catch_ups",
    "predicted_speedup_here",
    "predicted_speedup_gpu",
    "gpu_cost_ratio",
    "gpu_card",
    "grounded_cost_ratio",
    "predicted_speedup_gpu_grounded",
    "predicted_speedup_gpu_grounded_band",
    "predicted_first_sentence_here",
    "predicted_first_sentence_gpu_grounded",
    "ngram_step_share",
    "ngram_drafted",
    "ngram_acceptance",
    "ngram_context_share",
)

COLD_KEYS = ("cold_ttft_ms", "cold_ttfs_ms", "cold_ttfs_first_clause_alone_ms")  # per prompt, a new caller's

PEER_KEYS = (  # present where --peer ran llama.cpp's own decoders
    "vs_llama_cpp",
    "llama_cpp_tokens_per_second",
    "llama_cpp_acceptance",
    "acceptance_as_llama_cpp_counts",
    "llama_cpp_identical",
    "baseline_vs_llama_cpp",
    "target_ms_per_decode",
    "llama_cpp_target_ms_per_decode",
    "llama_cpp_target_identical",
    "llama_cpp_target_total",
    "aggregate_speedup_over_llama_cpp",
    "baseline_vs_llama_cpp_defaults",
    "llama_cpp_defaults_target_ms_per_decode",
    "llama_cpp_defaults_target_identical",
    "llama_cpp_defaults_target_total",
    "aggregate_speedup_over_llama_cpp_defaults",
    "aggregate_speedup_over_fastest_llama_cpp",
)


def result_row(summary: dict[str, Any]) -> dict[str, Any]:
    """A draft's figures as the benchmarks commit them: every summary key, and llama.cpp's (None where the peer
    was not run)."""
    return {key: summary[key] for key in SUMMARY_KEYS} | {key: summary.get(key) for key in PEER_KEYS}


def totals(variants: list[dict[str, Any]]) -> tuple[int, float]:
    """Tokens and decode seconds summed over the prompts (each prompt's median run)."""
    return sum(v["tokens"] for v in variants), sum(v["decode_seconds"] for v in variants)


@dataclass
class Pooled:
    """A variant's steps pooled over the prompts (tokens / steps, as the offline meter pools: short answers do not
    weigh more)."""

    tau: float
    drafted_at: list[int]
    accepted_at: list[int]
    steps: int
    model_share: float  # of the drafted tokens, the draft model's (the rest were looked up, and cost nothing)
    catch_ups: list[int]  # the draft model's batches of more than one token before it proposed

    @classmethod
    def of(cls, variants: list[dict[str, Any]], has_model: bool) -> Pooled:
        drafted_at, accepted_at = (pooled_by_position(variants, key) for key in ("drafted_at", "accepted_at"))
        steps = sum(v["verify_steps"] for v in variants)
        drafted = sum(drafted_at)
        looked_up = sum(f["drafted"] for v in variants for source, f in source_counts(v).items() if source != DRAFT)
        return cls(
            tau=sum(v["produced"] for v in variants) / max(1, steps),
            drafted_at=drafted_at,
            accepted_at=accepted_at,
            steps=steps,
            model_share=(drafted - looked_up) / drafted if drafted else float(has_model),
            catch_ups=[n for v in variants for n in v.get("draft_catch_ups", [])],  # older rows: none counted
        )


def measured_figures(name: str, rows: list[dict], pooled: Pooled) -> dict[str, Any]:
    """What a bench's rows say of a variant with no model of cost: speed, waits, acceptance, identical answers
    (`pooled`: its steps, Pooled.of its rows)."""
    variants = [row["variants"][name] for row in rows]
    speedups = [v["speedup"] for v in variants]
    # The headline: all tokens over all decode time, with the draft over the target alone (a mean of per-prompt
    # ratios weighs short answers as much as long ones).
    target_alone = [row["variants"][TARGET] for row in rows]
    (tokens, seconds), (_, target_seconds) = totals(variants), totals(target_alone)
    drafted, accepted = sum(pooled.drafted_at), sum(pooled.accepted_at)
    counts = [source_counts(v) for v in variants]
    return {
        **versus_llama_cpp(variants, target_alone, seconds),
        "n": len(rows),
        "identical": sum(v["identical"] for v in variants),
        "aggregate_speedup": target_seconds / seconds if seconds else 0.0,
        "total_tokens": tokens,
        "total_seconds": seconds,
        "target_total_seconds": target_seconds,
        "ttfs_ms": statistics.median(v["ttfs_ms"] for v in variants),
        "target_ttfs_ms": statistics.median(v["ttfs_ms"] for v in target_alone),
        "ttft_ms": statistics.median(v["ttft_ms"] for v in variants),
        "target_ttft_ms": statistics.median(v["ttft_ms"] for v in target_alone),
        **new_caller_figures(variants, target_alone),
        "mean_speedup": statistics.mean(speedups),
        "best_speedup": max(speedups),
        "worst_speedup": min(speedups),
        "acceptance": accepted / drafted if drafted else 0.0,
        "acceptance_by_position": [
            a / d if d else 0.0 for d, a in zip(pooled.drafted_at, pooled.accepted_at, strict=True)
        ],
        "mean_accepted_len": pooled.tau,
        "mean_drafted_per_step": drafted / pooled.steps if pooled.steps else 0.0,
        **{
            key: value
            for source in lookup_sources(counts)
            for key, value in lookup_figures(counts, pooled.steps, source)
        },
        "draft_catch_ups": len(pooled.catch_ups),
    }


def summarize(
    name: str, rows: list[dict], profile: dict, config: BenchConfig, draft_path: Path | None
) -> dict[str, Any]:
    """The measured figures, and the predictions of the step-cost model here (`profile`: c and r(n) measured in
    the same run) and on a GPU, on the steps the bench really made (k at most: see speedup_of_steps)."""
    k = draft_length(config, name)
    pooled = Pooled.of([row["variants"][name] for row in rows], draft_path is not None)
    steps = (pooled.tau, pooled.drafted_at, pooled.steps)
    return {
        **measured_figures(name, rows, pooled),
        "draft_max": k,
        "exact": config.exact,
        "verify_ratio": verify_ratio_at(profile["verify_ratio"], k + 1),
        "profile": profile,
        **predicted_here(pooled, profile),
        **gpu_predictions(config, name, draft_path, pooled.model_share, steps),
    }


def predicted_here(pooled: Pooled, profile: dict) -> dict[str, float]:
    """The step-cost model on this machine (`profile`: c and r(n) measured in the same run), c paid on the model's
    share of the drafted tokens."""
    cost_ratio = profile["cost_ratio"] * pooled.model_share
    # A catch-up of n tokens is one batch of the draft: r(n) draft steps here (the target's r standing in for the
    # draft's), of which the step-cost model counts one; on a memory-bound GPU it costs what one step does.
    catch_up_cost = profile["cost_ratio"] * sum(
        verify_ratio_at(profile["verify_ratio"], n) - 1 for n in pooled.catch_ups
    )
    steps = (pooled.tau, pooled.drafted_at, pooled.steps)
    return {
        "cost_ratio": cost_ratio,
        "predicted_speedup_here": speedup_of_steps(*steps, cost_ratio, profile["verify_ratio"], catch_up_cost),
    }


def new_caller_figures(variants: list[dict[str, Any]], target_alone: list[dict[str, Any]]) -> dict[str, Any]:
    """A new caller's first words: medians over the prompts that measured them (first_words_every)."""
    return {
        "first_words_prompts": sum(COLD_KEYS[0] in v for v in variants),
        **{key: statistics.median(v[key] for v in variants if key in v) for key in COLD_KEYS},
        **{f"target_{key}": statistics.median(v[key] for v in target_alone if key in v) for key in COLD_KEYS[:2]},
    }


def gpu_predictions(
    config: BenchConfig, name: str, draft_path: Path | None, model_share: float, steps: tuple[float, list[int], int]
) -> dict[str, Any]:
    """The GPU predictions on the steps the bench made (`steps`: τ, drafted_at, verify steps): bytes only (r = 1,
    c what a step reads) and on the reference card (spectune.gpu: c and r fitted on published figures, with a band)."""
    target_weights, card = gguf_weights(config.target), reference_card()
    draft_weights = gguf_weights(draft_path) if draft_path else None
    read_c = step_cost_ratio(draft_weights, target_weights) if draft_weights else 0.0
    gpu_c = (config.gpu_cost_ratio.get(name) or read_c) * model_share
    grounded = on_card_of_steps(card, target_weights, draft_weights, model_share, *steps)
    return {
        "gpu_cost_ratio": gpu_c,
        "predicted_speedup_gpu": speedup_of_steps(*steps, gpu_c, None),
        "gpu_card": card.label,
        "grounded_cost_ratio": grounded["c"],
        "predicted_speedup_gpu_grounded": grounded["speedup"],
        "predicted_speedup_gpu_grounded_band": list(grounded["speedup_band"]),
    }


def grounded_figure(summary: dict[str, Any]) -> str:
    """The reference card's prediction as printed: the figure and its band (results older than the band: none)."""
    figure = f"{summary['predicted_speedup_gpu_grounded']:.2f}x"
    band = summary.get("predicted_speedup_gpu_grounded_band")
    return f"{figure} ({band[0]:.2f}-{band[1]:.2f}x)" if band else figure


def first_sentence_over_alone(summary: dict[str, Any], speedup: float) -> float:
    """Time to the first sentence over the target alone's, the prompt cached (speedup.first_sentence_ratio), for a
    variant that speeds whole answers `speedup` times: the clause is as many target steps as the target alone took
    here (its time to the first sentence over its first token's), τ the bench's. With the bench's own aggregate
    speedup it is checked against what the bench timed; with the grounded one it is the prediction for the card."""
    clause_tokens = summary["target_ttfs_ms"] / summary["target_ttft_ms"]
    return first_sentence_ratio(clause_tokens, summary["mean_accepted_len"], speedup)


def with_first_sentence(summary: dict[str, Any]) -> dict[str, Any]:
    return summary | {
        "predicted_first_sentence_here": first_sentence_over_alone(summary, summary["aggregate_speedup"]),
        "predicted_first_sentence_gpu_grounded": first_sentence_over_alone(
            summary, summary["predicted_speedup_gpu_grounded"]
        ),
    }


def source_counts(variant: dict[str, Any]) -> dict[str, dict[str, int]]:
    """A row's counts per speculator that proposed (steps, drafted, accepted, from_context); rows benched before
    `by_source` kept n-gram lookup's only, as `ngram_*`."""
    if "by_source" in variant:
        return variant["by_source"]
    return {NGRAM: {key: variant[f"ngram_{key}"] for key in ("steps", "drafted", "accepted", "from_context")}}


def lookup_sources(counts: list[dict[str, dict[str, int]]]) -> list[str]:
    """The model-free speculators whose figures a summary gives: n-gram lookup always (its keys are in every
    summary), then any other that proposed."""
    return list(dict.fromkeys([NGRAM, *(source for c in counts for source in c if source != DRAFT)]))


def lookup_figures(counts: list[dict[str, dict[str, int]]], steps: int, source: str) -> list[tuple[str, Any]]:
    """How often a model-free speculator proposed, how much of it was accepted, and how much of it the conversation
    gave (pooled over the prompts), as `SOURCE_step_share`, `SOURCE_drafted`, ..."""
    own = [c[source] for c in counts if source in c]
    drafted, accepted = (sum(f[key] for f in own) for key in ("drafted", "accepted"))
    return [
        (f"{source}_step_share", sum(f["steps"] for f in own) / steps if steps else 0.0),
        (f"{source}_drafted", drafted),
        (f"{source}_acceptance", accepted / drafted if drafted else 0.0),
        (f"{source}_context_share", sum(f["from_context"] for f in own) / drafted if drafted else 0.0),
    ]


def versus_llama_cpp(variants: list[dict], target_alone: list[dict], seconds: float) -> dict[str, Any]:
    """llama.cpp's own figures beside ours, where --peer ran them: its speculative decoder on this pair, and its
    target alone, the baseline (aggregates: all tokens over all decode seconds)."""
    report: dict[str, Any] = {}
    with_peer = [v for v in variants if "llama_cpp" in v]
    if with_peer:
        # Pooled over prompts as ours are (a mean of per-prompt rates read 42% where the pooled count read 32%)
        peer = [v["llama_cpp"] for v in with_peer]
        peer_seconds, ours_seconds = sum(p["seconds"] for p in peer), sum(v["decode_seconds"] for v in with_peer)
        peer_rate = sum(p["tokens"] for p in peer) / peer_seconds if peer_seconds else 0.0
        ours_rate = sum(v["produced"] for v in with_peer) / ours_seconds if ours_seconds else 0.0
        drafted, offered = sum(p["drafted"] for p in peer), sum(v["offered"] for v in with_peer)
        report |= {
            "vs_llama_cpp": ours_rate / peer_rate if peer_rate else 0.0,
            "llama_cpp_tokens_per_second": peer_rate,
            "llama_cpp_acceptance": sum(p["accepted"] for p in peer) / drafted if drafted else 0.0,
            # Our run counted as llama.cpp counts its own (see Stats.offered): equal to its figure where the
            # answers agree, so the two acceptances above k = 1 can be compared.
            "acceptance_as_llama_cpp_counts": (
                sum(v["accepted_as_llama_cpp"] for v in with_peer) / offered if offered else 0.0
            ),
            "llama_cpp_identical": sum(p["identical"] for p in peer),
        }
    for field in BASELINES:
        report |= over_baseline(target_alone, seconds, field)
    over = [report[f"aggregate_speedup_over_{field}"] for field in BASELINES if f"baseline_vs_{field}" in report]
    if over:
        # the headline a skeptic accepts: over the faster of llama.cpp's two, i.e. the smaller speedup
        report["aggregate_speedup_over_fastest_llama_cpp"] = min(over)
    return report


def over_baseline(target_alone: list[dict], seconds: float, field: str) -> dict[str, Any]:
    """With the draft over llama.cpp's target alone (`field`: one of BASELINES), where --peer ran it."""
    baseline = [v[field] for v in target_alone if field in v]
    if not baseline:
        return {}
    # Time per target decode over the same span on both sides: llama-server's clock runs from its first token
    # (sampled off the prompt's batch) to its last, n - 1 decodes for n tokens (the end token among them), so
    # ours is taken from our first token to our last too. Our first decode (the prompt's last token, after a
    # rollback and another batch shape) is slower than the rest; llama.cpp puts its own in the prompt time.
    llama_steps, llama_seconds = sum(b["tokens"] - 1 for b in baseline), sum(b["seconds"] for b in baseline)
    ours_steps = sum(v["verify_steps"] - 1 for v in target_alone)
    ours_seconds = sum(v["after_first_seconds"] for v in target_alone)
    llama_step = llama_seconds / llama_steps if llama_steps else 0.0
    ours_step = ours_seconds / ours_steps if ours_steps else 0.0
    return {
        # < 1: our target-alone loop is slower than llama.cpp's, and every speedup over it is inflated by that
        f"baseline_vs_{field}": llama_step / ours_step if ours_step else 0.0,
        "target_ms_per_decode": 1000 * ours_step,
        f"{field}_target_ms_per_decode": 1000 * llama_step,
        f"{field}_target_identical": sum(b["identical"] for b in baseline),
        f"{field}_target_total": [llama_steps, llama_seconds],
        # with the draft, over llama.cpp's target alone decoding the same answers (at its time per decode)
        f"aggregate_speedup_over_{field}": (
            llama_step * sum(v["verify_steps"] for v in target_alone) / seconds if seconds else 0.0
        ),
    }
