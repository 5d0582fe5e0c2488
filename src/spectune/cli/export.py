"""`spectune export` (one model to GGUF, or a run's pair handed to vLLM or SGLang) and `spectune export-pair`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import typer
from pydantic import Field
from rich.table import Table

from spectune.cli.shared import console
from spectune.config import positional, validate
from spectune.engines.handoff import HandoffConfig, hand_off
from spectune.errors import SpectuneError
from spectune.export.gguf import QuantSettings, export_model
from spectune.export.pair import ExportPairConfig
from spectune.export.pair import export_pair as run_export_pair
from spectune.flags import config_command
from spectune.layout import SERVER_SCRIPT
from spectune.models.resolve import MODEL_REFERENCE, resolve_model

app = typer.Typer()


class ExportConfig(QuantSettings):
    """Everything `spectune export` takes."""

    run_dir: Path | None = Field(
        None, **positional("With --for vllm|sglang: a finished run folder, whose chosen pair is handed.")
    )
    engine: Literal["gguf", "vllm", "sglang"] = Field(
        "gguf",
        description="gguf: one model to GGUF (--model, --out); vllm | sglang: a run's pair.",
        json_schema_extra={"flag": "--for"},
    )
    model: Path | None = Field(None, description=f"The model to export: {MODEL_REFERENCE}.")
    out: Path | None = Field(None, description="The .gguf file, or the hand-off folder (default RUN/handoff/ENGINE).")
    target_model_dir: Path | None = Field(
        None, description="An EAGLE-3 head's target (its tokenizer and config): the head's GGUF."
    )


@config_command(app, ExportConfig)
def export(config: ExportConfig) -> None:
    """HF -> GGUF with llama.cpp's own converter, then quantize with libllama (atomic); or, with --for vllm|sglang,
    a run's merged target and chosen draft as HF folders with that engine's command for them."""
    if config.engine != "gguf":
        if config.run_dir is None:
            raise SpectuneError(
                f"--for {config.engine}: give the run folder, e.g. spectune export --for {config.engine} runs/NAME"
            )
        handoff = {"run": config.run_dir, "engine": config.engine, "out": config.out}
        report = hand_off(validate(HandoffConfig, handoff, "command line"))
        console.print(f"{report['engine']}: draft {report['draft_name']}, k = {report['k']}; serve with", markup=False)
        typer.echo(report["command"])
        return
    if config.model is None or config.out is None:
        raise SpectuneError("--for gguf: give --model MODEL and --out FILE.gguf")
    target = resolve_model(config.target_model_dir) if config.target_model_dir else None
    path = export_model(
        resolve_model(config.model), config.out, config.quant, keep_f16=config.keep_f16, target_model_dir=target
    )
    console.print(f"{path} ({path.stat().st_size / 1e6:.1f} MB, {config.quant})")


@config_command(app, ExportPairConfig, name="export-pair")
def export_pair(config: ExportPairConfig) -> None:
    """Export a target and its drafts, check each is a valid speculative pair, report fidelity and sizes; write
    the pair to serve (pair.json) and llama.cpp's server command for it (llama-server.sh)."""
    report = run_export_pair(config)
    table = Table(title=f"export ({report['quant']})")
    for column in ("model", "GGUF MB", "F16 MB", "top-1 agreement", "ppl HF -> GGUF", "tokenizer"):
        table.add_column(column)
    for role, entry in report["models"].items():
        fid = entry.get("fidelity")
        table.add_row(
            role,
            f"{entry['bytes'] / 1e6:.1f}",
            f"{entry.get('f16_bytes', 0) / 1e6:.1f}",
            f"{fid['top1_agreement']:.1%}" if fid else "-",
            f"{fid['perplexity_hf']:.2f} -> {fid['perplexity_gguf']:.2f}" if fid else "-",
            f"exact on {entry['tokenizer_strings_checked']} strings",
        )
    console.print(table)
    chosen = report["chosen"]
    console.print(
        f"pairs accepted by llama.cpp's rules; to serve: {chosen['draft_name']} at k = {chosen['k']}; "
        f"with llama.cpp: {config.out / SERVER_SCRIPT}"
    )
