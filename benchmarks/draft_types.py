"""Each draft at every candidate GGUF type, measured in llama.cpp against the target's GGUF (issue 57).

The acceptance stage's sweep (spectune.acceptance.draft_types) run on its own: every draft exported at Q4_K_M as
the export makes it (with an importance matrix on `--train` where given), then quantized to each `--type`; the
target's GGUF answers the held-out prompts greedily and every file is measured on those answers: α by position, τ,
c in bytes and on the reference card, the predicted speedup at the best k; the type predicted fastest on the card
is the one a run serves.

Usage: python benchmarks/draft_types.py --target TARGET.gguf --draft NAME=HF_DIR [--draft ...] --data EVAL.jsonl \
           [--train TRAIN.jsonl] [--answers ANSWERS.jsonl] [--type Q4_K_M --type Q8_0] [--n 20] [--max-tokens 48] \
           [--keep DIR] --name NAME
`--answers`: the tuned target's own answers (seqkd's target_answers.jsonl) go first in the drafts' calibration text,
the training dialogues after them (the matrix reads its first chunks only).
Writes benchmarks/results/draft_types_NAME.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

from serving_http import shown

from spectune.acceptance.draft_types import DRAFT_TYPES, sweep_types, type_table
from spectune.atomic import atomic_path
from spectune.data.prepare import read_prompts
from spectune.export.gguf import export_model
from spectune.export.pair import CALIBRATION_DIALOGUES, calibration_text, held_out
from spectune.layout import DEFAULT_QUANT, gguf_name
from spectune.runtime.build import build_name
from spectune.threads import configure_torch_threads, thread_count

RESULTS = Path(__file__).parent / "results"


def keep_files(sweep: dict, folder: Path) -> None:
    """Every swept file copied into `folder` as NAME.LABEL.gguf (Q4_K_M+imatrix: NAME.Q4_K_M-imatrix.gguf)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, entry in sweep["drafts"].items():
        for row in entry["types"]:
            with atomic_path(folder / f"{name}.{row['label'].replace('+', '-')}.gguf") as tmp:
                shutil.copyfile(row["gguf"], tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True, help="The target's GGUF.")
    parser.add_argument("--draft", action="append", required=True, help="NAME=HF_DIR (repeat).")
    parser.add_argument("--data", type=Path, required=True, help="Held-out chat dataset: the prompts.")
    parser.add_argument("--train", type=Path, default=None, help="Training dialogues: the importance matrices.")
    parser.add_argument("--answers", type=Path, default=None, help="The target's answers: calibration text first.")
    parser.add_argument("--type", action="append", default=None, help="GGUF type (repeat; default: the run's).")
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--name", required=True)
    parser.add_argument("--keep", type=Path, default=None, help="Keep every swept GGUF here (to bench them after).")
    args = parser.parse_args()
    types, threads = args.type or list(DRAFT_TYPES), thread_count(args.threads)
    configure_torch_threads(threads)
    drafts = {name: Path(folder) for name, folder in (item.split("=", 1) for item in args.draft)}
    dialogues = [*held_out(args.answers, CALIBRATION_DIALOGUES), *held_out(args.train, CALIBRATION_DIALOGUES)]
    report = {
        "command": f"python benchmarks/draft_types.py --target {shown(args.target)} "
        + " ".join(f"--draft {name}={shown(folder)}" for name, folder in drafts.items())
        + f" --data {args.data}"
        + (f" --train {args.train}" if args.train else "")
        + (f" --answers {args.answers}" if args.answers else "")
        + "".join(f" --type {quant}" for quant in types)
        + f" --n {args.n} --max-tokens {args.max_tokens}"
        + (f" --keep {shown(args.keep)}" if args.keep else "")
        + f" --name {args.name}",
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip() + f", {threads} threads",
        "build": build_name(),
        "imatrix": bool(dialogues),
    }
    calibration = {name: calibration_text(folder, dialogues) for name, folder in drafts.items()} if dialogues else {}
    with tempfile.TemporaryDirectory() as scratch:
        exported, export_seconds = {}, {}
        for name, folder in drafts.items():
            start = time.perf_counter()
            out = Path(scratch) / gguf_name(name, DEFAULT_QUANT)
            exported[name] = (folder, export_model(folder, out, DEFAULT_QUANT, calibration=calibration.get(name)))
            export_seconds[name] = round(time.perf_counter() - start, 1)
        prompts = read_prompts(args.data)[: args.n]
        report["export_seconds"] = export_seconds
        report["sweep"] = sweep_types(args.target, exported, prompts, args.max_tokens, types, calibration, threads)
        if args.keep:
            keep_files(report["sweep"], args.keep)
    for entry in report["sweep"]["drafts"].values():  # the files were in a scratch folder: their names only
        entry["gguf"] = Path(entry["gguf"]).name
        for row in entry["types"]:
            row["gguf"] = Path(row["gguf"]).name
    print("\n".join(type_table(report["sweep"])))
    with atomic_path(RESULTS / f"draft_types_{args.name}.json") as tmp:
        tmp.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
