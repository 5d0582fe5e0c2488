"""The bench's serving verdict (bench/serving.py) and its stall re-timing (bench/stalls.py), on hand-built rows."""

from __future__ import annotations

import pytest

from spectune.bench.serving import FASTEST, serving_choice, serving_lines
from spectune.bench.stalls import retime_stalls, stall_lines, stalled
from spectune.layout import TARGET


def figures(tokens: int, seconds: float, **peers: tuple[int, float]) -> dict:
    row = {"tokens": tokens, "produced": tokens, "decode_seconds": seconds}
    return row | {field: {"tokens": n, "seconds": s} for field, (n, s) in peers.items()}


def row(index: int, target: float, draft: float, fastest: float, llama: float) -> dict:
    """A prompt of 10 tokens per side, each side's decode seconds as given."""
    return {
        "prompt": index,
        "variants": {
            TARGET: figures(10, target, llama_cpp_defaults=(10, llama)),
            "sft": figures(10, draft),
            FASTEST: figures(10, fastest),
        },
    }


def test_serving_chooses_the_fastest_alone_where_no_draft_pays_and_says_what_it_yields():
    rows = [row(i, target=1.0, draft=0.9, fastest=0.8, llama=0.76) for i in range(4)]
    choice = serving_choice(rows, ["sft"])
    assert choice["mode"] == "fastest" and choice["best_variant"] == "sft"
    assert choice["fastest_tokens_per_second"] == pytest.approx(12.5)
    assert choice["best_variant_tokens_per_second"] == pytest.approx(100 / 9)
    assert choice["over_llama_server_defaults"] == pytest.approx(0.76 / 0.8)
    assert "the target alone at llama.cpp's fastest settings" in serving_lines(choice)[1]


def test_serving_speculates_where_the_draft_beats_the_fastest_alone():
    rows = [row(i, target=1.0, draft=0.5, fastest=0.8, llama=0.76) for i in range(4)]
    choice = serving_choice(rows, ["sft"])
    assert choice["mode"] == "speculative"
    assert choice["over_llama_server_defaults"] == pytest.approx(0.76 / 0.5)
    assert "speculative with sft" in serving_lines(choice)[1]


def test_no_fastest_row_no_verdict():
    rows = [{"prompt": 0, "variants": {TARGET: figures(10, 1.0), "sft": figures(10, 0.5)}}]
    assert serving_choice(rows, ["sft"]) is None and serving_lines(None) == []


def test_a_side_over_three_times_its_median_is_found_with_the_side_named():
    rows = [row(i, target=1.0, draft=0.9, fastest=0.8, llama=0.76) for i in range(5)]
    rows[2]["variants"]["sft"]["decode_seconds"] = 2.8  # 3.1x its median: a stall
    rows[3]["variants"][TARGET]["llama_cpp_defaults"]["seconds"] = 2.4  # llama.cpp's side
    rows[4]["variants"][TARGET]["decode_seconds"] = 2.9  # 2.9x: not over
    assert stalled(rows) == {2: ["sft"], 3: [f"{TARGET} (llama_cpp_defaults)"]}


def test_a_stalled_prompt_is_timed_again_and_one_still_over_is_reported():
    rows = [row(i, target=1.0, draft=0.9, fastest=0.8, llama=0.76) for i in range(5)]
    rows[1]["variants"][FASTEST]["decode_seconds"] = 5.0
    rows[4]["variants"][TARGET]["decode_seconds"] = 9.0
    again = {1: row(1, 1.0, 0.9, 0.8, 0.76), 4: row(4, 9.5, 0.9, 0.8, 0.76)}  # prompt 4 stalls again
    new_rows, retimed = retime_stalls(rows, again.__getitem__)
    assert new_rows[1] is again[1] and new_rows[0] is rows[0]
    assert retimed == [
        {"prompt": 1, "sides": [FASTEST], "still_over": []},
        {"prompt": 4, "sides": [TARGET], "still_over": [TARGET]},
    ]
    assert (
        "2 prompts re-timed" in stall_lines(retimed)[1]
        and "Still over after re-timing: 1 (5)" in stall_lines(retimed)[1]
    )
    assert "no prompt" in stall_lines([])[1]
