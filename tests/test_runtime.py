"""The speculative decoder on llama.cpp: identical greedy answers, exact sampling, stats, context limits, bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import swap_two_tokens

from spectune.data.prepare import extract_prompts
from spectune.data.read import read_dialogues
from spectune.errors import SpectuneError
from spectune.export.gguf import convert, export_model
from spectune.runtime.chat import CLAUSE_END, chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.draft_model import DraftModel
from spectune.runtime.first_words import FirstWordsRule
from spectune.runtime.llama import LlamaModel
from spectune.runtime.sampling import StochasticSampler
from spectune.runtime.speculative import Generation, SpeculativeDecoder, Stats

QUANTS = ("F32", "F16", "Q8_0", "Q4_K_M")


@pytest.fixture(scope="module")
def ggufs(tuned_target, sft_draft, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ggufs")
    return {
        quant: {
            role: export_model(source, folder / f"{role}.{quant}.gguf", quant)
            for role, source in (("target", tuned_target), ("draft", sft_draft))
        }
        for quant in QUANTS
    }


@pytest.fixture(scope="module")
def prompts(demo_data):
    return extract_prompts(read_dialogues(demo_data).dialogues, 16, seed=5)


def unpack(generation: Generation) -> tuple[list[int], Stats]:
    return generation.tokens, generation.stats


def load(path, n_ctx=512):
    return LlamaModel(path, n_ctx=n_ctx, threads=1, exact=True)


EXACT_AFTER_INEXACT = """
import sys
import numpy as np
from spectune.runtime.llama import LlamaModel
path = sys.argv[1]
first = LlamaModel(path, n_ctx=256, threads=1, exact=False)  # ggml decides its tiled matmul at the first batch
tokens = first.tokenize("Book a table for four at seven tonight near the station, please. " * 4)[:48]
first.decode(tokens, 0, all_logits=False)
model = LlamaModel(path, n_ctx=256, threads=1, exact=True)
batched = model.decode(tokens, 0, all_logits=False)[-1]
model.truncate(0)
one_by_one = [model.decode([token], position)[-1] for position, token in enumerate(tokens)][-1]
print(float(np.abs(batched - one_by_one).max()))
"""


def test_an_exact_model_stays_exact_after_an_inexact_one_in_the_same_process(ggufs):
    """ggml reads its tiled-matmul switch once per process: a non-exact model decoding first (seqkd's answers
    before the bench, in one `spectune run`) must not leave it on for exact ones. A fresh interpreter, since this
    test process has long since decided it."""
    script = [sys.executable, "-c", EXACT_AFTER_INEXACT, str(ggufs["Q4_K_M"]["target"])]
    result = subprocess.run(script, capture_output=True, text=True, env={**os.environ, "GGML_CPU_TILED_MM": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.split()[-1]) == 0.0  # a 48-token prefill's last row, bit for bit


@pytest.mark.parametrize("quant", QUANTS)
def test_greedy_speculative_output_equals_the_target_alone(ggufs, prompts, quant):
    target, draft = load(ggufs[quant]["target"]), load(ggufs[quant]["draft"])
    plain, speculative = SpeculativeDecoder(target), SpeculativeDecoder(target, [DraftModel(draft, target)])
    config = DecodeSettings(max_tokens=40, draft_max=5)
    accepted = 0
    for prompt in prompts:
        ids = target.tokenize(chat_prompt(target, prompt.messages))
        expected = plain.generate(ids, config).tokens
        generation = speculative.generate(ids, config)
        got, stats = generation.tokens, generation.stats
        assert got == expected, (quant, prompt.messages[-1])
        accepted += stats.accepted
        # Invariants of the loop.
        assert stats.accepted <= stats.drafted
        # Each step yields its accepted drafts and one own token, except that nothing follows an accepted end.
        assert stats.accepted + stats.verify_steps - 1 <= stats.produced <= stats.accepted + stats.verify_steps
        assert stats.generated <= stats.produced
        assert sum(stats.accepted_at) == stats.accepted and sum(stats.drafted_at) == stats.drafted
        assert all(a <= d for a, d in zip(stats.accepted_at, stats.drafted_at, strict=True))
        assert stats.draft_seconds > 0 and stats.verify_seconds > 0 and stats.ttft_seconds > 0
    assert accepted > 0  # the draft does get tokens accepted


def test_k0_and_no_draft_equal_plain_decoding(ggufs, prompts):
    target, draft = load(ggufs["Q8_0"]["target"]), load(ggufs["Q8_0"]["draft"])
    ids = target.tokenize(chat_prompt(target, prompts[0].messages))
    expected, plain_stats = unpack(SpeculativeDecoder(target).generate(ids, DecodeSettings(max_tokens=30)))
    got, stats = unpack(
        SpeculativeDecoder(target, [DraftModel(draft, target)]).generate(
            ids, DecodeSettings(max_tokens=30, draft_max=0)
        )
    )
    assert got == expected and stats.drafted == 0 and stats.verify_steps == plain_stats.verify_steps


def test_p_min_and_adaptive_k_keep_the_output(ggufs, prompts):
    target, draft = load(ggufs["F16"]["target"]), load(ggufs["F16"]["draft"])
    plain, speculative = SpeculativeDecoder(target), SpeculativeDecoder(target, [DraftModel(draft, target)])
    for prompt in prompts[:6]:
        ids = target.tokenize(chat_prompt(target, prompt.messages))
        expected, _ = unpack(plain.generate(ids, DecodeSettings(max_tokens=30)))
        cut, cut_stats = unpack(speculative.generate(ids, DecodeSettings(max_tokens=30, draft_max=6, draft_p_min=0.9)))
        adaptive, _ = unpack(speculative.generate(ids, DecodeSettings(max_tokens=30, draft_max=6, adaptive=True)))
        assert cut == expected and adaptive == expected
        assert all(d <= cut_stats.verify_steps for d in cut_stats.drafted_at)


def test_end_of_context_stops_without_crashing(ggufs, prompts):
    target, draft = load(ggufs["F32"]["target"], n_ctx=64), load(ggufs["F32"]["draft"], n_ctx=64)
    n_ctx = target.n_ctx  # llama.cpp may round the context up
    filler = target.tokenize(chat_prompt(target, prompts[0].messages))
    ids = (filler * (n_ctx // len(filler) + 1))[: n_ctx - 10]
    config = DecodeSettings(max_tokens=200, draft_max=8)
    expected, _ = unpack(SpeculativeDecoder(target).generate(ids, config))
    got, stats = unpack(SpeculativeDecoder(target, [DraftModel(draft, target)]).generate(ids, config))
    assert got == expected
    assert len(ids) + len(got) <= n_ctx
    assert stats.finish_reason in ("length", "stop")
    with pytest.raises(SpectuneError, match="does not fit the context"):
        SpeculativeDecoder(target).generate(filler * (n_ctx // len(filler) + 1), config)


def test_stop_strings_and_max_tokens(ggufs, prompts):
    target = load(ggufs["F16"]["target"])
    decoder = SpeculativeDecoder(target, [DraftModel(load(ggufs["F16"]["draft"]), target)])
    ids = target.tokenize(chat_prompt(target, prompts[1].messages))
    full, _ = unpack(decoder.generate(ids, DecodeSettings(max_tokens=30)))
    short, stats = unpack(decoder.generate(ids, DecodeSettings(max_tokens=3)))
    assert short == full[:3] and stats.finish_reason == "length"
    text = target.detokenize(full)
    assert len(text) > 4, text  # long enough to hold a stop string after its start
    stop = text[2:4]
    cut, cut_stats = unpack(decoder.generate(ids, DecodeSettings(max_tokens=30, stop=[stop])))
    assert stop not in target.detokenize(cut) and cut_stats.finish_reason == "stop"
    assert text.startswith(target.detokenize(cut))


def test_speculative_sampling_keeps_the_target_distribution():
    """Unit level: propose d ~ q, verify against p; the output token must be distributed as p."""
    rng = np.random.default_rng(0)
    sampler = StochasticSampler(DecodeSettings(temperature=1.0), np.random.default_rng(1))
    vocab = 6
    p_logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.07, 0.03]))
    q = np.array([0.1, 0.1, 0.5, 0.1, 0.1, 0.1])
    counts = Counter()
    trials = 40000
    for _ in range(trials):
        proposal = int(rng.choice(vocab, p=q))
        rows = np.stack([p_logits, p_logits])
        accepted, own = sampler.verify(rows, [proposal], [q])
        counts[proposal if accepted == 1 else own] += 1
    empirical = np.array([counts[i] / trials for i in range(vocab)])
    assert np.abs(empirical - np.exp(p_logits)).sum() / 2 < 0.01


def test_speculative_sampling_end_to_end_matches_plain_sampling(ggufs, prompts):
    target, draft = load(ggufs["F32"]["target"]), load(ggufs["F32"]["draft"])
    plain, speculative = SpeculativeDecoder(target), SpeculativeDecoder(target, [DraftModel(draft, target)])
    ids = target.tokenize(chat_prompt(target, prompts[2].messages))
    first_plain, first_spec = Counter(), Counter()
    runs = 300
    for seed in range(runs):
        config = DecodeSettings(max_tokens=2, temperature=1.0, top_k=8, seed=seed, draft_max=1)
        first_plain[plain.generate(ids, config).tokens[0]] += 1
        first_spec[speculative.generate(ids, config).tokens[0]] += 1
    tokens = set(first_plain) | set(first_spec)
    distance = sum(abs(first_plain[t] - first_spec[t]) for t in tokens) / (2 * runs)
    # Two samples of 300 from one distribution over at most 8 tokens lie about 0.06 apart in total variation (each
    # token's count has a standard error of sqrt(300 p (1 - p))); 0.12 is twice that. A draft whose proposals were
    # kept unconditionally would put its own distribution in, far more than 0.12 away: the unit test above checks
    # the acceptance rule itself to 0.01 on 40,000 draws.
    assert distance < 0.12, (first_plain.most_common(5), first_spec.most_common(5))


def test_an_incompatible_pair_is_refused(ggufs, sft_draft, tmp_path):
    other = convert(swap_two_tokens(sft_draft, tmp_path / "other"), tmp_path / "other.gguf", "F16")
    with pytest.raises(SpectuneError, match="token 300 differs"):
        target = load(ggufs["F16"]["target"])
        SpeculativeDecoder(target, [DraftModel(load(other), target)])


def test_bench_writes_its_report(ggufs, demo_data, tmp_path):
    from spectune.bench.config import BenchConfig
    from spectune.bench.run import bench

    config = BenchConfig(
        target=ggufs["Q4_K_M"]["target"],
        drafts={"sft": ggufs["Q4_K_M"]["draft"]},
        data=demo_data,
        out=tmp_path / "bench",
        n=3,
        repeats=1,
        max_tokens=24,
        draft_max=4,
        threads=1,
        first_words_every=2,
    )
    report = bench(config)
    summary = report["summary"]["sft"]
    assert summary["n"] == 3 and summary["identical"] == 3 and summary["exact"] is True
    assert summary["first_words_prompts"] == 2  # prompts 1 and 3: a new caller's first words on one in two
    assert summary["worst_speedup"] <= summary["mean_speedup"] <= summary["best_speedup"]
    # measured here: a draft step costs something, and verifying k + 1 tokens is no cheaper than one on this CPU
    assert summary["cost_ratio"] > 0 and summary["verify_ratio"] >= 0.9
    # S = τ / mean(1 + d·c) over steps drafting d <= k = 4 tokens: between τ / (1 + 4c) and τ
    tau, c = summary["mean_accepted_len"], summary["gpu_cost_ratio"]
    assert tau >= 1.0 and tau / (1 + 4 * c) <= summary["predicted_speedup_gpu"] <= tau
    # a caller's waits: the first sentence comes no sooner than the first token
    assert 0 < summary["target_ttft_ms"] <= summary["target_ttfs_ms"] and 0 < summary["ttft_ms"] <= summary["ttfs_ms"]
    # a new caller's: the prompt's prefill is in both, and the first sentence still comes after the first token
    assert summary["target_ttft_ms"] < summary["target_cold_ttft_ms"] <= summary["target_cold_ttfs_ms"]
    # (within one run: the first-clause-alone figure is another run's, so its order against this one is timing)
    assert 0 < summary["cold_ttft_ms"] <= summary["cold_ttfs_ms"] and summary["cold_ttfs_first_clause_alone_ms"] > 0
    assert summary["predicted_first_sentence_here"] > 0 and summary["predicted_first_sentence_gpu_grounded"] > 0
    for name in ("report.json", "report.md", "report.png"):
        assert (tmp_path / "bench" / name).stat().st_size > 0
    assert json.loads((tmp_path / "bench" / "report.json").read_text())["settings"]["n"] == 3
    assert "measured on 2 of the 3 prompts (one in 2)" in (tmp_path / "bench" / "report.md").read_text()
    assert "here (model) / on the card |" in (tmp_path / "bench" / "report.md").read_text()


def test_a_new_turn_reuses_the_cached_prefix_and_answers_the_same(ggufs, prompts):
    target, draft = load(ggufs["Q4_K_M"]["target"]), load(ggufs["Q4_K_M"]["draft"])
    decoder = SpeculativeDecoder(target, [DraftModel(draft, target)])
    config = DecodeSettings(max_tokens=20, draft_max=4)
    messages = list(prompts[3].messages)
    first_ids = target.tokenize(chat_prompt(target, messages))
    answer, _ = unpack(decoder.generate(first_ids, config))
    messages += [{"role": "assistant", "content": target.detokenize(answer)}, {"role": "user", "content": "Thanks."}]
    second_ids = target.tokenize(chat_prompt(target, messages))
    reused_answer, stats = unpack(decoder.generate(second_ids, config))
    assert stats.reused_prompt_tokens >= len(first_ids) - 1
    fresh_target = load(ggufs["Q4_K_M"]["target"])
    fresh, fresh_stats = unpack(SpeculativeDecoder(fresh_target).generate(second_ids, config))
    assert fresh_stats.reused_prompt_tokens == 0
    assert reused_answer == fresh


def draft_calls(decoder: SpeculativeDecoder) -> list[tuple[int, int]]:
    """(sequence length, tokens the draft had to catch up on) at each of the decoder's proposals from now on."""
    calls: list[tuple[int, int]] = []
    speculators = decoder.speculators
    propose = speculators.propose

    def recorded(sequence, *args):
        calls.append((len(sequence), speculators.behind(sequence)))
        return propose(sequence, *args)

    speculators.propose = recorded
    return calls


