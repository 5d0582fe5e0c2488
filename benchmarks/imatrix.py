"""Quantizing with an importance matrix from the task's own dialogues, against plain quantization (issue 57).

For each model and quant type: the F16 GGUF once, then libllama's plain quantization and llama-quantize with an
importance matrix computed by llama-imatrix on the first `--calibration` training dialogues rendered with the
model's chat template; each GGUF's fidelity to the HF weights (top-1 next-token agreement and perplexity, on held-out
dialogues the matrix never saw), and the time of each step. The matrix is computed here, not read from the cache.

Usage: python benchmarks/imatrix.py --model NAME=HF_DIR [--model ...] --train TRAIN.jsonl --eval EVAL.jsonl \
           [--quant Q4_K_M --quant Q6_K] [--calibration 1000] [--fidelity 20] --name NAME
Writes benchmarks/results/imatrix_NAME.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from never_slower import shown

from spectune.atomic import atomic_path
from spectune.export import imatrix
from spectune.export.gguf import convert, quantize
from spectune.export.pair import fidelity, held_out
from spectune.models.load import load_tokenizer
from spectune.runtime.build import build_name
from spectune.threads import configure_torch_threads, thread_count

RESULTS = Path(__file__).parent / "results"


def rendered(folder: Path, data: Path, n: int) -> list[str]:
    tokenizer = load_tokenizer(folder)
    return [tokenizer.apply_chat_template(messages, tokenize=False) for messages in held_out(data, n)]


def timed(function, *args, **kwargs) -> tuple[object, float]:
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return result, round(time.perf_counter() - start, 1)


def measure_model(folder: Path, args: argparse.Namespace, scratch: Path) -> dict:
    """One model: the F16 GGUF, its matrix, and each quant type plain and with the matrix, with fidelity."""
    calibration = "\n".join(rendered(folder, args.train, args.calibration))
    texts = rendered(folder, args.eval, args.fidelity)
    f16, convert_seconds = timed(convert, folder, scratch / "model.f16.gguf", "F16")
    # the benchmark times the matrix, not the cache: one cached by a run of this model is computed again
    imatrix.cached_matrix(f16, calibration, args.chunks).unlink(missing_ok=True)
    (matrix, _), matrix_seconds = timed(imatrix.importance_matrix, f16, calibration, args.threads, args.chunks)
    row = {
        "hf": shown(folder),
        "calibration_characters": len(calibration),
        "convert_seconds": convert_seconds,
        "imatrix_seconds": matrix_seconds,
        "types": {},
    }
    for quant in args.quant:
        plain, plain_seconds = timed(quantize, f16, scratch / f"plain.{quant}.gguf", quant, args.threads)
        weighted, weighted_seconds = timed(
            imatrix.quantize_with, f16, scratch / f"imatrix.{quant}.gguf", quant, matrix, args.threads
        )
        row["types"][quant] = {
            "plain": {**fidelity(folder, plain, texts, args.threads), "bytes": plain.stat().st_size},
            "imatrix": {**fidelity(folder, weighted, texts, args.threads), "bytes": weighted.stat().st_size},
            "quantize_seconds": {"plain": plain_seconds, "imatrix": weighted_seconds},
        }
        print(f"{folder.name} {quant}: {json.dumps(row['types'][quant])}", flush=True)
    return row


def table(report: dict) -> str:
    lines = [
        "| model | type | top-1 agreement: plain / imatrix | perplexity HF -> plain / imatrix | imatrix s |",
        "|---|---|---|---|---|",
    ]
    for name, row in report["models"].items():
        for quant, figures in row["types"].items():
            plain, weighted = figures["plain"], figures["imatrix"]
            lines.append(
                f"| {name} | {quant} | {plain['top1_agreement']:.1%} / {weighted['top1_agreement']:.1%} | "
                f"{plain['perplexity_hf']:.2f} -> {plain['perplexity_gguf']:.2f} / {weighted['perplexity_gguf']:.2f} "
                f"| {row['imatrix_seconds']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, help="NAME=HF_DIR (repeat)")
    parser.add_argument("--train", type=Path, required=True, help="Chat dataset: the calibration dialogues.")
    parser.add_argument("--eval", type=Path, required=True, help="Chat dataset: held-out fidelity dialogues.")
    parser.add_argument("--quant", action="append", default=None, help="Quant type (repeat; default Q4_K_M).")
    parser.add_argument("--calibration", type=int, default=1000, help="Training dialogues the matrix reads.")
    parser.add_argument("--fidelity", type=int, default=20, help="Held-out dialogues fidelity is measured on.")
    parser.add_argument("--chunks", type=int, default=imatrix.MAX_CHUNKS, help="Chunks of 512 tokens the matrix reads.")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    args.quant = args.quant or ["Q4_K_M"]
    args.threads = thread_count(args.threads)
    configure_torch_threads(args.threads)
    models = dict(item.split("=", 1) for item in args.model)
    report = {
        "command": "python benchmarks/imatrix.py "
        + " ".join(f"--model {name}={shown(Path(folder))}" for name, folder in models.items())
        + f" --train {args.train} --eval {args.eval} "
        + " ".join(f"--quant {quant}" for quant in args.quant)
        + f" --calibration {args.calibration} --fidelity {args.fidelity} --chunks {args.chunks}"
        + f" --threads {args.threads} --name {args.name}",
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip() + f", {args.threads} threads",
        "build": build_name(),
        "train": str(args.train),
        "eval": str(args.eval),
        "calibration_dialogues": args.calibration,
        "fidelity_dialogues": args.fidelity,
        "chunk_tokens": imatrix.CHUNK_TOKENS,
        "max_chunks": args.chunks,
        "models": {},
    }
    for name, folder in models.items():
        with tempfile.TemporaryDirectory() as scratch:
            report["models"][name] = measure_model(Path(folder), args, Path(scratch))
    print(table(report))
    with atomic_path(RESULTS / f"imatrix_{args.name}.json") as tmp:
        tmp.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
