"""The plain training loop of the heads spectune trains itself (EAGLE-3 heads, MTP assistants): AdamW with warm-up
and cosine decay over shuffled items, checkpoints every `save_steps` that `resume` continues from, and a held-out
measure at each checkpoint (how it grows with training)."""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spectune.atomic import atomic_path
from spectune.progress import Ticker
from spectune.train.common import TrainConfig, console, last_checkpoint

STATE = "head.pt"


def resume_from(module: Any, optimizer: Any, schedule: Any, config: TrainConfig) -> int:
    """The step to start at: that of the last complete checkpoint with `resume` (its state loaded), else 0."""
    import torch

    checkpoint = last_checkpoint(config.out) if config.resume else None
    if checkpoint is None:
        if config.resume:
            console.print("[yellow]--resume: no complete checkpoint yet, starting from the beginning[/]")
        shutil.rmtree(config.out / "checkpoints", ignore_errors=True)
        return 0
    state = torch.load(checkpoint / STATE, weights_only=True)
    module.load_state_dict(state["head"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    return int(checkpoint.name.split("-")[1])


def save_checkpoint(module: Any, optimizer: Any, schedule: Any, out: Path, step: int) -> None:
    """checkpoint-STEP/ with the module, optimizer and schedule (trainer_state.json last, as last_checkpoint
    expects); the older one removed."""
    import torch

    folder = out / "checkpoints" / f"checkpoint-{step}"
    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        state = {"head": module.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()}
        torch.save(state, tmp / STATE)
        (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    for older in folder.parent.glob("checkpoint-*"):
        if older != folder:
            shutil.rmtree(older, ignore_errors=True)


@dataclass(frozen=True)
class Fitted:
    """A training run's steps, the held-out measure before it, after it and at every checkpoint, and its seconds."""

    steps: int
    before: list[float]
    after: list[float]
    by_steps: dict[int, list[float]]
    seconds: float


def fit_measured(
    module: Any,
    items: list[Any],
    loss_of: Callable[[list[Any]], Any],
    evaluate: Callable[[], list[float]],
    config: TrainConfig,
    label: str,
) -> Fitted:
    """`fit`, with `evaluate()` before it and after it (the module then in eval mode), timed together."""
    started = time.perf_counter()
    before = evaluate()
    steps, curve = fit(module.train(), items, loss_of, evaluate, config, label)
    module.eval()
    after = evaluate()
    return Fitted(steps, before, after, {0: before, **curve, steps: after}, time.perf_counter() - started)


def fit(
    module: Any,
    items: list[Any],
    loss_of: Callable[[list[Any]], Any],
    evaluate: Callable[[], list[float]],
    config: TrainConfig,
    label: str,
) -> tuple[int, dict[int, list[float]]]:
    """Train `module` on `items` (`loss_of` a batch of them); the steps run and `evaluate()` at each checkpoint."""
    import torch

    per_epoch = math.ceil(len(items) / config.batch_size)
    total = config.max_steps or max(1, math.ceil(config.epochs * per_epoch / config.grad_accum))
    warmup = max(1, total // 30)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=config.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total))
    )
    start = resume_from(module, optimizer, schedule, config)
    ticker, curve = Ticker(total, label), {}
    for step in range(start, total):
        for micro in range(config.grad_accum):
            index = step * config.grad_accum + micro
            epoch, within = divmod(index, per_epoch)
            order = torch.randperm(len(items), generator=torch.Generator().manual_seed(config.seed + epoch))
            chosen = order[within * config.batch_size : (within + 1) * config.batch_size].tolist()
            loss = loss_of([items[i] for i in chosen])
            (loss / config.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if (step + 1) % config.save_steps == 0 and step + 1 < total:
            save_checkpoint(module, optimizer, schedule, config.out, step + 1)
            module.eval()
            curve[step + 1] = evaluate()
            module.train()
        ticker.update(step + 1, f"loss {loss.item():.3f}")
    ticker.close()
    return total, curve
