"""The bench's headline arithmetic on hand-built rows whose answers are worked out by hand: a changed formula
(aggregate speedup, the n - 1 span of the llama.cpp baseline, pooled acceptance, τ, the predictions) fails here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

import spectune.bench.run as bench_run
from spectune.bench.config import BenchConfig
from spectune.bench.report import read_result
from spectune.bench.run import variant_profiles
from spectune.bench.summary import BenchSummary, Pooled, first_sentence_over_alone, measured_figures, summarize
from spectune.gpu.card import reference_card
from spectune.runtime.ngram import NgramSettings
from spectune.runtime.profile import gguf_weights
from spectune.runtime.registry import Variant
from spectune.speedup import first_sentence_ratio

COLD = {"ttft_ms": 5.0, "ttfs_ms": 9.0, "cold_ttft_ms": 7.0, "cold_ttfs_ms": 12.0}


def variant(
    tokens,
    seconds,
    steps,
    produced,
    drafted_at,
    accepted_at,
    offered,
    accepted_llama,
    speedup,
    peer,
    looked_up=0,
    defaults=None,
    catch_ups=(),
):
    return {
        "draft_catch_ups": list(catch_ups),
        **({"llama_cpp_defaults": defaults} if defaults else {}),
        "ngram_steps": 1 if looked_up else 0,
        "ngram_drafted": looked_up,
        "ngram_accepted": looked_up // 2,
        "ngram_from_context": looked_up // 4,
        "tokens": tokens,
        "decode_seconds": seconds,
        "after_first_seconds": seconds - 0.1,
        "verify_steps": steps,
        "produced": produced,
        "drafted_at": drafted_at,
        "accepted_at": accepted_at,
        "offered": offered,
        "accepted_as_llama_cpp": accepted_llama,
        "speedup": speedup,
        "identical": True,
        "cold_ttfs_first_clause_alone_ms": 11.0,
        "llama_cpp": peer,
        **COLD,
    }


def peer(tokens, seconds, drafted=0, accepted=0):
    return {"tokens": tokens, "seconds": seconds, "drafted": drafted, "accepted": accepted, "identical": True}


ROWS = [
    {
        "variants": {
            # llama.cpp: 9 decodes, 80 ms; at its defaults 9 in 0.54 s, 60 ms
            "target": variant(10, 1.0, 10, 10, [], [], 0, 0, 1.0, peer(10, 0.72), defaults=peer(10, 0.54)),
            # the draft read 2 tokens, then 3, in one batch before proposing
            "sft": variant(10, 0.5, 4, 10, [4, 2], [3, 1], 8, 4, 2.0, peer(10, 0.4, 8, 4), catch_ups=(2, 3)),
        }
    },
    {
        "variants": {
            # 19 decodes, 80 ms; at its defaults 60 ms
            "target": variant(20, 2.0, 20, 20, [], [], 0, 0, 1.0, peer(20, 1.52), defaults=peer(20, 1.14)),
            "sft": variant(20, 0.5, 5, 20, [5, 5], [5, 4], 10, 9, 4.0, peer(20, 0.6, 10, 9)),
        }
    },
]
PROFILE = {"cost_ratio": 0.5, "verify_ratio": {"2": 1.5, "3": 2.0}}


def write_gguf(path, vocab: int, width: int, body: int, tied: bool, layers: int) -> None:
    """A GGUF of F32 tensors: a vocab x width embedding table, a head of the same shape unless tied, `body` more."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_tensor("token_embd.weight", np.zeros((vocab, width), np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((vocab, width), np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros(body, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_pair(folder) -> None:
    """c = 0.1 by what a step reads, not by file size: the target reads its head (4,000 bytes), body (8,000) and one
    embedding row (40) of its 4,000-byte table, 12,040; the tied draft its whole table as the head (400), body (800)
    and a row (4), 1,204. The files weigh 16,000 and 1,200 bytes of tensors (0.075)."""
    write_gguf(folder / "t.gguf", vocab=100, width=10, body=2000, tied=False, layers=4)
    write_gguf(folder / "d.gguf", vocab=100, width=1, body=200, tied=True, layers=1)