def test_the_first_token_never_waits_for_the_draft_and_a_new_turn_is_all_it_reads(ggufs, prompts):
    target, draft = load(ggufs["Q4_K_M"]["target"]), load(ggufs["Q4_K_M"]["draft"])
    decoder, plain = (
        SpeculativeDecoder(target, [DraftModel(draft, target)]),
        SpeculativeDecoder(load(ggufs["Q4_K_M"]["target"])),
    )
    calls = draft_calls(decoder)
    messages = list(prompts[6].messages)
    ids = target.tokenize(chat_prompt(target, messages))
    answer, stats = unpack(decoder.generate(ids, DecodeSettings(max_tokens=24, draft_max=4)))
    # the target's own first step, then the draft reads the prompt and the first token, and proposes
    assert calls[0] == (len(ids) + 1, len(ids) + 1) and stats.drafted_at and stats.verify_steps > 1
    assert answer == plain.generate(ids, DecodeSettings(max_tokens=24)).tokens
    # the next turn: the draft's cache kept the earlier turns, so it reads only what is new
    messages += [{"role": "assistant", "content": target.detokenize(answer)}, {"role": "user", "content": "Yes."}]
    next_ids = target.tokenize(chat_prompt(target, messages))
    calls.clear()
    decoder.generate(next_ids, DecodeSettings(max_tokens=8, draft_max=4))
    new = len(next_ids) - len(ids) - len(answer)
    assert 0 < calls[0][1] <= new + len(answer) + 2, (calls[0], new, len(answer))  # never the earlier turns
    # a barge-in: the caller cut the answer short, so the conversation keeps only its first words; both caches roll
    # back to where it diverges, and the draft again reads only from there
    cut = target.detokenize(answer[:3])
    barge_in = [*messages[:-2], {"role": "assistant", "content": cut}, {"role": "user", "content": "No, wait."}]
    barge_ids = target.tokenize(chat_prompt(target, barge_in))
    calls.clear()
    generation = decoder.generate(barge_ids, DecodeSettings(max_tokens=8, draft_max=4))
    assert generation.stats.reused_prompt_tokens >= len(ids) and calls[0][1] <= len(barge_ids) - len(ids) + 2
    # another caller (the server forgets both caches between callers): the draft reads the whole prompt again
    decoder.forget()
    calls.clear()
    decoder.generate(next_ids, DecodeSettings(max_tokens=8, draft_max=4))
    assert calls[0][1] == len(next_ids) + 1


