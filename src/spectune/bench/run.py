"""`spectune bench`: the target alone beside the target with each draft, prompt by prompt, interleaved.

For every prompt the runs alternate (target, draft A, draft B, target, ...) after a warm-up, `repeats` times, and
medians are kept, so a change in machine load hits every variant alike. Greedy answers are compared with the
target alone's. The hardware profile (c, r(n)) is measured in the same run, and the speedup the measured τ
predicts is given for this machine and for a memory-bound GPU (r = 1), beside the measured wall-clock one.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console

from spectune.bench.config import BenchConfig, BenchSettings, baseline_settings, draft_length
from spectune.bench.llama_cpp_loop import PeerRun, llama_baseline, run_peer
from spectune.bench.report import write_report
from spectune.bench.serving import FASTEST, serving_choice
from spectune.bench.stalls import retime_stalls
from spectune.bench.summary import summarize
from spectune.data.prepare import read_prompts
from spectune.data.read import assistant_turns
from spectune.engines.llama_cpp import SPECULATIVE_TOOL, built_tool
from spectune.engines.llama_server import llama_cpp_runs
from spectune.errors import SpectuneError
from spectune.layout import TARGET
from spectune.runtime.build import identity_verdict
from spectune.runtime.chat import CLAUSE_END, chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.first_words import FirstWords
from spectune.runtime.llama import LlamaModel
from spectune.runtime.ngram import NGRAM, NgramSettings, NgramSetup, domain_of_texts
from spectune.runtime.profile import measure_profile
from spectune.runtime.speculative import Generation, SpeculativeDecoder

console = Console()
Result = TypeVar("Result")
Key = TypeVar("Key")


def load_decoders(config: BenchConfig) -> tuple[LlamaModel, dict[str, SpeculativeDecoder]]:
    """The target alone, then the target with each draft and n-gram variant (one context per model, shared: a
    cache holds what it holds by content, whichever decoder filled it; an EAGLE-3 head's holds its own drafted
    pairs too, so each variant gets its own head)."""
    loading = {"n_ctx": config.n_ctx, "threads": config.threads, "gpu_layers": config.gpu_layers}
    target = LlamaModel(config.target, exact=config.exact, **loading)
    decoders = {TARGET: SpeculativeDecoder(target)}
    if config.exact:  # what serving would run where no draft pays (bench/serving.py)
        decoders[FASTEST] = SpeculativeDecoder(LlamaModel(config.target, exact=False, **loading))

    def load(path: Path) -> LlamaModel:
        return LlamaModel(path, exact=config.exact, beside=target, **loading)

    models = {name: load(path) for name, path in config.drafts.items()}
    heads_taken: set[Path] = set()
    setups: dict[str, NgramSetup] = {}
    if config.ngram:  # the domain table is built once and read by every n-gram variant
        answers = assistant_turns(config.ngram_data) if config.ngram_data else []
        setups[NGRAM] = NgramSetup(config.ngram, domain_of_texts(config.ngram, answers, target.tokenize))
    for name, variant in config.variants().items():
        draft = models[variant.draft] if variant.draft else None
        if draft is not None and draft.is_head:
            draft = load(draft.path) if draft.path in heads_taken else draft
            heads_taken.add(draft.path)
        decoders[name] = SpeculativeDecoder(target, variant.speculators(target, draft, setups))
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

        def timed_prompt(index: int) -> dict[str, Any]:
            return bench_prompt(index, prompts[index].messages, target, decoders, sampling, peer, baselines, config)

        rows, retimed = retime_stalls([timed_prompt(index) for index in range(len(prompts))], timed_prompt)
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
            "exact": config.exact,
            "gpu_layers": config.gpu_layers,
            "device": target.device,  # every model of the bench loads alike
            "greedy": True,
            "peer": "llama.cpp llama-speculative-simple" if config.peer else None,
            "build": verdict["build"],
        },
        # Said beside the identical counts: can this build promise them for this target? (The draft only proposes.)
        "identity": verdict,
        "prompts": rows,
        "retimed": retimed,
        "summary": {
            name: summarize(name, rows, profiles[name], config, config.draft_path(name)).model_dump(mode="json")
            for name in config.variants()
        },
        "serving": serving_choice(rows, list(config.variants())),
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
        (name, "llama_cpp"): functools.partial(peer, name, text)
        for name, variant in config.variants().items()
        if peer and llama_cpp_runs(variant)
    }
    for field, baseline in baselines.items():
        llama_runs[TARGET, field] = functools.partial(baseline, without_bos(target, text), config.max_tokens)
    runs, peer_runs = run_interleaved(decoders, sampling, ids, llama_runs, config.repeats)
    row = prompt_row(index, ids, target.detokenize(runs[TARGET][0].generation.tokens), runs, peer_runs)
    if index % config.first_words_every == 0:
        variants = {name: decoder for name, decoder in decoders.items() if name != FASTEST}  # no first-words choice
        for name, first_words in cold_first_words(variants, sampling, ids, index // config.first_words_every).items():
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
    decodes 7.0/4.2/3.4 ms, then 2.6; without llama.cpp between, 3.1/2.7). The target alone at the fastest
    settings (another copy of its weights) gets rounds of its own after ours, for the same reason: the variant after
    it in a round read its first token 11% later than the target alone (demo pair, prompt cached)."""
    runs = {name: functools.partial(timed_generate, decoder, ids, sampling[name]) for name, decoder in decoders.items()}
    fastest = {name: runs.pop(name) for name in [FASTEST] if name in runs}
    return rounds(runs, repeats) | rounds(fastest, repeats), rounds(llama_runs, repeats)


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
            "by_source": stats[0].as_dict()["by_source"],
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


def variant_profiles(config: BenchConfig) -> dict[str, dict[str, Any]]:
    """c and r(n) per variant, measured once per draft model for every variant it runs in (r(n) up to their longest
    k: a lookup in front may draft further than the draft alone); model-free speculators cost nothing (c = 0, the
    target's r)."""
    by_draft: dict[str | None, list[str]] = {}
    for name, variant in config.variants().items():
        by_draft.setdefault(variant.draft, []).append(name)
    profiles = {}
    for draft, names in by_draft.items():
        max_batch = max(draft_length(config, name) for name in names) + 1
        path = config.drafts[draft] if draft else None
        measured = measure_profile(
            config.target, path or config.target, max_batch, threads=config.threads, exact=config.exact
        )
        profiles |= dict.fromkeys(
            names, measured if path else {**measured, "cost_ratio": 0.0, "draft_ms_per_token": 0.0}
        )
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
        draft = config.draft_path(name)
        return run_peer(
            binary,
            config.target,
            draft,
            without_bos(target, text),
            draft_length(config, name),
            config.max_tokens,
            target.threads,
            config.n_ctx,
            config.exact,
            lookups=config.variants()[name].lookups,
            ngram_type=config.peer_ngram,
            ngram_n=config.ngram.min_n if config.ngram else NgramSettings().min_n,
        )

    return run
