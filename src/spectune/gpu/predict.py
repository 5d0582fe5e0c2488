"""`spectune predict`: how fast a pair will decode on a card, before or after training it, with no model loaded.

A pair's members are given as GGUFs, HF model folders, LAYERS:BYTES, or shapes named in published.yaml; acceptance
comes from a run's acceptance report (α at every draft position), a `spectune bench` report (τ and the tokens each
step drafted, as measured), or by hand (`--alpha NAME=0.8` or `NAME=0.9,0.8,0.7` by position, the last repeated).
A run folder (`--run`, or a report inside one) gives its exported GGUFs as the members and its report as acceptance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field

from spectune.config import Settings
from spectune.errors import SpectuneError
from spectune.gpu.card import Band, GpuCard, card_named, custom_card, reference_card
from spectune.gpu.published import published
from spectune.layout import TARGET, RunLayout
from spectune.runtime.profile import gguf_weights
from spectune.runtime.registry import Variant
from spectune.speedup import (
    MAX_DRAFT_LEN,
    Q4_K_M_BITS,
    Weights,
    speedup_of_steps,
    steps_of,
    verify_ratio_at,
    verify_ratio_between,
)

STORY_GOALS = (1.7, 2.2)  # the reference story's mean and best speedups


class PredictConfig(Settings):
    """Everything `spectune predict` takes."""

    card: str | None = Field(None, description="A card of the published table (default: the reference story's).")
    bandwidth: float | None = Field(None, description="A card not in the table: its memory bandwidth in GB/s.")
    floor_us: float | None = Field(None, description="With --bandwidth: its per-layer floor in µs (default: fitted).")
    target: str | None = Field(None, description="The target: a GGUF, a model folder, LAYERS:BYTES or a shape name.")
    drafts: dict[str, str] = Field(default_factory=dict, description="Drafts by name, each given as the target is.")
    alpha: dict[str, str] = Field(default_factory=dict, description="Acceptance by hand: NAME=a1,a2,... by position.")
    report: Path | None = Field(None, description="An acceptance report (acceptance.json) or a bench report.")
    run: Path | None = Field(
        None, description="A `spectune run` folder: its GGUFs are the pair, its bench (else acceptance) report the α."
    )
    story: bool = Field(False, description="The reference story's check and what each draft shape must reach.")


def shape_weights(spec: str) -> Weights:
    """A pair member from how it was given (see the module docstring)."""
    shapes = published().shapes
    if spec in shapes:
        return shapes[spec].weights()
    path = Path(spec)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise SpectuneError(f"{spec}: no such GGUF")
        return gguf_weights(path)
    if path.is_dir():
        return _folder_weights(path)
    layers, sep, size = spec.partition(":")
    try:
        weights = Weights(total=round(float(size)), embedding=0, rows=1, tied=False, layers=int(layers))
    except (ValueError, OverflowError):  # not numbers, or an infinite size
        weights = None
    if not sep or weights is None or weights.layers < 1 or weights.total <= 0:
        raise SpectuneError(
            f"{spec!r}: not a GGUF, a model folder, LAYERS:BYTES (e.g. 48:7.3e9) or a shape of {', '.join(shapes)}"
        )
    return weights


def _folder_weights(folder: Path) -> Weights:
    """An HF folder at Q4_K_M: its 16-bit safetensors' parameters at the type's mean width, its layers from config."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise SpectuneError(f"{folder}: no config.json (not a model folder)")
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    if "num_hidden_layers" not in config:
        raise SpectuneError(f"{config_file}: no num_hidden_layers")
    params = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2
    if not params:
        raise SpectuneError(f"{folder}: no .safetensors weights")
    return Weights(round(params * Q4_K_M_BITS / 8), 0, 1, False, int(config["num_hidden_layers"]))


def expected_tokens_by_position(alphas: list[float], k: int) -> float:
    """τ(k) with acceptance α_i at position i (given the ones before it accepted); the last α repeats past the list."""
    tau, reach = 1.0, 1.0
    for position in range(k):
        reach *= alphas[min(position, len(alphas) - 1)]
        tau += reach
    return tau


