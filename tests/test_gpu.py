"""The card model fitted on published figures (spectune.gpu): its error on rows left out of the fit, the band's
arithmetic, the reference story as its first check, and `spectune predict` on a committed run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from spectune.cli import main
from spectune.errors import SpectuneError
from spectune.gpu.card import card_named, custom_card, reference_card
from spectune.gpu.fit import BAND_QUANTILE, HTTP_WEIGHT, CardModel, excluded, fit, fit_report, leave_one_out
from spectune.gpu.predict import (
    PredictConfig,
    expected_tokens_by_position,
    on_card,
    on_card_of_steps,
    predict,
    shape_weights,
)
from spectune.gpu.published import HTTP, published
from spectune.runtime.llama import LlamaModel
from spectune.speedup import (
    Weights,
    expected_tokens,
    speedup_of_steps,
    steps_of,
    verify_ratio_at,
)

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"


def test_the_table_holds_the_cards_sizes_and_sources_the_fit_needs():
    table = published()
    cards = {row.card.name for row in table.rows}
    assert {"RTX 4060 Ti 16GB", "RTX 4080", "RTX 3090", "H100 SXM 80GB"} <= cards
    assert len(table.rows) >= 20 and len({row.shape.params for row in table.rows}) >= 5
    assert all(row.source.startswith("http") for row in table.rows)
    report = fit_report()
    assert len(report.fitted) + len(report.excluded) == len(table.rows)
    assert all(excluded(row) is None for row in report.fitted)


def test_the_fit_recovers_a_model_it_generated():
    # Rows made by a known model (floor 30 µs, η 0.8, HTTP 1 ms) are fitted back to it
    truth = CardModel(30e-6, 0.8, 1e-3)
    rows = [dataclasses.replace(r, tokens_per_s=truth.tokens_per_s(r)) for r in fit_report().fitted]
    fitted = fit(rows)
    assert fitted.layer_seconds == pytest.approx(30e-6, rel=1e-6)
    assert fitted.efficiency == pytest.approx(0.8, rel=1e-6)
    assert fitted.http_seconds == pytest.approx(1e-3, rel=1e-6)


def test_each_row_left_out_is_predicted_as_least_squares_says_without_refitting():
    """The leave-one-out predictions against another computation: one fit on every row and the hat matrix, whose
    diagonal gives each row's left-out residual in closed form (e_i / (1 - h_ii)), no fit without the row."""
    rows = fit_report().fitted
    weights = np.array([np.sqrt(HTTP_WEIGHT if row.method == HTTP else 1.0) for row in rows])
    seconds = np.array([1.0 / row.tokens_per_s for row in rows])
    columns = np.array(
        [[r.shape.weights().layers, r.shape.weights().step_read() / r.card.bandwidth, r.method == HTTP] for r in rows],
        dtype=float,
    )
    design = columns / seconds[:, None] * weights[:, None]
    hat = design @ np.linalg.inv(design.T @ design) @ design.T
    residuals = weights - hat @ weights
    left_out = weights - residuals / (1.0 - np.diag(hat))  # each row's fitted value from a fit without it
    predicted = 1.0 / (left_out * seconds / weights)  # back from the weighted, relative scale to tokens/s
    assert [h.predicted for h in leave_one_out(rows)] == pytest.approx(list(predicted), rel=1e-6)


def test_each_row_left_out_is_predicted_within_the_stated_error():
    report = fit_report()
    held = report.held_out
    # the goal: the median left-out row within 10%; the band covers at least the share of rows it states
    assert report.median_error <= 0.10
    within = [abs(h.error) <= report.band for h in held]
    assert sum(within) / len(within) >= BAND_QUANTILE


def test_the_reference_story_is_reproduced_from_the_fit():
    # Gemma 4 12B Q4_K_M alone on the story's card: within ±15% of its published 34 tokens/s, and inside its band
    table, card = published(), reference_card()
    speed, (low, high) = card.tokens_per_s(table.story.weights())
    assert table.story_tokens_per_s * 0.85 <= speed <= table.story_tokens_per_s * 1.15
    assert low <= table.story_tokens_per_s <= high
    # the story is a check, not a row of the fit, and the card has no fitted row of its own
    assert all(row.card.name != card.name for row in fit_report().fitted)


