"""A card as the fitted model sees it: a step's time, c, r(n), tokens/s alone, each with the band the fit's
leave-one-out error puts on it (spectune.gpu.fit)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

from spectune.errors import SpectuneError
from spectune.gpu.fit import CardModel, fit_report, read_by_batch
from spectune.gpu.published import published
from spectune.speedup import MAX_DRAFT_LEN, Weights, verify_ratio_between

GROUNDED_PROFILE = "gpu-grounded"  # the key of the reference card's profile in acceptance reports

Band = tuple[float, float]


@dataclass(frozen=True)
class GpuCard:
    name: str
    bandwidth: float  # bytes per second
    model: CardModel
    read_central: dict[int, float]  # read(n) from the central sweep
    read_band: dict[int, Band]  # the lowest and highest read(n) of the published sweeps
    spread: tuple[CardModel, ...]  # the leave-one-out refits, whose spread is the band on c
    error: float  # the relative error a step time carries (the fit's band)

    @property
    def label(self) -> str:
        """How a figure on this card is introduced wherever it is printed: a prediction, never a measurement."""
        return f"predicted on an {self.name} (±{self.error:.0%} a step)"

    def step_seconds(self, weights: Weights, tokens: int = 1, model: CardModel | None = None) -> float:
        return (model or self.model).step_seconds(self.bandwidth, weights, self.read_central[tokens])

    def tokens_per_s(self, weights: Weights) -> tuple[float, Band]:
        """Decode speed alone, with its band."""
        speed = 1.0 / self.step_seconds(weights)
        return speed, (speed / (1 + self.error), speed / (1 - self.error))

    def cost_ratio(self, draft: Weights, target: Weights, model: CardModel | None = None) -> float:
        """c on this card: a draft step over a target step."""
        return self.step_seconds(draft, model=model) / self.step_seconds(target, model=model)

    def cost_ratio_band(self, draft: Weights, target: Weights) -> Band:
        """c under every leave-one-out refit: how much c moves with the rows the fit rests on."""
        ratios = [self.cost_ratio(draft, target, model) for model in (self.model, *self.spread)]
        return min(ratios), max(ratios)

    def verify_ratios(self, target: Weights, read: dict[int, float] | None = None) -> dict[str, float]:
        """r(n) on this card for n = 2 .. MAX_DRAFT_LEN + 1, keyed as a measured profile's."""
        read = read or self.read_central
        floor = target.layers * self.model.layer_seconds
        bytes_part = self.step_seconds(target) - floor
        return {str(n): (floor + bytes_part * read[n]) / (floor + bytes_part) for n in range(2, MAX_DRAFT_LEN + 2)}

    def verify_band(self, target: Weights) -> tuple[dict[str, float], dict[str, float]]:
        """r(n) at the lowest and the highest read(n) of the published sweeps."""
        return tuple(
            self.verify_ratios(target, {n: band[side] for n, band in self.read_band.items()}) for side in (0, 1)
        )  # type: ignore[return-value]

    def band_of(self, speedup: Callable[[float, dict[str, float]], float], cost_band: Band, target: Weights) -> Band:
        """A speedup's band: `speedup(c, r profile)` at its worst (the highest c and r) and best (the lowest)."""
        low_r, high_r = self.verify_band(target)
        return speedup(cost_band[1], high_r), speedup(cost_band[0], low_r)

    def speedup_band(self, tau: float, drafted: float, cost_band: Band, target: Weights) -> Band:
        """S = τ / (r(d+1) + d·c) at its worst and best, d the mean drafted (r interpolated between sizes)."""
        return self.band_of(lambda c, r: tau / (verify_ratio_between(r, drafted + 1) + drafted * c), cost_band, target)


def _card(name: str, bandwidth: float, model: CardModel | None = None) -> GpuCard:
    report, table = fit_report(), published()
    model = model or report.model
    reads = [read_by_batch(sweep, model) for sweep in table.sweeps.values()]
    band = {n: (min(r[n] for r in reads), max(r[n] for r in reads)) for n in reads[0]}
    spread = tuple(
        held.model if model is report.model else replace(held.model, layer_seconds=model.layer_seconds)
        for held in report.held_out
    )
    return GpuCard(name, bandwidth, model, read_by_batch(table.sweeps["central"], model), band, spread, report.band)


@cache
def card_named(name: str) -> GpuCard:
    cards = published().cards
    if name not in cards:
        raise SpectuneError(
            f"--card {name!r}: not in the published table; one of {', '.join(cards)}, or give "
            "--bandwidth (GB/s) and optionally --floor-us for another card"
        )
    return _card(name, cards[name].bandwidth)


def custom_card(bandwidth_gbs: float, floor_us: float | None = None) -> GpuCard:
    """A card not in the table: its bandwidth, and the fitted floor unless one is given."""
    if bandwidth_gbs <= 0 or (floor_us is not None and floor_us < 0):
        raise SpectuneError("--bandwidth must be > 0 GB/s and --floor-us >= 0")
    model = fit_report().model
    if floor_us is not None:
        model = replace(model, layer_seconds=floor_us * 1e-6)
    return _card(f"card at {bandwidth_gbs:g} GB/s", bandwidth_gbs * 1e9, model)


def reference_card() -> GpuCard:
    """The reference story's class of card (published.yaml's reference_card)."""
    return card_named(published().reference_card.name)