def _alphas(text: str, name: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0.0 <= a <= 1.0 for a in values):
        raise SpectuneError(f"--alpha {name}={text}: expected probabilities in [0, 1], comma-separated by position")
    return values


def report_acceptance(path: Path) -> dict[str, dict[str, Any]]:
    """Per draft: {"alphas": [...]} from an acceptance report, or {"tau", "drafted", "bytes_c"} from a bench report."""
    try:
        loaded = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SpectuneError(f"{path}: not a readable JSON report ({error})") from error
    try:
        return _acceptance_of(loaded)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise SpectuneError(f"{path}: not a report spectune wrote ({type(error).__name__}: {error})") from error


def _acceptance_of(loaded: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(loaded, dict):
        raise ValueError("the top level is not an object")
    if isinstance(loaded.get("drafts"), list):  # acceptance.json
        rows = [row for row in loaded["drafts"] if row.get("alpha_by_position")]
        if not rows:
            raise ValueError("an acceptance report with no draft's alpha_by_position")
        return {
            row["name"]: {
                "alphas": [row["alpha_by_position"][key] for key in sorted(row["alpha_by_position"], key=int)]
            }
            for row in rows
        }
    if isinstance(loaded.get("summary"), dict):  # a bench report, and the steps it made where it has its rows
        rows = loaded.get("prompts", [])
        return {
            name: {
                "tau": s["mean_accepted_len"],
                "drafted": s["mean_drafted_per_step"],
                "bytes_c": s["gpu_cost_ratio"],
                "steps": steps_of([row["variants"][name] for row in rows if name in row["variants"]]),
            }
            for name, s in loaded["summary"].items()
        }
    raise ValueError("neither an acceptance report (drafts) nor a bench report (summary)")


def run_of_report(report: Path) -> Path | None:
    """The run folder a report lies in (acceptance.json at its top, a bench report in bench/), if it does."""
    for folder in (report.parent, report.parent.parent):
        if (folder / "manifest.json").is_file() and RunLayout(folder).gguf_dir.is_dir():
            return folder
    return None


def run_members(run: Path) -> tuple[Path, dict[str, Path]]:
    """A run's exported target and drafts (gguf/NAME.TYPE.gguf at the target's type): no shape to give by hand."""
    layout = RunLayout(run)
    targets = sorted(layout.gguf_dir.glob(f"{TARGET}.*.gguf"))
    if len(targets) != 1:
        found = "none" if not targets else ", ".join(path.name for path in targets)
        raise SpectuneError(f"{layout.gguf_dir}: expected one exported target GGUF, found {found} (has it exported?)")
    quant = targets[0].name.removeprefix(f"{TARGET}.").removesuffix(".gguf")
    drafts = {path.name.split(".")[0]: path for path in layout.gguf_dir.glob(f"*.{quant}.gguf") if path != targets[0]}
    return targets[0], drafts


def run_report(run: Path) -> Path:
    """A run's bench report (τ as measured in llama.cpp), else its acceptance report (α offline)."""
    layout = RunLayout(run)
    for report in (layout.bench_dir / "report.json", layout.acceptance):
        if report.is_file():
            return report
    raise SpectuneError(f"{run}: neither bench/report.json nor acceptance.json (has the run measured its drafts?)")


def with_run(config: PredictConfig) -> PredictConfig:
    """The config with what a run folder gives filled in where the flags say nothing: its report, target, drafts."""
    run = config.run or (run_of_report(config.report) if config.report else None)
    if run is None:
        return config
    if not run.is_dir():
        raise SpectuneError(f"--run {run}: no such folder")
    target, drafts = run_members(run)
    return config.model_copy(
        update={
            "report": config.report or run_report(run),
            "target": config.target or str(target),
            "drafts": {name: str(path) for name, path in drafts.items()} | config.drafts,
        }
    )


def best_k(
    card: GpuCard, alphas: list[float], cost: float, target: Weights, ratios: dict[str, float] | None = None
) -> tuple[int, float, float]:
    """(k, τ(k), S(k)) at the k with the best speedup on the card, k = 1 .. MAX_DRAFT_LEN (r: the card's central
    r(n) unless `ratios` are given)."""
    ratios = ratios or card.verify_ratios(target)
    options = []
    for k in range(1, MAX_DRAFT_LEN + 1):
        tau = expected_tokens_by_position(alphas, k)
        options.append((tau / (verify_ratio_at(ratios, k + 1) + k * cost), k, tau))
    speedup, k, tau = max(options)
    return k, tau, speedup


def _bench_draft(name: str, bytes_c: float, target: Weights, drafts: dict[str, Weights]) -> tuple[Weights, float]:
    """A bench variant's draft model and the share of its proposals the model made (lookup in front costs nothing):
    its bytes c over the model's own (a variant `ngram+seqkd` runs the draft given as `seqkd`)."""
    model = Variant.parse(name).draft or ""
    if model not in drafts:
        raise SpectuneError(f"{name}: give the draft model's shape, --drafts {model}=SPEC (its c needs its layers)")
    draft = drafts[model]
    return draft, bytes_c / (draft.step_read() / target.step_read())


def draft_cost(card: GpuCard, target: Weights, draft: Weights | None, share: float) -> tuple[float, Band]:
    """c on the card, with its band, of a draft model that made `share` of the proposals (None: lookup alone, which
    costs nothing)."""
    if draft is None:
        return 0.0, (0.0, 0.0)
    low, high = card.cost_ratio_band(draft, target)
    return card.cost_ratio(draft, target) * share, (low * share, high * share)


def on_card(card: GpuCard, target: Weights, draft: Weights | None, share: float, tau: float, drafted: float) -> dict:
    """A variant known by its τ and the tokens a step drafts on average (the offline meter's, α by hand) on the card:
    c with its band, and S = τ / (r(d+1) + d·c) with its band, r interpolated at the mean."""
    cost, cost_band = draft_cost(card, target, draft, share)
    speedup = tau / (verify_ratio_between(card.verify_ratios(target), drafted + 1) + drafted * cost)
    band = card.speedup_band(tau, drafted, cost_band, target)
    return {"c": cost, "c_band": cost_band, "k": round(drafted), "tau": tau, "speedup": speedup, "speedup_band": band}


def on_card_of_steps(
    card: GpuCard, target: Weights, draft: Weights | None, share: float, tau: float, drafted_at: list[int], steps: int
) -> dict:
    """A variant as a bench measured it, step by step, on the card: S = τ / mean over the steps of (r(d+1) + d·c),
    each step at the d it drafted (speedup.speedup_of_steps), with its band. The bench's report, grounded_gpu.py and
    the README read this one computation."""
    cost, cost_band = draft_cost(card, target, draft, share)

    def speedup(c: float, r: dict[str, float]) -> float:
        return speedup_of_steps(tau, drafted_at, steps, c, r)

    central = speedup(cost, card.verify_ratios(target))
    return {
        "c": cost,
        "c_band": cost_band,
        "tau": tau,
        "speedup": central,
        "speedup_band": card.band_of(speedup, cost_band, target),
    }


def draft_row(
    card: GpuCard, target: Weights, name: str, drafts: dict[str, Weights], acceptance: dict[str, Any]
) -> dict[str, Any]:
    """One draft's prediction: c with its band, the k it would run, τ, and S with its band."""
    alone, _ = card.tokens_per_s(target)
    if acceptance.get("bytes_c") == 0.0:  # lookup alone: no model runs
        draft, share = None, 0.0
    elif name in drafts:
        draft, share = drafts[name], 1.0
    elif "bytes_c" in acceptance:
        draft, share = _bench_draft(name, acceptance["bytes_c"], target, drafts)
    else:
        raise SpectuneError(f"{name}: give the draft's shape, --drafts {name}=SPEC, or the run folder, --run RUN")
    if "alphas" in acceptance:  # α by position: the k that pays best on the card
        cost = card.cost_ratio(draft, target) * share if draft else 0.0
        k, tau, _ = best_k(card, acceptance["alphas"], cost, target)
        row = on_card(card, target, draft, share, tau, float(k))
    elif acceptance.get("steps"):  # the bench's own steps: the figure its report gives
        row = on_card_of_steps(card, target, draft, share, acceptance["tau"], *acceptance["steps"])
        row |= {"k": round(acceptance["drafted"])}
    else:
        row = on_card(card, target, draft, share, acceptance["tau"], acceptance["drafted"])
    return row | {"tokens_per_s": alone * row["speedup"]}


def alpha_needed(card: GpuCard, cost: float, target: Weights, goal: float, ratios: dict[str, float]) -> float | None:
    """The least α (the same at every position) whose best k reaches `goal` on the card; None if α = 1 cannot."""
    if best_k(card, [1.0], cost, target, ratios)[2] < goal:
        return None
    low, high = 0.0, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (low, middle) if best_k(card, [middle], cost, target, ratios)[2] >= goal else (middle, high)
    return high


def story_check(card: GpuCard) -> dict[str, Any]:
    """The reference story on its card: Gemma 4 12B alone against its published 34 tokens/s, then what each draft
    shape must guess (the same α at every position, at its best k) for the story's 1.7x and 2.2x: its MTP assistant
    first, then draft shapes of the size classes a user would otherwise train (Gemma 3's, their c on this target)."""
    table = published()
    shape = table.shapes["gemma-4-12b"]
    target = shape.weights()
    speed, band = card.tokens_per_s(target)
    rows = {}
    for name in ("gemma-4-12b-assistant", "gemma-3-1b", "gemma-3-270m", "eagle3-head-12b"):
        draft = table.shapes[name].weights()
        cost, (low_c, high_c) = card.cost_ratio(draft, target), card.cost_ratio_band(draft, target)
        low_r, high_r = card.verify_band(target)
        rows[name] = {"c": cost, "c_band": (low_c, high_c)} | {
            f"alpha_for_{goal}x": (
                alpha_needed(card, cost, target, goal, card.verify_ratios(target)),
                alpha_needed(card, low_c, target, goal, low_r),  # the band's easy end: low c, low r
                alpha_needed(card, high_c, target, goal, high_r),
            )
            for goal in STORY_GOALS
        }
    return {
        "card": card.name,
        "target": f"{shape.model} {shape.quant}",
        "target_tokens_per_s": speed,
        "target_band": band,
        "published_tokens_per_s": table.story_tokens_per_s,
        "drafts": rows,
    }


def predict(config: PredictConfig) -> dict[str, Any]:
    """The stage's entry: the card, then the story check or the pair's predictions."""
    if config.bandwidth is not None:
        card = custom_card(config.bandwidth, config.floor_us)
    elif config.floor_us is not None:
        raise SpectuneError("--floor-us goes with --bandwidth (a card not in the table)")
    else:
        card = card_named(config.card) if config.card else reference_card()
    if config.story:
        return {"label": card.label, "story": story_check(card)}
    config = with_run(config)
    if config.target is None:
        raise SpectuneError("give --target (and drafts with acceptance), --run RUN, or --story")
    target = shape_weights(config.target)
    acceptance = report_acceptance(config.report) if config.report else {}
    acceptance |= {name: {"alphas": _alphas(text, name)} for name, text in config.alpha.items()}
    names = sorted(acceptance)
    missing = [name for name in config.drafts if name not in acceptance]
    if missing:
        raise SpectuneError(f"no acceptance for {', '.join(missing)}: give --report or --alpha NAME=...")
    drafts = {name: shape_weights(spec) for name, spec in config.drafts.items()}
    speed, band = card.tokens_per_s(target)
    return {
        "label": card.label,
        "report": str(config.report) if config.report else None,
        "card": card.name,
        "target_tokens_per_s": speed,
        "target_band": band,
        "drafts": {name: draft_row(card, target, name, drafts, acceptance[name]) for name in names},
    }