@pytest.fixture
def summary(tmp_path):
    write_pair(tmp_path)
    config = BenchConfig(
        target=tmp_path / "t.gguf", drafts={"sft": tmp_path / "d.gguf"}, data=tmp_path, recommended_k={"sft": 2}
    )
    return summarize("sft", ROWS, PROFILE, config, tmp_path / "d.gguf")


def test_speedups_are_all_tokens_over_all_seconds(summary):
    assert summary.aggregate_speedup == pytest.approx(3.0)  # (1.0 + 2.0) s alone over (0.5 + 0.5) s
    assert (summary.total_tokens, summary.total_seconds, summary.target_total_seconds) == (30, 1.0, 3.0)
    assert (summary.mean_speedup, summary.best_speedup, summary.worst_speedup) == (3.0, 4.0, 2.0)


def test_acceptance_and_tau_are_pooled_over_the_prompts(summary):
    assert summary.acceptance == pytest.approx(13 / 16)  # (3 + 1 + 5 + 4) / (4 + 2 + 5 + 5), not a mean of rates
    assert summary.acceptance_by_position == pytest.approx([8 / 9, 5 / 7])
    assert summary.mean_accepted_len == pytest.approx(30 / 9)
    assert summary.mean_drafted_per_step == pytest.approx(16 / 9)


def test_the_predictions_cost_each_step_by_what_it_drafted(summary):
    # 2 steps drafted 1 token, 7 drafted 2: here 2 (r(2) + c) + 7 (r(3) + 2c) = 25, and the catch-ups of 2 and 3
    # tokens cost c (r(2) - 1) + c (r(3) - 1) = 0.75 more; on a GPU 9 + 16 x 0.1 = 10.6 (a batch costs one step)
    assert summary.draft_catch_ups == 2
    assert summary.predicted_speedup_here == pytest.approx(30 / 25.75)
    assert summary.gpu_cost_ratio == pytest.approx(0.1)
    assert summary.predicted_speedup_gpu == pytest.approx(30 / 10.6)


def test_the_grounded_prediction_costs_each_step_on_the_reference_card(summary, tmp_path):
    # A tiny pair is all layer floors on the card: c just under 1/4 (one layer against four), r(2) and r(3) near 1; the
    # same 2 steps of one drafted token and 7 of two as the other predictions, and the band's ends the same sum at
    # the worst (high c, high r) and best (low c, low r) ends
    card = reference_card()
    target, draft = gguf_weights(tmp_path / "t.gguf"), gguf_weights(tmp_path / "d.gguf")
    c, r = card.cost_ratio(draft, target), card.verify_ratios(target)
    assert (target.layers, draft.layers) == (4, 1)
    assert 0.249 < c < 0.25 and 1.0 < r["2"] < r["3"] < 1.001
    assert summary.gpu_card == card.label and "predicted" in card.label
    assert summary.grounded_cost_ratio == pytest.approx(c)
    assert summary.predicted_speedup_gpu_grounded == pytest.approx(30 / (2 * (r["2"] + c) + 7 * (r["3"] + 2 * c)))
    (low_c, high_c), (low_r, high_r) = card.cost_ratio_band(draft, target), card.verify_band(target)
    worst = 30 / (2 * (high_r["2"] + high_c) + 7 * (high_r["3"] + 2 * high_c))
    best = 30 / (2 * (low_r["2"] + low_c) + 7 * (low_r["3"] + 2 * low_c))
    assert summary.predicted_speedup_gpu_grounded_band == pytest.approx((worst, best))
    assert worst <= summary.predicted_speedup_gpu_grounded <= best


def test_the_first_sentence_waits_for_the_step_that_ends_it(summary):
    assert first_sentence_ratio(1.0, 3.0, 2.0) == 1.0  # a one-token clause is the target's own step, drafted or not
    assert first_sentence_ratio(5.0, 1.0, 1.0) == 1.0  # nothing accepted, nothing lost: each step one token
    # 5 tokens: the first, then 4 at twice the pace, and the step that ends the clause yields (3 - 1) / 2 = 1 more
    assert first_sentence_ratio(5.0, 3.0, 2.0) == pytest.approx((1 + (4 + 1) / 2) / 5)
    figures = summary.model_copy(update={"target_ttft_ms": 100.0, "target_ttfs_ms": 500.0, "mean_accepted_len": 3.0})
    assert first_sentence_over_alone(figures, 2.0) == pytest.approx(0.7)  # the clause: 5 of the target's steps


