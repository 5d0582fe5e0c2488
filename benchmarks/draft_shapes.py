"""Which draft shape to make: c (the draft's cost per token over the target's) against α.

For each shape (a list of layers, embeddings, final norm and head shared), on a pipeline run whose target is tuned:
cut the draft from the tuned target (default) or from another model (`--cut-from`, e.g. the run's sibling draft:
its first layers), train it with the run's draft settings (`--set` overrides them) and `--method`, export both to
Q4_K_M and measure c and r(n) in time here (llama.cpp, interleaved), then the offline α on the run's acceptance
prompts and the speedup it predicts here, on a memory-bound GPU (c by what a step reads) and on the reference card
(spectune.gpu). The run's own draft of that method is reused for the run's shape. `--keep` keeps the GGUFs (for
`spectune bench`) and each trained shape's folder (for benchmarks/draft_types.py: the shape at other types).
Writes benchmarks/results/draft_shapes_<name>.json/.md.

Usage: python benchmarks/draft_shapes.py configs/smollm2-sgd.yaml --name smollm2_sgd --shapes 0,-1 0,1 0,-3,-2,-1
       python benchmarks/draft_shapes.py configs/qwen-sgd.yaml --name qwen_sgd_cuts --method seqkd \
           --cut-from qwen2.5-coder-0.5b-instruct --shapes 0,1,2,3 0,1,2,3,4,5,6,7 --set lr=0.0003 max_steps=60 \
           --keep runs/qwen-sgd/cuts
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline_run import RESULTS

from spectune.acceptance.stage import HERE, AcceptanceConfig, run_acceptance
from spectune.atomic import atomic_path
from spectune.config import validate
from spectune.export.gguf import export_model
from spectune.gpu.card import GROUNDED_PROFILE
from spectune.models.derive import derive_draft
from spectune.models.resolve import model_folder
from spectune.pipeline.config import DERIVED_LAYERS, RunConfig, load_run_config
from spectune.runtime.profile import measure_profile
from spectune.speedup import GPU_PROFILE
from spectune.train.draft import TARGET_ANSWERS, DraftConfig, DraftSettings, train_draft


@dataclass
class Shapes:
    """How every shape is made and trained."""

    config: RunConfig
    cut_from: Path | None  # None: the tuned target
    method: str
    settings: DraftSettings  # the run's draft settings for `method`, `--set` applied


def trained_draft(shapes: Shapes, layers: list[int], scratch: Path) -> tuple[Path, dict[str, Any]]:
    """(the trained draft folder, its training report): the run's own where the shape is the run's."""
    config, layout, method = shapes.config, shapes.config.layout, shapes.method
    runs_shape = config.models.draft == "target-layers" and layers == (config.models.draft_layers or DERIVED_LAYERS)
    own = layout.draft_dir(method) / "draft.json"
    runs_settings = shapes.settings == DraftSettings.model_validate(config.draft_settings(method))
    if shapes.cut_from is None and runs_shape and runs_settings and own.is_file():
        return layout.draft_dir(method) / "model", json.loads(own.read_text())
    base = derive_draft(shapes.cut_from or layout.merged_target, layers, scratch / "base")
    result = train_draft(
        DraftConfig(
            target=layout.merged_target,
            draft=base,
            method=method,
            data=layout.train_file,
            eval_data=layout.eval_file,
            out=scratch / "trained",
            seed=config.data.seed,
            **shapes.settings.model_dump(),
        )
    )
    return result.model, {"result": result.model_dump(mode="json")}


def measure_shape(shapes: Shapes, layers: list[int], target_gguf: Path, scratch: Path) -> dict:
    config = shapes.config
    draft, report = trained_draft(shapes, layers, scratch)
    draft_gguf = export_model(draft, scratch / "draft.Q4_K_M.gguf")
    profile = measure_profile(target_gguf, draft_gguf, threads=config.threads)
    (scratch / "profile.json").write_text(json.dumps(profile))
    acceptance = run_acceptance(
        AcceptanceConfig(
            target=config.layout.merged_target,
            drafts={"draft": draft},
            data=config.layout.eval_file,
            profile=scratch / "profile.json",
            ggufs={"target": target_gguf, "draft": draft_gguf},
            **config.acceptance.model_dump(),
        )
    )
    row = acceptance["drafts"][0]
    gpu_k, here_k, card_k = (row["best_k"][key] for key in (GPU_PROFILE, HERE, GROUNDED_PROFILE))
    costs = row["cost_ratio"]
    return {
        "layers": layers,
        "eval_loss_before": report["result"]["eval_loss_before"],
        "eval_loss_after": report["result"]["eval_loss_after"],
        "draft_bytes_q4_k_m": draft_gguf.stat().st_size,
        "cost_ratio_gpu": costs[GPU_PROFILE],
        "cost_ratio_card": costs[GROUNDED_PROFILE],
        "cost_ratio_here": costs[HERE],
        "verify_ratio_here": profile["verify_ratio"],
        "acceptance": row["alpha"],
        "alpha_by_position": row["alpha_by_position"],
        "tokens": row["tokens"],
        "best_k_gpu": gpu_k,
        "predicted_speedup_gpu": row["speedup"][GPU_PROFILE][str(gpu_k)],
        "best_k_card": card_k,
        "predicted_speedup_card": row["speedup"][GROUNDED_PROFILE][str(card_k)],
        "best_k_here": here_k,
        "predicted_speedup_here": row["speedup"][HERE][str(here_k)],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| layers | eval loss before → after | c: GPU bytes / card / here | α | GPU S (k) | card S (k) | here S (k) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        costs = f"{r['cost_ratio_gpu']:.3f} / {r['cost_ratio_card']:.3f} / {r['cost_ratio_here']:.3f}"
        lines.append(
            f"| {r['layers']} | {r['eval_loss_before']:.2f} → {r['eval_loss_after']:.2f} | {costs} "
            f"| {r['acceptance']:.1%} | {r['predicted_speedup_gpu']:.2f}x ({r['best_k_gpu']}) "
            f"| {r['predicted_speedup_card']:.2f}x ({r['best_k_card']}) "
            f"| {r['predicted_speedup_here']:.2f}x ({r['best_k_here']}) |"
        )
    return "\n".join(lines)


def keep(folder: Path, files: dict[Path, str]) -> None:
    """Each file copied into `folder` under its new name, whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    for source, name in files.items():
        with atomic_path(folder / name) as tmp:
            shutil.copyfile(source, tmp)


