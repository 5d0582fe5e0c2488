"""The card model, fitted by least squares on the published rows, and its error by leave-one-out.

    t(step) = layers · floor + step_read / (η · bandwidth) · read(n) + http

floor: what a layer costs a step however few bytes it reads (kernel launches, syncs); η: the fraction of the card's
specified bandwidth a quantized decode reaches (it can exceed 1 where the floor absorbs part of the read); http: the
per-token work of a server timed by its client (rows measured that way only); read(n): how reading the weights for a
batch of n grows over one token, from a published micro-batch sweep (read(1) = 1). One floor and one η for every card:
the rows do not identify them card by card (see docs/design.md, "A GPU prediction calibrated on published figures").
"""

from __future__ import annotations

import datetime
import statistics
from dataclasses import dataclass
from functools import cache

import numpy as np

from spectune.gpu.published import HTTP, PublishedRow, Sweep, published
from spectune.speedup import Weights

# The rule for which rows are fitted (the others are listed, and predicted, but not fitted)
FIRST_FITTED_DATE = datetime.date(2025, 1, 1)  # llama.cpp's CUDA decode changed since (graphs, MMVQ): older is slower
MIN_COMPUTE = 7.0  # before Volta llama.cpp runs other quantized kernels (no int8 tensor paths), a term no row fits
MAX_DEPTH = 1024  # a long context reads its KV cache every step, which the model leaves out (voice turns are short)
FITTED_ARCH = "dense"  # hybrid layers, MoE experts and per-layer embeddings read other than their file says
QUANTIZED = ("F16", "BF16", "F32")  # full-width rows run cuBLAS, not the quantized kernels spectune's GGUFs use
HTTP_WEIGHT = 0.5  # a client's timing carries its own noise (network, the client)
BAND_QUANTILE = 0.8  # a band covers this share of the leave-one-out errors


def excluded(row: PublishedRow) -> str | None:
    """Why a row is not fitted, or None."""
    if row.shape.arch != FITTED_ARCH:
        return f"{row.shape.arch} architecture"
    if row.card.compute < MIN_COMPUTE:
        return f"compute capability {row.card.compute} < {MIN_COMPUTE}"
    if row.shape.quant in QUANTIZED:
        return f"{row.shape.quant} weights"
    if row.depth > MAX_DEPTH:
        return f"timed at a depth of {row.depth} tokens"
    if row.date < FIRST_FITTED_DATE:
        return f"a llama.cpp build of {row.date.isoformat()}, before {FIRST_FITTED_DATE.isoformat()}"
    return None


@dataclass(frozen=True)
class CardModel:
    layer_seconds: float  # the floor
    efficiency: float  # η
    http_seconds: float  # a server's per-token work, timed through HTTP

    def step_seconds(self, bandwidth: float, weights: Weights, read_factor: float = 1.0, http: bool = False) -> float:
        read = weights.step_read() / (self.efficiency * bandwidth) * read_factor
        return weights.layers * self.layer_seconds + read + (self.http_seconds if http else 0.0)

    def tokens_per_s(self, row: PublishedRow) -> float:
        return 1.0 / self.step_seconds(row.card.bandwidth, row.shape.weights(), http=row.method == HTTP)


def fit(rows: list[PublishedRow]) -> CardModel:
    """Least squares on relative error: each row's predicted step over its published one, weighted by method."""
    design, target = [], []
    for row in rows:
        seconds, weights = 1.0 / row.tokens_per_s, row.shape.weights()
        weight = np.sqrt(HTTP_WEIGHT if row.method == HTTP else 1.0)
        columns = [weights.layers, weights.step_read() / row.card.bandwidth, float(row.method == HTTP)]
        design.append(np.array(columns) / seconds * weight)
        target.append(weight)
    (floor, inverse_efficiency, http), *_ = np.linalg.lstsq(np.array(design), np.array(target), rcond=None)
    return CardModel(float(floor), 1.0 / float(inverse_efficiency), float(http))


@dataclass(frozen=True)
class HeldOut:
    row: PublishedRow
    model: CardModel  # fitted without the row
    predicted: float  # its tokens/s from that model

    @property
    def error(self) -> float:
        return self.predicted / self.row.tokens_per_s - 1.0


@dataclass(frozen=True)
class FitReport:
    model: CardModel
    fitted: list[PublishedRow]
    excluded: list[tuple[PublishedRow, str]]
    held_out: list[HeldOut]  # one per fitted row

    @property
    def median_error(self) -> float:
        return statistics.median(abs(h.error) for h in self.held_out)

    @property
    def band(self) -> float:
        """The relative error a step-time prediction carries: BAND_QUANTILE of the leave-one-out errors."""
        errors = sorted(abs(h.error) for h in self.held_out)
        return errors[min(len(errors) - 1, int(BAND_QUANTILE * len(errors)))]


def leave_one_out(rows: list[PublishedRow]) -> list[HeldOut]:
    held = []
    for index, row in enumerate(rows):
        model = fit(rows[:index] + rows[index + 1 :])
        held.append(HeldOut(row, model, model.tokens_per_s(row)))
    return held


@cache
def fit_report() -> FitReport:
    table = published()
    reasons = [(row, excluded(row)) for row in table.rows]
    rows = [row for row, reason in reasons if reason is None]
    return FitReport(fit(rows), rows, [(r, why) for r, why in reasons if why], leave_one_out(rows))


def read_by_batch(sweep: Sweep, model: CardModel) -> dict[int, float]:
    """read(n) from a sweep: its step at micro-batch n less the model's floor, over the same at n = 1. Sizes the sweep
    skipped are interpolated and n = 9 extrapolated linearly."""
    weights = sweep.shape.weights()
    floor = weights.layers * model.layer_seconds
    one = 1.0 / sweep.tokens_per_s[1] - floor
    read = {n: (n / speed - floor) / one for n, speed in sweep.tokens_per_s.items()}
    known = sorted(read)
    for n in range(2, 10):
        if n not in read:
            low = max((m for m in known if m < n), default=known[0])
            high = min((m for m in known if m > n), default=None)
            if high is None:  # past the sweep: the last slope
                low, high = known[-2], known[-1]
            read[n] = read[low] + (read[high] - read[low]) * (n - low) / (high - low)
    return dict(sorted(read.items()))
