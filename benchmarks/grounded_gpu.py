"""The reference card's prediction (spectune.gpu, fitted on published figures) on every committed result, with its
band, beside the bytes-only one.

What a decode step reads and how many layers it runs are facts of a model's shapes and quant types, not of its
weights. Each committed pair's target shape (bytes a step reads, layers) is kept in gpu_grounded.json; `--export`
measures it again by exporting the target at Q4_K_M from weights of its shapes (the base model as fetched, or
spectune's own recipe at its initial weights). A draft model's bytes are its committed c (bytes) times the target's,
as the bench measured them on the tuned GGUFs; its layers are its recipe's, its config's (DRAFT_LAYERS) or the
target's layers it was cut from. The prediction is each result's own τ over r(d + 1) + d·c on the reference card, d
the tokens a step drafted on average (the results keep that mean, not the spread: r is interpolated there, which puts
the figure within a few percent of the per-step sum); with r = 1 this reproduces the committed bytes-only figure
exactly, which the table checks. The band: S at the worst (the highest c of the fit's leave-one-out refits, the
highest published r) and the best (the lowest of both).

Usage: python benchmarks/grounded_gpu.py [RESULT.json ...] [--export] [--threads N]   (default: every result)
Writes benchmarks/results/gpu_grounded.json and prints the table, then the time to the first sentence with a draft
over without, prompt cached (bench.summary.first_sentence_over_alone): timed, the model's figure from the result's
own speedup (its check) and its prediction on the card, for every result timed with the first token the target's own
step, `spectune bench` reports (BENCH_REPORTS) included.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from spectune.atomic import atomic_path
from spectune.bench.report import read_result
from spectune.bench.summary import BenchSummary, bench_summaries, first_sentence_over_alone
from spectune.export.gguf import export_model
from spectune.gpu.card import GpuCard, reference_card
from spectune.gpu.predict import on_card, on_card_of_steps
from spectune.models.demo_pair import RECIPES, build_tokenizer, llama_config
from spectune.models.imported import fetch
from spectune.models.tokenizer import save_tokenizer
from spectune.pipeline.config import DERIVED_LAYERS
from spectune.runtime.profile import gguf_weights
from spectune.runtime.registry import Variant
from spectune.speedup import Weights, steps_of, verify_ratio_between
from spectune.threads import configure_torch_threads

RESULTS = Path(__file__).parent / "results"
REPORT = RESULTS / "gpu_grounded.json"
# result file -> (target, separate draft model or None for a cut of the target's own layers); a name in RECIPES is
# spectune's own pair, any other a fetched model
PAIRS = {
    "speculative_demo.json": ("demo", "demo"),
    "speculative_smollm2_sgd_ngram.json": ("smollm2-135m-instruct", None),
    "speculative_qwen_sgd.json": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
    "speculative_gemma3_270m_sgd_ngram.json": ("gemma3-270m", None),
    "eagle3_smollm2_sgd.json": ("smollm2-135m-instruct", None),
    "eagle3_gemma3_270m_sgd.json": ("gemma3-270m", None),
    "llama_cpp_files_qwen_sgd_head_512.json": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
}
DRAFT_LAYERS = {"qwen2.5-coder-0.5b-instruct": 24}  # num_hidden_layers of the fetched draft's config
# `spectune bench` reports on the tuned Qwen 1.5B (the target of speculative_qwen_sgd.json): each draft model's layers
BENCH_REPORTS = {
    "speculative_qwen_sgd_domain.json": {"generic": 24, "seqkd": 24},
}
BENCH_TARGET = "speculative_qwen_sgd.json"
HEAD_LAYERS = 1  # an EAGLE-3 head is one decoder layer (train/eagle3.py)


def recipe_model(size: str, role: str, folder: Path) -> Path:
    """spectune's own pair member (`role`: target or draft) at its initial weights, with its tokenizer."""
    import torch
    from transformers import LlamaForCausalLM

    recipe = RECIPES[size]
    tokenizer = build_tokenizer(recipe)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(getattr(recipe, role), recipe, tokenizer))
    model.save_pretrained(folder)
    save_tokenizer(tokenizer, folder)
    return folder


def exported_target(name: str, scratch: Path) -> dict[str, float]:
    """The Q4_K_M target's shape, measured by exporting it (see the module docstring)."""
    folder = recipe_model(name, "target", scratch / name) if name in RECIPES else fetch(name)
    weights = gguf_weights(export_model(folder, scratch / f"{name}.gguf", "Q4_K_M"))
    return {"step_read": weights.step_read(), "layers": weights.layers}


