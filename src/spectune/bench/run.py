"""`spectune bench`: the target alone beside the target with each draft, prompt by prompt, interleaved.

For every prompt the runs alternate (target, draft A, draft B, target, ...) after a warm-up, `repeats` times, and
medians are kept, so a change in machine load hits every variant alike. Greedy answers are compared with the
target alone's. The hardware profile (c, r(n)) is measured in the same run, and the speedup the measured τ
predicts is given for this machine and for a memory-bound GPU (r = 1), beside the measured wall-clock one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field, model_validator
from rich.console import Console

from spectune.atomic import atomic_path
from spectune.bench.peer import PeerRun, llama_baseline, run_peer
from spectune.data.prepare import read_prompts
from spectune.data.read import assistant_turns
from spectune.engines.llama_cpp import SPECULATIVE_TOOL, built_tool
from spectune.engines.llama_server import NgramType
from spectune.errors import SpectuneError
from spectune.gpu.card import reference_card
from spectune.layout import CONTROL_DRAFT, TARGET
from spectune.runtime.build import identity_verdict
from spectune.runtime.chat import CLAUSE_END, chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel
from spectune.runtime.ngram import NGRAM, NgramDrafter, NgramSettings, domain_of_texts
from spectune.runtime.profile import gguf_weights, measure_profile
from spectune.runtime.speculative import FirstWords, Generation, SpeculativeDecoder
from spectune.speedup import first_sentence_ratio, speedup_of_steps, step_cost_ratio, verify_ratio_at

console = Console()
Result = TypeVar("Result")
Key = TypeVar("Key")
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
# llama.cpp's target alone, the baseline, by its key in the rows and how the report says it: with the bench's own
# settings (exact: spectune's identity settings), and at llama.cpp's own defaults (repacked weights, flash attention
# auto, tiled matmul), as a user runs it.
BASELINES = {"llama_cpp": "with this bench's settings", "llama_cpp_defaults": "at its defaults"}


def result_row(summary: dict[str, Any]) -> dict[str, Any]:
    """A draft's figures as the benchmarks commit them: every summary key, and llama.cpp's (None where the peer
    was not run)."""
    return {key: summary[key] for key in SUMMARY_KEYS} | {key: summary.get(key) for key in PEER_KEYS}


class BenchSettings(DecodeSettings):
    """The bench's settings: the `bench:` section of a run config and the flags of `spectune bench`."""

    n: int = Field(30, ge=1, description="Prompts.")
    repeats: int = Field(3, ge=1, description="Interleaved timed runs per prompt and variant (medians).")
    peer: bool = Field(False, description="Also run llama.cpp's own speculative decoder on each pair.")
    peer_ngram: NgramType = Field(
        "ngram-simple", description="llama.cpp's n-gram speculator beside the lookup variants (see speculation_flags)."
    )
    first_words_every: int = Field(
        1,
        ge=1,
        description="A new caller's first words (both caches empty, every variant) on every Nth prompt: on long "
        "prompts each costs a prefill per variant.",
    )
    ngram_with: list[str] | None = Field(
        None, description="The drafts n-gram lookup goes in front of (default: every tuned one)."
    )

    @model_validator(mode="after")
    def _comparable(self) -> BenchSettings:
        """What the bench compares must be comparable: answers identical to the target alone's (greedy), and
        llama.cpp's tools decoding the same way (they are given no stop strings, minimum length or ignore_eos)."""
        if self.temperature > 0:
            raise ValueError("the bench checks answers identical to the target alone's: temperature must be 0")
        if self.peer and (self.stop or self.min_tokens or self.ignore_eos):
            raise ValueError("peer: llama.cpp's tools run without stop, min_tokens, ignore_eos: leave them unset")
        return self


