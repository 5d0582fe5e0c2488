"""How far a long task is: rich's transient bar on a terminal; elsewhere (a log file, CI, `nohup`) a plain line now
and then, so a stage that takes an hour does not stay silent in its log. Both go to the terminal, also while
the libraries' chatter goes to a log file (terminal.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TypeVar

from rich.progress import Progress, TextColumn

from spectune.terminal import terminal

Item = TypeVar("Item")
PLAIN_EVERY_SECONDS = 60.0


class Ticker:
    """`total` steps of `description`, reported as they are done (`update`), with a note such as the loss."""

    def __init__(self, total: int, description: str, every_seconds: float = PLAIN_EVERY_SECONDS) -> None:
        self.console, self.total, self.description = terminal.console(), total, description
        self.every_seconds = every_seconds
        self.start = self.last = time.monotonic()
        self.bar: Progress | None = None
        if self.console.is_terminal:
            columns = (*Progress.get_default_columns(), TextColumn("{task.fields[note]}"))
            self.bar = Progress(*columns, console=self.console, transient=True)
            self.task = self.bar.add_task(description, total=total, note="")
            self.bar.start()

    def update(self, done: int, note: str = "") -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, note=note)
            return
        now = time.monotonic()
        if now - self.last >= self.every_seconds or done == self.total:
            left = (now - self.start) / max(done, 1) * (self.total - done)
            noted = f", {note}" if note else ""
            line = f"{self.description}: {done}/{self.total}{noted}, {now - self.start:.0f} s, about {left:.0f} s left"
            print(line, file=self.console.file, flush=True)
            self.last = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def progress(items: Sequence[Item], description: str, every_seconds: float = PLAIN_EVERY_SECONDS) -> Iterator[Item]:
    """Each item of `items`, the loop's progress shown as it goes (a line at least at the end when not on a
    terminal: done, elapsed, the time left at the pace so far)."""
    ticker = Ticker(len(items), description, every_seconds)
    try:
        for done, item in enumerate(items, 1):
            yield item
            ticker.update(done)
    finally:
        ticker.close()