def test_the_llama_cpp_baseline_is_compared_per_decode_over_the_same_span(summary):
    # llama-server times n - 1 decodes for n tokens: 2.24 s / 28 = 80 ms; ours from first token to last: 2.8 / 28
    assert summary.llama_cpp_target_ms_per_decode == pytest.approx(80.0)
    assert summary.target_ms_per_decode == pytest.approx(100.0)
    assert summary.baseline_vs_llama_cpp == pytest.approx(0.8)
    assert summary.llama_cpp_target_total == (28, pytest.approx(2.24))
    # with the draft over llama.cpp's target alone on the same answers: 30 decodes at 80 ms over 1.0 s
    assert summary.aggregate_speedup_over_llama_cpp == pytest.approx(2.4)


def test_the_headline_is_over_the_faster_llama_cpp(summary):
    """llama.cpp at its defaults decodes in 60 ms (1.62 s / 27 decodes): 30 x 60 ms over 1.0 s = 1.8x, the smaller."""
    assert summary.llama_cpp_defaults_target_ms_per_decode == pytest.approx(60.0)
    assert summary.baseline_vs_llama_cpp_defaults == pytest.approx(0.6)
    assert summary.aggregate_speedup_over_llama_cpp_defaults == pytest.approx(1.8)
    assert summary.aggregate_speedup_over_fastest_llama_cpp == pytest.approx(1.8)


def test_llama_cpps_speculative_figures_are_pooled_like_ours(summary):
    assert summary.vs_llama_cpp == pytest.approx(1.0)  # 30 tokens in 1.0 s both
    assert summary.llama_cpp_acceptance == pytest.approx(13 / 18)
    assert summary.acceptance_as_llama_cpp_counts == pytest.approx(13 / 18)
    assert summary.llama_cpp_identical == 2 and summary.llama_cpp_target_identical == 2


def test_in_front_of_a_draft_lookup_is_free_and_the_draft_pays_for_its_share(tmp_path):
    """ngram+sft: of 16 drafted tokens 8 were looked up (c = 0), so c per drafted token is half the model's."""
    looked_up = (
        {"ngram_steps": 1, "ngram_drafted": 4, "ngram_accepted": 4, "ngram_from_context": 1},
        {"ngram_steps": 2, "ngram_drafted": 4, "ngram_accepted": 2, "ngram_from_context": 3},
    )
    everything = ({"ngram_steps": 4, "ngram_drafted": 6}, {"ngram_steps": 5, "ngram_drafted": 10})
    rows = [
        {"variants": {**row["variants"], "ngram+sft": sft | lookup, "ngram": sft | alone}}
        for row, lookup, alone in zip(ROWS, looked_up, everything, strict=True)
        for sft in [row["variants"]["sft"]]
    ]
    write_pair(tmp_path)
    config = BenchConfig(
        target=tmp_path / "t.gguf", drafts={"sft": tmp_path / "d.gguf"}, data=tmp_path, recommended_k={"sft": 2}
    )
    config = config.model_copy(update={"ngram": NgramSettings()})
    combined = summarize("ngram+sft", rows, PROFILE, config, tmp_path / "d.gguf")
    assert combined.cost_ratio == pytest.approx(0.25) and combined.gpu_cost_ratio == pytest.approx(0.05)
    assert combined.predicted_speedup_gpu == pytest.approx(30 / (9 + 16 * 0.05))
    lookup = combined.lookups["ngram"]
    assert lookup.step_share == pytest.approx(3 / 9) and lookup.acceptance == pytest.approx(6 / 8)
    assert lookup.context_share == pytest.approx(4 / 8)
    alone = summarize("ngram", rows, {**PROFILE, "cost_ratio": 0.0}, config, None)
    assert alone.gpu_cost_ratio == 0.0 and alone.predicted_speedup_gpu == pytest.approx(30 / 9)
    assert alone.lookups["ngram"].step_share == pytest.approx(1.0) and alone.lookups["ngram"].drafted == 16