class BenchConfig(BenchSettings):
    """Everything `spectune bench` takes."""

    target: Path = Field(description="Target GGUF.")
    drafts: dict[str, Path] = Field(description="Draft GGUFs by name.")
    data: Path = Field(description="Prompts: a chat dataset or a `data prompts` file.")
    out: Path = Field(Path("bench"), description="Folder for report.json, report.md, report.png.")
    recommended_k: dict[str, int] = Field({}, description="k per draft where draft_max is auto.")
    ngram: NgramSettings | None = Field(
        None, description="Also n-gram lookup: `ngram` alone, and `ngram+DRAFT` in front of tuned drafts."
    )
    threads: int | None = Field(None, description="Threads for llama.cpp (default: $SPECTUNE_THREADS or all).")
    n_ctx: int = Field(2048, ge=64, description="Context length.")
    gpu_cost_ratio: dict[str, float] = Field(
        {}, description="c per draft for the GPU prediction (default: what a step reads of the GGUFs)."
    )
    peer_binary: Path | None = Field(None, description="llama-speculative-simple to compare with (default: built).")
    plot: bool = Field(True, description="Also draw PNG plots.")
    ngram_data: Path | None = Field(
        None, description="Chat dataset whose assistant turns fill the n-gram domain table (the target's answers)."
    )

    @model_validator(mode="after")
    def _known_drafts(self) -> BenchConfig:
        unknown = sorted(set(self.ngram_with or []) - set(self.drafts))
        if unknown:
            raise ValueError(f"ngram_with: no draft named {', '.join(unknown)} (drafts: {', '.join(self.drafts)})")
        return self

    def variants(self) -> dict[str, Path | None]:
        """Every variant's draft model (None: n-gram lookup alone), the target alone not included."""
        ngram: dict[str, Path | None] = {NGRAM: None} if self.ngram else {}
        if self.ngram:
            fronted = self.ngram_with if self.ngram_with is not None else set(self.drafts) - {CONTROL_DRAFT}
            ngram |= {f"{NGRAM}+{name}": path for name, path in self.drafts.items() if name in fronted}
        return {**self.drafts, **ngram}


def load_decoders(config: BenchConfig) -> tuple[LlamaModel, dict[str, SpeculativeDecoder]]:
    """The target alone, then the target with each draft and n-gram variant (one context per model, shared: a
    cache holds what it holds by content, whichever decoder filled it)."""
    target = LlamaModel(config.target, n_ctx=config.n_ctx, threads=config.threads, exact=config.exact)
    decoders = {TARGET: SpeculativeDecoder(target)}
    models = {
        name: LlamaModel(path, n_ctx=config.n_ctx, threads=config.threads, exact=config.exact)
        for name, path in config.drafts.items()
    }
    answers = assistant_turns(config.ngram_data) if config.ngram and config.ngram_data else []
    domain = domain_of_texts(config.ngram, answers, target.tokenize) if config.ngram else None
    for name in config.variants():
        draft_name = name.removeprefix(f"{NGRAM}+") if name != NGRAM else None
        ngram = NgramDrafter(config.ngram, domain) if config.ngram and name.startswith(NGRAM) else None
        decoders[name] = SpeculativeDecoder(target, models.get(draft_name or ""), ngram)
    return target, decoders


def bench(config: BenchConfig) -> dict[str, Any]:
    prompts = read_prompts(config.data)[: config.n]
    target, decoders = load_decoders(config)
    verdict = identity_verdict(config.target, config.exact)
    console.print(
        f"{verdict['build']}, exact = {config.exact}: identical answers "
        + ("guaranteed" if verdict["guaranteed"] else "NOT guaranteed: " + "; ".join(verdict["reasons"]))
    )
    decode = config.decoding()
    sampling = {name: decode.model_copy(update={"draft_max": draft_length(config, name)}) for name in decoders}
    peer = peer_runner(config, target) if config.peer else None
    with contextlib.ExitStack() as stack:
        baselines = {
            field: stack.enter_context(llama_baseline(config.target, target.threads, config.n_ctx, exact))
            for field, exact in baseline_settings(config).items()
        }
        rows = [
            bench_prompt(index, prompt.messages, target, decoders, sampling, peer, baselines, config)
            for index, prompt in enumerate(prompts)
        ]
    profiles = variant_profiles(config)
    report = {
        "target": str(config.target),
        "drafts": {name: str(path) for name, path in config.drafts.items()},
        "ngram_data": str(config.ngram_data) if config.ngram_data else None,
        "data": str(config.data),
        "settings": {
            **config.model_dump(mode="json", include=set(BenchSettings.model_fields)),
            "n": len(prompts),
            "draft_max": {name: draft_length(config, name) for name in config.variants()},
            "threads": target.threads,
            "greedy": True,
            "peer": "llama.cpp llama-speculative-simple" if config.peer else None,
            "build": verdict["build"],
        },
        # Said beside the identical counts: can this build promise them for this target? (The draft only proposes.)
        "identity": verdict,
        "prompts": rows,
        "summary": {
            name: with_first_sentence(_summary(name, rows, profiles[name], config, path))
            for name, path in config.variants().items()
        },
    }
    write_report(report, config.out, config.plot)
    return report