def test_a_first_clause_decoded_alone_is_the_same_answer_and_drafting_starts_after_it(ggufs, prompts):
    target, draft = load(ggufs["Q4_K_M"]["target"]), load(ggufs["Q4_K_M"]["draft"])
    decoder, plain = (
        SpeculativeDecoder(target, [DraftModel(draft, target)]),
        SpeculativeDecoder(load(ggufs["Q4_K_M"]["target"])),
    )
    calls = draft_calls(decoder)
    for prompt in prompts[:6]:
        ids = target.tokenize(chat_prompt(target, prompt.messages))
        calls.clear()
        config = DecodeSettings(max_tokens=40, draft_max=4)
        generation = decoder.generate(ids, config, first_words="alone")
        assert generation.tokens == plain.generate(ids, config).tokens
        clause = next((m.start() + 1 for m in CLAUSE_END.finditer(generation.text)), None)  # past its mark
        if calls:  # the first proposal comes after the first clause, whose tokens the target made alone
            assert clause is not None and len(target.detokenize(generation.tokens[: calls[0][0] - len(ids)])) >= clause


def test_the_first_clause_goes_to_the_draft_only_where_it_comes_sooner():
    pace = FirstWordsRule()
    assert pace.draft_first_clause(10_000)  # nothing measured yet: draft, and measure
    pace.alone, pace.speculative, pace.catch_up, pace.clause_tokens = 0.010, 0.005, 0.001, 8.0
    assert pace.draft_first_clause(10)  # 10 ms to catch up + 7 x 5 ms < 7 x 10 ms alone
    assert not pace.draft_first_clause(100)  # a long new turn: 100 ms + 35 ms > 70 ms
    pace.speculative = 0.012  # a draft that does not pay here (a CPU): the first clause always goes alone
    assert not pace.draft_first_clause(1)
    # A draft that pays a little: 7 x 9.5 ms < 70 ms, but the step that ends the clause is heard only once verified,
    # 1.5 tokens past it at τ 4: (7 + 1.5) x 9.5 ms > 70 ms
    pace.speculative, pace.catch_up = 0.0095, 0.0
    assert pace.draft_first_clause(0)
    pace.step_tokens = 4.0
    assert not pace.draft_first_clause(0)


