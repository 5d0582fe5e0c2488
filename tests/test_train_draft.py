"""Drafts that think like the target (sft, kd, seqkd, onpolicy, speckd) and the offline acceptance meter, on the micro
pair."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import run_cli, swap_two_tokens

from spectune.acceptance.meter import simulate_tau
from spectune.acceptance.stage import AcceptanceConfig, run_acceptance
from spectune.data.read import read_dialogues
from spectune.errors import SpectuneError
from spectune.export.gguf import export_model
from spectune.models.load import load_tokenizer
from spectune.runtime.ngram import NgramSettings
from spectune.speedup import expected_tokens, speedup, speedup_of_steps
from spectune.train.distill import divergence, divergence_loss, sparse_log_probs
from spectune.train.draft import (
    DraftConfig,
    DraftResult,
    conversation_prompts,
    hf_answerer,
    llama_answerer,
    train_draft,
)

STEPS = {"batch_size": 8, "max_seq_length": 256, "max_eval": 16}


def draft_config(micro_pair, tuned_target, demo_data, out, method: str, **options) -> DraftConfig:
    return DraftConfig(
        target=tuned_target,
        draft=options.pop("draft", micro_pair / "draft"),
        data=demo_data,
        out=out,
        method=method,
        max_steps=20,
        lr=3e-3,
        max_tokens=24,
        **{**STEPS, **options},
    )


@pytest.fixture(scope="module")
def drafts(micro_pair, tuned_target, sft_draft, demo_data, tmp_path_factory):
    results = {}
    variants = {"kd": {}, "kd-top64": {"teacher_top_k": 64}, "seqkd": {}, "onpolicy": {"batch_size": 4}}
    for name, options in variants.items():
        out = tmp_path_factory.mktemp(name)
        stale = out / "checkpoints" / "checkpoint-999"  # left by an earlier, different run in the same folder
        stale.mkdir(parents=True)
        (stale / "trainer_state.json").write_text("{}")
        results[name] = train_draft(
            draft_config(micro_pair, tuned_target, demo_data, out, name.split("-")[0], **options)
        )
        assert not stale.exists()  # a fresh run never resumes into another run's checkpoint
    speckd_out = tmp_path_factory.mktemp("speckd")  # started from seqkd's draft, as configs start it
    results["speckd"] = train_draft(
        draft_config(micro_pair, tuned_target, demo_data, speckd_out, "speckd", draft=results["seqkd"].model)
    )
    results["sft"] = DraftResult.model_validate(json.loads((sft_draft.parent / "draft.json").read_text())["result"])
    return results


def test_every_method_trains_and_reports(drafts):
    for name, result in drafts.items():
        assert result.method == name.split("-")[0]
        assert (result.model / "model.safetensors").is_file()
        if name != "onpolicy":  # its eval loss is on freshly sampled answers: too noisy for 20 steps
            assert result.eval_loss_after < result.eval_loss_before, name
    assert drafts["seqkd"].teacher_seconds > 0 and drafts["kd-top64"].teacher_seconds > 0


def test_speckd_continues_seqkd_on_the_targets_answers_with_total_variation(drafts):
    speckd, seqkd = drafts["speckd"], drafts["seqkd"]
    assert [path.name for path in seqkd.model.parent.glob("teacher.*.gguf")] == ["teacher.Q4_K_M.gguf"]  # as served
    assert not list(speckd.model.parent.glob("teacher.*.gguf"))  # seqkd's answers, from the cache
    assert speckd.teacher_seconds < seqkd.teacher_seconds
    assert speckd.trained_tokens == seqkd.trained_tokens  # the same dialogues: the target's answers
    assert 0.0 < speckd.eval_loss_after < speckd.eval_loss_before <= 1.0  # a total variation, not a KL


def test_seqkd_reuses_the_targets_answers(drafts, micro_pair, tuned_target, demo_data, tmp_path):
    again = train_draft(draft_config(micro_pair, tuned_target, demo_data, tmp_path, "seqkd"))
    assert not list(tmp_path.glob("teacher.*.gguf"))  # nothing exported: the answers came from the cache
    assert again.teacher_seconds < drafts["seqkd"].teacher_seconds
    assert again.eval_loss_after == pytest.approx(drafts["seqkd"].eval_loss_after, rel=1e-4)


def test_cached_teacher_trains_like_the_live_one(drafts):
    # Top-64 of a 2048 vocabulary plus a rest bucket: a lower bound of the live divergence, that training shrinks.
    live, cached = drafts["kd"], drafts["kd-top64"]
    assert cached.eval_loss_before <= live.eval_loss_before
    assert cached.eval_loss_after < cached.eval_loss_before / 2
    assert (cached.model.parent / "teacher_top64.pt").is_file()


def test_sft_beats_generic_on_held_out_prompts(micro_pair, tuned_target, drafts, demo_data, tmp_path):
    names = {"generic": micro_pair / "draft", **{m: r.model for m, r in drafts.items()}}
    config = AcceptanceConfig(
        target=tuned_target,
        drafts=names,
        data=demo_data,
        n=12,
        max_tokens=24,
        temperature=1.0,
        json_out=tmp_path / "acceptance.json",
        ngram=NgramSettings(),
        ngram_data=demo_data,
    )
    report = run_acceptance(config)
    alpha = {row["name"]: row["alpha"] for row in report["drafts"]}
    print(alpha)
    for name in ("sft", "kd", "kd-top64", "seqkd", "speckd"):
        assert alpha[name] > alpha["generic"] + 0.05, alpha
    rows = {row["name"]: row for row in report["drafts"]}
    assert set(rows) == {*names, "ngram", *(f"ngram+{name}" for name in names)}
    lookup = rows["ngram"]
    assert lookup["looked_up"]["drafted"] > 0 and lookup["cost_ratio"]["gpu"] == 0.0
    # lookup alone costs nothing: on a GPU (r = 1) its speedup is its τ
    assert lookup["speedup"]["gpu"] == pytest.approx(lookup["tau_simulated"])
    assert report["ngram"] == NgramSettings().model_dump() and report["ngram_data"] == str(demo_data)
    for row in report["drafts"]:
        if row["name"].startswith("ngram"):
            continue
        assert row["tokens"] > 0 and 0.0 <= row["alpha"] <= 1.0
        assert 0.0 <= row["alpha_sampled"] <= 1.0
        assert set(row["tau_simulated"]) == {str(k) for k in range(1, 9)}
        assert row["alpha_by_position"]["1"] <= 1.0 and set(row["alpha_by_position"]) <= set(row["tau_simulated"])
        assert all(1.0 <= tau <= k + 1 for k, tau in ((int(k), t) for k, t in row["tau_simulated"].items()))
        # the best k on the reference card where the GGUFs gave it, else bytes only; never 0
        assert row["recommended_by"] == ("gpu-grounded" if "gpu-grounded" in row["speedup"] else "gpu")
        ranked = row["speedup"][row["recommended_by"]]
        assert row["recommended_k"] == max(1, int(max(ranked, key=ranked.get)))
    assert (tmp_path / "acceptance.json").is_file()


def test_seqkd_answers_from_llama_cpp_are_the_targets_greedy_answers(tuned_target, demo_data, tmp_path):
    from transformers import AutoModelForCausalLM

    prompts = conversation_prompts(read_dialogues(demo_data).dialogues[:4])[:8]
    target = AutoModelForCausalLM.from_pretrained(str(tuned_target), dtype=torch.float32).eval()
    by_hf = hf_answerer(target, load_tokenizer(tuned_target), 24)
    by_llama = llama_answerer(export_model(tuned_target, tmp_path / "teacher.Q8_0.gguf", "Q8_0"), 24)
    answers = [(by_hf(messages), by_llama(messages)) for messages in prompts]
    assert all(llama for _, llama in answers)
    # Q8_0 against f32: a near-tie may flip a token, so most answers, not all, must agree to the character.
    assert sum(hf == llama for hf, llama in answers) >= 6, answers


def test_tau_formula_matches_a_simulation():
    rng = random.Random(0)
    for alpha in (0.2, 0.5, 0.8, 0.95):
        matches = [[rng.random() < alpha for _ in range(400)] for _ in range(50)]
        for k in (1, 3, 5, 8):
            simulated = simulate_tau(matches, k).tau
            assert simulated == pytest.approx(expected_tokens(alpha, k), rel=0.03), (alpha, k)


def test_simulated_tau_on_known_sequences():
    assert simulate_tau([[True] * 11], 4).tau == 11 / 3  # the first token alone, then 4 accepted + bonus, twice
    assert simulate_tau([[False] * 6], 4).tau == 1.0  # every step yields only the target's own token
    replay = simulate_tau([[True, True, True, False, True]], 8)
    assert replay.tau == 5 / 3 and replay.runs == {2: 1, 1: 1}
    # step 1 verifies positions 1-3 (rejects the third), step 2 position 1 of the last token, then the text ends
    assert replay.reached[:4] == [2, 1, 1, 0] and replay.accepted[:4] == [2, 1, 0, 0]
    assert replay.alpha_by_position() == {1: 1.0, 2: 1.0, 3: 0.0}


def test_simulated_tau_with_lookup_in_front_on_known_sequences():
    """The lookup proposes at position 1 (two of its three tokens right), nowhere else; the draft model is always
    wrong. k = 3: the first token alone; 2 looked-up tokens accepted + the correction; then the draft's two steps."""
    matches = [[True, False, False, False, False, False]]

    def lookup(index: int, position: int) -> list[bool] | None:
        return [True, True, False] if position == 1 else None

    combined = simulate_tau(matches, 3, lookup)
    assert combined.tau == 6 / 4 and combined.runs == {2: 1, 0: 2}
    assert (combined.drafted, combined.looked_up_drafted, combined.looked_up_accepted) == (3 + 2 + 1, 3, 2)
    assert combined.model_share == 0.5
    assert combined.looked_up() == {"step_share": 1 / 4, "drafted": 3, "acceptance": 2 / 3}
    alone = simulate_tau(matches, 3, lookup, model=False)  # no draft model: the other steps are the target's own
    assert alone.tau == 6 / 4 and alone.drafted == 3 and alone.model_share == 0.0


