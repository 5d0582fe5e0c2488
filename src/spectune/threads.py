"""Thread counts, set explicitly: on 2 cores the defaults stall (llama.cpp's batch threads) or oversubscribe."""

from __future__ import annotations

import os

from pydantic import Field

from spectune.config import Settings

DEFAULT_N_CTX = 4096  # a model's context (per slot, in a server) where its user names none


ALL_LAYERS = -1  # llama.cpp offloads every layer (n_gpu_layers = -1)


class ThreadsSettings(Settings):
    """The one definition of a verb's thread count (torch's and llama.cpp's)."""

    threads: int | None = Field(
        None, ge=1, description="Threads for torch and llama.cpp (default: $SPECTUNE_THREADS or every core)."
    )


class LlamaSettings(ThreadsSettings):
    """How a verb's llama.cpp contexts run: its threads and its context length."""

    n_ctx: int = Field(DEFAULT_N_CTX, ge=64, description="Context length (per slot, in a server).")
    exact: bool = Field(True, description="Batched logits equal to one-token ones (identical greedy answers).")
    gpu_layers: int = Field(
        ALL_LAYERS,
        ge=ALL_LAYERS,
        description="Layers llama.cpp offloads to the GPU: -1 every one (the default), 0 none; a CPU build of "
        "llama.cpp runs them all on the CPU whatever this says.",
    )


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
