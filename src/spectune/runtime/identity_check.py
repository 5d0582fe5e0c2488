"""Identical answers, measured on the GGUF and the device it runs on: a verification batch's logits against the same
tokens decoded one at a time. runtime/build.py says where the CPU kernels promise it by rule; a GPU's kernels, or
any build the rule does not know, are checked this way instead of assumed (`spectune doctor`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spectune.runtime.llama import LlamaModel
from spectune.threads import ALL_LAYERS

# A caller's turn, long enough that each verification batch reads a KV cache of some length.
CHECK_TEXT = (
    "Hello, I would like to book a table for four people tomorrow evening at eight, near the window if you can, "
    "and could you tell me whether you have parking close by? My name is Alex and my number ends in two four."
)
BATCH = 5  # tokens verified together: a draft of k = 4 and the token after it
POSITIONS = (8, 24, 40)  # where each verification batch starts


@dataclass(frozen=True)
class IdentityCheck:
    equal: bool  # every batched logit equals its one-token logit, bit for bit
    max_difference: float  # the largest absolute difference seen (0.0 where equal)
    batches: int
    device: str


def check_identity(
    gguf: str | Path, exact: bool = True, gpu_layers: int = ALL_LAYERS, threads: int | None = None
) -> IdentityCheck:
    """Decode BATCH tokens at each of POSITIONS in one batch and one at a time, on the device the GGUF loads on."""
    model = LlamaModel(gguf, n_ctx=128, threads=threads, exact=exact, gpu_layers=gpu_layers)
    try:
        tokens = model.tokenize(CHECK_TEXT)
        equal, difference = True, 0.0
        for start in POSITIONS:
            verified = tokens[start : start + BATCH]
            model.truncate(0)
            model.decode(tokens[:start], 0, all_logits=False)
            batched = model.decode(verified, start)
            model.truncate(start)
            single = np.concatenate([model.decode([token], start + i) for i, token in enumerate(verified)])
            equal = equal and bool(np.array_equal(batched, single))
            difference = max(difference, float(np.nanmax(np.abs(batched - single))))
        return IdentityCheck(equal, difference, len(POSITIONS), model.device)
    finally:
        model.close()