def test_speedup_formula():
    assert speedup(3.0, 4, 0.1, 1.0) == pytest.approx(3.0 / 1.4)
    assert speedup(expected_tokens(0.0, 4), 4, 0.1, 1.0) < 1.0  # a useless draft slows decoding down


def test_speedup_counts_the_drafts_each_step_really_made():
    # 4 steps: one drafted nothing (an answer's last step), two drafted 1 token, one drafted 2
    profile = {"2": 1.5, "3": 2.0}
    expected_cost = 1 * 1.0 + 2 * (1.5 + 0.1) + 1 * (2.0 + 0.2)
    assert speedup_of_steps(2.0, [3, 1], 4, 0.1, profile) == pytest.approx(2.0 * 4 / expected_cost)
    assert speedup_of_steps(2.0, [3, 1], 4, 0.1, None) == pytest.approx(2.0 * 4 / 4.4)  # r = 1: a GPU
    # every step drafting k gives the formula on k
    assert speedup_of_steps(3.0, [5, 5, 5, 5], 5, 0.1, None) == pytest.approx(speedup(3.0, 4, 0.1, 1.0))


def test_divergences():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    mask = torch.ones(2, 5, dtype=torch.bool)
    for kind in ("forward_kl", "reverse_kl", "jsd", "tv"):
        assert divergence_loss(teacher, teacher, mask, kind, 1.0) == pytest.approx(0.0, abs=1e-6)
        assert divergence_loss(student, teacher, mask, kind, 1.0) > 0.01
    tv = divergence_loss(student, teacher, mask, "tv", 1.0)
    p, q = torch.softmax(teacher, -1), torch.softmax(student, -1)
    assert tv == pytest.approx(float(1 - torch.minimum(p, q).sum(-1).mean()), rel=1e-5)  # TV = 1 - acceptance
    assert divergence_loss(student, teacher, mask, "jsd", 1.0) == pytest.approx(
        float(divergence_loss(teacher, student, mask, "jsd", 1.0)), rel=1e-5
    )
    assert divergence_loss(student, teacher, mask, "jsd", 1.0) <= 1.0  # JSD in bits is at most 1
    masked = divergence_loss(student, teacher, torch.zeros_like(mask), "tv", 1.0)
    assert masked == 0.0


