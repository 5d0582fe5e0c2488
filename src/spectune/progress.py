"""How far a long loop is: rich's transient bar on a terminal; elsewhere (a log file, CI, `nohup`) a plain line now
and then, so a stage that takes an hour does not stay silent in its log."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from typing import TypeVar

from rich.progress import track

Item = TypeVar("Item")
PLAIN_EVERY_SECONDS = 60.0


def progress(items: Sequence[Item], description: str, every_seconds: float = PLAIN_EVERY_SECONDS) -> Iterator[Item]:
    """Each item of `items`, with the loop's progress shown: a bar on a terminal, else a line at most every
    `every_seconds` and at the end (done, elapsed, the time left at the pace so far)."""
    if sys.stdout.isatty():
        yield from track(items, description=description, transient=True)
        return
    start = last = time.monotonic()
    for done, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if now - last >= every_seconds or done == len(items):
            left = (now - start) / done * (len(items) - done)
            print(f"{description}: {done}/{len(items)}, {now - start:.0f} s, about {left:.0f} s left", flush=True)
            last = now
