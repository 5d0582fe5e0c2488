"""Retune Gemma 4's MTP assistant for a tuned target: the assistant as shipped (trained for the base model) goes on
training, reading the tuned target's hidden states and cache, labelled by the tuned target's greedy tokens. On the
same data the target was tuned on, or, better, on the target's own answers (seqkd's target_answers.jsonl): there
teacher forcing is exactly the chains greedy verification accepts (models/mtp_assistant.py).

Written as transformers' own classes (Gemma4AssistantForCausalLM), so the pinned converter exports it and llama.cpp
runs it with `--spec-type draft-mtp`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from spectune.atomic import atomic_path
from spectune.models.load import load_tokenizer, read_config
from spectune.models.mtp_assistant import (
    chain_losses,
    check_fit,
    step_labels,
    target_states,
    unroll,
)
from spectune.models.resolve import MODEL_REFERENCE, resolve_model
from spectune.speedup import MAX_DRAFT_LEN
from spectune.threads import configure_torch_threads
from spectune.train.common import (
    TrainConfig,
    TrainSettings,
    console,
    load_task_data,
    peak_memory_bytes,
    read_split,
    write_report,
)
from spectune.train.loop import fit_measured

REPORT = "assistant.json"
ASSISTANT = "assistant"  # the retuned assistant's name among a run's drafts


class AssistantSettings(TrainSettings):
    """MTP assistant retuning: the `drafts.assistant:` section of a run config and the flags of `spectune assistant`."""

    lr: float = Field(1e-3, gt=0, description="Learning rate.")
    draft_steps: int = Field(
        3, ge=1, le=MAX_DRAFT_LEN, description="Chained guesses trained per position (llama.cpp's draft length)."
    )


class AssistantConfig(AssistantSettings, TrainConfig):
    """Everything `spectune assistant` takes. `data` is best the target's own answers (seqkd's
    target_answers.jsonl); the labels are the target's argmax either way."""

    target: Path = Field(description=f"The fine-tuned (merged) Gemma 4 target: {MODEL_REFERENCE}.")
    assistant: Path = Field(description=f"The assistant as shipped for the base model: {MODEL_REFERENCE}.")


class AssistantResult(BaseModel):
    model: Path
    parameters: int
    steps: int
    train_dialogues: int
    trained_tokens: int
    seconds: float
    accuracy_before: list[float]  # held-out top-1 against the target's argmax, by chained step (teacher-forced)
    accuracy_after: list[float]
    accuracy_by_steps: dict[int, list[float]]
    peak_memory_bytes: int
    peak_memory_how: str


def load_pair(target_dir: Path, assistant_dir: Path) -> tuple[Any, Any]:
    """The target (frozen, f32) and the assistant, after checking the assistant can read the target's cache."""
    import torch
    from transformers import AutoModelForCausalLM

    check_fit(target_dir, read_config(target_dir), assistant_dir, read_config(assistant_dir))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), local_files_only=True, dtype=torch.float32)
    assistant = AutoModelForCausalLM.from_pretrained(str(assistant_dir), local_files_only=True, dtype=torch.float32)
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    return target.eval(), assistant


def padded(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[Any, Any]:
    """(tokens, trained mask) [B, T], rows right-padded (padding is never a label)."""
    import torch

    length = max(len(ids) for ids, _ in rows)
    tokens = torch.full((len(rows), length), pad, dtype=torch.long)
    trained = torch.zeros((len(rows), length), dtype=torch.long)
    for row, (ids, mask) in enumerate(rows):
        tokens[row, : len(ids)] = torch.tensor(ids)
        trained[row, : len(mask)] = torch.tensor(mask)
    return tokens, trained


class Chains:
    """The chained-step loss and accuracy of an assistant on rows of a target's data."""

    def __init__(self, assistant: Any, target: Any, steps: int, pad: int) -> None:
        self.assistant, self.target, self.steps, self.pad = assistant, target, steps, pad
        self.window = getattr(target.config.get_text_config(), "sliding_window", None)

    def losses(self, rows: list[tuple[list[int], list[int]]]) -> tuple[Any, list[tuple[int, int]]]:
        tokens, trained = padded(rows, self.pad)
        states = target_states(self.target, tokens)
        labels = step_labels(states.argmax, trained, self.steps)
        return chain_losses(unroll(self.assistant, states, tokens, self.steps, self.window), labels)

    def accuracy(self, rows: list[tuple[list[int], list[int]]], batch_size: int) -> list[float]:
        import torch

        totals = [[0, 0] for _ in range(self.steps)]
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                for total, (hits, count) in zip(totals, self.losses(rows[start : start + batch_size])[1], strict=True):
                    total[0] += hits
                    total[1] += count
        return [round(hits / count, 4) if count else 0.0 for hits, count in totals]


def train_assistant(config: AssistantConfig) -> AssistantResult:
    """Retune the assistant for the target on `data`; write OUT/model (HF layout) and OUT/assistant.json."""
    from transformers import set_seed

    configure_torch_threads()
    config = config.model_copy(
        update={"target": resolve_model(config.target), "assistant": resolve_model(config.assistant)}
    )
    target, assistant = load_pair(config.target, config.assistant)
    set_seed(config.seed)
    tokenizer = load_tokenizer(config.target, config.chat_template)
    data = load_task_data(tokenizer, config, read_split(config))
    rows = [list(pair) for pair in zip(data.train["input_ids"], data.train["assistant_masks"], strict=True)]
    held_out = [list(pair) for pair in zip(data.eval["input_ids"], data.eval["assistant_masks"], strict=True)]
    chains = Chains(assistant, target, config.draft_steps, tokenizer.pad_token_id)
    fitted = fit_measured(
        assistant,
        rows,
        lambda batch: chains.losses(batch)[0],
        lambda: chains.accuracy(held_out, config.batch_size),
        config,
        "retuning the assistant",
    )
    out = config.out / "model"
    with atomic_path(out) as tmp:
        assistant.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    peak, how = peak_memory_bytes()
    result = AssistantResult(
        model=out,
        parameters=sum(p.numel() for p in assistant.parameters()),
        steps=fitted.steps,
        train_dialogues=len(rows),
        trained_tokens=data.trained_tokens,
        seconds=round(fitted.seconds, 2),
        accuracy_before=fitted.before,
        accuracy_after=fitted.after,
        accuracy_by_steps=fitted.by_steps,
        peak_memory_bytes=peak,
        peak_memory_how=how,
    )
    write_report(config.out / REPORT, config, result, data)
    console.print(f"assistant: {result.parameters:,} parameters, accuracy by step {fitted.before} -> {fitted.after}")
    return result
