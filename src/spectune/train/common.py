"""What the target and draft trainers share: task data rendered to token ids with assistant masks,
TRL/transformers trainer settings for this hardware, checkpoints, progress and peak memory."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console

from spectune.data.prepare import split_dialogues
from spectune.data.read import Dialogue, read_dialogues
from spectune.data.render import RenderStats, render_all
from spectune.errors import SpectuneError

console = Console()


@dataclass
class TaskData:
    train: Any  # datasets.Dataset with input_ids and assistant_masks
    eval: Any
    train_stats: RenderStats
    trained_tokens: int


class TrainConfig(BaseModel):
    """What every trainer takes (TRL style: one config per method extends this)."""

    model_config = ConfigDict(extra="forbid")

    data: Path
    out: Path
    eval_data: Path | None = None
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    max_eval: int = Field(200, ge=1)
    system: str | None = None
    chat_template: Path | None = None
    max_tokens: int = Field(1024, ge=16)
    epochs: float = Field(1.0, gt=0)
    max_steps: int = 0
    batch_size: int = Field(8, ge=1)
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(2e-4, gt=0)
    save_steps: int = Field(50, ge=1)
    gradient_checkpointing: bool | None = None  # None: on for CUDA, off on CPU
    seed: int = 0
    resume: bool = False


def read_split(config: TrainConfig) -> tuple[list[Dialogue], list[Dialogue]]:
    """Train and held-out dialogues: the eval file if given, else a seeded split of the data."""
    dialogues = read_dialogues(config.data, system=config.system).dialogues
    if config.eval_data is not None:
        return dialogues, read_dialogues(config.eval_data, system=config.system).dialogues[: config.max_eval]
    split = split_dialogues(dialogues, eval_fraction=config.eval_fraction, seed=config.seed)
    return split.train, split.eval[: config.max_eval]


def load_task_data(
    tokenizer: Any, config: TrainConfig, split: tuple[list[Dialogue], list[Dialogue]] | None = None
) -> TaskData:
    """Render train/eval dialogues with the chat template; mask everything but assistant tokens.
    `split` replaces the (train, eval) dialogues (e.g. with the target's own answers)."""
    import datasets

    data, eval_data, max_tokens = config.data, config.eval_data, config.max_tokens
    train, held_out = split or read_split(config)
    rendered_train, stats = render_all(tokenizer, [d.messages for d in train], max_tokens)
    rendered_eval, _ = render_all(tokenizer, [d.messages for d in held_out], max_tokens)
    if stats.truncated or stats.dropped:
        dropped = ", ".join(f"{n} {why}" for why, n in stats.dropped.items()) or "none dropped"
        console.print(
            f"truncated {stats.truncated} dialogues on turn boundaries ({stats.turns_cut} assistant turns "
            f"cut); {dropped}"
        )
    if not rendered_train:
        raise SpectuneError(f"{data}: no trainable tokens after rendering and truncation to {max_tokens} tokens")
    if not rendered_eval:
        raise SpectuneError(f"{eval_data or data}: no eval dialogues left (raise --eval-fraction or give --eval-data)")

    def to_dataset(rows: list) -> Any:
        return datasets.Dataset.from_dict(
            {"input_ids": [r.input_ids for r in rows], "assistant_masks": [r.assistant_mask for r in rows]}
        )

    trained = sum(r.trained_tokens for r in rendered_train)
    return TaskData(to_dataset(rendered_train), to_dataset(rendered_eval), stats, trained)


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def trainer_settings(config: TrainConfig) -> dict[str, Any]:
    """SFTConfig arguments for this hardware: bf16 and gradient checkpointing only where they pay (CUDA)."""
    import torch

    cuda = has_cuda()
    return {
        "output_dir": str(config.out / "checkpoints"),
        "per_device_train_batch_size": config.batch_size,
        "per_device_eval_batch_size": config.batch_size,
        "gradient_accumulation_steps": config.grad_accum,
        "learning_rate": config.lr,
        "num_train_epochs": config.epochs,
        "max_steps": config.max_steps if config.max_steps > 0 else -1,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 0.03,
        "logging_steps": 5,
        "save_steps": config.save_steps,
        "save_total_limit": 2,
        "eval_strategy": "no",
        "report_to": [],
        "seed": config.seed,
        "data_seed": config.seed,
        "bf16": cuda and torch.cuda.is_bf16_supported(),
        "fp16": False,
        "use_cpu": not cuda,
        "gradient_checkpointing": cuda if config.gradient_checkpointing is None else config.gradient_checkpointing,
        "max_length": config.max_tokens,
        "packing": False,
        "dataloader_num_workers": 0,
        "include_num_input_tokens_seen": "all",
        "disable_tqdm": False,
    }


def last_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete checkpoint (trainer_state.json is written last), so Ctrl-C mid-save is harmless."""
    folder = out_dir / "checkpoints"
    complete = [p for p in folder.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    return max(complete, key=lambda p: int(p.name.split("-")[1]), default=None)


def peak_memory_bytes() -> tuple[int, str]:
    """(bytes, how): CUDA max allocated on a GPU, else this process's peak RSS."""
    if has_cuda():
        import torch

        return torch.cuda.max_memory_allocated(), "cuda max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
