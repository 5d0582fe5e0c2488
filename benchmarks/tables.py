"""Every table of figures in the README and docs/results.md, rendered from the committed results in
benchmarks/results/ (each speed prediction on the reference card with its band from gpu_grounded.json), so they cannot
drift and a new bench edits no prose. Each table stands between `<!-- table: NAME -->` and `<!-- end table -->`;
`tests/test_docs.py` checks that each block holds exactly what this renders.

Usage: python benchmarks/tables.py           (prints the tables)
       python benchmarks/tables.py --write   (rewrites the blocks in README.md and docs/results.md)
"""

from __future__ import annotations

import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from spectune.bench.report import read_result
from spectune.bench.summary import BenchSummary, bench_summaries

RESULTS = Path(__file__).parent / "results"
GROUNDED = "gpu_grounded.json"  # benchmarks/grounded_gpu.py: the reference card applied to every result below
CARD = "RTX 4060 Ti 16 GB"  # the reference card (spectune.gpu's published.yaml)
# Each pair in words, with its data
SMOLLM2, GEMMA3 = "SmolLM2-135M-Instruct, QLoRA on SGD (SGD dev)", "Gemma 3 270M, QLoRA on SGD (SGD dev)"
# results file -> its pair: the pairs at a glance, the off-the-shelf draft, the best tuned one and, where the bench ran
# n-gram lookup, its best variant
PAIRS = {
    "speculative_demo.json": "demo 17M target, 1.3M draft (generated voice-bot dialogues)",
    "speculative_smollm2_sgd_ngram.json": SMOLLM2,
    "speculative_gemma3_270m_sgd_ngram.json": GEMMA3,
}
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

# results file -> its pair: EAGLE-3 heads beside the best standalone draft, in llama.cpp's loop
HEADS = {
    "eagle3_smollm2_sgd.json": SMOLLM2,
    "eagle3_gemma3_270m_sgd.json": GEMMA3,
    "llama_cpp_files_qwen_sgd_head_512.json": "Qwen2.5-Coder 1.5B, QLoRA on SGD (the run's eval split)",
}
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
    grounded = read_result(RESULTS / GROUNDED)["results"][file]["drafts"][name]
    return (
        f"{grounded['bytes_only_committed']:.2f}x / {on_card(grounded)} "
        f"(c = {grounded['bytes_c']:.3f} / {grounded['grounded_c']:.3f})"
    )


def row(file: str, pair: str, name: str, result: dict) -> str:
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
        f"| {pair} | {name} | {figures.draft_max} | {figures.n} | {figures.identical}/{figures.n} "
        f"| {figures.acceptance:.1%} | {figures.mean_accepted_len:.2f} | {here} "
        f"({figures.total_tokens:,} tokens) | {over_exact} / {over_defaults} "
        f"| {gpu_figures(file, name)} |"
    )


def table() -> str:
    lines = [HEADER]
    for file, pair in PAIRS.items():
        result = read_result(RESULTS / file)
        drafts = bench_summaries(result["drafts"], file)
        for name in ("generic", best_draft(drafts), best_draft(drafts, looked_up=True)):
            if name is not None:
                lines.append(row(file, pair, name, result))
    return "\n".join(lines)


def headline_table() -> str:
    lines = [HEADLINE_HEADER]
    result = read_result(RESULTS / HEADLINE)
    for name, f in bench_summaries(result["drafts"], HEADLINE).items():
        grounded = read_result(RESULTS / GROUNDED)["results"][HEADLINE]["drafts"][name]
        lines.append(
            f"| {DRAFT_WORDS.get(name, name)} | {f.draft_max} | {f.acceptance:.1%} | {f.mean_accepted_len:.2f} "
            f"| {f.identical}/{f.n} / {f.llama_cpp_identical}/{f.n} "
            f"| {grounded['bytes_only_committed']:.2f}x / {on_card(grounded)} |"
        )
    return "\n".join(lines)


