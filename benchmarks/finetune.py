"""QLoRA (NF4 base) vs LoRA (f32 base) on a demo target: step time and peak memory, interleaved A/B, medians;
and the memory planner's estimate beside the measured peak.

Each run is a fresh process (clean peak RSS). Measured model memory = peak RSS minus the RSS of the same process
after imports, before the model loads. On CPU the planner's f16 / NF4 weight estimates are compared with what the
process holds (f32 on CPU for the LoRA base), so the comparison is of the NF4 case.

Usage: python benchmarks/finetune.py --size small --steps 20 --rounds 2
Writes benchmarks/results/finetune_<size>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
CHILD = """
import json, resource, sys, time
import torch, transformers, trl, peft  # noqa: F401  (imports are part of the baseline)
from spectune.train.target import FinetuneConfig, finetune
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
config = FinetuneConfig.model_validate_json(sys.argv[1])
result = finetune(config)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps({"baseline": baseline, "peak": peak, "seconds": result.seconds, "steps": result.steps,
                              "eval_loss_after": result.eval_loss_after}))
"""


def run_once(model: Path, data: Path, four_bit: bool, steps: int, seq: int, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        config = {
            "model": str(model),
            "data": str(data),
            "out": out,
            "four_bit": four_bit,
            "max_steps": steps,
            "batch_size": batch,
            "max_seq_length": seq,
            "max_eval": 8,
            "lr": 2e-3,
            "save_steps": 10_000,
        }
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(config)], capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(done.stderr[-2000:])
        return json.loads(line[7:])


def main() -> None:
    from spectune.data.demo import generate_dialogues
    from spectune.data.read import write_jsonl
    from spectune.models.demo_pair import build_pair
    from spectune.train.plan import estimate, read_shape

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    target = build_pair(args.size) / "target"
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "demo.jsonl"
        write_jsonl(generate_dialogues(600, seed=0), data)
        runs: dict[str, list[dict]] = {"qlora": [], "lora": []}
        for _ in range(args.rounds):  # interleaved A/B
            for name, four_bit in (("qlora", True), ("lora", False)):
                runs[name].append(run_once(target, data, four_bit, args.steps, args.seq, args.batch))
    plan = estimate(read_shape(target), seq=args.seq, batch=args.batch, rank=16, context=args.seq)
    result = {"size": args.size, "steps": args.steps, "seq": args.seq, "batch": args.batch, "variants": {}}
    for name, samples in runs.items():
        result["variants"][name] = {
            "seconds_per_step": statistics.median(s["seconds"] / s["steps"] for s in samples),
            "model_memory_bytes": statistics.median(s["peak"] - s["baseline"] for s in samples),
            "peak_rss_bytes": statistics.median(s["peak"] for s in samples),
        }
    estimated = plan.nf4_weights + plan.lora_train_state + plan.activations + plan.logits
    measured = result["variants"]["qlora"]["model_memory_bytes"]
    result["planner"] = {
        "qlora_estimate_bytes_no_margin": estimated,
        "measured_model_bytes": measured,
        "error": (estimated - measured) / measured,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"finetune_{args.size}.json").write_text(json.dumps(result, indent=2))
    print(f"{'variant':8} {'s/step':>8} {'model MB':>9} {'peak RSS MB':>12}")
    for name, v in result["variants"].items():
        print(
            f"{name:8} {v['seconds_per_step']:8.3f} {v['model_memory_bytes'] / 1e6:9.1f} "
            f"{v['peak_rss_bytes'] / 1e6:12.1f}"
        )
    print(
        f"planner QLoRA estimate {estimated / 1e6:.1f} MB vs measured {measured / 1e6:.1f} MB "
        f"(error {result['planner']['error']:+.0%})"
    )


if __name__ == "__main__":
    main()
