"""`spectune run` and `spectune demo`: the whole pipeline, and the story it ends with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from pydantic import Field
from rich.table import Table

from spectune.bench.summary import bench_summaries, grounded_figure
from spectune.cli.shared import VerboseSettings, console
from spectune.config import positional
from spectune.flags import config_command
from spectune.layout import RunLayout
from spectune.models.demo_pair import RECIPES
from spectune.models.gemma4_pair import GEMMA4_RECIPES
from spectune.pipeline.config import RunConfig, demo_config, load_run_config
from spectune.pipeline.run import dry_run as plan_run
from spectune.pipeline.run import run_pipeline
from spectune.runtime.chosen import ChosenPair
from spectune.terminal import terminal

app = typer.Typer()


class RunCommandConfig(VerboseSettings):
    run_config: Path = Field(**positional("Run config (YAML); see configs/ for examples."))
    from_stage: str | None = Field(None, description="Rerun from this stage on.", json_schema_extra={"flag": "--from"})
    only: str | None = Field(None, description="Rerun only this stage.")
    dry_run: bool = Field(False, description="Check the config and paths, print each stage's settings; run nothing.")


@config_command(app, RunCommandConfig, name="run")
def run_command(config: RunCommandConfig) -> None:
    """The whole pipeline: data -> QLoRA target -> merge -> drafts -> export -> acceptance -> bench -> report."""
    terminal.verbose = config.verbose
    if config.dry_run:
        typer.echo(json.dumps(plan_run(load_run_config(config.run_config)), indent=2))
        return
    summary = run_pipeline(load_run_config(config.run_config), config.from_stage, config.only)
    console.print(summary["line"], markup=False)


class DemoConfig(VerboseSettings):
    size: str = Field(
        "demo",
        description="demo (default), micro (a quick look), medium (~1 h) or gemma4-demo (a Gemma 4 target and its "
        "MTP assistant, retuned).",
    )
    run_dir: Path | None = Field(None, description="Run folder (default runs/demo, runs/demo-SIZE, runs/gemma4-demo).")


@config_command(app, DemoConfig)
def demo(config: DemoConfig) -> None:
    """The whole story on the built-in default: demo pair, generated voice-bot dialogues, all stages."""
    terminal.verbose = config.verbose
    run_config = demo_config(config.size, config.run_dir)
    console.print(demo_intro(config.size, run_config))
    summary = run_pipeline(run_config)
    print_story(summary, run_config.layout)


def demo_intro(size: str, run_config: RunConfig) -> str:
    """What the demo of `size` is about to show."""
    dialogues = f"{run_config.data.demo_dialogues:,} voice-bot dialogues"
    if size in GEMMA4_RECIPES:
        recipe = GEMMA4_RECIPES[size]
        return (
            f"[bold]spectune demo[/]: a {recipe.target.hidden} x {recipe.target.layers} Gemma 4 target fine-tuned "
            f"with QLoRA on {dialogues}, and its MTP assistant (trained for the base target, as Google ships one) "
            "retuned for it, beside the assistant as shipped: how many of the target's tokens each guesses, in "
            "llama.cpp's draft-mtp and spectune's loop, with answers identical to the target alone, at 4 bits."
        )
    recipe = RECIPES[size]
    return (
        f"[bold]spectune demo[/]: a {recipe.target.hidden} x {recipe.target.layers} target fine-tuned with QLoRA on "
        f"{dialogues}, and drafts {recipe.target.hidden // recipe.draft.hidden}x narrower that learn to think like "
        f"it ({', '.join(run_config.drafts.methods)}), beside the off-the-shelf one: how many of the target's tokens "
        "each draft guesses, and what that buys with answers identical to the target alone, at 4 bits on llama.cpp."
    )


def print_story(summary: dict[str, Any], layout: RunLayout) -> None:
    """The demo's last lines: per draft what it guessed, what that predicts on a GPU and measures here."""
    # Short headers, the shared figures in the caption: one row a line in an 80-column terminal (the report has all).
    summaries = bench_summaries(summary["bench"], f"{layout.manifest}: summary.bench")
    first = next(iter(summaries.values()))
    table = Table(
        title="speculative decoding, the target alone = 1.00x",
        caption=f"GPU: predicted, c = {first.gpu_cost_ratio:.2f} (bytes a step reads). card: "
        f"{first.gpu_card}, c and r fitted on published llama.cpp figures. CPU: measured here, all "
        f"{first.total_tokens:,} tokens over all decode time. same: answers identical to the target alone's.",
    )
    for column in ("draft", "k", "accept", "tok/pass", "GPU", "card", "CPU", "same"):
        table.add_column(column, justify="left" if column == "draft" else "right")
    for name, s in summaries.items():
        table.add_row(
            name,
            str(s.draft_max),
            f"{s.acceptance:.0%}",
            f"{s.mean_accepted_len:.2f}",
            f"{s.predicted_speedup_gpu:.2f}x",
            grounded_figure(s),
            f"{s.aggregate_speedup:.2f}x",
            f"{s.identical}/{s.n}",
        )
    console.print()
    console.print(table)
    chosen = ChosenPair.read(layout.chosen_pair)
    best = summaries[chosen.draft_name]
    profile = best.profile  # every bench keeps the profile it measured
    console.print(
        f"Why CPU and GPU differ: here verifying {best.draft_max + 1} tokens costs {best.verify_ratio:.1f}x one "
        "(decoding on a small CPU is compute-bound), on a GPU about 1x (memory-bound), so the same guesses pay off "
        f"there. Measured: target {profile['target_ms_per_token']:.2f} ms/token, draft "
        f"{profile['draft_ms_per_token']:.2f} ms/token (c = {profile['cost_ratio']:.3f}). Report: {layout.report}"
    )
    console.print(
        f"\nChat with the result:\n  spectune generate --chat --target {chosen.target} --draft {chosen.draft} "
        f"--draft-max {chosen.k}\n"
        f"Serve it to a voice bot (OpenAI-compatible, streaming):\n  spectune serve --run {layout.root}\n"
        f"or with llama.cpp's own server: {layout.server_script}"
    )