@pytest.mark.parametrize("quant", ("F32", "F16"))
def test_offline_acceptance_matches_the_runtime(ggufs, tuned_target, sft_draft, demo_data, quant):
    """The HF meter's simulated τ(k) against the tokens per verify step the engine measures, prompt by prompt.
    Greedy, both score the draft's argmax against the target's own answer, so on a prompt where HF and the GGUF
    break no near-tie differently they must agree exactly; across prompts, near-ties (which differ by CPU: llamafile's
    batched kernels round differently) may change a few. (The engine's acceptance *rate* is not α: the token after an
    accepted draft is the target's bonus, never drafted, so it counts other positions.)"""
    from spectune.acceptance.meter import simulate_tau, target_continuations, teacher_forced
    from spectune.acceptance.stage import load_models
    from spectune.data.prepare import read_prompts

    n, max_tokens = 10, 24
    prompts = read_prompts(demo_data)[:n]
    hf_target, hf_drafts, _, tokenizer = load_models(tuned_target, {"sft": sft_draft})
    answers = target_continuations(hf_target, tokenizer, prompts, max_tokens)
    matches = [
        (teacher_forced(hf_drafts["sft"], ids, answer).argmax(-1) == torch.tensor(answer)).tolist()
        for ids, answer in answers
    ]
    target, draft = load(ggufs[quant]["target"]), load(ggufs[quant]["draft"])
    decoder = SpeculativeDecoder(target, [DraftModel(draft, target)])
    for k in (1, 4):
        exact = 0
        for prompt, flags in zip(prompts, matches, strict=True):
            ids = target.tokenize(chat_prompt(target, prompt.messages))
            stats = decoder.generate(ids, DecodeSettings(max_tokens=max_tokens, draft_max=k)).stats
            exact += stats.produced / stats.verify_steps == pytest.approx(simulate_tau([flags], k).tau, rel=1e-9)
        assert exact >= 8, (quant, k, exact)  # the meter simulates the engine; at most 2 of 10 prompts hit a near-tie
