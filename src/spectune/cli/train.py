"""The training verbs: `finetune`, `merge`, `draft`, `eagle3`, `assistant`, `acceptance`, and `plan` (what fits)."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from spectune.acceptance.stage import AcceptanceConfig, run_acceptance
from spectune.cli.shared import console
from spectune.flags import config_command
from spectune.train.assistant import AssistantConfig, train_assistant
from spectune.train.draft import DraftConfig, train_draft
from spectune.train.eagle3 import Eagle3Config, train_eagle3
from spectune.train.plan import GIB, PlanConfig, cost_ratio, parse_memory, plan_report, read_shape
from spectune.train.target import FinetuneConfig, MergeConfig
from spectune.train.target import finetune as run_finetune
from spectune.train.target import merge as run_merge

app = typer.Typer()


@config_command(app, FinetuneConfig)
def finetune(config: FinetuneConfig) -> None:
    """Fine-tune the target with QLoRA (4-bit NF4 base + LoRA adapter) on assistant tokens."""
    result = run_finetune(config)
    console.print(
        f"eval loss {result.eval_loss_before:.4f} -> {result.eval_loss_after:.4f} | adapter {result.adapter} "
        f"({result.adapter_bytes / 1e6:.2f} MB) | peak memory {result.peak_memory_bytes / 2**30:.2f} GiB "
        f"({result.peak_memory_how}) | {result.seconds:.0f} s"
    )


@config_command(app, MergeConfig)
def merge(config: MergeConfig) -> None:
    """Merge a (Q)LoRA adapter into the base it was trained on; checks merged == base + adapter."""
    result = run_merge(config)
    console.print(
        f"merged into the {result.merged_into} -> {result.model} "
        f"(max logit difference vs base + adapter: {result.max_logit_diff:.1e})"
    )


@config_command(app, DraftConfig)
def draft(config: DraftConfig) -> None:
    """Train a draft that thinks like the target: sft (same data), kd (distillation), seqkd (the target's own
    answers), onpolicy (TRL on-policy distillation) or speckd (acceptance on the target's greedy path)."""
    result = train_draft(config)
    console.print(
        f"draft ({result.method}): eval loss {result.eval_loss_before:.4f} -> {result.eval_loss_after:.4f} "
        f"| {result.model} | {result.seconds:.0f} s"
    )


@config_command(app, Eagle3Config)
def eagle3(config: Eagle3Config) -> None:
    """Train an EAGLE-3 head for the tuned target (a draft for spectune's loop and llama.cpp's); export it with
    `spectune export --model HEAD --target-model-dir TARGET --out HEAD.gguf`."""
    result = train_eagle3(config)
    console.print(
        f"eagle3: held-out accuracy by draft step {result.accuracy_before} -> {result.accuracy_after} | "
        f"{result.model} | {result.seconds + result.feature_seconds:.0f} s"
    )


@config_command(app, AssistantConfig)
def assistant(config: AssistantConfig) -> None:
    """Retune a Gemma 4 target's MTP assistant (as shipped for the base model) for the tuned target; llama.cpp runs
    it with --spec-type draft-mtp: `spectune export --model OUT/model --out ASSISTANT.gguf`."""
    result = train_assistant(config)
    console.print(
        f"assistant: held-out accuracy by draft step {result.accuracy_before} -> {result.accuracy_after} | "
        f"{result.model} | {result.seconds:.0f} s"
    )


@config_command(app, AcceptanceConfig)
def acceptance(config: AcceptanceConfig) -> None:
    """Offline acceptance: α, α at draft positions 1-3, τ(k), best k and predicted speedup, per draft."""
    report = run_acceptance(config)
    table = Table(title=f"acceptance on {report['prompts']} held-out prompts (target's greedy answers)")
    profiles = (f"τ(k*) / k* / S ({p['name']})" for p in report["profiles"])
    for column in ("draft", "α", "α@1 / @2 / @3", "tokens", *profiles):
        table.add_column(column)
    for row in report["drafts"]:
        alpha_at = row["alpha_by_position"]  # a position no step reached has no acceptance
        by_position = " / ".join(f"{alpha_at[str(i)]:.0%}" if str(i) in alpha_at else "-" for i in (1, 2, 3))
        cells = [row["name"], f"{row['alpha']:.1%}", by_position, str(row["tokens"])]
        for profile in report["profiles"]:
            k = row["best_k"][profile["key"]]
            cells.append(f"{row['tau_simulated'][str(k)]:.2f} / {k} / {row['speedup'][profile['key']][str(k)]:.2f}x")
        table.add_row(*cells)
    console.print(table)


@config_command(app, PlanConfig)
def plan(config: PlanConfig) -> None:
    """Estimate what QLoRA training and 4-bit inference need, and what fits in --gpu-mem."""
    shape = read_shape(config.model)
    seq, batch, rank = config.max_seq_length, config.batch_size, config.lora_r
    report = plan_report(shape, parse_memory(config.gpu_mem), seq=seq, batch=batch, rank=rank, context=config.context)
    if config.draft is not None:
        draft_shape = read_shape(config.draft)
        report["draft"] = {"params": draft_shape.params, "cost_ratio": cost_ratio(shape, draft_shape)}
    numbers = report["estimate"]
    title = f"{config.model}: {numbers['params'] / 1e9:.2f}B parameters; seq {seq} x batch {batch}, rank {rank}"
    table = Table(title=title)
    table.add_column("what")
    table.add_column("GiB", justify="right")
    rows = [
        ("f16 weights", "f16_weights"),
        ("NF4 weights (double quant)", "nf4_weights"),
        ("LoRA weights + grads + AdamW", "lora_train_state"),
        ("adapter on disk (bf16)", "adapter_bytes_bf16"),
        ("activations", "activations"),
        ("activations, gradient checkpointing", "activations_checkpointed"),
        ("logits (+ f32 loss)", "logits"),
        ("QLoRA total", "qlora_total"),
        ("QLoRA total, gradient checkpointing", "qlora_total_checkpointed"),
        ("Q4_K_M GGUF", "gguf_q4_k_m"),
        (f"KV cache at {config.context} tokens (f16)", "kv_cache"),
        ("Q4_K_M inference total", "inference_total"),
    ]
    for label, key in rows:
        table.add_row(label, f"{numbers[key] / GIB:.2f}")
    console.print(table)
    for what, fits in report["fits"].items():
        console.print(f"{'[green]fits[/]' if fits else '[red]does not fit[/]'} in {config.gpu_mem}: {what}")
    longest = report["largest_seq_at_batch"]
    console.print(
        f"longest QLoRA sequence at batch {batch}: {longest['checkpointing']} tokens with gradient "
        f"checkpointing, {longest['no_checkpointing']} without"
    )
    if "draft" in report:
        params, c = report["draft"]["params"], report["draft"]["cost_ratio"]
        low, high = c["on_card_band"]
        console.print(
            f"draft {config.draft}: {params / 1e9:.2f}B parameters; c (draft step / target step) = {c['bytes']:.3f} "
            f"by what a step reads at Q4_K_M, {c['on_card']:.3f} ({low:.3f}-{high:.3f}) {c['card']}"
        )
    if config.json_out:
        config.json_out.write_text(json.dumps(report, indent=2))
