"""A bench's summary per variant, from its per-prompt rows: the aggregate speedup and the totals behind it, τ and
acceptance pooled over the prompts, a caller's waits, the predictions here and on a GPU, and llama.cpp beside ours."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from spectune.bench.config import BASELINES, BenchConfig, draft_length
from spectune.errors import SpectuneError
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

COLD_KEYS = ("cold_ttft_ms", "cold_ttfs_ms", "cold_ttfs_first_clause_alone_ms")  # per prompt, a new caller's


class LookupFigures(BaseModel):
    """A model-free speculator's part in a variant's steps, pooled over the prompts (lookup_figures)."""

    model_config = ConfigDict(extra="forbid")
    step_share: float  # of the verify steps, those it proposed for
    drafted: int
    acceptance: float
    context_share: float  # of its drafted tokens, those the conversation itself gave


class BenchSummary(BaseModel):
    """A variant's figures from a bench's per-prompt rows (summarize): what the report, the pipeline's line, the
    README's tables and benchmarks/grounded_gpu.py read. As JSON it is flat, as every committed result is: a
    lookup's figures as `SOURCE_step_share`, ... Figures a result from before they existed lacks are None."""

    model_config = ConfigDict(extra="forbid")
    n: int
    draft_max: int
    identical: int
    exact: bool
    # all tokens over all decode seconds, with the draft over the target alone (each prompt's median run)
    aggregate_speedup: float
    total_tokens: int
    total_seconds: float
    target_total_seconds: float
    ttfs_ms: float  # medians over the prompts: to the first sentence and the first token, prompt cached
    target_ttfs_ms: float
    ttft_ms: float
    target_ttft_ms: float
    first_words_prompts: int | None = None  # the prompts that timed a new caller's first words (the cold_ figures)
    cold_ttft_ms: float | None = None
    cold_ttfs_ms: float | None = None
    cold_ttfs_first_clause_alone_ms: float | None = None
    target_cold_ttft_ms: float | None = None
    target_cold_ttfs_ms: float | None = None
    mean_speedup: float
    best_speedup: float
    worst_speedup: float
    acceptance: float
    acceptance_by_position: list[float]
    mean_accepted_len: float  # τ: tokens per verify step, pooled
    mean_drafted_per_step: float
    draft_catch_ups: int | None = None
    lookups: dict[str, LookupFigures]
    cost_ratio: float  # c here, on the draft model's share of the drafted tokens
    verify_ratio: float
    profile: dict[str, Any] | None = None  # c and r(n) as measured in the run (not kept in committed rows)
    predicted_speedup_here: float
    predicted_speedup_gpu: float  # bytes only
    gpu_cost_ratio: float
    gpu_card: str | None = None
    grounded_cost_ratio: float | None = None
    predicted_speedup_gpu_grounded: float | None = None  # on the reference card
    predicted_speedup_gpu_grounded_band: tuple[float, float] | None = None
    predicted_first_sentence_here: float | None = None
    predicted_first_sentence_gpu_grounded: float | None = None
    # llama.cpp beside ours, where --peer ran it (versus_llama_cpp)
    vs_llama_cpp: float | None = None
    llama_cpp_tokens_per_second: float | None = None
    llama_cpp_acceptance: float | None = None
    acceptance_as_llama_cpp_counts: float | None = None
    llama_cpp_identical: int | None = None
    target_ms_per_decode: float | None = None
    baseline_vs_llama_cpp: float | None = None
    llama_cpp_target_ms_per_decode: float | None = None
    llama_cpp_target_identical: int | None = None
    llama_cpp_target_total: tuple[int, float] | None = None
    aggregate_speedup_over_llama_cpp: float | None = None
    baseline_vs_llama_cpp_defaults: float | None = None
    llama_cpp_defaults_target_ms_per_decode: float | None = None
    llama_cpp_defaults_target_identical: int | None = None
    llama_cpp_defaults_target_total: tuple[int, float] | None = None
    aggregate_speedup_over_llama_cpp_defaults: float | None = None
    aggregate_speedup_over_fastest_llama_cpp: float | None = None

    @model_validator(mode="before")
    @classmethod
    def gather_lookups(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "lookups" in data:
            return data
        sources = [key.removesuffix("_step_share") for key in data if key.endswith("_step_share")]
        flat = {f"{source}_{field}": (source, field) for source in sources for field in LookupFigures.model_fields}
        lookups: dict[str, dict[str, Any]] = {source: {} for source in sources}
        for key, (source, field) in flat.items():
            if key in data:
                lookups[source][field] = data[key]
        return {key: value for key, value in data.items() if key not in flat} | {"lookups": lookups}

    @model_serializer(mode="wrap")
    def flat_lookups(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        lookups = data.pop("lookups", {})
        return data | {f"{source}_{field}": value for source, row in lookups.items() for field, value in row.items()}


def bench_summaries(summaries: dict[str, Any], where: str) -> dict[str, BenchSummary]:
    """Each variant's BenchSummary from a report's JSON (`where`: the report, for the error)."""
    try:
        return {name: BenchSummary.model_validate(summary) for name, summary in summaries.items()}
    except ValidationError as error:
        raise SpectuneError(f"{where}: not a bench summary: {error}") from error


def result_row(summary: dict[str, Any]) -> dict[str, Any]:
    """A variant's figures as the benchmarks commit them: all but the run's profile."""
    return BenchSummary.model_validate(summary).model_dump(mode="json", exclude={"profile"})


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


def summarize(name: str, rows: list[dict], profile: dict, config: BenchConfig, draft_path: Path | None) -> BenchSummary:
    """The measured figures, and the predictions of the step-cost model here (`profile`: c and r(n) measured in
    the same run) and on a GPU, on the steps the bench really made (k at most: see speedup_of_steps)."""
    k = draft_length(config, name)
    pooled = Pooled.of([row["variants"][name] for row in rows], draft_path is not None)
    steps = (pooled.tau, pooled.drafted_at, pooled.steps)
    summary = BenchSummary.model_validate(
        {
            **measured_figures(name, rows, pooled),
            "draft_max": k,
            "exact": config.exact,
            "verify_ratio": verify_ratio_at(profile["verify_ratio"], k + 1),
            "profile": profile,
            **predicted_here(pooled, profile),
            **gpu_predictions(config, name, draft_path, pooled.model_share, steps),
        }
    )
    return with_first_sentence(summary)


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


def grounded_figure(summary: BenchSummary) -> str:
    """The reference card's prediction as printed: the figure and its band (results older than the band: none)."""
    figure = f"{summary.predicted_speedup_gpu_grounded:.2f}x"
    band = summary.predicted_speedup_gpu_grounded_band
    return f"{figure} ({band[0]:.2f}-{band[1]:.2f}x)" if band else figure


def first_sentence_over_alone(summary: BenchSummary, speedup: float) -> float:
    """Time to the first sentence over the target alone's, the prompt cached (speedup.first_sentence_ratio), for a
    variant that speeds whole answers `speedup` times: the clause is as many target steps as the target alone took
    here (its time to the first sentence over its first token's), τ the bench's. With the bench's own aggregate
    speedup it is checked against what the bench timed; with the grounded one it is the prediction for the card."""
    clause_tokens = summary.target_ttfs_ms / summary.target_ttft_ms
    return first_sentence_ratio(clause_tokens, summary.mean_accepted_len, speedup)


def with_first_sentence(summary: BenchSummary) -> BenchSummary:
    grounded = summary.predicted_speedup_gpu_grounded
    return summary.model_copy(
        update={
            "predicted_first_sentence_here": first_sentence_over_alone(summary, summary.aggregate_speedup),
            "predicted_first_sentence_gpu_grounded": (
                first_sentence_over_alone(summary, grounded) if grounded is not None else None
            ),
        }
    )


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
