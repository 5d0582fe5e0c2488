"""The grounded GPU prediction (spectune.gpu_card) applied to every committed result, beside the bytes-only one.

What a decode step reads and how many layers it runs are facts of a model's shapes and quant types, not of its
weights. So each committed pair's target is exported at Q4_K_M from weights of its shapes (the base model as fetched,
or spectune's own recipe at its initial weights) and each draft model likewise; a draft's bytes are its committed c
(bytes) times the target's, as the bench measured them on the tuned GGUFs. The prediction is then each result's own
τ over r(d + 1) + d·c on the reference card, d the tokens a step drafted on average (the results keep that mean, not
the spread: r is interpolated there, which puts the grounded figure within a few percent of the per-step sum); with
r = 1 this reproduces the committed bytes-only figure exactly, which the table checks.

Usage: python benchmarks/grounded_gpu.py [RESULT.json ...] [--threads N]   (default: every result; fetches the real
       models into the user cache once)
Writes benchmarks/results/gpu_grounded.json and prints the table, then the time to the first sentence with a draft over
without, prompt cached (bench.run.first_sentence_over_alone): timed, the model's figure from the result's own speedup
(its check) and its prediction on the card, for every result timed with the first token the target's own step,
`spectune bench` reports (BENCH_REPORTS, whose grounded figures are their own) included.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from spectune.atomic import atomic_path
from spectune.bench.run import first_sentence_over_alone
from spectune.export.gguf import export_model
from spectune.gpu_card import REFERENCE_CARD
from spectune.models.imported import fetch
from spectune.models.tokenizer import save_tokenizer
from spectune.models.world import RECIPES, build_tokenizer, llama_config
from spectune.pipeline import DERIVED_LAYERS
from spectune.runtime.ngram import NGRAM
from spectune.runtime.profile import gguf_weights
from spectune.speedup import Weights
from spectune.threads import configure_torch_threads

RESULTS = Path(__file__).parent / "results"
# result file -> (target, separate draft model or None for a cut of the target's own layers); a name in RECIPES is
# spectune's own pair, any other a fetched model
PAIRS = {
    "speculative_demo.json": ("demo", "demo"),
    "speculative_medium.json": ("medium", "medium"),
    "speculative_smollm2_sgd.json": ("smollm2-135m-instruct", None),
    "speculative_smollm2_sgd_ngram.json": ("smollm2-135m-instruct", None),
    "speculative_gemma3_270m_sgd_tuned.json": ("gemma3-270m", None),
    "speculative_qwen_sgd.json": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
    "speculative_gemma3_270m_sgd_ngram.json": ("gemma3-270m", None),
    "eagle3_smollm2_sgd.json": ("smollm2-135m-instruct", None),
}
# `spectune bench` reports: they carry their own grounded figures; the first sentence is added from them
BENCH_REPORTS = (
    "speculative_qwen_sgd_lookup.json",
    "speculative_qwen_sgd_cuts.json",
    "speculative_qwen_sgd_domain.json",
    "speculative_qwen_sgd_ngram_mod.json",
)
GROUNDED = "predicted_speedup_gpu_grounded"
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


def model_weights(name: str, role: str, scratch: Path) -> Weights:
    """The Q4_K_M GGUF weights of a pair member (see the module docstring)."""
    folder = recipe_model(name, role, scratch / f"{name}-{role}") if name in RECIPES else fetch(name)
    return gguf_weights(export_model(folder, scratch / f"{name}-{role}.gguf", "Q4_K_M"))


def draft_layers(result: dict[str, Any], draft: Weights | None, name: str) -> int:
    if name == "eagle3":
        return HEAD_LAYERS
    return draft.layers if draft is not None else len(result["pair"]["draft_layers"] or DERIVED_LAYERS)


def interpolated_ratio(verify: dict[str, float], tokens: float) -> float:
    """r at a fractional batch size, linear between the card's integer ones (r(1) = 1)."""
    ratios = {1: 1.0} | {int(n): r for n, r in verify.items()}
    low = min(max(int(tokens), 1), max(ratios) - 1)
    return ratios[low] + (ratios[low + 1] - ratios[low]) * (tokens - low)


