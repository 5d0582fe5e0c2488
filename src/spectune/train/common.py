"""What the target and draft trainers share: task data rendered to token ids with assistant masks,
TRL/transformers trainer settings for this hardware, checkpoints, progress and peak memory."""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from rich.console import Console

from spectune.atomic import atomic_path
from spectune.config import Settings
from spectune.data.prepare import SplitSettings, split_dialogues
from spectune.data.read import Dialogue, read_dialogues
from spectune.data.render import RenderStats, render_all
from spectune.errors import SpectuneError
from spectune.models.load import save_tokenizer
from spectune.terminal import terminal

console = Console()


class _OptionalKernelNotice(logging.Filter):
    """bitsandbytes warns at import that the optional `kernels` package (a faster CPU 4-bit matmul) is missing; its
    own kernel runs instead. Only that line is dropped: anything else the logger says still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "gemm_4bit_forward from kernels-community" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_OptionalKernelNotice())
# peft reads `model.is_gradient_checkpointing`, which transformers 5 renamed (peft 0.21's call, not ours).
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


@dataclass
class TaskData:
    train: Any  # datasets.Dataset with input_ids and assistant_masks
    eval: Any
    train_stats: RenderStats
    trained_tokens: int


class TrainSettings(Settings):
    """The hyperparameters every trainer takes (TRL style: each method's settings extend these)."""

    epochs: float = Field(1.0, gt=0, description="Epochs over the data.")
    max_steps: int = Field(0, ge=0, description="Stop after this many optimizer steps (0: epochs decide).")
    batch_size: int = Field(8, ge=1, description="Dialogues per step.")
    grad_accum: int = Field(1, ge=1, description="Steps accumulated per optimizer update.")
    lr: float = Field(2e-4, gt=0, description="Learning rate.")
    max_seq_length: int = Field(512, ge=16, description="Longest training sequence; longer dialogues are cut on turns.")
    max_eval: int = Field(100, ge=1, description="Held-out dialogues the eval loss is measured on.")
    max_train: int = Field(0, ge=0, description="Use only the first N train dialogues (0: all).")
    save_steps: int = Field(50, ge=1, description="Checkpoint every N steps.")
    gradient_checkpointing: bool | None = Field(
        None, description="Recompute activations in backward (default: on with CUDA, off on a CPU)."
    )


class TrainInputs(SplitSettings):
    """What a trainer reads and writes; `spectune run` fills these from its data section and run layout."""

    data: Path = Field(description="Task dataset (chat JSONL or a save_to_disk folder).")
    out: Path = Field(description="Output folder (checkpoints/, the model or adapter, a JSON report).")
    chat_template: Path | None = Field(None, description="Jinja chat template file, if the model has none.")
    resume: bool = Field(False, description="Continue from the last complete checkpoint.")


class TrainConfig(TrainSettings, TrainInputs):
    """Everything a trainer takes."""


def read_split(config: TrainConfig) -> tuple[list[Dialogue], list[Dialogue]]:
    """Train and held-out dialogues: the eval file if given, else a seeded split of the data."""
    dialogues = read_dialogues(config.data, system=config.system).dialogues
    if config.eval_data is not None:
        train, held_out = dialogues, read_dialogues(config.eval_data, system=config.system).dialogues
    else:
        split = split_dialogues(dialogues, eval_fraction=config.eval_fraction, seed=config.seed)
        train, held_out = split.train, split.eval
    return train[: config.max_train or None], held_out[: config.max_eval]


def load_task_data(
    tokenizer: Any, config: TrainConfig, split: tuple[list[Dialogue], list[Dialogue]] | None = None
) -> TaskData:
    """Render train/eval dialogues with the chat template; mask everything but assistant tokens.
    `split` replaces the (train, eval) dialogues (e.g. with the target's own answers)."""
    import datasets

    data, eval_data, max_seq_length = config.data, config.eval_data, config.max_seq_length
    train, held_out = split or read_split(config)
    rendered_train, stats = render_all(tokenizer, [d.messages for d in train], max_seq_length)
    rendered_eval, _ = render_all(tokenizer, [d.messages for d in held_out], max_seq_length)
    if stats.truncated or stats.dropped:
        dropped = ", ".join(f"{n} {why}" for why, n in stats.dropped.items()) or "none dropped"
        console.print(
            f"truncated {stats.truncated} dialogues on turn boundaries ({stats.turns_cut} assistant turns "
            f"cut); {dropped}"
        )
    if not rendered_train:
        raise SpectuneError(f"{data}: no trainable tokens after rendering and truncation to {max_seq_length} tokens")
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
        "activation_checkpointing": cuda if config.gradient_checkpointing is None else config.gradient_checkpointing,
        "max_length": config.max_seq_length,
        "packing": False,
        "dataloader_num_workers": 0,
        "include_num_input_tokens_seen": "all",
        "disable_tqdm": not terminal.verbose,  # else spectune's own steps line (StepProgress) says how far it is
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


def is_main_process() -> bool:
    """The only process, or rank 0 of a torchrun / accelerate launch: the one that writes outputs."""
    return int(os.environ.get("RANK", "0")) == 0


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


@contextmanager
def out_of_memory_advice(config: TrainConfig) -> Iterator[None]:
    """Turn an out-of-memory error into advice on which knob to turn."""
    import torch

    try:
        yield
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise SpectuneError(
            f"out of memory at batch_size {config.batch_size}, max_seq_length {config.max_seq_length}: lower "
            "--batch-size (raise --grad-accum to keep the effective batch), lower --max-seq-length, or turn on "
            "gradient checkpointing (gradient_checkpointing: true); `spectune plan` estimates what fits. The last "
            f"complete checkpoint, if any, is in {config.out / 'checkpoints'} (--resume continues from it)."
        ) from exc


class TrainResult(BaseModel):
    """What every training stage reports (each stage's result extends it)."""

    eval_loss_before: float
    eval_loss_after: float
    steps: int
    train_dialogues: int
    trained_tokens: int
    seconds: float  # training with its evaluations
    peak_memory_bytes: int
    peak_memory_how: str


def train_and_save(trainer: Any, tokenizer: Any, config: TrainConfig, save_to: Path, data: TaskData) -> TrainResult:
    """Evaluate, train (from the last complete checkpoint with `resume`), evaluate; save atomically."""
    resume_from = last_checkpoint(config.out) if config.resume else None
    if config.resume and resume_from is None:
        console.print("[yellow]--resume: no complete checkpoint yet, starting from the beginning[/]")
    if not config.resume and is_main_process():  # a fresh run must never resume an earlier run's checkpoints
        shutil.rmtree(config.out / "checkpoints", ignore_errors=True)
    with Timer() as timer, out_of_memory_advice(config):
        before = trainer.evaluate()["eval_loss"]
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        after = trainer.evaluate()["eval_loss"]
    if trainer.args.world_size > 1:  # each rank's own count: DDP's gradient all-reduce keeps them in step
        args = trainer.args
        console.print(f"rank {args.process_index} of {args.world_size}: {trainer.state.global_step} optimizer steps")
    if is_main_process():  # one copy of the model, written by rank 0 under torchrun
        with atomic_path(save_to) as tmp:
            trainer.model.save_pretrained(str(tmp))
            save_tokenizer(tokenizer, tmp)
    trainer.accelerator.wait_for_everyone()  # no rank reads the output before it is complete
    peak, how = peak_memory_bytes()
    return TrainResult(
        eval_loss_before=before,
        eval_loss_after=after,
        steps=trainer.state.global_step,
        train_dialogues=len(data.train),
        trained_tokens=data.trained_tokens,
        seconds=round(timer.seconds, 2),
        peak_memory_bytes=peak,
        peak_memory_how=how,
    )


def write_report(path: Path, config: BaseModel, result: BaseModel, data: TaskData) -> None:
    """The stage's config, result and what rendering cut, as JSON (atomic; by rank 0 only under torchrun)."""
    if not is_main_process():
        return
    report = {
        "config": config.model_dump(mode="json"),
        "result": result.model_dump(mode="json"),
        "render": asdict(data.train_stats),
    }
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(report, indent=2, default=str))


def model_identity(folder: Path) -> list[Any]:
    """What a cache made from a model folder depends on: its path and each file's name, size and modification time
    (a model retrained in place is another model)."""
    files = sorted(path for path in folder.iterdir() if path.is_file())
    return [str(folder.resolve()), [[path.name, path.stat().st_size, path.stat().st_mtime_ns] for path in files]]


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of the chat `messages` and the assistant's generation prompt, as training renders them."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def greedy_answer(model: Any, tokenizer: Any, messages: list[dict[str, str]], max_new_tokens: int) -> tuple[list, list]:
    """(prompt ids, the model's greedy answer ids up to and with its end token) after the chat `messages`."""
    import torch

    ids = prompt_ids(tokenizer, messages)
    tensor = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            tensor,
            attention_mask=torch.ones_like(tensor),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return ids, out[0, len(ids) :].tolist()