def bench_prompt(
    index: int,
    messages: list[dict[str, str]],
    target: LlamaModel,
    decoders: dict[str, SpeculativeDecoder],
    sampling: dict[str, DecodeSettings],
    peer: Callable[[str, str], PeerRun] | None,
    baselines: dict[str, Callable[[str, int], PeerRun]],
    config: BenchConfig,
) -> dict[str, Any]:
    """One prompt through every variant (and llama.cpp's, with --peer); its row, printed as it comes."""
    text = chat_prompt(target, messages)
    ids = target.tokenize(text)
    llama_runs: dict[tuple[str, str], Callable[[], PeerRun]] = {
        (name, "llama_cpp"): functools.partial(peer, name, text) for name in decoders if name != TARGET and peer
    }
    for field, baseline in baselines.items():
        llama_runs[TARGET, field] = functools.partial(baseline, without_bos(target, text), config.max_tokens)
    runs, peer_runs = run_interleaved(decoders, sampling, ids, llama_runs, config.repeats)
    row = prompt_row(index, ids, target.detokenize(runs[TARGET][0].generation.tokens), runs, peer_runs)
    if index % config.first_words_every == 0:
        for name, first_words in cold_first_words(decoders, sampling, ids, index // config.first_words_every).items():
            row["variants"][name] |= first_words
    console.print(
        f"prompt {index + 1}: "
        + "  ".join(
            f"{name} {v['tokens_per_second']:.0f} tok/s ({v['speedup']:.2f}x)" for name, v in row["variants"].items()
        )
    )
    return row


@dataclass
class Timed:
    generation: Generation
    ttfs_seconds: float  # time to first sentence: to the end of the first clause the server's chunking streams


def timed_generate(
    decoder: SpeculativeDecoder,
    ids: list[int],
    sampling: DecodeSettings,
    first_words: FirstWords = "draft",
    first_sentence_only: bool = False,
) -> Timed:
    """A generation, and when its text first held a clause end (the whole answer if it never did); stopped there
    with `first_sentence_only`."""
    start, text, first = time.perf_counter(), [""], [0.0]

    def on_text(piece: str) -> bool:
        if not first[0]:
            text[0] += piece
            if CLAUSE_END.search(text[0]):
                first[0] = time.perf_counter() - start
        return not (first_sentence_only and first[0])

    generation = decoder.generate(ids, sampling, on_text, first_words)
    return Timed(generation, first[0] or time.perf_counter() - start)


def cold_first_words(
    decoders: dict[str, SpeculativeDecoder], sampling: dict[str, DecodeSettings], ids: list[int], turn: int
) -> dict[str, dict[str, float]]:
    """A new caller's first turn: time to first token and to first sentence with both caches empty (the prompt's
    prefill, and the draft's catch-up on it, included), each variant once; a draft also with its first clause
    decoded by the target alone, the catch-up after it. The order turns with `turn` (the prompt's index): with the
    target alone always first, its time to first token read 18.9 ms against 15.0 ms for the same first step with
    a draft (demo pair, 226 prompts), the first run after the timed rounds paying for it."""
    runs: list[tuple[str, str, FirstWords]] = [(name, "cold_ttfs_ms", "draft") for name in decoders]
    runs += [(name, "cold_ttfs_first_clause_alone_ms", "alone") for name in decoders if name != TARGET]
    figures: dict[str, dict[str, float]] = {}
    for name, key, first_words in runs[turn % len(runs) :] + runs[: turn % len(runs)]:
        decoders[name].forget()
        timed = timed_generate(decoders[name], ids, sampling[name], first_words, first_sentence_only=True)
        if key == "cold_ttfs_ms":
            figures.setdefault(name, {})["cold_ttft_ms"] = 1000 * timed.generation.stats.ttft_seconds
        figures.setdefault(name, {})[key] = 1000 * timed.ttfs_seconds
    return figures


def run_interleaved(
    decoders: dict[str, SpeculativeDecoder],
    sampling: dict[str, DecodeSettings],
    ids: list[int],
    llama_runs: dict[tuple[str, str], Callable[[], PeerRun]],
    repeats: int,
) -> tuple[dict[str, list[Timed]], dict[tuple[str, str], list[PeerRun]]]:
    """Our variants on one prompt, alternating, then llama.cpp's the same way. Not mixed round by round: a llama.cpp
    process run just before left our first decodes 1.5-2.5x slower (its weights in the CPU caches, our threads
    asleep), and the variant run first after it, the target alone, paid for it alone (demo pair: its first three
    decodes 7.0/4.2/3.4 ms, then 2.6; without llama.cpp between, 3.1/2.7)."""
    ours = {name: functools.partial(timed_generate, decoder, ids, sampling[name]) for name, decoder in decoders.items()}
    return rounds(ours, repeats), rounds(llama_runs, repeats)


def rounds(runs: dict[Key, Callable[[], Result]], repeats: int) -> dict[Key, list[Result]]:
    """Each run in turn, `repeats` times after a dropped warm-up round (caches, page faults)."""
    results: dict[Key, list[Result]] = {name: [] for name in runs}
    for repeat in range(repeats + 1):
        for name, run in runs.items():
            result = run()
            if repeat:
                results[name].append(result)
    return results


def prompt_row(
    index: int,
    ids: list[int],
    answer: str,
    runs: dict[str, list[Timed]],
    peer_runs: dict[tuple[str, str], list[PeerRun]],
) -> dict[str, Any]:
    """One prompt's medians per variant, its speedups over the target alone, and llama.cpp's beside ours (under
    `llama_cpp`; the target alone also under each of BASELINES)."""
    plain_tokens = runs[TARGET][0].generation.tokens
    row: dict[str, Any] = {"prompt": index, "prompt_tokens": len(ids), "answer": answer, "variants": {}}
    for name, timed in runs.items():
        results = [t.generation for t in timed]
        stats = [r.stats for r in results]
        row["variants"][name] = {
            "tokens": stats[0].generated,
            "tokens_per_second": statistics.median(s.tokens_per_second for s in stats),
            "decode_seconds": statistics.median(s.total_seconds - s.prefill_seconds for s in stats),
            # llama-server's span: from the first token to the last (its first decode is in its prompt time)
            "after_first_seconds": statistics.median(s.total_seconds - s.ttft_seconds for s in stats),
            "ttft_ms": 1000 * statistics.median(s.ttft_seconds for s in stats),
            "ttfs_ms": 1000 * statistics.median(t.ttfs_seconds for t in timed),
            "acceptance": stats[0].acceptance_rate,
            "mean_accepted_len": stats[0].mean_accepted_len,
            "produced": stats[0].produced,
            "verify_steps": stats[0].verify_steps,
            "offered": stats[0].offered,
            "accepted_as_llama_cpp": stats[0].accepted_as_llama_cpp,
            "drafted_at": stats[0].drafted_at,
            "accepted_at": stats[0].accepted_at,
            "ngram_steps": stats[0].ngram_steps,
            "ngram_drafted": stats[0].ngram_drafted,
            "ngram_accepted": stats[0].ngram_accepted,
            "ngram_from_context": stats[0].ngram_from_context,
            "draft_catch_ups": stats[0].draft_catch_ups,
            "draft_seconds": statistics.median(s.draft_seconds for s in stats),
            "verify_seconds": statistics.median(s.verify_seconds for s in stats),
            "identical": all(r.tokens == plain_tokens for r in results),
        }
    base = row["variants"][TARGET]["tokens_per_second"]
    for variant in row["variants"].values():
        variant["speedup"] = variant["tokens_per_second"] / base if base else 0.0
    for (name, field), results in peer_runs.items():
        peer_tps = statistics.median(r.tokens_per_second for r in results)
        ours = row["variants"][name]
        # llama.cpp counts the end token it produced: so does `produced`, over the same decode span as its own
        ours_tps = ours["produced"] / ours["decode_seconds"] if ours["decode_seconds"] else 0.0
        ours[field] = {
            "tokens": results[0].decoded_tokens,
            "seconds": statistics.median(r.seconds for r in results),
            "tokens_per_second": peer_tps,
            "drafted": results[0].drafted,
            "accepted": results[0].accepted,
            "acceptance": results[0].accepted / results[0].drafted if results[0].drafted else 0.0,
            # exactly the same text: the tool's echo of the prompt is cut off (peer.generated_text)
            "identical": all(r.text == answer for r in results),
            "ours_over_llama_cpp": ours_tps / peer_tps if peer_tps else 0.0,
        }
    return row


def baseline_settings(config: BenchConfig) -> dict[str, bool]:
    """Each llama.cpp target-alone baseline --peer runs (one of BASELINES) with its `exact`."""
    if not config.peer:
        return {}
    if not config.exact:  # the bench's own settings are llama.cpp's defaults
        return {"llama_cpp": False}
    return {"llama_cpp": True, "llama_cpp_defaults": False}


def draft_length(config: BenchConfig, name: str) -> int:
    """k for this variant (0 for the target alone); `ngram+DRAFT` drafts as far as DRAFT does."""
    if name not in config.variants():
        return 0
    # an n-gram variant the meter did not measure drafts as far as its draft
    measured = config.recommended_k.get(name, config.recommended_k.get(name.removeprefix(f"{NGRAM}+")))
    return config.with_k(measured).k


def variant_profiles(config: BenchConfig) -> dict[str, dict[str, Any]]:
    """c and r(n) per variant: each draft model's measured; n-gram lookup costs nothing (c = 0, the target's r)."""
    profiles = {}
    for name, path in config.variants().items():
        if name.startswith(NGRAM) and name != NGRAM:
            continue  # the draft's own, below
        # r(n) up to the longest k of the variants this draft serves (ngram+DRAFT may draft further than DRAFT)
        users = [variant for variant in config.variants() if variant in (name, f"{NGRAM}+{name}")]
        max_batch = max(draft_length(config, variant) for variant in users) + 1
        measured = measure_profile(
            config.target, path or config.target, max_batch, threads=config.threads, exact=config.exact
        )
        profiles[name] = measured if path else {**measured, "cost_ratio": 0.0, "draft_ms_per_token": 0.0}
    for name in config.variants():
        profiles.setdefault(name, profiles[name.removeprefix(f"{NGRAM}+")])
    return profiles


def without_bos(target: LlamaModel, text: str) -> str:
    """The prompt text for llama.cpp's tools, which add the BOS token themselves where the model asks for one: the
    template's own BOS text is taken off (a doubled BOS changed Gemma's answers on 18 of 20 prompts)."""
    bos_text = target.detokenize([target.bos]) if target.adds_bos and target.bos >= 0 else ""
    return text.removeprefix(bos_text)


def peer_runner(config: BenchConfig, target: LlamaModel) -> Callable[[str, str], PeerRun]:
    """Runs llama.cpp's own speculative decoder on (draft name, prompt text) with this bench's settings."""
    binary = config.peer_binary or built_tool(SPECULATIVE_TOOL)
    if config.draft_p_min or config.adaptive:
        raise SpectuneError("--peer llama.cpp compares a fixed draft length: drop --draft-p-min / --adaptive")

    def run(name: str, text: str) -> PeerRun:
        return run_peer(
            binary,
            config.target,
            config.variants()[name],
            without_bos(target, text),
            draft_length(config, name),
            config.max_tokens,
            target.threads,
            config.n_ctx,
            config.exact,
            ngram_n=config.ngram.min_n if config.ngram and name.startswith(NGRAM) else 0,
            ngram_type=config.peer_ngram,
        )

    return run


def totals(variants: list[dict[str, Any]]) -> tuple[int, float]:
    """Tokens and decode seconds summed over the prompts (each prompt's median run)."""
    return sum(v["tokens"] for v in variants), sum(v["decode_seconds"] for v in variants)


def _summary(
    name: str, rows: list[dict], profile: dict, config: BenchConfig, draft_path: Path | None
) -> dict[str, Any]:
    variants = [row["variants"][name] for row in rows]
    speedups = [v["speedup"] for v in variants]
    # The headline: all tokens over all decode time, with the draft over the target alone (a mean of per-prompt
    # ratios weighs short answers as much as long ones).
    target_alone = [row["variants"][TARGET] for row in rows]
    (tokens, seconds), (_, target_seconds) = totals(variants), totals(target_alone)
    # Pooled over prompts (tokens / steps), as the offline meter pools: short answers do not weigh more.
    drafted_at, accepted_at = (pooled_by_position(variants, key) for key in ("drafted_at", "accepted_at"))
    drafted, accepted = sum(drafted_at), sum(accepted_at)
    steps = sum(v["verify_steps"] for v in variants)
    tau = sum(v["produced"] for v in variants) / max(1, steps)
    k = draft_length(config, name)
    ngram_drafted = sum(v["ngram_drafted"] for v in variants)
    # The draft model's cost is paid on the tokens it drafted, not on those looked up: c per drafted token, averaged
    model_share = (drafted - ngram_drafted) / drafted if drafted else float(draft_path is not None)
    cost_ratio = profile["cost_ratio"] * model_share
    per_position = [a / d if d else 0.0 for d, a in zip(drafted_at, accepted_at, strict=True)]
    # A catch-up of n tokens is one batch of the draft: r(n) draft steps here (the target's r standing in for the
    # draft's), of which the step-cost model counts one; on a memory-bound GPU it costs what one step does.
    catch_ups = [n for v in variants for n in v["draft_catch_ups"]]
    catch_up_cost = profile["cost_ratio"] * sum(verify_ratio_at(profile["verify_ratio"], n) - 1 for n in catch_ups)
    return {
        **versus_llama_cpp(variants, target_alone, seconds),
        "n": len(rows),
        "draft_max": k,
        "identical": sum(v["identical"] for v in variants),
        "exact": config.exact,
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
        "acceptance_by_position": per_position,
        "mean_accepted_len": tau,
        "cost_ratio": cost_ratio,
        "verify_ratio": verify_ratio_at(profile["verify_ratio"], k + 1),
        "profile": profile,
        "mean_drafted_per_step": drafted / steps if steps else 0.0,
        **ngram_figures(variants),
        # The step-cost model on the drafts each step really made (k at most): see speedup_of_steps
        "draft_catch_ups": len(catch_ups),
        "predicted_speedup_here": speedup_of_steps(
            tau, drafted_at, steps, cost_ratio, profile["verify_ratio"], catch_up_cost
        ),
        **gpu_predictions(config, name, draft_path, model_share, (tau, drafted_at, steps)),
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
    grounded_c, c_band = 0.0, (0.0, 0.0)
    if draft_weights:
        grounded_c = card.cost_ratio(draft_weights, target_weights) * model_share
        c_band = tuple(c * model_share for c in card.cost_ratio_band(draft_weights, target_weights))
    band = card.band_of(lambda c, r: speedup_of_steps(*steps, c, r), c_band, target_weights)  # type: ignore[arg-type]
    return {
        "gpu_cost_ratio": gpu_c,
        "predicted_speedup_gpu": speedup_of_steps(*steps, gpu_c, None),
        "gpu_card": card.label,
        "grounded_cost_ratio": grounded_c,
        "predicted_speedup_gpu_grounded": speedup_of_steps(*steps, grounded_c, card.verify_ratios(target_weights)),
        "predicted_speedup_gpu_grounded_band": list(band),
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


def ngram_figures(variants: list[dict[str, Any]]) -> dict[str, Any]:
    """How often n-gram lookup proposed, how much of it was accepted, and where it came from (pooled)."""
    steps = sum(v["verify_steps"] for v in variants)
    drafted, accepted = (sum(v[key] for v in variants) for key in ("ngram_drafted", "ngram_accepted"))
    return {
        "ngram_step_share": sum(v["ngram_steps"] for v in variants) / steps if steps else 0.0,
        "ngram_drafted": drafted,
        "ngram_acceptance": accepted / drafted if drafted else 0.0,
        "ngram_context_share": sum(v["ngram_from_context"] for v in variants) / drafted if drafted else 0.0,
    }


def pooled_by_position(variants: list[dict[str, Any]], key: str) -> list[int]:
    """A per-draft-position count (drafted_at or accepted_at) summed over the prompts."""
    positions = max((len(v[key]) for v in variants), default=0)
    return [sum(v[key][i] for v in variants if i < len(v[key])) for i in range(positions)]


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


def write_report(report: dict[str, Any], out: Path, with_plot: bool = True) -> None:
    """report.json, report.md and two PNG plots, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "report.json") as tmp:
        tmp.write_text(json.dumps(report, indent=2))
    with atomic_path(out / "report.md") as tmp:
        tmp.write_text(markdown(report))
    if with_plot:
        plot(report, out)


def timed_runs(repeats: int) -> str:
    """How the per-prompt figures were taken, in words."""
    return "one timed run per prompt" if repeats == 1 else f"medians of {repeats} interleaved runs per prompt"


def markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        "# spectune bench",
        "",
        f"Target `{report['target']}`, {settings['n']} prompts from `{report['data']}`, greedy, "
        f"{settings['max_tokens']} tokens max, exact = {settings['exact']}, "
        f"{settings['threads']} threads, {timed_runs(settings['repeats'])} after a warm-up, "
        f"{settings.get('build', 'build not recorded')}.",
        "",
        "| draft | k | identical | acceptance | τ (tokens/verify) | speedup here: aggregate (tokens, s) | "
        "per prompt mean / best / worst | c | r(k+1) | predicted here | predicted GPU: bytes only | "
        "predicted on the reference card (band) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in report["summary"].items():
        lines.append(
            f"| {name} | {s['draft_max']} | {s['identical']}/{s['n']} | {s['acceptance']:.1%} | "
            f"{s['mean_accepted_len']:.2f} | "
            f"{s['aggregate_speedup']:.2f}x ({s['total_tokens']}, {s['total_seconds']:.2f} vs "
            f"{s['target_total_seconds']:.2f}) | "
            f"{s['mean_speedup']:.2f}x / {s['best_speedup']:.2f}x / {s['worst_speedup']:.2f}x | "
            f"{s['cost_ratio']:.3f} | {s['verify_ratio']:.2f} | {s['predicted_speedup_here']:.2f}x | "
            f"{s['predicted_speedup_gpu']:.2f}x (c = {s['gpu_cost_ratio']:.3f}) | "
            f"{grounded_figure(s)} (c = {s['grounded_cost_ratio']:.3f}, {s['gpu_card']}) |"
        )
    lines += latency_lines(report) + ngram_lines(report) + llama_cpp_lines(report)
    timed = [s["target_total_seconds"] for s in report["summary"].values()]
    if timed and min(timed) < 2.0:
        lines += ["", f"The target alone decoded for {min(timed):.2f} s in all: too little to time reliably."]
    lines += [
        "",
        "Speedup here, aggregate: all tokens over all decode seconds with the draft, over the same for the target "
        "alone (the tokens and seconds are shown); the per-prompt mean weighs a short answer as much as a long one.",
        "Predicted GPU speedup: τ / (1 + d·c), decoding memory-bound (r = 1), c what a draft step reads of its GGUF "
        "over what a target step reads, d the tokens a step really drafted (at most k: a draft stops at an end "
        "token), averaged over the steps. "
        f"On the reference card: the same {reference_card().label}, c and r(d+1) from the card model fitted on "
        "published llama.cpp figures (a per-layer floor, an effective bandwidth, the weights' read growing with "
        "the batch; docs/design.md); the band carries the fit's leave-one-out error through c and r. "
        "Predicted here: τ / (r(d+1) + d·c) with this machine's measured r and c; on a small CPU verification is "
        "compute-bound (r(k+1) well above 1), so only a draft with a high τ gains wall-clock time here.",
        "",
    ]
    return "\n".join(lines)


def latency_lines(report: dict[str, Any]) -> list[str]:
    """What a caller waits for: the first token and the first sentence (the first chunk a TTS engine can speak),
    with the draft and (in brackets) the target alone. Prompt cached: each prompt runs in rounds, so both caches
    hold it (a conversation's earlier turns are cached the same way). New prompt: both caches empty, the prefill
    and the draft's catch-up included; "alone first" decodes the first clause without the draft. Over alone's: the
    first sentence with the draft over without, as timed, as the model puts it from the bench's own speedup, and
    as it predicts on the reference card (first_sentence_over_alone)."""
    lines = [
        "",
        "| draft | TTFT ms, prompt cached | first sentence ms, prompt cached | TTFT ms, new prompt | "
        "first sentence ms, new prompt: drafted / alone first | first sentence over alone's, prompt cached: "
        "here (model) / on the card |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in report["summary"].items():
        lines.append(
            f"| {name} | {s['ttft_ms']:.0f} ({s['target_ttft_ms']:.0f}) | "
            f"{s['ttfs_ms']:.0f} ({s['target_ttfs_ms']:.0f}) | "
            f"{s['cold_ttft_ms']:.0f} ({s['target_cold_ttft_ms']:.0f}) | {s['cold_ttfs_ms']:.0f} / "
            f"{s['cold_ttfs_first_clause_alone_ms']:.0f} ({s['target_cold_ttfs_ms']:.0f}) | "
            f"{s['ttfs_ms'] / s['target_ttfs_ms']:.2f}x ({s['predicted_first_sentence_here']:.2f}x) / "
            f"{s['predicted_first_sentence_gpu_grounded']:.2f}x |"
        )
    every = report["settings"]["first_words_every"]
    if every > 1:
        measured = next(iter(report["summary"].values()))["first_words_prompts"]
        total = report["settings"]["n"]
        lines += ["", f"A new prompt's first words: measured on {measured} of the {total} prompts (one in {every})."]
    return lines


def ngram_lines(report: dict[str, Any]) -> list[str]:
    """What n-gram lookup did in each variant that used it: how often it proposed, how much the target kept."""
    looked_up = {name: s for name, s in report["summary"].items() if s["ngram_drafted"]}
    if not looked_up:
        return []
    lines = [
        "",
        "| variant | steps proposed by lookup | tokens looked up | of them accepted | from the conversation |",
        "|---|---|---|---|---|",
    ]
    for name, s in looked_up.items():
        lines.append(
            f"| {name} | {s['ngram_step_share']:.1%} | {s['ngram_drafted']} | {s['ngram_acceptance']:.1%} | "
            f"{s['ngram_context_share']:.1%} |"
        )
    return [
        *lines,
        "Looked-up tokens not from the conversation came from the domain table (the target's own answers); a step "
        "the lookup did not propose for was the draft model's.",
    ]


def llama_cpp_lines(report: dict[str, Any]) -> list[str]:
    """llama.cpp's speculative decoder beside ours, and its target alone as the baseline check (--peer)."""
    lines: list[str] = []
    peers = {name: s for name, s in report["summary"].items() if "vs_llama_cpp" in s}
    if peers:
        lines += [
            "",
            "| draft | llama.cpp tok/s | llama.cpp acceptance | ours counted as llama.cpp counts | "
            "llama.cpp identical | ours / llama.cpp |",
            "|---|---|---|---|---|---|",
        ]
        for name, s in peers.items():
            lines.append(
                f"| {name} | {s['llama_cpp_tokens_per_second']:.1f} | {s['llama_cpp_acceptance']:.1%} | "
                f"{s['acceptance_as_llama_cpp_counts']:.1%} | {s['llama_cpp_identical']}/{s['n']} | "
                f"{s['vs_llama_cpp']:.2f}x |"
            )
        lines.append(
            "llama.cpp's draft-simple drafts k tokens every step, on past the draft's end token, counts them all as "
            "drafted, and counts an accepted end token before the k-th draft as the target's own; spectune stops "
            "drafting at an end token. Counted its way, our run comes near its figure but does not equal it: its "
            "first step drafts k (its draft reads the prompt before the first token), ours is the target's own, so "
            "the steps fall differently after it (and at the token limit llama.cpp's last step still drafts k)."
        )
    baselines = {name: s for name, s in report["summary"].items() if "baseline_vs_llama_cpp" in s}
    if baselines:
        first = next(iter(baselines.values()))
        lines += ["", "Baseline: the target alone through llama.cpp's own loop (llama-server, same GGUF and threads)."]
        for field, said in BASELINES.items():
            if f"baseline_vs_{field}" not in first:
                continue
            lines.append(
                f"{said.capitalize()}: {first[f'{field}_target_ms_per_decode']:.2f} ms per decode "
                f"({first[f'{field}_target_total'][0]} decodes in {first[f'{field}_target_total'][1]:.2f} s; same "
                f"answer on {first[f'{field}_target_identical']}/{first['n']} prompts), ours "
                f"{first['target_ms_per_decode']:.2f} ms: llama.cpp's / ours = {first[f'baseline_vs_{field}']:.2f}. "
                "With each draft over it: "
                + ", ".join(f"{name} {s[f'aggregate_speedup_over_{field}']:.2f}x" for name, s in baselines.items())
                + "."
            )
    return lines


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name in report["summary"]:
        speedups = [row["variants"][name]["speedup"] for row in report["prompts"]]
        axes[0].plot(range(1, len(speedups) + 1), speedups, marker="o", label=name)
        by_position = report["summary"][name]["acceptance_by_position"]
        axes[1].plot(range(1, len(by_position) + 1), by_position, marker="o", label=name)
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set(title="wall-clock speedup per prompt (this machine)", xlabel="prompt", ylabel="speedup")
    axes[1].set(title="acceptance by draft position", xlabel="position", ylabel="accepted", ylim=(0, 1.05))
    for axis in axes:
        axis.legend()
    figure.tight_layout()
    with atomic_path(out / "report.png") as tmp:
        figure.savefig(tmp, format="png", dpi=110)
    plt.close(figure)
