"""`spectune run CONFIG.yaml`: the runner over the stage table, the run directory and its manifest.

data -> target -> finetune (QLoRA) -> merge -> base-draft -> draft:<method>... -> export -> acceptance -> bench.
Each stage is a function of the run's context that calls the same entry function its CLI verb does, and declares
the settings it reads, the stages whose outputs it uses and the files it reads. The runner hashes all three and
skips a stage only when none changed since it last finished, so a crashed run resumes at the first unfinished stage
(an interrupted training continues from its last checkpoint), and a changed input reruns exactly what reads it.
Training stages read the train file only: their reported eval loss is measured on the eval file of the time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import platform
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

from spectune.acceptance.draft_types import type_table
from spectune.atomic import atomic_path
from spectune.bench.summary import bench_summaries
from spectune.cache import path_hash
from spectune.config import Settings
from spectune.errors import SpectuneError
from spectune.gpu.card import reference_card
from spectune.layout import RunLayout
from spectune.pipeline.config import RunConfig
from spectune.pipeline.stages import Context, Stage, stages
from spectune.runtime.chosen import ChosenPair
from spectune.terminal import chatter_to, terminal
from spectune.threads import configure_torch_threads
from spectune.train.plan import parse_memory, plan_report, read_shape


def _hash(value: Any) -> str:
    """A stable digest of JSON-like values; settings objects count by their fields."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=_dump).encode()).hexdigest()[:16]


def _dump(value: Any) -> Any:
    return value.model_dump(mode="json") if isinstance(value, Settings) else str(value)


class Run:
    """A run directory with its manifest; `execute` runs a stage unless everything it reads is unchanged."""

    def __init__(self, config: RunConfig, force_from: str | None = None, only: str | None = None) -> None:
        self.config, self.layout = config, config.layout
        self.layout.root.mkdir(parents=True, exist_ok=True)
        path = self.layout.manifest
        self.manifest: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {"stages": {}}
        self.manifest["config"] = config.model_dump(mode="json")
        self.manifest["versions"] = {
            name: version(name)
            for name in ("spectune", "torch", "transformers", "trl", "peft", "bitsandbytes", "llama-cpp-python")
        }
        self.manifest["machine"] = platform.platform()
        self.force_from, self.only = force_from, only
        self.forcing = False
        self.outputs: dict[str, dict[str, Any]] = {}

    def save(self) -> None:
        with atomic_path(self.layout.manifest) as tmp:
            tmp.write_text(json.dumps(self.manifest, indent=2, default=str))

    def inputs_key(self, stage: Stage, context: Context) -> str:
        records = self.manifest["stages"]
        return _hash(
            {
                "settings": stage.settings(self.config),
                "needs": {name: _hash([records[name]["inputs"], records[name]["outputs"]]) for name in stage.needs},
                "files": {str(path): path_hash(path) for path in stage.reads(context)},
            }
        )

    def should_skip(self, stage: Stage, record: dict[str, Any], key: str) -> bool:
        family = stage.name.split(":")[0]
        if self.force_from and family == self.force_from.split(":")[0]:
            self.forcing = True
        if self.only and family != self.only.split(":")[0]:
            if record.get("status") != "done":
                raise SpectuneError(f"--only {self.only}: stage {stage.name} it depends on has not finished")
            return True
        if self.only:  # the named stage reruns even when its inputs are unchanged
            return False
        return record.get("status") == "done" and record.get("inputs") == key and not self.forcing

    def execute(self, stage: Stage, number: int, total: int) -> dict[str, Any]:
        context = Context(self.config, self.layout, self.outputs)
        key = self.inputs_key(stage, context)
        record = self.manifest["stages"].get(stage.name, {})
        header = f"{number}/{total} {stage.name}"
        if self.should_skip(stage, record, key):
            terminal.console().print(f"[dim]{header}: unchanged, skipped[/]", soft_wrap=True)
            self.outputs[stage.name] = record["outputs"]
            return record["outputs"]
        context.resuming = record.get("status") == "running" and record.get("inputs") == key
        self.manifest["stages"][stage.name] = {"status": "running", "inputs": key, "started": time.time()}
        self.save()
        start = time.perf_counter()
        outputs = self.step(stage, context, header)
        seconds = round(time.perf_counter() - start, 2)
        figure = FIGURES[stage.name.split(":")[0]](outputs)
        terminal.console().print(f"[green]✓[/] {header}: {figure} ({seconds:.0f} s)", soft_wrap=True)
        self.manifest["stages"][stage.name] = {
            "status": "done",
            "inputs": key,
            "started": self.manifest["stages"][stage.name]["started"],
            "seconds": seconds,
            "outputs": outputs,
        }
        self.save()
        self.outputs[stage.name] = outputs
        return outputs

    def step(self, stage: Stage, context: Context, header: str) -> dict[str, Any]:
        """The stage's step, the libraries' output kept in its log (logs/STAGE.log); a spinner (on a terminal) or
        a line (elsewhere) while it runs."""
        log = self.layout.logs / f"{stage.name.replace(':', '-')}.log"
        with chatter_to(log) as terminal:
            if not terminal.is_terminal:
                terminal.print(f"{header} ...", highlight=False, soft_wrap=True)
            try:
                with terminal.status(header) if terminal.is_terminal else contextlib.nullcontext():
                    return json.loads(json.dumps(stage.step(context), default=str))
            except BaseException:
                terminal.print(f"[red]✗[/] {header} stopped; what the libraries said is in {log}", soft_wrap=True)
                raise


