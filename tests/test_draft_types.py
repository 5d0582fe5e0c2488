"""Each draft's type chosen by measurement (acceptance/draft_types.py): the match flags come from llama.cpp on the
quantized files, aligned with the answers the real loop gives, and the type served is the one predicted fastest."""

from __future__ import annotations

from pathlib import Path

import pytest

from spectune.acceptance.draft_types import choose_type, gguf_matches, sweep_types, target_answers, type_table
from spectune.config import validate
from spectune.data.prepare import extract_prompts
from spectune.data.read import read_dialogues
from spectune.engines.llama_cpp import build_llama_cpp
from spectune.errors import SpectuneError
from spectune.export.gguf import export_model
from spectune.export.pair import calibration_text, held_out
from spectune.gpu.card import GROUNDED_PROFILE
from spectune.pipeline.config import RunConfig
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel
from spectune.runtime.speculative import SpeculativeDecoder


def prompts_of(demo_data, n: int) -> list:
    return extract_prompts(read_dialogues(demo_data).dialogues[-n:], n=n)


def test_the_targets_answers_are_the_loops_and_a_gguf_matches_itself_everywhere(pair, demo_data):
    target_file, draft_file = pair
    target, draft = LlamaModel(target_file, threads=1), LlamaModel(draft_file, threads=1)
    try:
        answered = target_answers(target, prompts_of(demo_data, 3), max_tokens=12)
        alone = SpeculativeDecoder(target)
        for prompt, answer in answered:
            alone.forget()
            generated = alone.generate(prompt, DecodeSettings(max_tokens=12, draft_max=0)).tokens
            assert answer[: len(generated)] == generated and len(answer) - len(generated) <= 1  # + its end token
        itself = gguf_matches(target, answered)
        assert [len(flags) for flags in itself] == [len(answer) for _, answer in answered]
        assert all(all(flags) for flags in itself)  # an off-by-one alignment would miss here
        by_draft = [flag for flags in gguf_matches(draft, answered) for flag in flags]
        assert 0 < sum(by_draft) < len(by_draft)  # a smaller, other model: right sometimes, not always
    finally:
        target.close()
        draft.close()


def test_every_type_plain_and_weighted_is_measured_made_anew_and_the_fastest_on_the_card_served(
    pair, sft_draft, demo_data, tmp_path
):
    build_llama_cpp()  # llama-imatrix and llama-quantize weigh a type by the importance matrix
    exported = export_model(sft_draft, tmp_path / "sft.Q4_K_M.gguf", "Q4_K_M")
    (tmp_path / "types").mkdir()
    (tmp_path / "types" / "sft.Q8_0.gguf").write_text("left by an earlier run")  # never trusted: other weights
    calibration = {"sft": calibration_text(sft_draft, held_out(demo_data, 200))}
    sweep = sweep_types(
        pair[0], {"sft": (sft_draft, exported)}, prompts_of(demo_data, 3), 12, ["Q4_K_M", "q8_0"], calibration, 1
    )
    entry = sweep["drafts"]["sft"]
    rows = {row["label"]: row for row in entry["types"]}
    # Q8_0 takes no matrix: weighted only where the type uses one
    assert sweep["types"] == ["Q4_K_M", "Q8_0"] and list(rows) == ["Q4_K_M", "Q4_K_M+imatrix", "Q8_0"]
    assert rows["Q8_0"]["bytes"] == (tmp_path / "types" / "sft.Q8_0.gguf").stat().st_size > rows["Q4_K_M"]["bytes"]
    assert Path(rows["Q4_K_M+imatrix"]["gguf"]).name == "sft.Q4_K_M-imatrix.gguf"
    assert rows["Q8_0"]["cost_ratio"]["gpu"] > rows["Q4_K_M"]["cost_ratio"]["gpu"]  # it reads more bytes a step
    assert all(row["chosen_by"]["profile"] == GROUNDED_PROFILE for row in rows.values())
    best = choose_type(list(rows.values()), sweep["type_margin"])  # the smallest file within the margin of the best
    assert sweep["type_margin"] == 0.02 and entry["chosen"] == best["label"] and entry["gguf"] == best["gguf"]
    assert sweep["answer_tokens"] > 0 and all(0 < row["alpha"] < 1 for row in rows.values())
    table = type_table(sweep)
    assert sum("| sft |" in line for line in table) == 3 and sum(line.endswith("| chosen |") for line in table) == 1


def test_a_larger_type_is_chosen_only_where_it_wins_by_more_than_the_margin():
    def row(label: str, size: int, speedup: float) -> dict:
        quant, weighted = label.removesuffix("+imatrix"), label.endswith("+imatrix")
        return {"label": label, "quant": quant, "imatrix": weighted, "bytes": size, "chosen_by": {"speedup": speedup}}

    near_tie = [row("Q6_K", 600, 0.951), row("Q4_K_M", 400, 0.949), row("Q8_0", 800, 0.90)]
    assert choose_type(near_tie, 0.02)["label"] == "Q4_K_M"  # the Gemma 3 run's case: within noise, the smaller
    assert choose_type(near_tie, 0.0)["label"] == "Q6_K"  # no margin: the best, however slight
    clear_win = [row("Q4_K_M", 400, 0.90), row("Q5_K_M", 500, 1.10), row("Q6_K", 600, 1.11)]
    assert choose_type(clear_win, 0.02)["label"] == "Q5_K_M"  # Q6_K's 1% over Q5_K_M is noise, Q5_K_M's 22% is not
    # one type's two files cost the same step: the plain one, unless the matrix wins by more than the margin
    weighted_larger = [row("Q4_K_M", 400, 1.00), row("Q4_K_M+imatrix", 401, 1.015), row("Q5_K_M+imatrix", 501, 1.2)]
    assert choose_type(weighted_larger[:2], 0.02)["label"] == "Q4_K_M"
    assert choose_type(weighted_larger, 0.02)["label"] == "Q5_K_M+imatrix"  # the only file of its type
    weighted_smaller = [row("Q4_K_M", 401, 1.00), row("Q4_K_M+imatrix", 400, 1.015)]
    assert choose_type(weighted_smaller, 0.02)["label"] == "Q4_K_M"  # by type, not by the metadata's bytes
    assert choose_type([row("Q4_K_M", 400, 1.00), row("Q4_K_M+imatrix", 401, 1.05)], 0.02)["label"] == "Q4_K_M+imatrix"


def test_an_unknown_type_is_refused_when_the_config_is_read():
    with pytest.raises(SpectuneError, match=r"\[acceptance\.draft_types\].*'Q9'"):
        validate(RunConfig, {"run_dir": "run", "acceptance": {"draft_types": ["Q4_K_M", "Q9"]}}, "run.yaml")
    read = validate(RunConfig, {"run_dir": "run", "acceptance": {"draft_types": ["q6_k"]}}, "run.yaml")
    assert read.acceptance.draft_types == ["Q6_K"]
