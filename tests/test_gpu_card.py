"""The reference card's model against the published figures it is grounded in: a changed constant or formula that
no longer reproduces them fails here."""

from __future__ import annotations

import pytest

from spectune.gpu_card import (
    REFERENCE_CARD,
    RTX_4080_SMALL_MODEL,
    SWEEP_BANDWIDTH,
    SWEEP_LAYERS,
    SWEEP_STEP_READ,
    SWEEP_TOKENS_PER_SECOND,
    GpuCard,
)
from spectune.speedup import Weights, step_cost_ratio


def weights(step_read: float, layers: int) -> Weights:
    return Weights(total=round(step_read), embedding=0, rows=1, tied=False, layers=layers)


def test_the_card_decodes_its_published_small_model_at_its_published_speed():
    step_read, layers, tokens_per_second = RTX_4080_SMALL_MODEL
    assert REFERENCE_CARD.step_seconds(weights(step_read, layers)) == pytest.approx(1 / tokens_per_second)


def test_the_sweep_card_reproduces_every_published_micro_batch():
    # the same model on the sweep's own card: its floor per layer, the card's read(n)
    floor = (1 / SWEEP_TOKENS_PER_SECOND[0] - SWEEP_STEP_READ / SWEEP_BANDWIDTH) / SWEEP_LAYERS
    sweep_card = GpuCard("RTX 3090", SWEEP_BANDWIDTH, floor, REFERENCE_CARD.read_by_batch)
    model = weights(SWEEP_STEP_READ, SWEEP_LAYERS)
    for n, speed in enumerate(SWEEP_TOKENS_PER_SECOND, start=1):
        assert sweep_card.step_seconds(model, n) == pytest.approx(n / speed)


def test_a_small_sibling_costs_more_than_its_bytes_and_a_one_layer_head_little():
    # Qwen2.5-Coder 1.5B (28 layers) and 0.5B (24 layers) at 0.40 of its bytes: the floor lifts c well above 0.40;
    # a one-layer head reading 0.06 of the bytes stays cheap, its floor one layer of 28
    target, sibling, head = weights(1.1e9, 28), weights(0.44e9, 24), weights(0.066e9, 1)
    assert REFERENCE_CARD.cost_ratio(sibling, target) > step_cost_ratio(sibling, target) + 0.15
    assert REFERENCE_CARD.cost_ratio(head, target) < 0.1


def test_verification_costs_more_than_one_step_and_less_for_a_floor_bound_model():
    big, tiny = REFERENCE_CARD.verify_ratios(weights(8e9, 32)), REFERENCE_CARD.verify_ratios(weights(1e7, 4))
    assert list(big) == [str(n) for n in range(2, 10)]
    assert all(1.0 < tiny[n] < big[n] for n in big)
    assert big["9"] > 2.0 and tiny["9"] < 1.2
