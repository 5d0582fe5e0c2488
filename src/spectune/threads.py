"""Thread counts, set explicitly: on 2 cores the defaults stall (llama.cpp's batch threads) or oversubscribe."""

from __future__ import annotations

import os


def thread_count(requested: int | None = None) -> int:
    """`requested`, else $SPECTUNE_THREADS, else every core."""
    if requested:
        return requested
    return int(os.environ.get("SPECTUNE_THREADS") or os.cpu_count() or 1)


def configure_torch_threads(requested: int | None = None) -> int:
    import torch

    count = thread_count(requested)
    torch.set_num_threads(count)
    return count