def test_greedy_tv_is_one_minus_the_drafts_chance_of_the_targets_greedy_token():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    mask = torch.ones(2, 5, dtype=torch.bool)
    greedy = teacher.argmax(-1, keepdim=True)
    expected = 1 - torch.softmax(student, -1).gather(-1, greedy).mean()
    assert divergence_loss(student, teacher, mask, "greedy_tv", 1.0) == pytest.approx(float(expected), rel=1e-5)
    # only the target's argmax counts: a teacher with the same argmax and any other mass gives the same loss
    sharpened = teacher * 10
    assert divergence_loss(student, sharpened, mask, "greedy_tv", 1.0) == pytest.approx(float(expected), rel=1e-5)
    one_hot = torch.full_like(student, -1e4).scatter(-1, greedy, 1e4)  # the draft proposes the greedy token surely
    assert divergence_loss(one_hot, teacher, mask, "greedy_tv", 1.0) == pytest.approx(0.0, abs=1e-6)


def test_bucketed_divergence_is_exact_with_full_support_and_a_lower_bound_with_top_k():
    torch.manual_seed(0)
    student, teacher = torch.randn(6, 32), torch.randn(6, 32)
    log_p, log_q = torch.log_softmax(teacher, -1), torch.log_softmax(student, -1)
    mask = torch.ones(6)
    for kind in ("forward_kl", "reverse_kl", "jsd", "tv"):
        dense = float(divergence(log_p, log_q, mask, kind))
        for k, check in ((32, lambda x, d=dense: x == pytest.approx(d, rel=1e-4)), (4, lambda x, d=dense: x <= d)):
            values, ids = log_p.topk(k, dim=-1)
            assert check(float(divergence(*sparse_log_probs(values, log_q, ids), mask, kind))), (kind, k)


