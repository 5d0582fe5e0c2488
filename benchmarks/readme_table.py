"""The results tables, rendered from the committed results (benchmarks/results/speculative_*.json, and eagle3_*.json
for the EAGLE-3 heads, each with its prediction on the reference card and its band from gpu_grounded.json), so they
cannot drift and a new bench edits no prose: the README holds the headline table only, docs/results.md every pair's
and the heads', each between `<!-- table: NAME -->` and `<!-- end table -->`. `tests/test_docs.py` checks that each
block holds exactly what this renders.

Usage: python benchmarks/readme_table.py           (prints the tables)
       python benchmarks/readme_table.py --write   (rewrites the blocks in README.md and docs/results.md)
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from spectune.bench.summary import BenchSummary, bench_summaries

RESULTS = Path(__file__).parent / "results"
GROUNDED = "gpu_grounded.json"  # benchmarks/grounded_gpu.py: the reference card applied to every result below
CARD = "RTX 4060 Ti 16 GB"  # the reference card (spectune.gpu's published.yaml)
# (results file, the pair in words, its data): the pairs the README reports beside the headline, the off-the-shelf
# draft, the best tuned one and, where the bench ran n-gram lookup, its best variant
PAIRS = (
    ("speculative_demo.json", "demo 17M target, 1.3M draft", "generated voice-bot dialogues"),
    ("speculative_smollm2_sgd_ngram.json", "SmolLM2-135M-Instruct, QLoRA on SGD", "SGD dev"),
    ("speculative_gemma3_270m_sgd_ngram.json", "Gemma 3 270M, QLoRA on SGD", "SGD dev"),
)
HEADER = (
    "| pair (data) | draft | k | prompts | identical | acceptance | tokens per target pass | here: with the draft "
    "over the target alone | over llama.cpp's target alone: exact settings / its defaults | predicted on a GPU: "
    f"bytes only / {CARD} (band) (c) |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)

# The headline: the reference story's shape on a real family, every variant the bench ran
HEADLINE = "speculative_qwen_sgd.json"
HEADLINE_HEADER = (
    "| draft | k | acceptance | tokens per target pass | identical: ours / llama.cpp's tool "
    f"| predicted on a GPU: bytes only / {CARD} (band) |\n"
    "|---|---|---|---|---|---|"
)
DRAFT_WORDS = {
    "generic": "the 0.5B off the shelf",
    "sft": "the 0.5B tuned on the same data",
    "seqkd": "the 0.5B tuned on the target's answers",
    "ngram": "n-gram lookup (no model)",
    "ngram+seqkd": "lookup, then the seqkd 0.5B",
}

# (results file, the pair in words, its data): EAGLE-3 heads beside the best standalone draft, in llama.cpp's loop
HEADS = (
    ("eagle3_smollm2_sgd.json", "SmolLM2-135M-Instruct, QLoRA on SGD", "SGD dev"),
    ("eagle3_gemma3_270m_sgd.json", "Gemma 3 270M, QLoRA on SGD", "SGD dev"),
    ("llama_cpp_files_qwen_sgd_head_512.json", "Qwen2.5-Coder 1.5B, QLoRA on SGD", "the run's eval split"),
)
HEADS_HEADER = (
    "| pair (data) | draft | k | prompts | identical | acceptance (llama.cpp's count) | α / tokens per target pass "
    "(offline) | over llama.cpp's target alone, both in llama.cpp's loop | predicted on a GPU: bytes only / "
    f"{CARD} (band) (c) |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def best_draft(drafts: dict[str, BenchSummary], looked_up: bool = False) -> str | None:
    """The tuned draft model (or, `looked_up`, the n-gram variant) with the highest predicted GPU speedup."""
    tuned = {name: row for name, row in drafts.items() if name != "generic" and name.startswith("ngram") == looked_up}
    return max(tuned, key=lambda name: tuned[name].predicted_speedup_gpu) if tuned else None


MIN_TIMED_RUNS = 3  # a speed measured here is quoted only from this many interleaved runs, or a stall check


def timed_runs(result: dict) -> int:
    """How many timed runs per prompt a committed result rests on (its own record; older results say it in their
    command, --one-repeat, or their config's bench.repeats, each 1 for the results quoted here)."""
    return result.get("timed_runs") or result.get("settings", {}).get("repeats") or 1


def quotable(result: dict) -> bool:
    """Whether a result's speeds measured here may be quoted: enough timed runs, or every prompt stall-checked."""
    return timed_runs(result) >= MIN_TIMED_RUNS or "retimed" in result


def speedup_or_not_run(speedup: float | None, result: dict) -> str:
    if not quotable(result):
        return "1 run"
    return f"{speedup:.2f}x" if speedup else "not run"


def on_card(grounded: dict) -> str:
    """The reference card's prediction with its band."""
    low, high = grounded["grounded_band"]
    return f"{grounded['grounded']:.2f}x ({low:.2f}-{high:.2f}x)"


def gpu_figures(file: str, name: str) -> str:
    """The bytes-only and the reference card's prediction of a committed draft, each with its c."""
    grounded = json.loads((RESULTS / GROUNDED).read_text())["results"][file]["drafts"][name]
    return (
        f"{grounded['bytes_only_committed']:.2f}x / {on_card(grounded)} "
        f"(c = {grounded['bytes_c']:.3f} / {grounded['grounded_c']:.3f})"
    )


def row(file: str, pair: str, data: str, name: str, result: dict) -> str:
    figures = BenchSummary.model_validate(result["drafts"][name])
    here, over_exact, over_defaults = (
        speedup_or_not_run(speedup, result)
        for speedup in (
            figures.aggregate_speedup,
            figures.aggregate_speedup_over_llama_cpp,
            figures.aggregate_speedup_over_llama_cpp_defaults,
        )
    )
    return (
        f"| {pair} ({data}) | {name} | {figures.draft_max} | {figures.n} | {figures.identical}/{figures.n} "
        f"| {figures.acceptance:.1%} | {figures.mean_accepted_len:.2f} | {here} "
        f"({figures.total_tokens:,} tokens) | {over_exact} / {over_defaults} "
        f"| {gpu_figures(file, name)} |"
    )


def table() -> str:
    lines = [HEADER]
    for file, pair, data in PAIRS:
        result = json.loads((RESULTS / file).read_text())
        drafts = bench_summaries(result["drafts"], file)
        for name in ("generic", best_draft(drafts), best_draft(drafts, looked_up=True)):
            if name is not None:
                lines.append(row(file, pair, data, name, result))
    return "\n".join(lines)


def headline_table() -> str:
    lines = [HEADLINE_HEADER]
    result = json.loads((RESULTS / HEADLINE).read_text())
    for name, f in bench_summaries(result["drafts"], HEADLINE).items():
        grounded = json.loads((RESULTS / GROUNDED).read_text())["results"][HEADLINE]["drafts"][name]
        lines.append(
            f"| {DRAFT_WORDS.get(name, name)} | {f.draft_max} | {f.acceptance:.1%} | {f.mean_accepted_len:.2f} "
            f"| {f.identical}/{f.n} / {f.llama_cpp_identical}/{f.n} "
            f"| {grounded['bytes_only_committed']:.2f}x / {on_card(grounded)} |"
        )
    return "\n".join(lines)


def heads_table() -> str:
    lines = [HEADS_HEADER]
    for file, pair, data in HEADS:
        result = json.loads((RESULTS / file).read_text())
        for name, f in result["drafts"].items():
            lines.append(
                f"| {pair} ({data}) | {name} | {f['k']} | {f['n']} | {f['identical']}/{f['n']} "
                f"| {f['llama_cpp_acceptance']:.1%} | {f['alpha']:.1%} / {f['tau']:.2f} "
                f"| {speedup_or_not_run(f.get('over_llama_cpp_target_alone'), result)} ({f['tokens']:,} tokens) "
                f"| {gpu_figures(file, name)} |"
            )
    return "\n".join(lines)


# The Gemma 4 demo's MTP assistant, as shipped (generic) and retuned: llama.cpp's draft-mtp and spectune's loop at k = 3
ASSISTANT_FILES = ("eagle3_gemma4_demo_assistant.json", "bench_gemma4_demo_k3.json")
ASSISTANT_HEADER = (
    "| assistant | k | prompts | identical: llama.cpp's draft-mtp / spectune's loop | accepted, llama.cpp's count: "
    "all / median per prompt | spectune's loop: median per prompt / tokens per target pass | α (offline, the "
    "target's own answers) |\n|---|---|---|---|---|---|---|"
)


def assistant_table() -> str:
    llama_cpp, ours = (json.loads((RESULTS / file).read_text()) for file in ASSISTANT_FILES)
    lines = [ASSISTANT_HEADER]
    for name, f in llama_cpp["drafts"].items():
        mine = ours["summary"][name]
        per_prompt = [p["variants"][name] for p in ours["prompts"] if p["variants"][name]["offered"]]
        median = statistics.median(v["accepted_as_llama_cpp"] / v["offered"] for v in per_prompt)
        words = "as shipped (trained for the base target)" if name == "generic" else "retuned for the tuned target"
        lines.append(
            f"| {words} | {f['k_decoded']} | {f['n']} | {f['identical']}/{f['n']} / {mine['identical']}/{mine['n']} "
            f"| {f['llama_cpp_acceptance']:.1%} / {f['median_prompt_acceptance']:.1%} "
            f"| {median:.1%} / {mine['mean_accepted_len']:.2f} | {f['alpha']:.1%} |"
        )
    return "\n".join(lines)


FIRST_TOKEN = "first_token_qwen_sgd.json"  # benchmarks/first_token.py
TURNS = (  # (the result's kind of turn, in words)
    ("new", "a new caller"),
    ("returning", "the same caller's next turn"),
    ("while_speaking", "next turn, words sent as spoken"),
    ("last_word_late", "the same, last word late"),
    ("other_tenant", "another tenant, same system prompt"),
)


def first_token_table(brief: bool = False) -> str:
    """Median time to first token per kind of turn, spectune serve beside llama-server at its defaults, with each
    pass's ratio, the prefill time each server reports and the tokens cached (brief: the README's, without them)."""
    result = json.loads((RESULTS / FIRST_TOKEN).read_text())
    ours, theirs = result["summary"]["spectune serve"], result["summary"]["llama-server, defaults"]
    size = f"{result['n']} SGD dialogues x {result['passes']} passes, {result['system_prompt_tokens']}-token prompt"
    turn = f"turn ({size})"
    rows = [[turn, "spectune serve", "llama-server", "ratio", "each pass", "prefill, each server's report", "cached"]]
    for kind, words in TURNS:
        mine = ours[kind]
        base = (theirs.get(kind) or theirs["returning"]) if kind != "other_tenant" else None
        cached = statistics.median(
            run["spectune serve"][kind]["cached_tokens"] for run in result["prompts"] if kind in run["spectune serve"]
        )
        row = [words, f"{mine['median_ttft_ms']:.0f} ms", "-", "-", "-", f"{mine['median_prefill_ms']:.0f} ms"]
        if base:
            key = "ratio_to_llama_server" if kind in theirs else "ratio_to_llama_server_returning"
            passes = ", ".join(f"{each['spectune serve'][kind][key]:.2f}" for each in result["summary_per_pass"])
            row[2:] = [f"{base['median_ttft_ms']:.0f} ms", f"{mine[key]:.2f}x", passes, f"{row[5]} / "
                       f"{base['median_prefill_ms']:.0f} ms"]  # fmt: skip
        rows.append([*row, f"{cached:.0f}"])
    shown = rows if not brief else [row[:4] for row in rows] + [first_audio_row()]
    lines = ["| " + " | ".join(row) + " |" for row in shown]
    lines.insert(1, "|" + "---|" * len(shown[0]))
    return "\n".join(lines)


FIRST_AUDIO = "first_audio_qwen_sgd.json"  # benchmarks/first_audio.py


def first_audio_row() -> list[str]:
    """The median time from the end of a caller's turn to the first audio sample of the answer (`call --speak`)."""
    result = json.loads((RESULTS / FIRST_AUDIO).read_text())
    words = f"first audio, `spectune call --speak` ({len(result['turns'])} turns)"
    return [words, f"{result['median_first_audio_ms']:.0f} ms", "-", "-"]


COMMANDS = "commands.json"  # the two commands' times, as measured on this machine (each entry says how)


def commands_table() -> str:
    """How long the two commands took here, and what each one's time counts."""
    lines = ["| command | time here | measured |", "|---|---|---|"]
    for command, record in json.loads((RESULTS / COMMANDS).read_text()).items():
        lines.append(f"| `{command}` | {record['seconds'] / 60:.0f} min | {record['how']} |")
    return "\n".join(lines)


ROOT = Path(__file__).parent.parent
# Each page's generated blocks: the table's name in its markers, and what renders it
BLOCKS: dict[str, dict[str, Callable[[], str]]] = {
    "README.md": {
        "commands": commands_table,
        "headline": headline_table,
        "first_token": lambda: first_token_table(brief=True),
    },
    "docs/results.md": {
        "pairs": table,
        "heads": heads_table,
        "assistant": assistant_table,
        "first_token": first_token_table,
    },
}


def block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- table: {name} -->\n)(.*?)\n?<!-- end table -->", re.DOTALL)


def blocks_of(text: str, name: str) -> list[str]:
    """What a page holds between the markers of table `name`."""
    return [match.group(2) for match in block(name).finditer(text)]


def write() -> None:
    for page, tables in BLOCKS.items():
        path = ROOT / page
        text = path.read_text()
        for name, render in tables.items():
            if len(blocks_of(text, name)) != 1:
                raise SystemExit(f"{page}: expected one <!-- table: {name} --> block")
            text = block(name).sub(lambda match, render=render: f"{match.group(1)}{render()}\n<!-- end table -->", text)
        path.write_text(text)


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write()
    else:
        print("\n\n".join(render() for tables in BLOCKS.values() for render in tables.values()))