def model_layers(result: dict[str, Any], pair_draft: str | None, name: str) -> int:
    """The layers a draft model's step runs: a head's one, a separate model's own, a cut's share of the target's."""
    if name == "eagle3":
        return HEAD_LAYERS
    if pair_draft is not None:
        return RECIPES[pair_draft].draft.layers if pair_draft in RECIPES else DRAFT_LAYERS[pair_draft]
    return len(result["pair"]["draft_layers"] or DERIVED_LAYERS)


def committed_steps(prompts: list[dict[str, Any]], name: str) -> tuple[list[int], int] | None:
    """The steps a committed bench made for a variant, from its per-prompt rows (None: not recorded)."""
    return steps_of([row["variants"][name] for row in prompts if name in row["variants"]])


def card_figures(
    card: GpuCard,
    target: Weights,
    tau: float,
    drafted: float,
    layers: int,
    model_c: float,
    share: float,
    steps: tuple[list[int], int] | None,
) -> dict[str, Any]:
    """The variant on the card, its draft model reading `model_c` of the target's bytes and running `layers` layers
    (0: lookup alone): from the steps the bench made where the result has them (the bench report's own computation,
    spectune.gpu.predict.on_card_of_steps), else from the mean drafted (on_card, as `spectune predict` does)."""
    draft = Weights(round(model_c * target.step_read()), 0, 1, False, layers) if layers else None
    if steps is None:
        figures = on_card(card, target, draft, share, tau, drafted)
    else:
        figures = on_card_of_steps(card, target, draft, share, tau, *steps)
    return {
        "grounded_c": figures["c"],
        "grounded_c_band": figures["c_band"],
        "verify_ratio": verify_ratio_between(card.verify_ratios(target), drafted + 1),
        "grounded": figures["speedup"],
        "grounded_band": figures["speedup_band"],
    }


def predictions(card: GpuCard, result: dict, target: Weights, pair_draft: str | None, name: str, row: dict) -> dict:
    """One committed draft row: its figures, the bytes-only prediction recomputed and the card's with its band."""
    if "mean_drafted_per_step" in row:  # a bench row of spectune's own loop
        summary = BenchSummary.model_validate(row)
        tau, drafted, bytes_c = summary.mean_accepted_len, summary.mean_drafted_per_step, summary.gpu_cost_ratio
        committed = summary.predicted_speedup_gpu
    else:  # an EAGLE-3 bench row: the offline meter's τ at k
        tau, drafted, bytes_c, committed = row["tau"], row["k"], row["cost_ratio_gpu_bytes"], row["predicted_gpu"]
    # The draft model's bytes and layers; an n-gram proposal costs nothing, so c scales with the model's share.
    # sft@Q6_K: the sft draft at one GGUF type of several (benchmarks/llama_cpp_files.py), its own row's bytes.
    variant = name.partition("@")[0]
    model = Variant.parse(variant).draft  # ngram+seqkd: the seqkd draft behind the lookup
    model_row = result["drafts"][name if model == variant else model] if model else {}
    model_c = model_row.get("gpu_cost_ratio", bytes_c) if model else 0.0
    share = bytes_c / model_c if model_c else 0.0
    layers = model_layers(result, pair_draft, model) if model else 0  # ngram+eagle3: the head's one layer
    return {
        "tau": tau,
        "mean_drafted": drafted,
        "bytes_c": bytes_c,
        "bytes_only": tau / (1 + drafted * bytes_c),
        "bytes_only_committed": committed,
        "draft_layers": layers,
        **card_figures(
            card, target, tau, drafted, layers, model_c, share, committed_steps(result.get("prompts", []), name)
        ),
    }


def first_sentence(row: dict[str, Any], grounded: float) -> dict[str, float] | None:
    """The first sentence over the target alone's, prompt cached: as timed, as the model puts it from the result's
    own speedup (bench.summary.first_sentence_over_alone) and as it predicts on the card; for the results timed with the
    first token the target's own step (they time a new caller too), None for the others."""
    if "cold_ttft_ms" not in row:
        return None
    summary = BenchSummary.model_validate(row)
    return {
        "timed": summary.ttfs_ms / summary.target_ttfs_ms,
        "model_here": first_sentence_over_alone(summary, summary.aggregate_speedup),
        "card": first_sentence_over_alone(summary, grounded),
    }


def bench_report_predictions(card: GpuCard, file: str, target: Weights) -> dict[str, dict[str, Any]]:
    """A `spectune bench` report's variants on the card, from their τ, mean drafted and bytes c (as the results of
    spectune's own loop above), and the first sentence."""
    report = read_result(RESULTS / file)
    summaries, out = bench_summaries(report["summary"], file), {}
    for name, s in summaries.items():
        model = Variant.parse(name).draft
        model_c = summaries[model].gpu_cost_ratio if model else 0.0
        share = s.gpu_cost_ratio / model_c if model_c else 0.0
        layers = BENCH_REPORTS[file][model] if model else 0
        steps = committed_steps(report["prompts"], name)
        figures = card_figures(
            card, target, s.mean_accepted_len, s.mean_drafted_per_step, layers, model_c, share, steps
        )
        out[name] = figures | {
            "grounded_committed": s.predicted_speedup_gpu_grounded,
            "first_sentence": first_sentence(report["summary"][name], figures["grounded"]),
        }
    return out


