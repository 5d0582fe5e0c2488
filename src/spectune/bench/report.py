"""A bench's report: report.json, report.md (its tables and what they mean) and report.png."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from spectune.atomic import atomic_path
from spectune.bench.config import BASELINES
from spectune.bench.serving import serving_lines
from spectune.bench.stalls import stall_lines
from spectune.bench.summary import BenchSummary, bench_summaries, grounded_figure
from spectune.gpu.card import reference_card
from spectune.runtime.ngram import NGRAM


def write_report(report: dict[str, Any], out: Path, with_plot: bool = True) -> None:
    """report.json, report.md and two PNG plots, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "report.json") as tmp:
        tmp.write_text(json.dumps(report, indent=2))
    with atomic_path(out / "report.md") as tmp:
        tmp.write_text(markdown(report))
    if with_plot:
        plot(report, out)


def read_result(path: Path) -> dict[str, Any]:
    """A committed result: `path`, or its gzip (`NAME.json.gz`, named or found beside an absent `NAME.json`: results
    over 1 MB are committed compressed)."""
    packed = path if path.suffix == ".gz" else path.with_name(path.name + ".gz")
    if path == packed or (not path.is_file() and packed.is_file()):
        return json.loads(gzip.decompress(packed.read_bytes()))
    return json.loads(path.read_text())


def timed_runs(repeats: int) -> str:
    """How the per-prompt figures were taken, in words."""
    return "one timed run per prompt" if repeats == 1 else f"medians of {repeats} interleaved runs per prompt"


def markdown(report: dict[str, Any]) -> str:
    settings, summaries = report["settings"], bench_summaries(report["summary"], "the bench report")
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
    for name, s in summaries.items():
        lines.append(
            f"| {name} | {s.draft_max} | {s.identical}/{s.n} | {s.acceptance:.1%} | {s.mean_accepted_len:.2f} | "
            f"{s.aggregate_speedup:.2f}x ({s.total_tokens}, {s.total_seconds:.2f} vs {s.target_total_seconds:.2f}) | "
            f"{s.mean_speedup:.2f}x / {s.best_speedup:.2f}x / {s.worst_speedup:.2f}x | "
            f"{s.cost_ratio:.3f} | {s.verify_ratio:.2f} | {s.predicted_speedup_here:.2f}x | "
            f"{s.predicted_speedup_gpu:.2f}x (c = {s.gpu_cost_ratio:.3f}) | "
            f"{grounded_figure(s)} (c = {s.grounded_cost_ratio:.3f}, {s.gpu_card}) |"
        )
    lines += latency_lines(summaries, settings) + ngram_lines(summaries) + llama_cpp_lines(summaries)
    lines += serving_lines(report.get("serving")) + stall_lines(report.get("retimed", []))
    timed = [s.target_total_seconds for s in summaries.values()]
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


def latency_lines(summaries: dict[str, BenchSummary], settings: dict[str, Any]) -> list[str]:
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
    for name, s in summaries.items():
        lines.append(
            f"| {name} | {s.ttft_ms:.0f} ({s.target_ttft_ms:.0f}) | {s.ttfs_ms:.0f} ({s.target_ttfs_ms:.0f}) | "
            f"{s.cold_ttft_ms:.0f} ({s.target_cold_ttft_ms:.0f}) | {s.cold_ttfs_ms:.0f} / "
            f"{s.cold_ttfs_first_clause_alone_ms:.0f} ({s.target_cold_ttfs_ms:.0f}) | "
            f"{s.ttfs_ms / s.target_ttfs_ms:.2f}x ({s.predicted_first_sentence_here:.2f}x) / "
            f"{s.predicted_first_sentence_gpu_grounded:.2f}x |"
        )
    every = settings["first_words_every"]
    if every > 1:
        measured = next(iter(summaries.values())).first_words_prompts
        total = settings["n"]
        lines += ["", f"A new prompt's first words: measured on {measured} of the {total} prompts (one in {every})."]
    return lines


def ngram_lines(summaries: dict[str, BenchSummary]) -> list[str]:
    """What n-gram lookup did in each variant that used it: how often it proposed, how much the target kept."""
    looked_up = {name: s.lookups[NGRAM] for name, s in summaries.items() if NGRAM in s.lookups}
    looked_up = {name: lookup for name, lookup in looked_up.items() if lookup.drafted}
    if not looked_up:
        return []
    lines = [
        "",
        "| variant | steps proposed by lookup | tokens looked up | of them accepted | from the conversation |",
        "|---|---|---|---|---|",
    ]
    for name, lookup in looked_up.items():
        lines.append(
            f"| {name} | {lookup.step_share:.1%} | {lookup.drafted} | {lookup.acceptance:.1%} | "
            f"{lookup.context_share:.1%} |"
        )
    return [
        *lines,
        "Looked-up tokens not from the conversation came from the domain table (the target's own answers); a step "
        "the lookup did not propose for was the draft model's.",
    ]


def llama_cpp_lines(summaries: dict[str, BenchSummary]) -> list[str]:
    """llama.cpp's speculative decoder beside ours, and its target alone as the baseline check (--peer)."""
    lines: list[str] = []
    peers = {name: s for name, s in summaries.items() if s.vs_llama_cpp is not None}
    if peers:
        lines += [
            "",
            "| draft | llama.cpp tok/s | llama.cpp acceptance | ours counted as llama.cpp counts | "
            "llama.cpp identical | ours / llama.cpp |",
            "|---|---|---|---|---|---|",
        ]
        for name, s in peers.items():
            lines.append(
                f"| {name} | {s.llama_cpp_tokens_per_second:.1f} | {s.llama_cpp_acceptance:.1%} | "
                f"{s.acceptance_as_llama_cpp_counts:.1%} | {s.llama_cpp_identical}/{s.n} | {s.vs_llama_cpp:.2f}x |"
            )
        lines.append(
            "llama.cpp's draft-simple drafts k tokens every step, on past the draft's end token, counts them all as "
            "drafted, and counts an accepted end token before the k-th draft as the target's own; spectune stops "
            "drafting at an end token. Counted its way, our run comes near its figure but does not equal it: its "
            "first step drafts k (its draft reads the prompt before the first token), ours is the target's own, so "
            "the steps fall differently after it (and at the token limit llama.cpp's last step still drafts k)."
        )
    baselines = {name: s.model_dump() for name, s in summaries.items() if s.baseline_vs_llama_cpp is not None}
    if baselines:
        first = next(iter(baselines.values()))
        lines += ["", "Baseline: the target alone through llama.cpp's own loop (llama-server, same GGUF and threads)."]
        for field, said in BASELINES.items():
            if first[f"baseline_vs_{field}"] is None:
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
    for name, summary in bench_summaries(report["summary"], "the bench report").items():
        speedups = [row["variants"][name]["speedup"] for row in report["prompts"]]
        axes[0].plot(range(1, len(speedups) + 1), speedups, marker="o", label=name)
        by_position = summary.acceptance_by_position
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