def test_the_band_brackets_each_figure():
    card = reference_card()
    target, draft = shape_weights("gemma-3-12b"), shape_weights("gemma-3-1b")
    speed, (low, high) = card.tokens_per_s(target)
    assert low == pytest.approx(speed / (1 + card.error)) and high == pytest.approx(speed / (1 - card.error))
    c, (low_c, high_c) = card.cost_ratio(draft, target), card.cost_ratio_band(draft, target)
    assert low_c <= c <= high_c
    low_r, high_r = card.verify_band(target)
    central = card.verify_ratios(target)
    assert all(low_r[n] <= central[n] <= high_r[n] for n in central)
    tau = expected_tokens(0.8, 3)
    worst, best = card.speedup_band(tau, 3.0, (low_c, high_c), target)
    assert worst == pytest.approx(tau / (high_r["4"] + 3 * high_c))
    assert best == pytest.approx(tau / (low_r["4"] + 3 * low_c))
    assert worst <= tau / (central["4"] + 3 * c) <= best


def test_a_card_by_bandwidth_and_floor():
    slow, fast = custom_card(288), custom_card(576)
    target = Weights(7_000_000_000, 0, 1, False, 48)
    assert slow.step_seconds(target) > fast.step_seconds(target)
    assert slow.step_seconds(target) == pytest.approx(card_named("RTX 4060 Ti 16GB").step_seconds(target))
    floorless = custom_card(288, floor_us=0.0)
    assert floorless.step_seconds(target) == pytest.approx(7e9 / (floorless.model.efficiency * 288e9))
    with pytest.raises(SpectuneError, match="--card"):
        card_named("RTX 9999")
    with pytest.raises(SpectuneError, match="bandwidth"):
        custom_card(-1)


def test_tau_by_position_is_the_iid_formula_for_one_alpha():
    assert expected_tokens_by_position([0.7], 4) == pytest.approx(expected_tokens(0.7, 4))
    assert expected_tokens_by_position([1.0, 0.5, 0.0], 5) == pytest.approx(1 + 1 + 0.5)


def refuse_to_load(*args, **kwargs) -> None:
    raise AssertionError("predict loaded a model")


def test_predict_answers_for_a_committed_run_without_loading_a_model(monkeypatch):
    # The tuned Qwen pair's domain bench (τ and the tokens each step drafted, as measured), its members by shape
    report = RESULTS / "speculative_qwen_sgd_domain.json"
    loaded = json.loads(report.read_text())
    summary = loaded["summary"]
    sibling = "24:392039360"
    config = PredictConfig(target="28:980098400", drafts={"generic": sibling, "seqkd": sibling}, report=report)
    monkeypatch.setattr(LlamaModel, "__init__", refuse_to_load)  # answered from shapes and the report alone
    result = predict(config)
    assert set(result["drafts"]) == set(summary)
    card, target = reference_card(), shape_weights("28:980098400")
    lookup = summary["ngram"]
    assert result["drafts"]["ngram"]["c"] == 0.0
    # from the steps the bench made (its rows), as its report and grounded_gpu.py compute it
    steps = steps_of([row["variants"]["ngram"] for row in loaded["prompts"]])
    assert steps is not None and steps[1] == sum(row["variants"]["ngram"]["verify_steps"] for row in loaded["prompts"])
    assert result["drafts"]["ngram"]["speedup"] == pytest.approx(
        speedup_of_steps(lookup["mean_accepted_len"], *steps, 0.0, card.verify_ratios(target))
    )
    committed = json.loads((RESULTS / "gpu_grounded.json").read_text())["bench_reports"][report.name]["ngram"]
    assert result["drafts"]["ngram"]["speedup"] == pytest.approx(committed["grounded"], rel=1e-3)
    for row in result["drafts"].values():
        assert row["speedup_band"][0] <= row["speedup"] <= row["speedup_band"][1]
    assert "predicted" in result["label"]


def test_predict_the_story_from_the_cli(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["predict", "--story"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "predicted on an RTX 4060 Ti 16GB" in out and "eagle3-head-12b" in out
    assert "Gemma 4 12B Q4_K_M alone" in out and "gemma-4-12b-assis" in out  # the name folds at 80 columns


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "junk"], "not a GGUF"),
        (["--target", "48:7e9", "--alpha", "d=1.5"], "probabilities"),
        (["--target", "48:7e9", "--drafts", "d=gemma-3-1b"], "no acceptance for d"),
        (["--floor-us", "10", "--story"], "--floor-us goes with --bandwidth"),
        (["--bandwidth", "nan", "--story"], "finite number"),
        (["--bandwidth", "inf", "--story"], "finite number"),
        (["--bandwidth", "300", "--floor-us", "nan", "--story"], "finite number"),
        (["--target", "24:inf"], "not a GGUF"),
        (["--target", "24:nan"], "not a GGUF"),
        (["--run", "no-such-run"], "no such folder"),
    ],
)
def test_predict_refuses_bad_input_saying_what(capsys, args, message):
    with pytest.raises(SystemExit) as exited:
        main(["predict", *args])
    assert exited.value.code != 0
    assert message in capsys.readouterr().err