def keep_folder(source: Path, destination: Path) -> None:
    """A trained shape's HF folder (benchmarks/draft_types.py measures it at other types), whole or not at all."""
    if not source.is_dir():  # the run's own draft, reused: it stays in the run
        return
    with atomic_path(destination) as tmp:
        shutil.copytree(source, tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--name", required=True, help="suffix of the result files")
    parser.add_argument("--shapes", nargs="+", required=True, help="layer lists, e.g. 0,-1 0,1 0,-3,-2,-1")
    parser.add_argument("--method", default="sft", help="how every shape is trained (the run's settings)")
    parser.add_argument(
        "--cut-from", help="cut the shapes from this model (a real model's name or a folder), not from the tuned target"
    )
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="draft settings over the run's")
    parser.add_argument(
        "--keep",
        type=Path,
        help="keep the target's and each shape's Q4_K_M GGUF and trained folder here (to bench them after)",
    )
    args = parser.parse_args()
    config = load_run_config(args.config)
    overrides = dict(item.split("=", 1) for item in args.set)
    settings = validate(DraftSettings, {**config.draft_settings(args.method), **overrides}, "--set")
    cut_from = model_folder(args.cut_from) if args.cut_from else None
    shapes = Shapes(config, cut_from, args.method, settings)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        target_gguf = export_model(config.layout.merged_target, Path(scratch) / "target.Q4_K_M.gguf")
        for shape in args.shapes:
            folder = Path(scratch) / shape
            folder.mkdir()
            rows.append(measure_shape(shapes, [int(i) for i in shape.split(",")], target_gguf, folder))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            if args.keep:  # with seqkd, the target's answers too (an n-gram domain table)
                kept = {target_gguf: "target.Q4_K_M.gguf", folder / "draft.Q4_K_M.gguf": f"{shape}.Q4_K_M.gguf"}
                answers = folder / "trained" / TARGET_ANSWERS
                keep(args.keep, kept | ({answers: TARGET_ANSWERS} if answers.is_file() else {}))
                keep_folder(folder / "trained" / "model", args.keep / shape)
    result = {
        "target": str(config.layout.merged_target),
        "cut_from": args.cut_from or str(config.layout.merged_target),  # as given: a name, not this machine's path
        "method": args.method,
        "settings": settings.model_dump(mode="json"),
        "shapes": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"draft_shapes_{args.name}.json").write_text(json.dumps(result, indent=2))
    (RESULTS / f"draft_shapes_{args.name}.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