def predictions(result: dict[str, Any], target: Weights, draft: Weights | None, name: str, row: dict) -> dict:
    """One committed draft row: its figures, the bytes-only prediction recomputed and the grounded one."""
    if "mean_drafted_per_step" in row:  # a bench row of spectune's own loop
        tau, drafted, bytes_c = row["mean_accepted_len"], row["mean_drafted_per_step"], row["gpu_cost_ratio"]
        committed = row["predicted_speedup_gpu"]
    else:  # an EAGLE-3 bench row: the offline meter's τ at k
        tau, drafted, bytes_c, committed = row["tau"], row["k"], row["cost_ratio_gpu_bytes"], row["predicted_gpu"]
    # The draft model's bytes and layers; an n-gram proposal costs nothing, so c scales with the model's share
    model = name.split("+")[-1]  # ngram+seqkd: the seqkd draft behind the lookup
    model_c = 0.0 if model == NGRAM else result["drafts"][model].get("gpu_cost_ratio", bytes_c)
    share = bytes_c / model_c if model_c else 0.0
    draft_model = Weights(
        total=round(model_c * target.step_read()),
        embedding=0,
        rows=1,
        tied=False,
        layers=draft_layers(result, draft, name),
    )
    grounded_c = REFERENCE_CARD.cost_ratio(draft_model, target) * share
    verify = interpolated_ratio(REFERENCE_CARD.verify_ratios(target), drafted + 1)
    return {
        "tau": tau,
        "mean_drafted": drafted,
        "bytes_c": bytes_c,
        "bytes_only": tau / (1 + drafted * bytes_c),
        "bytes_only_committed": committed,
        "grounded_c": grounded_c,
        "verify_ratio": verify,
        "grounded": tau / (verify + drafted * grounded_c),
    }


def first_sentence(row: dict[str, Any], grounded: float) -> dict[str, float] | None:
    """The first sentence over the target alone's, prompt cached: as timed, as the model puts it from the result's
    own speedup (bench.run.first_sentence_over_alone) and as it predicts on the card; for the results timed with the
    first token the target's own step (they time a new caller too), None for the others."""
    if "cold_ttft_ms" not in row:
        return None
    return {
        "timed": row["ttfs_ms"] / row["target_ttfs_ms"],
        "model_here": first_sentence_over_alone(row, row["aggregate_speedup"]),
        "card": first_sentence_over_alone(row, grounded),
    }


def bench_report_predictions(file: str) -> dict[str, dict[str, Any]]:
    """A `spectune bench` report's own grounded figures (it computes them as it runs) and the first sentence."""
    summary = json.loads((RESULTS / file).read_text())["summary"]
    return {
        name: {"grounded": s[GROUNDED], "first_sentence": first_sentence(s, s[GROUNDED])} for name, s in summary.items()
    }


def grounded_report(files: list[str]) -> dict[str, Any]:
    """The report with `files` (re)computed; the other results' entries kept from the committed report."""
    committed = RESULTS / "gpu_grounded.json"
    report: dict[str, Any] = {
        "card": REFERENCE_CARD.name,
        "layer_floor_us": REFERENCE_CARD.layer_seconds * 1e6,
        "weight_read_by_batch": REFERENCE_CARD.read_by_batch,
        "results": json.loads(committed.read_text())["results"] if committed.is_file() else {},
    }
    exported: dict[tuple[str, str], Weights] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for file in files:
            target_name, draft_name = PAIRS[file]
            result = json.loads((RESULTS / file).read_text())
            for key in [("target", target_name)] + ([("draft", draft_name)] if draft_name else []):
                if key not in exported:
                    exported[key] = model_weights(key[1], key[0], Path(scratch))
            target, draft = exported[("target", target_name)], exported.get(("draft", draft_name or ""))
            report["results"][file] = {
                "target": {"model": target_name, "step_read": target.step_read(), "layers": target.layers},
                "drafts": {
                    name: predictions(result, target, draft, name, row) for name, row in result["drafts"].items()
                },
            }
    for file, entry in report["results"].items():  # every result's, kept or recomputed: no export needed
        rows = json.loads((RESULTS / file).read_text())["drafts"]
        for name, figures in entry["drafts"].items():
            figures["first_sentence"] = first_sentence(rows[name], figures["grounded"])
    report["bench_reports"] = {file: bench_report_predictions(file) for file in BENCH_REPORTS}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", help=f"results to (re)compute, of {', '.join(PAIRS)} (default: all)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    unknown = sorted(set(args.files) - set(PAIRS))
    if unknown:
        parser.error(f"no pair known for {', '.join(unknown)} (PAIRS in this script)")
    configure_torch_threads(args.threads)
    report = grounded_report(args.files or list(PAIRS))
    with atomic_path(RESULTS / "gpu_grounded.json") as tmp:
        tmp.write_text(json.dumps(report, indent=2) + "\n")
    card = REFERENCE_CARD.name
    print(f"| result | draft | τ | d | bytes only (committed) | c bytes / on the {card} | r(d+1) | grounded |")
    print("|---|---|---|---|---|---|---|---|")
    for file, entry in report["results"].items():
        for name, p in entry["drafts"].items():
            print(
                f"| {file} | {name} | {p['tau']:.2f} | {p['mean_drafted']:.2f} | {p['bytes_only']:.2f}x "
                f"({p['bytes_only_committed']:.2f}x) | {p['bytes_c']:.3f} / {p['grounded_c']:.3f} "
                f"| {p['verify_ratio']:.2f} | {p['grounded']:.2f}x |"
            )
    print_first_sentences(report)


def print_first_sentences(report: dict[str, Any]) -> None:
    """The first sentence over the target alone's, prompt cached, for every result that timed it."""
    print(f"\n| result | variant | first sentence here: timed / model | grounded | on the {REFERENCE_CARD.name} |")
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
