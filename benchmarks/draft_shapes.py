"""Which draft shape to make from the target: c (the draft's cost per token over the target's) against α.

For each shape (a list of the target's layers, embeddings, final norm and head shared), on a finished pipeline
run: derive the draft from the tuned target, train it with the run's draft settings and `--method`, export both to
Q4_K_M and measure c and r(n) in time here (llama.cpp, interleaved), then the offline α on the run's acceptance
prompts and the speedup it predicts here and on a memory-bound GPU (c by parameters). The run's own draft of that
method is reused for the run's shape. Writes benchmarks/results/draft_shapes_<name>.json/.md.

Usage: python benchmarks/draft_shapes.py configs/smollm2-sgd.yaml --name smollm2_sgd --shapes 0,-1 0,1 0,-3,-2,-1
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from pipeline_run import RESULTS

from spectune.export.gguf import export_model
from spectune.models.derive import derive_draft
from spectune.pipeline import RunConfig, load_run_config
from spectune.runtime.profile import measure_profile
from spectune.speedup import GPU_PROFILE
from spectune.train.acceptance import HERE, AcceptanceConfig, run_acceptance
from spectune.train.draft import DraftConfig, train_draft


def trained_draft(config: RunConfig, layers: list[int], method: str, scratch: Path) -> tuple[Path, dict[str, Any]]:
    """(the trained draft folder, its training report): the run's own where the shape is the run's."""
    layout = config.layout
    if layers == config.models.draft_layers and (layout.draft_dir(method) / "draft.json").is_file():
        return layout.draft_dir(method) / "model", json.loads((layout.draft_dir(method) / "draft.json").read_text())
    base = derive_draft(layout.merged_target, layers, scratch / "base")
    result = train_draft(
        DraftConfig(
            target=layout.merged_target,
            draft=base,
            method=method,
            data=layout.train_file,
            eval_data=layout.eval_file,
            out=scratch / "trained",
            seed=config.data.seed,
            **config.drafts.for_method(method),
        )
    )
    return result.model, {"result": result.model_dump(mode="json")}


def measure_shape(config: RunConfig, layers: list[int], method: str, target_gguf: Path, scratch: Path) -> dict:
    draft, report = trained_draft(config, layers, method, scratch)
    draft_gguf = export_model(draft, scratch / "draft.Q4_K_M.gguf")
    profile = measure_profile(target_gguf, draft_gguf, threads=config.threads)
    (scratch / "profile.json").write_text(json.dumps(profile))
    acceptance = run_acceptance(
        AcceptanceConfig(
            target=config.layout.merged_target,
            drafts={"draft": draft},
            data=config.layout.eval_file,
            profile=scratch / "profile.json",
            **config.acceptance.model_dump(),
        )
    )
    row = acceptance["drafts"][0]
    gpu_k, here_k = row["best_k"][GPU_PROFILE], row["best_k"][HERE]
    costs = row["cost_ratio"]
    return {
        "layers": layers,
        "eval_loss_before": report["result"]["eval_loss_before"],
        "eval_loss_after": report["result"]["eval_loss_after"],
        "draft_bytes_q4_k_m": draft_gguf.stat().st_size,
        "cost_ratio_gpu": costs[GPU_PROFILE],
        "cost_ratio_here": costs[HERE],
        "verify_ratio_here": profile["verify_ratio"],
        "acceptance": row["alpha"],
        "tokens": row["tokens"],
        "best_k_gpu": gpu_k,
        "predicted_speedup_gpu": row["speedup"][GPU_PROFILE][str(gpu_k)],
        "best_k_here": here_k,
        "predicted_speedup_here": row["speedup"][HERE][str(here_k)],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| layers | eval loss before → after | c GPU (params) | c here (time) | α | GPU S (k) | here S (k) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layers']} | {r['eval_loss_before']:.2f} → {r['eval_loss_after']:.2f} | {r['cost_ratio_gpu']:.3f} "
            f"| {r['cost_ratio_here']:.3f} | {r['acceptance']:.1%} | {r['predicted_speedup_gpu']:.2f}x "
            f"({r['best_k_gpu']}) | {r['predicted_speedup_here']:.2f}x ({r['best_k_here']}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--name", required=True, help="suffix of the result files")
    parser.add_argument("--shapes", nargs="+", required=True, help="layer lists, e.g. 0,-1 0,1 0,-3,-2,-1")
    parser.add_argument("--method", default="sft", help="how every shape is trained (the run's settings)")
    args = parser.parse_args()
    config = load_run_config(args.config)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        target_gguf = export_model(config.layout.merged_target, Path(scratch) / "target.Q4_K_M.gguf")
        for shape in args.shapes:
            folder = Path(scratch) / shape
            folder.mkdir()
            rows.append(measure_shape(config, [int(i) for i in shape.split(",")], args.method, target_gguf, folder))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    result = {"target": str(config.layout.merged_target), "method": args.method, "shapes": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"draft_shapes_{args.name}.json").write_text(json.dumps(result, indent=2))
    (RESULTS / f"draft_shapes_{args.name}.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
