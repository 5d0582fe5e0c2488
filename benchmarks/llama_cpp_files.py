"""Drafts and an EAGLE-3 head given as GGUF files, in llama.cpp's own loop against llama.cpp's target alone:
benchmarks/eagle3.py's bench without a pipeline run (a head trained by `spectune eagle3` on a target tuned outside
one; a draft at several GGUF types side by side). Each label's k, offline α, τ and predictions come from its row of
`spectune acceptance --json-out` on the same target (the label is the row's name), or, for `NAME@TYPE`, from draft
NAME's row for that type in a `benchmarks/draft_types.py` result (`--sweep`: measured on that very file); the label
`eagle3` runs as a head (`ngram+eagle3`: llama.cpp's n-gram lookup in front of it), its training read from
`--training`.

Usage: python benchmarks/llama_cpp_files.py --target TARGET.gguf --data EVAL.jsonl --draft eagle3=HEAD.gguf \
           [--draft sft@Q6_K=F.gguf --sweep draft_types_X.json] --acceptance ACCEPTANCE.json \
           [--training HEAD_DIR/eagle3.json] [--n 60] [--max-tokens 48] [--repeats 1] [--threads 2] --name NAME
Writes benchmarks/results/llama_cpp_files_NAME.json and prints the summaries.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

from eagle3 import bench_pair, result_report
from pipeline_run import write_result

from spectune.data.prepare import read_prompts
from spectune.runtime.registry import Variant
from spectune.threads import thread_count
from spectune.train.eagle3 import EAGLE3

# What the result keeps of the head's training report (eagle3.json)
HEAD_FIGURES = (
    "steps",
    "seconds",
    "feature_seconds",
    "parameters",
    "aux_layers",
    "draft_vocab_size",
    "train_dialogues",
    "accuracy_after",
    "accuracy_by_steps",  # absent from heads trained before it was kept
)


def swept_rows(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A draft_types result's rows as acceptance rows, by `NAME@TYPE`: k is the one the sweep chose the type at."""
    return {
        f"{name}@{row['label']}": {
            "name": f"{name}@{row['label']}",
            "recommended_k": row["chosen_by"]["k"],
            "alpha": row["alpha"],
            "tau_simulated": row["tau"],
            "cost_ratio": row["cost_ratio"],
            "speedup": row["speedup"],
        }
        for name, entry in result["sweep"]["drafts"].items()
        for row in entry["types"]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True, help="The target's GGUF.")
    parser.add_argument("--data", type=Path, required=True, help="Held-out chat dataset: the prompts.")
    parser.add_argument("--draft", action="append", required=True, help="LABEL=GGUF (repeat); `eagle3` is a head.")
    parser.add_argument("--acceptance", type=Path, required=True, help="`spectune acceptance --json-out` of them.")
    parser.add_argument("--sweep", type=Path, default=None, help="A draft_types result: the NAME@TYPE labels' rows.")
    parser.add_argument("--training", type=Path, default=None, help="The head's eagle3.json (`spectune eagle3`).")
    parser.add_argument("--n", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    threads = thread_count(args.threads)
    known = {row["name"]: row for row in json.loads(args.acceptance.read_text())["drafts"]}
    if args.sweep is not None:
        known |= swept_rows(json.loads(args.sweep.read_text()))
    files = {label: Path(gguf) for label, gguf in (item.split("=", 1) for item in args.draft)}
    missing = sorted(set(files) - set(known))
    if missing:
        where = f"{args.acceptance}" + (f" and {args.sweep}" if args.sweep else "")
        parser.error(f"{where}: no row for {', '.join(missing)} (their rows: {', '.join(sorted(known))})")
    accepted = {label: known[label] for label in files}
    if any(Variant.parse(label).draft == EAGLE3 for label in files) and args.training is None:
        parser.error("--training: the head's eagle3.json is needed with a draft labelled eagle3 (or LOOKUP+eagle3)")
    drafts = {label: (gguf, accepted[label]["recommended_k"]) for label, gguf in files.items()}
    rows = bench_pair(args.target, drafts, read_prompts(args.data)[: args.n], args.repeats, args.max_tokens, threads)
    head = json.loads(args.training.read_text())["result"] if args.training else None
    result = result_report(
        rows,
        list(drafts),
        accepted,
        pair={"target": args.target.name} | {label: gguf.name for label, gguf in files.items()},
        machine=f"{platform.machine()} {platform.processor() or ''}".strip() + f", {threads} threads",
        settings={"n": len(rows), "repeats": args.repeats, "max_tokens": args.max_tokens},
        eagle3_training=head and {key: head.get(key) for key in HEAD_FIGURES},
    )
    write_result(f"llama_cpp_files_{args.name}.json", result)
    print(json.dumps({"target_alone": result["target_alone"], "drafts": result["drafts"]}, indent=2))


if __name__ == "__main__":
    main()