def test_a_draft_with_another_tokenizer_is_refused(micro_pair, demo_data, tmp_path):

    other = swap_two_tokens(micro_pair / "draft", tmp_path / "other")
    with pytest.raises(SpectuneError, match="do not share a tokenizer"):
        train_draft(DraftConfig(target=micro_pair / "target", draft=other, data=demo_data, out=tmp_path / "o"))


def test_draft_cli_reports_config_errors(tmp_path, capsys):
    assert run_cli("draft", "--method", "magic", "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "[method]" in err and "[target]" in err


def test_draft_settings_that_do_not_fit_the_method_are_refused(micro_pair, demo_data, tmp_path, capsys):
    common = ("--target", str(micro_pair / "target"), "--draft", str(micro_pair / "draft"), "--data", str(demo_data))
    assert run_cli("draft", *common, "--out", str(tmp_path), "--method", "onpolicy", "--divergence", "tv") == 2
    assert "not tv" in capsys.readouterr().err
    assert run_cli("draft", *common, "--out", str(tmp_path), "--method", "sft", "--teacher-top-k", "8") == 2
    assert "for kd and speckd only" in capsys.readouterr().err
    assert run_cli("draft", *common, "--out", str(tmp_path), "--method", "speckd", "--teacher-top-k", "8") == 2
    assert "greedy_tv needs the target's argmax" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()