def test_a_draft_is_profiled_as_far_as_its_longest_variant_drafts(tmp_path, monkeypatch):
    """sft serves at k = 1 alone but k = 6 behind lookup: its r(n) must reach r(7), or ngram+sft is predicted with
    r(2) (which read 1.87x predicted against 0.87x measured on the demo pair). Lookup alone verifies k + 1 = 8."""
    write_pair(tmp_path)
    asked = {}

    def measured(target, draft, max_batch, threads=None, exact=True):
        asked[draft.name] = max_batch
        return {"cost_ratio": 0.5, "draft_ms_per_token": 1.0, "verify_ratio": {str(n): 1.0 for n in range(2, 9)}}

    monkeypatch.setattr(bench_run, "measure_profile", measured)
    config = BenchConfig(
        target=tmp_path / "t.gguf",
        drafts={"sft": tmp_path / "d.gguf"},
        data=tmp_path,
        recommended_k={"sft": 1, "ngram+sft": 6, "ngram": 7},
        ngram=NgramSettings(),
    )
    profiles = variant_profiles(config)
    assert asked == {"d.gguf": 7, "t.gguf": 8}
    assert profiles["ngram+sft"]["cost_ratio"] == 0.5 and profiles["ngram"]["cost_ratio"] == 0.0


def test_the_bench_refuses_settings_it_cannot_compare(tmp_path):
    """Sampled answers cannot be checked for identity, and llama.cpp's tools take no stop strings."""
    base = {"target": tmp_path / "t.gguf", "drafts": {}, "data": tmp_path / "d.jsonl"}
    with pytest.raises(ValueError, match="temperature must be 0"):
        BenchConfig(**base, temperature=0.7)
    with pytest.raises(ValueError, match=r"llama\.cpp's tools run without stop"):
        BenchConfig(**base, peer=True, stop=["."])
    assert BenchConfig(**base, stop=["."]).stop == ["."]  # spectune's own loop alone takes them


RESULTS = Path(__file__).parent.parent / "benchmarks" / "results"


def committed_summaries() -> list[tuple[str, dict, dict, list]]:
    """(file, variant, its committed summary, the file's per-prompt rows) of every committed bench result."""
    found = []
    for path in sorted([*RESULTS.rglob("*.json"), *RESULTS.rglob("*.json.gz")]):
        result = read_result(path)
        for part in ("summary", "drafts") if isinstance(result, dict) else ():
            for name, figures in (result.get(part) or {}).items():
                if isinstance(figures, dict) and "aggregate_speedup" in figures:
                    found.append((str(path.relative_to(RESULTS)), name, figures, result.get("prompts") or []))
    return found


def test_every_committed_bench_summary_reads_as_typed_and_writes_back_the_same_figures():
    summaries = committed_summaries()
    assert len(summaries) >= 25  # every variant of the committed bench results (29 in the files kept since 2026-12-08)
    for file, name, figures, _ in summaries:
        written = BenchSummary.model_validate(figures).model_dump(mode="json")
        assert {key: written[key] for key in figures} == figures, (file, name)
        assert all(written[key] is None for key in set(written) - set(figures)), (file, name)


def test_every_committed_bench_summary_recomputes_from_its_per_prompt_rows():
    # the code that summarizes today finds the figures every committed bench printed (their predictions need the
    # GGUFs, not committed: the measured figures are what the rows alone decide)
    recomputed = 0
    for file, name, figures, rows in committed_summaries():
        first = rows[0]["variants"].get(name, {}) if rows else {}
        if "drafted_at" not in first or not ({"by_source", "ngram_steps"} & set(first)):
            continue  # not a row of our loop, or older than counting by speculator (history/)
        variants = [row["variants"][name] for row in rows]
        measured = measured_figures(name, rows, Pooled.of(variants, Variant.parse(name).draft is not None))
        for key, value in measured.items():
            if figures.get(key) is not None:
                assert value == pytest.approx(figures[key], rel=1e-9), (file, name, key)
                recomputed += 1
    assert recomputed > 1000
