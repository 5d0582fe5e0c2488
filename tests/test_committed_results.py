"""The committed results (benchmarks/results/, older ones under history/) hold to the bars the project set itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"
CURRENT = sorted(RESULTS.glob("speculative_*.json"))
TTFT_BAR = 1.05  # a caller's first token with any draft, over the target alone's: the first token is its own step


def drafts_of(result: dict) -> dict[str, dict]:
    """Each variant's summary: the benchmarks' result rows, or a `spectune bench` report's summary."""
    return result["drafts"] if isinstance(next(iter(result["drafts"].values())), dict) else result["summary"]


def test_the_results_are_found():
    assert len(CURRENT) >= 5


@pytest.mark.parametrize("path", CURRENT, ids=lambda path: path.name)
def test_no_draft_delays_the_first_token(path):
    for name, figures in drafts_of(json.loads(path.read_text())).items():
        for key in ("ttft_ms", "cold_ttft_ms"):
            if figures.get(key) and figures.get(f"target_{key}"):
                ratio = figures[key] / figures[f"target_{key}"]
                assert ratio <= TTFT_BAR, f"{path.name} {name}: {key} {ratio:.3f}x the target alone's"