def _losses(outputs: dict[str, Any]) -> str:
    return f"eval loss {outputs['eval_loss_before']:.2f} -> {outputs['eval_loss_after']:.2f}"


def _served(chosen: dict[str, Any]) -> str:
    """The pair.json's variant and its k."""
    pair = ChosenPair.model_validate(chosen)
    return f"{pair.variant.name} ({pair.draft.name}) at k = {pair.k}"


# Each stage's own figure, printed when it ends.
FIGURES: dict[str, Callable[[dict[str, Any]], str]] = {
    "data": lambda out: f"{out['train_dialogues']:,} dialogues to train on, {out['eval_dialogues']:,} held out",
    "target": lambda out: out["target"],
    "finetune": lambda out: f"{out['steps']} steps, {_losses(out)}",
    "merge": lambda out: f"into the {out['merged_into']}, logits within {out['max_logit_diff']:.0e} of base + adapter",
    "base-draft": lambda out: out["draft"],
    "draft": lambda out: f"{out['method']}, {out['steps']} steps, {_losses(out)}",
    "eagle3": lambda out: (
        f"{out['steps']} steps, {out['parameters']:,} parameters, held-out accuracy by draft step "
        f"{out['accuracy_before']} -> {out['accuracy_after']}"
    ),
    "assistant": lambda out: (
        f"{out['steps']} steps, held-out accuracy by draft step {out['accuracy_before']} -> {out['accuracy_after']}"
    ),
    "export": lambda out: (
        f"{len(out['files'])} GGUFs at {out['reports']['quant']}"
        + (", with importance matrices" if out["reports"].get("imatrix", {}).get("used") else "")
    ),
    "acceptance": lambda out: (
        "accepted "
        + ", ".join(f"{row['name']} {row['alpha']:.0%}" for row in out["drafts"])
        + f"; serving {_served(out['chosen'])}"
    ),
    "bench": lambda out: (
        "here " + ", ".join(f"{name} {row['aggregate_speedup']:.2f}x" for name, row in out["summary"].items())
    ),
}


def run_pipeline(config: RunConfig, force_from: str | None = None, only: str | None = None) -> dict[str, Any]:
    """Every stage of a run; returns the summary (also in the manifest and report.md)."""
    configure_torch_threads(config.threads)
    run = Run(config, force_from, only)
    table = stages(config)
    for number, stage in enumerate(table, 1):
        run.execute(stage, number, len(table))
    summary = summarize(run.outputs["acceptance"], run.outputs["bench"], run.layout)
    run.manifest["summary"] = summary
    run.save()
    write_run_report(run, summary)
    return summary


DRY_RUN_CONTEXT = 8192  # the planner's KV cache default


def _resolved(settings: Any) -> Any:
    return json.loads(json.dumps(settings, default=_dump))


def dry_run(config: RunConfig) -> dict[str, Any]:
    """What a run would do, nothing executed: each stage's resolved settings and the stages it needs, and for a
    local target folder the memory plan at the fine-tune's sequence, batch and rank (16 GiB, the reference card)."""
    plan = None
    if config.models.target is not None and config.models.target.is_dir():
        section = config.finetune
        plan = plan_report(
            read_shape(config.models.target),
            parse_memory("16GiB"),
            seq=section.max_seq_length,
            batch=section.batch_size,
            rank=section.lora_r,
            context=DRY_RUN_CONTEXT,
        )
    return {
        "run_dir": str(config.run_dir),
        "stages": {
            stage.name: {"needs": list(stage.needs), "settings": _resolved(stage.settings(config))}
            for stage in stages(config)
        },
        "memory_plan": plan,
    }


def summarize(accepted: dict[str, Any], benched: dict[str, Any], layout: RunLayout) -> dict[str, Any]:
    """The run's result in the reference story's terms."""
    alpha = {row["name"]: row["alpha"] for row in accepted["drafts"]}
    summaries = bench_summaries(benched["summary"], f"{layout.bench_dir}: the bench stage's summary")
    identical = sum(s.identical for s in summaries.values())
    prompts = sum(s.n for s in summaries.values())
    line = (
        "acceptance: "
        + " | ".join(f"{name} {s.acceptance:.0%}" for name, s in summaries.items())
        + " — tokens per target pass "
        + " / ".join(f"{s.mean_accepted_len:.1f}" for s in summaries.values())
        + " — predicted on a GPU "
        + " / ".join(f"{s.predicted_speedup_gpu:.1f}x" for s in summaries.values())
        + f" ({reference_card().label}: "
        + " / ".join(f"{s.predicted_speedup_gpu_grounded:.1f}x" for s in summaries.values())
        + ")"
        + " — here (CPU, compute-bound, all tokens / all time) "
        + " / ".join(f"{s.aggregate_speedup:.2f}x" for s in summaries.values())
        + f" — identical answers {identical}/{prompts} — report: {layout.report}"
    )
    return {"line": line, "offline_alpha": alpha, "bench": benched["summary"]}


def write_run_report(run: Run, summary: dict[str, Any]) -> None:
    stages_run = run.manifest["stages"]
    lines = ["# spectune run", "", summary["line"], "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {name} | {record.get('seconds', '-')} |" for name, record in stages_run.items()]
    sweep = run.outputs["acceptance"].get("draft_types")
    lines += ["", *type_table(sweep)] if sweep else []
    bench_md = run.layout.bench_dir / "report.md"
    if bench_md.is_file():
        lines += ["", bench_md.read_text()]
    with atomic_path(run.layout.report) as tmp:
        tmp.write_text("\n".join(lines) + "\n")
