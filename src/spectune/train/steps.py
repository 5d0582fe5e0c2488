"""A trainer's steps as spectune's progress line (with the last logged loss) instead of its printed log
dictionaries and tqdm bars; --verbose keeps the trainer's own. Imported by the trainers with transformers."""

from __future__ import annotations

from typing import Any

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

from spectune.progress import Ticker
from spectune.terminal import terminal
from spectune.train.common import is_main_process


class StepProgress(TrainerCallback):
    def __init__(self, description: str) -> None:
        self.description, self.loss = description, ""
        self.ticker: Ticker | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ticker = Ticker(state.max_steps, self.description)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.loss = f"loss {float(logs['loss']):.3f}"

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ticker is not None:
            self.ticker.update(state.global_step, self.loss)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ticker is not None:
            self.ticker.close()


def show_steps(trainer: Any, description: str) -> None:
    """Unless --verbose: the trainer's steps as one progress line named `description` (rank 0 only)."""
    if terminal.verbose:
        return
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if is_main_process():
        trainer.add_callback(StepProgress(description))
