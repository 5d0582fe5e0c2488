"""The committed results (benchmarks/results/, older ones under history/) hold to the bars the project set itself."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from spectune.bench.report import read_result
from spectune.bench.summary import Pooled, measured_figures, predicted_here
from spectune.runtime.registry import Variant

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"
CURRENT = sorted(RESULTS.glob("speculative_*.json*"))  # a result over 1 MB is committed gzipped
TTFT_BAR = 1.05  # a caller's first token with any draft, over the target alone's: the first token is its own step


def drafts_of(result: dict) -> dict[str, dict]:
    """Each variant's summary: the benchmarks' result rows, or a `spectune bench` report's summary."""
    return result["drafts"] if isinstance(next(iter(result["drafts"].values())), dict) else result["summary"]


def test_the_results_are_found():
    assert len(CURRENT) >= 5


@pytest.mark.parametrize("path", CURRENT, ids=lambda path: path.name)
def test_no_draft_delays_the_first_token(path):
    for name, figures in drafts_of(read_result(path)).items():
        for key in ("ttft_ms", "cold_ttft_ms"):
            if figures.get(key) and figures.get(f"target_{key}"):
                ratio = figures[key] / figures[f"target_{key}"]
                assert ratio <= TTFT_BAR, f"{path.name} {name}: {key} {ratio:.3f}x the target alone's"


def close(fresh: object, committed: object) -> bool:
    if isinstance(fresh, list):
        return isinstance(committed, list) and len(fresh) == len(committed) and all(map(close, fresh, committed))
    if isinstance(fresh, float):
        return math.isclose(fresh, committed, rel_tol=1e-9, abs_tol=1e-12)
    return fresh == committed


@pytest.mark.parametrize("path", CURRENT, ids=lambda path: path.name)
def test_every_summary_is_what_its_rows_say_with_todays_code(path):
    """The bench's summary arithmetic, rerun on the committed per-prompt rows, gives every committed figure it
    covers: what the rows measured, and the prediction here where the summary kept the profile it used."""
    result = read_result(path)
    checked = 0
    for name, committed in drafts_of(result).items():
        has_model = Variant.parse(name).draft is not None
        pooled = Pooled.of([row["variants"][name] for row in result["prompts"]], has_model)
        fresh = measured_figures(name, result["prompts"], pooled)
        if "profile" in committed:
            fresh |= predicted_here(pooled, committed["profile"])
        for key, value in fresh.items():
            if committed.get(key) is not None:
                assert close(value, committed[key]), f"{name} {key}: {value} now, {committed[key]} committed"
                checked += 1
    assert checked >= 20 * len(drafts_of(result))  # the rows really were read: a score of figures per variant
