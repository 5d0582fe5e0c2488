"""The arithmetic behind the README's columns that benchmark scripts compute: exact expectations on hand-built rows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from spectune.gpu.card import reference_card
from spectune.speedup import Weights, verify_ratio_between

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def script(name: str):
    sys.path.insert(0, str(BENCHMARKS))  # the scripts import their siblings (pipeline_run)
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_an_eagle3_answer_is_the_target_alones_or_its_continuation_past_the_limit():
    same_answer = script("eagle3").same_answer
    assert same_answer("Table for two.", "Table for two.", cut=False)
    assert not same_answer("Table for two. At", "Table for two.", cut=False)  # ran on though the target stopped
    assert same_answer("Table for two. At", "Table for two.", cut=True)  # the tool decodes past -n
    assert not same_answer(None, "Table", cut=True)
    assert not same_answer("Tables for", "Table for two", cut=True)


def test_the_eagle3_summary_counts_an_identical_answer_by_the_target_alones_tokens():
    eagle3 = script("eagle3")
    rows = [
        {
            "variants": {
                eagle3.TARGET: {"tokens": 10},  # llama.cpp's tool counted one more for the same answer
                "head": {"tokens": 11, "seconds": 0.5, "drafted": 8, "accepted": 6, "identical": True},
            }
        },
        {
            "variants": {
                eagle3.TARGET: {"tokens": 30},
                "head": {"tokens": 30, "seconds": 1.5, "drafted": 12, "accepted": 3, "identical": False},
            }
        },
    ]
    summary = eagle3.summary(rows, "head", baseline_seconds=4.0, accepted={})
    assert summary["n"] == 2 and summary["tokens"] == 40 and summary["decode_seconds"] == 2.0
    assert summary["tokens_per_second"] == 20.0
    assert summary["over_llama_cpp_target_alone"] == pytest.approx(20.0 / (40 / 4.0))
    assert summary["identical"] == 1 and summary["llama_cpp_acceptance"] == pytest.approx(9 / 20)


def test_grounded_gpu_predicts_each_committed_row_on_the_card_with_its_band():
    grounded = script("grounded_gpu")
    card = reference_card()
    target = Weights(total=1_000_000_000, embedding=0, rows=1, tied=False, layers=28)
    result = {"drafts": {"seqkd": {"gpu_cost_ratio": 0.4}}, "pair": {"draft_layers": None}}
    committed = json.loads((BENCHMARKS / "results" / "speculative_qwen_sgd.json").read_text())["drafts"]["seqkd"]
    figures = {"mean_accepted_len": 1.6, "mean_drafted_per_step": 0.9, "gpu_cost_ratio": 0.4}
    figures["predicted_speedup_gpu"] = 1.2
    row = committed | figures  # a bench summary as committed, with figures worked out by hand below
    out = grounded.predictions(card, result, target, "qwen2.5-coder-0.5b-instruct", "seqkd", row)
    draft = Weights(total=400_000_000, embedding=0, rows=1, tied=False, layers=24)
    c = card.cost_ratio(draft, target)
    r = verify_ratio_between(card.verify_ratios(target), 1.9)
    assert out["draft_layers"] == 24 and out["grounded_c"] == pytest.approx(c)
    assert out["bytes_only"] == pytest.approx(1.6 / (1 + 0.9 * 0.4))
    assert out["grounded"] == pytest.approx(1.6 / (r + 0.9 * c))
    low, high = out["grounded_band"]
    assert low <= out["grounded"] <= high
    # lookup in front: the model proposed a quarter of the tokens, so a quarter of its c; lookup alone costs nothing
    result["drafts"]["ngram+seqkd"] = {}
    looked = grounded.predictions(
        card, result, target, "qwen2.5-coder-0.5b-instruct", "ngram+seqkd", {**row, "gpu_cost_ratio": 0.1}
    )
    assert looked["grounded_c"] == pytest.approx(c * 0.25)
    alone = grounded.predictions(card, result, target, None, "ngram", {**row, "gpu_cost_ratio": 0.0})
    assert alone["grounded_c"] == 0.0 and alone["draft_layers"] == 0
    assert alone["grounded"] == pytest.approx(1.6 / r)


def answers(speeds: list[float], tokens: int = 11) -> list[dict]:
    """serving.py's per-answer decode figures: `tokens` of text, decoded after the first at each speed."""
    return [
        {"tokens": tokens, "decode_seconds": (tokens - 1) / speed, "tokens_per_second": speed, "ttft_ms": 5.0}
        for speed in speeds
    ]


def test_the_decode_figures_are_the_totals_and_the_median_of_per_prompt_ratios():
    serving = script("serving")
    ours, theirs = answers([10.0, 20.0, 10.0]), answers([20.0, 20.0, 20.0])
    figures = serving.decode_summary(ours, theirs)
    assert figures["median_ratio_to_llama_server"] == pytest.approx(0.5)
    # 30 tokens in 1 + 0.5 + 1 s against 30 in 1.5 s
    assert figures["decode_tokens"] == 30 and figures["decode_seconds"] == pytest.approx(2.5)
    assert figures["total_ratio_to_llama_server"] == pytest.approx(12.0 / 20.0)
    assert figures["median_tokens_per_second"] == 10.0