def test_a_model_folder_is_read_at_q4_k_m_and_a_bad_one_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 6}}))
    (tmp_path / "model.safetensors").write_bytes(bytes(2000))  # 1,000 parameters at 16 bits
    weights = shape_weights(str(tmp_path))
    assert (weights.layers, weights.total) == (6, round(1000 * 4.85 / 8))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SpectuneError, match="num_hidden_layers"):
        shape_weights(str(tmp_path))


def test_a_bench_measured_step_by_step_is_predicted_on_the_card_by_its_own_steps():
    """on_card_of_steps (the bench's report, grounded_gpu.py, the README) equals on_card where every step drafted
    the same d, and weighs r(d+1) step by step where they differ."""
    card = reference_card()
    target = Weights(total=1_000_000_000, embedding=0, rows=1, tied=False, layers=28)
    draft = Weights(total=100_000_000, embedding=0, rows=1, tied=False, layers=4)
    even = on_card_of_steps(card, target, draft, 1.0, 2.5, [100, 100, 100], 100)  # every step drafted 3
    mean = on_card(card, target, draft, 1.0, 2.5, 3.0)
    assert even["speedup"] == pytest.approx(mean["speedup"]) and even["c"] == pytest.approx(mean["c"])
    assert even["speedup_band"] == pytest.approx(mean["speedup_band"])
    # half the steps drafted 1, half 5: the same mean d = 3, costed step by step
    mixed = on_card_of_steps(card, target, draft, 1.0, 2.5, [100, 50, 50, 50, 50], 100)
    r = card.verify_ratios(target)
    by_steps = 2.5 / ((verify_ratio_at(r, 2) + 1 * mean["c"] + verify_ratio_at(r, 6) + 5 * mean["c"]) / 2)
    assert mixed["speedup"] == pytest.approx(by_steps)
    lookup = on_card_of_steps(card, target, None, 0.0, 2.5, [100, 100, 100], 100)
    assert lookup["c"] == 0.0 and lookup["speedup"] == pytest.approx(2.5 / verify_ratio_at(r, 4))


def a_run(tmp_path, pair) -> tuple:
    """A run folder as the pipeline leaves it, as far as predict reads it: its GGUFs and its acceptance report."""
    import shutil

    run = tmp_path / "run"
    (run / "gguf").mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    shutil.copy(pair[0], run / "gguf" / "target.Q8_0.gguf")
    shutil.copy(pair[1], run / "gguf" / "sft.Q8_0.gguf")
    acceptance = {"drafts": [{"name": "sft", "alpha_by_position": {"1": 0.8, "2": 0.7, "3": 0.6}}]}
    (run / "acceptance.json").write_text(json.dumps(acceptance))
    return run, run / "acceptance.json"


def test_predict_reads_a_runs_pair_and_figures_with_no_flag_more(tmp_path, pair, capsys):
    """Before: --report RUN/acceptance.json raised KeyError: 'bytes_c', and a bench report asked for every draft's
    shape by hand although the run folder holds every GGUF."""
    run, acceptance = a_run(tmp_path, pair)
    by_hand = predict(PredictConfig(target=str(pair[0]), drafts={"sft": str(pair[1])}, alpha={"sft": "0.8,0.7,0.6"}))
    for args in (["--run", str(run)], ["--report", str(acceptance)]):
        with pytest.raises(SystemExit) as exited:
            main(["predict", *args])
        assert exited.value.code == 0
        assert f"acceptance from {acceptance}" in capsys.readouterr().out
        result = predict(PredictConfig(report=acceptance) if "--report" in args else PredictConfig(run=run))
        assert result["drafts"]["sft"]["speedup"] == pytest.approx(by_hand["drafts"]["sft"]["speedup"])
    (run / "gguf" / "sft.Q8_0.gguf").unlink()
    with pytest.raises(SystemExit) as exited:
        main(["predict", "--run", str(run)])
    assert exited.value.code == 2 and "--drafts sft=SPEC, or the run folder" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"\x00\xff\xfe binary", b'{"drafts": [{"nom": 1}]}', b"[1, 2]", b'"text"'])
def test_a_report_of_the_wrong_kind_is_one_line_and_exit_2(tmp_path, content, capsys):
    report = tmp_path / "report.json"
    report.write_bytes(content)
    with pytest.raises(SystemExit) as exited:
        main(["predict", "--target", "24:1e9", "--report", str(report)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith(f"error: {report}: not a") and "Traceback" not in err