def heads_table() -> str:
    lines = [HEADS_HEADER]
    for file, pair in HEADS.items():
        result = read_result(RESULTS / file)
        for name, f in result["drafts"].items():
            lines.append(
                f"| {pair} | {name} | {f['k']} | {f['n']} | {f['identical']}/{f['n']} "
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
    llama_cpp, ours = (read_result(RESULTS / file) for file in ASSISTANT_FILES)
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


SERVING = "serving_qwen_sgd.json"  # benchmarks/serving.py: decode, first token, load and first audio, one start
SPECTUNE, LLAMA = "spectune serve", "llama-server, defaults"
TURNS = (  # (the result's kind of turn, in words)
    ("new", "a new caller"),
    ("returning", "the same caller's next turn"),
    ("while_speaking", "next turn, words sent as spoken"),
    ("last_word_late", "the same, last word late"),
    ("other_tenant", "another tenant, same system prompt"),
)


def first_token_table(brief: bool = False) -> str:
    """Median time to first token per kind of turn, spectune serve beside llama-server at its defaults (for a turn
    llama-server has no kind for, its returning caller: the same final prompt), with each pass's ratio, the prefill
    time each server reports and the tokens cached (brief: the README's, without them)."""
    report = read_result(RESULTS / SERVING)
    result = report["first_token"]
    ours, theirs = result["summary"][SPECTUNE], result["summary"][LLAMA]
    size = f"{result['n']} SGD dialogues x {result['passes']} passes, {report['system_prompt_tokens']}-token prompt"
    rows = [
        [f"turn ({size})", SPECTUNE, "llama-server", "ratio", "each pass", "prefill, each server's report", "cached"]
    ]
    for kind, words in TURNS:
        mine = ours[kind]
        cached = statistics.median(
            run[SPECTUNE][kind]["cached_tokens"] for run in result["prompts"] if kind in run[SPECTUNE]
        )
        row = [words, f"{mine['median_ttft_ms']:.0f} ms", "-", "-", "-", f"{mine['median_prefill_ms']:.0f} ms"]
        if "ratio_to_llama_server" in mine:
            base = theirs.get(kind, theirs["returning"])
            passes = ", ".join(
                f"{each[SPECTUNE][kind]['ratio_to_llama_server']:.2f}" for each in result["summary_per_pass"]
            )
            ratio, prefill = f"{mine['ratio_to_llama_server']:.2f}x", f"{row[5]} / {base['median_prefill_ms']:.0f} ms"
            row[2:] = [f"{base['median_ttft_ms']:.0f} ms", ratio, passes, prefill]
        rows.append([*row, f"{cached:.0f}"])
    return markdown_table(rows if not brief else [row[:4] for row in rows] + [first_audio_row(report)])


def first_audio_row(report: dict) -> list[str]:
    """The median time from the end of a caller's turn to the first audio sample of the answer (`call --speak`)."""
    words = f"first audio, `spectune call --speak` ({len(report['audio']['turns'])} turns)"
    return [words, f"{report['audio']['median_first_audio_ms']:.0f} ms", "-", "-"]


COMMANDS = "commands.json"  # the two commands' times, as measured on this machine (each entry says how)


def commands_table() -> str:
    """How long the two commands took here, and what each one's time counts."""
    lines = ["| command | time here | measured |", "|---|---|---|"]
    for command, record in read_result(RESULTS / COMMANDS).items():
        lines.append(f"| `{command}` | {record['seconds'] / 60:.0f} min | {record['how']} |")
    return "\n".join(lines)


def markdown_table(rows: list[list[str]]) -> str:
    """Rows of cells, the first the header, as a Markdown table."""
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


def card_or_dash(file: str, name: str, figures: BenchSummary) -> str:
    """The draft's prediction on the reference card: gpu_grounded.json's where it holds the result, else the bench's
    own (a bench made after the card model), else a dash."""
    grounded = read_result(RESULTS / GROUNDED)
    committed = grounded["results"].get(file) or grounded["bench_reports"].get(file)
    if committed and "drafts" in committed:
        return on_card(committed["drafts"][name])
    if committed and name in committed:
        return on_card(committed[name])
    if figures.predicted_speedup_gpu_grounded and figures.predicted_speedup_gpu_grounded_band:
        band = figures.predicted_speedup_gpu_grounded_band
        return on_card({"grounded": figures.predicted_speedup_gpu_grounded, "grounded_band": band})
    return "-"


def ratio_or_dash(value: float | None, result: dict) -> str:
    return speedup_or_not_run(value, result) if value is not None else "-"


def variants_table(file: str) -> str:
    """Every variant a bench of one pair ran: what it guessed, whether the answers stayed the target alone's, its
    speed here beside the target alone and llama.cpp's, and its predicted speed on a GPU."""
    result = read_result(RESULTS / file)
    drafts = bench_summaries(result["drafts"] if "summary" not in result else result["summary"], file)
    rows = [[
        f"draft ({next(iter(drafts.values())).n} prompts)", "k", "identical: ours / llama.cpp's tool", "acceptance",
        "tokens per target pass", "here: over the target alone (tokens)",
        "over llama.cpp's target alone: exact settings / its defaults",
        f"predicted on a GPU: bytes only / {CARD} (band)",
    ]]  # fmt: skip
    for name, f in drafts.items():
        theirs = f"{f.llama_cpp_identical}/{f.n}" if f.llama_cpp_identical is not None else "-"
        rows.append([
            name, str(f.draft_max), f"{f.identical}/{f.n} / {theirs}", f"{f.acceptance:.1%}",
            f"{f.mean_accepted_len:.2f}",
            f"{speedup_or_not_run(f.aggregate_speedup, result)} ({f.total_tokens:,})",
            f"{ratio_or_dash(f.aggregate_speedup_over_llama_cpp, result)} / "
            f"{ratio_or_dash(f.aggregate_speedup_over_llama_cpp_defaults, result)}",
            f"{f.predicted_speedup_gpu:.2f}x / {card_or_dash(file, name, f)}",
        ])  # fmt: skip
    return markdown_table(rows)


def methods_table(*files: str) -> str:
    """How each way of training a draft did offline: acceptance of the tuned target's greedy tokens, tokens per target
    pass at the best k, the bytes-only GPU prediction, the training time."""
    rows = [["pair", "draft", "α (offline)", "tokens per target pass", "best k",
             "predicted on a GPU, bytes only", "training seconds"]]  # fmt: skip
    for file in files:
        result = read_result(RESULTS / file)
        for row in result["rows"]:
            rows.append([
                result["pair"]["fetch"] or result["pair"]["size"], row["name"], f"{row['alpha']:.1%}",
                f"{row['tau']:.2f}", str(row["best_k"]), f"{row['predicted_speedup']:.2f}x",
                f"{row['train_seconds_total']:,.0f}",
            ])  # fmt: skip
    return markdown_table(rows)


NGRAM_SOURCES = "ngram_sources_demo.json"  # benchmarks/ngram_sources.py


def ngram_sources_table() -> str:
    """At each position of the tuned target's answers, whether each lookup source proposed its next token, and how
    often right."""
    result = read_result(RESULTS / NGRAM_SOURCES)
    rows = [["source (demo pair)", "positions", "proposed", "right", "right of proposed"]]
    for source, counts in result["sources"].items():
        share = counts["right"] / counts["proposed"] if counts["proposed"] else 0.0
        rows.append(
            [source, f"{counts['positions']:,}", f"{counts['proposed']:,}", f"{counts['right']:,}", f"{share:.1%}"]
        )
    return markdown_table(rows)


DRAFT_TYPES = "draft_types_qwen_sgd_tuned_target.json"  # benchmarks/draft_types.py


def draft_types_table() -> str:
    """Each draft quantized to each type: its size, the tuned target's tokens it guessed and the best predicted
    speedup on the card, and which type the sweep chose for each draft."""
    drafts = read_result(RESULTS / DRAFT_TYPES)["sweep"]["drafts"]
    names = list(drafts)
    rows = [["type (Qwen 0.5B)", "MB", *(f"α: {name}" for name in names),
             *(f"predicted on {CARD} at the best k (band): {name}" for name in names)]]  # fmt: skip
    by_label = {name: {kind["label"]: kind for kind in drafts[name]["types"]} for name in names}
    for label, first in by_label[names[0]].items():
        kinds = [by_label[name][label] for name in names]
        chosen = [f"{kind['alpha']:.1%}" + (" (chosen)" if drafts[name]["chosen"] == label else "")
                  for name, kind in zip(names, kinds, strict=True)]  # fmt: skip
        rows.append([label, f"{first['bytes'] / 1e6:,.0f}", *chosen, *map(card_at_best_k, kinds)])
    return markdown_table(rows)


def card_at_best_k(kind: dict) -> str:
    k = kind["best_k"]["gpu-grounded"]
    low, high = kind["card_band"]
    return f"{kind['speedup']['gpu-grounded'][str(k)]:.2f}x ({low:.2f}-{high:.2f}x, k {k})"


DECODE = (SERVING,)  # benchmarks/serving.py


def decode_table() -> str:
    """Decoding through HTTP, each server on the same prompts in turn: tokens per second, over llama-server's."""
    rows = [["target", "server (its mode)", "tokens/s, median", "over llama-server: median / all tokens", "tokens",
             "identical to the target alone"]]  # fmt: skip
    for file in DECODE:
        report = read_result(RESULTS / file)
        for name, s in report["decode"]["servers"].items():
            rows.append([
                Path(report["target"]).name, f"{name} ({report['modes'][name] or 'its defaults'})",
                f"{s['median_tokens_per_second']:.1f}",
                f"{s['median_ratio_to_llama_server']:.2f}x / {s['total_ratio_to_llama_server']:.2f}x",
                f"{s['decode_tokens']:,}",
                f"{report['decode']['identical_to_the_target_alone'][name]}/{report['decode']['n']}",
            ])  # fmt: skip
    return markdown_table(rows)


def load_table() -> str:
    """Callers at once against each server: time to first token and errors."""
    load = read_result(RESULTS / SERVING)["load"]
    rows = [[f"server ({load['clients']} callers at once)", "answers", "errors", "first token: p50 / p95"]]
    for name, s in load["servers"].items():
        rows.append(
            [name, str(s["requests"]), str(s["errors"]), f"{s['p50_ttft_ms']:.0f} ms / {s['p95_ttft_ms']:.0f} ms"]
        )
    return markdown_table(rows)


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
        "demo": lambda: variants_table("speculative_demo.json"),
        "qwen": lambda: variants_table("speculative_qwen_sgd.json"),
        "smollm2": lambda: variants_table("speculative_smollm2_sgd_ngram.json"),
        "gemma3": lambda: variants_table("speculative_gemma3_270m_sgd_ngram.json"),
        "gemma4": lambda: variants_table("speculative_gemma4_demo.json"),
        "methods": lambda: methods_table("draft_methods_demo_speckd.json", "draft_methods_smollm2_sgd_speckd.json"),
        "ngram_sources": ngram_sources_table,
        "draft_types": draft_types_table,
        "decode": decode_table,
        "load": load_table,
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