def test_a_prompt_any_server_stalled_on_is_timed_again_once():
    timed_passes = script("serving_http").timed_passes
    speeds = {"spectune": [10.0, 10.0, 3.0, 10.0], "llama-server": [20.0, 7.0, 20.0, 20.0]}
    calls: list[int] = []

    def one(index: int) -> dict[str, float]:  # each prompt's seconds per token by server; prompt 2 stalls once
        calls.append(index)
        return {name: 1 / (10.0 if name == "spectune" and calls.count(index) > 1 else rates[index])
                for name, rates in speeds.items()}  # fmt: skip

    timed = timed_passes(one, 4, lambda row: row)
    assert calls == [0, 1, 2, 3, 2]  # 3.3x its median time per token; llama-server's 20/7 = 2.9x is not over
    assert timed["retimed"] == [3] and timed["still_stalled"] == []  # numbered from 1


def test_the_first_token_summary_compares_a_turn_llama_server_has_no_kind_for_with_its_returning_caller():
    serving = script("serving")
    ask = {"stages": {"prefill_seconds": 0.1}, "cached_tokens": 0}

    def turns(**ttfts: float) -> dict:
        return {kind: ask | {"ttft_ms": ms} for kind, ms in ttfts.items()}

    rows = [
        {
            "spectune serve": turns(new=30.0, returning=20.0, while_speaking=5.0),
            "llama-server, defaults": turns(new=20.0, returning=40.0),
        }
    ]
    rows[0]["spectune serve"]["other_tenant"] = ask | {"ttft_ms": 90.0}
    summary = serving.ttft_summary(rows)["spectune serve"]
    assert summary["new"]["ratio_to_llama_server"] == pytest.approx(1.5)
    assert summary["while_speaking"]["ratio_to_llama_server"] == pytest.approx(5.0 / 40.0)
    assert "ratio_to_llama_server" not in summary["other_tenant"] and summary["other_tenant"]["cached_tokens"] == [0]
    assert summary["new"]["median_prefill_ms"] == pytest.approx(100.0)


def test_llama_cpp_files_reads_a_types_rows_from_the_sweep_with_the_k_it_was_chosen_at():
    row = {"label": "Q6_K", "chosen_by": {"k": 3}, "alpha": 0.8, "tau": {"3": 2.1}, "cost_ratio": {}, "speedup": {}}
    rows = script("llama_cpp_files").swept_rows({"sweep": {"drafts": {"sft": {"types": [row]}}}})
    assert list(rows) == ["sft@Q6_K"]
    assert rows["sft@Q6_K"]["recommended_k"] == 3 and rows["sft@Q6_K"]["tau_simulated"] == {"3": 2.1}


def test_llama_cpp_files_refuses_a_draft_with_no_acceptance_row_naming_the_file(tmp_path, monkeypatch, capsys):
    acceptance = tmp_path / "acceptance.json"
    acceptance.write_text('{"drafts": [{"name": "sft", "recommended_k": 2}, {"name": "ngram+eagle3"}]}')
    argv = ["llama_cpp_files.py", "--target", "t.gguf", "--acceptance", str(acceptance), "--data", "d.jsonl"]
    main = script("llama_cpp_files").main
    for drafts, expected in (
        (["--draft", "sft@Q6_K=s.gguf"], f"{acceptance}: no row for sft@Q6_K (their rows: ngram+eagle3, sft)"),
        (["--draft", "sft=s.gguf", "--draft", "eagle3=h.gguf"], "no row for eagle3"),
        (["--draft", "ngram+eagle3=h.gguf"], "--training: the head's eagle3.json is needed"),  # a head behind lookup
    ):
        monkeypatch.setattr(sys, "argv", [*argv, *drafts, "--name", "x"])
        with pytest.raises(SystemExit) as exit_info:
            main()
        assert exit_info.value.code == 2 and expected in capsys.readouterr().err


def test_compare_lists_the_figures_two_results_share_and_flags_one_beyond_its_spread(tmp_path, capsys):
    compare = script("compare")
    committed = {"drafts": {"seqkd": {"acceptance": 0.80, "identical": 40, "aggregate_speedup": 1.00}}, "prompts": []}
    fresh = {"drafts": {"seqkd": {"acceptance": 0.81, "identical": 39, "aggregate_speedup": 1.08}}}
    paths = [tmp_path / "committed.json", tmp_path / "fresh.json"]
    for path, result in zip(paths, (committed, fresh), strict=True):
        path.write_text(json.dumps(result))
    assert compare.main([str(path) for path in paths]) == 1
    out = capsys.readouterr().out
    assert "3 figures, 1 beyond their spread" in out  # an answer no longer identical; the rest within
    flagged = [line for line in out.splitlines() if "beyond its spread" in line]
    assert len(flagged) == 1 and flagged[0].startswith("| drafts/seqkd/identical")
    paths[1].write_text(json.dumps({"servers": {}}))
    assert compare.main([str(path) for path in paths]) == 2
