"""What a person reads while spectune works: one line per stage and the stages' own progress. What the libraries
say meanwhile (transformers, datasets, TRL, accelerate, peft, bitsandbytes: progress bars, log records, warnings,
prints) goes to the stage's log file in the run folder instead; `--verbose` lets it all through."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

# Loggers whose records are chatter around what spectune says ("py.warnings": Python warnings, once captured).
LIBRARY_LOGGERS = (
    "transformers",
    "datasets",
    "trl",
    "accelerate",
    "peft",
    "bitsandbytes",
    "huggingface_hub",
    "torch",
    "httpx",
    "filelock",
    "py.warnings",
)


class Terminal:
    """Where spectune speaks: the terminal the process started with, also while a stage's chatter is redirected."""

    def __init__(self) -> None:
        self.verbose = False
        self.live: Console | None = None  # while chatter is redirected: the one console on the real stdout

    def console(self) -> Console:
        """The console to speak on (one instance while a stage runs: its live displays nest)."""
        return self.live if self.live is not None else Console()


terminal = Terminal()


def _silence_progress_bars(silent: bool) -> None:
    """The libraries' own progress bars (datasets' map, hub downloads, transformers' loading) off or back on."""
    import datasets
    import huggingface_hub
    import transformers

    if silent:
        datasets.disable_progress_bars()
        huggingface_hub.utils.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    else:
        datasets.enable_progress_bars()
        huggingface_hub.utils.enable_progress_bars()
        transformers.utils.logging.enable_progress_bar()


@contextlib.contextmanager
def chatter_to(log_path: Path) -> Iterator[Console]:
    """Run the block with the libraries' output in `log_path` and spectune's own lines still on the terminal
    (nothing moves with --verbose); yields the console to speak on."""
    if terminal.verbose:
        yield terminal.console()
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    saved = [(logger.handlers[:], logger.propagate) for logger in loggers]
    with open(log_path, "a", encoding="utf-8") as log:
        handler = logging.StreamHandler(log)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        for logger in loggers:  # a logger's own handler keeps the stream it was made with: replace it
            logger.handlers, logger.propagate = [handler], False
        logging.captureWarnings(True)
        _silence_progress_bars(True)
        terminal.live = Console(file=sys.stdout)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield terminal.live
        finally:
            terminal.live = None
            _silence_progress_bars(False)
            logging.captureWarnings(False)
            for logger, (handlers, propagate) in zip(loggers, saved, strict=True):
                logger.handlers, logger.propagate = handlers, propagate
