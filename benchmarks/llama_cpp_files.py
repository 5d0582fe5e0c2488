"""Drafts and an EAGLE-3 head given as GGUF files, in llama.cpp's own loop against llama.cpp's target alone:
benchmarks/eagle3.py's bench without a pipeline run (a head trained by `spectune eagle3` on a target tuned outside
one; a draft at several GGUF types side by side). A draft's label is its acceptance row's name, optionally with
`@TYPE` (`sft@Q6_K=FILE`): its k, offline α, τ and predictions come from that row of `spectune acceptance
--json-out` on the same target; the label `eagle3` runs as a head, its training read from `--training`.

Usage: python benchmarks/llama_cpp_files.py --target TARGET.gguf --draft eagle3=HEAD.gguf [--draft sft@Q6_K=F.gguf] \
           --acceptance ACCEPTANCE.json [--training HEAD_DIR/eagle3.json] --data EVAL.jsonl [--n 60] \
           [--max-tokens 48] [--repeats 1] [--threads 2] --name NAME
Writes benchmarks/results/llama_cpp_files_NAME.json and prints the summaries.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from eagle3 import bench_pair, result_report
from pipeline_run import write_result

from spectune.data.prepare import read_prompts
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
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True, help="The target's GGUF.")
    parser.add_argument("--data", type=Path, required=True, help="Held-out chat dataset: the prompts.")
    parser.add_argument("--draft", action="append", required=True, help="LABEL=GGUF (repeat); `eagle3` is a head.")
    parser.add_argument("--acceptance", type=Path, required=True, help="`spectune acceptance --json-out` of them.")
    parser.add_argument("--training", type=Path, default=None, help="The head's eagle3.json (`spectune eagle3`).")
    parser.add_argument("--n", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    threads = thread_count(args.threads)
    rows_by_name = {row["name"]: row for row in json.loads(args.acceptance.read_text())["drafts"]}
    files = {label: Path(gguf) for label, gguf in (item.split("=", 1) for item in args.draft)}
    accepted = {label: rows_by_name.get(label.split("@")[0]) for label in files}
    missing = sorted(label for label, row in accepted.items() if row is None)
    if missing:
        known = ", ".join(sorted(rows_by_name))
        parser.error(f"{args.acceptance}: no acceptance row for {', '.join(missing)} (its rows: {known})")
    if EAGLE3 in files and args.training is None:
        parser.error("--training: the head's eagle3.json is needed with a draft labelled eagle3")
    drafts = {label: (gguf, accepted[label]["recommended_k"]) for label, gguf in files.items()}
    rows = bench_pair(args.target, drafts, read_prompts(args.data)[: args.n], args.repeats, args.max_tokens, threads)
    head = json.loads(args.training.read_text()) if args.training else None
    result = result_report(
        rows,
        list(drafts),
        accepted,
        pair={"target": args.target.name} | {label: gguf.name for label, gguf in files.items()},
        machine=f"{platform.machine()} {platform.processor() or ''}".strip() + f", {threads} threads",
        settings={"n": len(rows), "repeats": args.repeats, "max_tokens": args.max_tokens},
        eagle3_training=head and {key: head[key] for key in HEAD_FIGURES},
    )
    write_result(f"llama_cpp_files_{args.name}.json", result)
    print(json.dumps({"target_alone": result["target_alone"], "drafts": result["drafts"]}, indent=2))


if __name__ == "__main__":
    main()