def grounded_report(files: list[str], export: bool) -> dict[str, Any]:
    """Every result on the card; `files`' target shapes measured again when `export`, the others kept."""
    card = reference_card()
    committed = json.loads(REPORT.read_text()) if REPORT.is_file() else {"results": {}}
    shapes = {file: entry["target"] for file, entry in committed["results"].items()}
    if export:
        with tempfile.TemporaryDirectory() as scratch:
            measured: dict[str, dict[str, float]] = {}
            for file in files:
                name = PAIRS[file][0]
                measured.setdefault(name, exported_target(name, Path(scratch)))
                shapes[file] = {"model": name, **measured[name]}
    by_model = {shape["model"]: shape for shape in shapes.values()}
    for file, (name, _) in PAIRS.items():  # a new result on a committed result's target: that target's shape
        if file not in shapes and name in by_model:
            shapes[file] = by_model[name]
    missing = sorted(set(PAIRS) - set(shapes))
    if missing:
        raise SystemExit(f"no committed target shape for {', '.join(missing)}: run with --export")
    report: dict[str, Any] = {
        "card": card.label,
        "layer_floor_us": card.model.layer_seconds * 1e6,
        "efficiency": card.model.efficiency,
        "step_error": card.error,
        "weight_read_by_batch": card.read_central,
        "results": {},
    }
    for file, (_, pair_draft) in PAIRS.items():
        result, shape = read_result(RESULTS / file), shapes[file]
        target = Weights(total=round(shape["step_read"]), embedding=0, rows=1, tied=False, layers=shape["layers"])
        drafts = {
            name: predictions(card, result, target, pair_draft, name, row) for name, row in result["drafts"].items()
        }
        for name, figures in drafts.items():
            figures["first_sentence"] = first_sentence(result["drafts"][name], figures["grounded"])
        report["results"][file] = {"target": shape, "drafts": drafts}
    qwen = shapes[BENCH_TARGET]
    target = Weights(total=round(qwen["step_read"]), embedding=0, rows=1, tied=False, layers=qwen["layers"])
    report["bench_reports"] = {file: bench_report_predictions(card, file, target) for file in BENCH_REPORTS}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "files", nargs="*", help=f"results whose target to export again (with --export), of {', '.join(PAIRS)}"
    )
    parser.add_argument("--export", action="store_true", help="measure the target shapes by exporting them")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    unknown = sorted(set(args.files) - set(PAIRS))
    if unknown:
        parser.error(f"no pair known for {', '.join(unknown)} (PAIRS in this script)")
    configure_torch_threads(args.threads)
    report = grounded_report(args.files or list(PAIRS), args.export)
    with atomic_path(REPORT) as tmp:
        tmp.write_text(json.dumps(report, indent=2) + "\n")
    print(f"All figures on the card are {report['card']}.")
    print("| result | draft | τ | d | bytes only (committed) | c bytes / card (band) | r(d+1) | card (band) |")
    print("|---|---|---|---|---|---|---|---|")
    for file, entry in report["results"].items():
        for name, p in entry["drafts"].items():
            low_c, high_c = p["grounded_c_band"]
            print(
                f"| {file} | {name} | {p['tau']:.2f} | {p['mean_drafted']:.2f} | {p['bytes_only']:.2f}x "
                f"({p['bytes_only_committed']:.2f}x) | {p['bytes_c']:.3f} / {p['grounded_c']:.3f} "
                f"({low_c:.3f}-{high_c:.3f}) | {p['verify_ratio']:.2f} | {p['grounded']:.2f}x "
                f"({p['grounded_band'][0]:.2f}-{p['grounded_band'][1]:.2f}x) |"
            )
    print_first_sentences(report)


def print_first_sentences(report: dict[str, Any]) -> None:
    """The first sentence over the target alone's, prompt cached, for every result that timed it."""
    print("\n| result | variant | first sentence here: timed / model | on the card | first sentence on the card |")
    print("|---|---|---|---|---|")
    entries = {file: entry["drafts"] for file, entry in report["results"].items()} | report["bench_reports"]
    for file, variants in entries.items():
        for name, p in variants.items():
            if (first := p["first_sentence"]) is not None:
                print(
                    f"| {file} | {name} | {first['timed']:.2f}x / {first['model_here']:.2f}x "
                    f"| {p['grounded']:.2f}x | {first['card']:.2f}x |"
                )


if __name__ == "__main__":
    main()
