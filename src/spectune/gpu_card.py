"""A GPU prediction grounded in published llama.cpp CUDA measurements, beside the bytes-only one.

The bytes-only prediction (speedup.step_cost_ratio, r = 1) treats a decode step as pure weight reading. On a real
card two things break it for small models: every layer costs a floor of kernel launches and syncs however few bytes
it reads (so a 0.5B does not decode 3x faster than a 1.5B), and verifying n tokens reads the weights once but the
batch's compute stops hiding behind that read as n grows (r(n) > 1). The card model:

    t(model, n tokens) = layers · floor + step_read / bandwidth · read(n)

`floor` comes from a named card's published single-stream decode speed, `read(n)` from llama.cpp's published
micro-batch sweep (docs/design.md, "A GPU prediction grounded in published figures", cites both). c is
t(draft, 1) / t(target, 1) and r(n) = t(target, n) / t(target, 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spectune.speedup import MAX_DRAFT_LEN, Weights

GROUNDED_PROFILE = "gpu-grounded"  # the key of the reference card's profile in acceptance reports

# The reference card: an NVIDIA GeForce RTX 4080 (16 GB GDDR6X, 716.8 GB/s), the reference story's gaming class.
RTX_4080_BANDWIDTH = 716.8e9
# Its published decode speed of a small model through llama.cpp, one request (pavlokhmel.com, "LLM throughput
# benchmark on 13 GPUs and 10 models", 2026-06-07): LFM2.5-1.2B Q4_K_M, 0.7 GB, 16 layers (tied head), 614 tokens/s.
RTX_4080_SMALL_MODEL = (0.7e9, 16, 614.0)  # (bytes a step reads, layers, tokens/s)
# llama.cpp's micro-batch sweep (ggml-org/llama.cpp PR 15802, RTX 3090, 936.2 GB/s, llama 8B Q4_0 of 4.33 GiB with
# 32 layers, its untied 128256 x 4096 Q4_0 embedding not read): tokens/s at micro-batch n = 1..8.
SWEEP_BANDWIDTH = 936.2e9
SWEEP_STEP_READ = 4.33 * 2**30 - 128256 * 4096 * 18 / 32  # Q4_0: 18 bytes per 32 weights
SWEEP_LAYERS = 32
SWEEP_TOKENS_PER_SECOND = (155.02, 277.36, 390.23, 468.95, 514.50, 529.37, 559.17, 570.67)


def weight_read_by_batch() -> dict[int, float]:
    """read(n): what reading the weights for a batch of n costs over one token, from the sweep (its floor taken off
    as the sweep's own one-token step reveals it); n = 9 extrapolated from 7 -> 8."""
    one_token = 1.0 / SWEEP_TOKENS_PER_SECOND[0]
    floor = one_token - SWEEP_STEP_READ / SWEEP_BANDWIDTH
    read = {n: (n / speed - floor) / (one_token - floor) for n, speed in enumerate(SWEEP_TOKENS_PER_SECOND, start=1)}
    read[9] = 2 * read[8] - read[7]
    return read


def layer_floor_seconds() -> float:
    """The per-layer floor of one decode step on the card: its published step time less the bytes at bandwidth."""
    step_read, layers, tokens_per_second = RTX_4080_SMALL_MODEL
    return (1.0 / tokens_per_second - step_read / RTX_4080_BANDWIDTH) / layers


@dataclass(frozen=True)
class GpuCard:
    """A named card as llama.cpp's CUDA backend decodes on it (see the module docstring)."""

    name: str
    bandwidth: float  # bytes per second
    layer_seconds: float  # the floor one layer costs a step
    read_by_batch: dict[int, float] = field(default_factory=dict)  # n -> read(n)

    def step_seconds(self, weights: Weights, tokens: int = 1) -> float:
        return weights.layers * self.layer_seconds + weights.step_read() / self.bandwidth * self.read_by_batch[tokens]

    def cost_ratio(self, draft: Weights, target: Weights) -> float:
        """c on this card: a draft step over a target step."""
        return self.step_seconds(draft) / self.step_seconds(target)

    def verify_ratios(self, target: Weights) -> dict[str, float]:
        """r(n) on this card for n = 2 .. MAX_DRAFT_LEN + 1, keyed as a measured profile's."""
        one = self.step_seconds(target)
        return {str(n): self.step_seconds(target, n) / one for n in range(2, MAX_DRAFT_LEN + 2)}


REFERENCE_CARD = GpuCard("RTX 4080 16 GB", RTX_4080_BANDWIDTH, layer_floor_seconds(), weight_read_by_batch())
