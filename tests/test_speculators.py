"""Speculators as a list: a new one is a class and a registry entry. A toy one ("repeat the last token"), defined
here and registered here only, runs through generate, bench and serve; answers stay the target alone's."""

from __future__ import annotations

from typing import ClassVar

import pytest
from conftest import running

from spectune.bench.config import BenchConfig
from spectune.bench.run import bench
from spectune.errors import SpectuneError
from spectune.runtime.chat import chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import LlamaModel
from spectune.runtime.ngram import NGRAM
from spectune.runtime.registry import SPECULATORS, Variant
from spectune.runtime.sampling import Sampler
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.runtime.speculators import Proposal, Speculators
from spectune.serve.config import ServeConfig
from spectune.serve.generate import GenerateConfig, generate

REPEAT = "repeat"


class RepeatLast:
    """Guesses that the last token comes again, k times, at every other position (so a draft behind it proposes at
    the rest): a poor guess, but one the target judges like any other."""

    name = REPEAT
    model = None
    proposed: ClassVar[list[int]] = []  # tokens proposed, by every instance: what the tests check reached the loop

    def __init__(self, is_end) -> None:
        self.is_end = is_end

    def propose(self, sequence: list[int], k: int, sampler: Sampler, p_min: float) -> Proposal:
        tokens = [] if self.is_end(sequence[-1]) or len(sequence) % 2 else [sequence[-1]] * k
        RepeatLast.proposed.append(len(tokens))
        return Proposal(tokens, source=REPEAT)

    def verified(self, proposal: Proposal, accepted: int) -> None:
        pass

    def behind(self, sequence: list[int]) -> int:
        return 0

    def forget(self) -> None:
        pass


@pytest.fixture
def repeat(monkeypatch):
    """The one registry line, made by the test."""
    monkeypatch.setitem(SPECULATORS, REPEAT, lambda target, setup: RepeatLast(target.is_end))
    RepeatLast.proposed = []


def test_a_variant_is_its_speculators_in_order_and_a_draft_last(repeat):
    assert Variant.parse("ngram+seqkd") == Variant((NGRAM,), "seqkd")
    assert Variant.parse("repeat+ngram").lookups == (REPEAT, NGRAM) and Variant.parse("ngram").draft is None
    assert Variant((NGRAM, REPEAT), "sft").name == "ngram+repeat+sft" and str(Variant(draft="sft")) == "sft"
    with pytest.raises(SpectuneError, match="sft is no speculator"):
        Variant.parse("sft+ngram")  # a draft model always proposes: nothing after it would ever be asked


def test_the_first_speculator_that_proposes_wins():
    class Fixed:
        model = None

        def __init__(self, name: str, tokens: list[int]) -> None:
            self.name, self.tokens, self.judged = name, tokens, []

        def propose(self, sequence, k, sampler, p_min):
            return Proposal(self.tokens[:k], source=self.name)

        def verified(self, proposal, accepted):
            self.judged.append(accepted)

        def behind(self, sequence):
            return 0

        def forget(self):
            pass

    silent, first, second = Fixed("silent", []), Fixed("first", [1, 2]), Fixed("second", [3])
    speculators = Speculators([silent, first, second])
    proposal = speculators.propose([0], 4, None, 0.0)
    assert proposal.tokens == [1, 2] and proposal.source == "first"
    speculators.verified(proposal, 1)
    assert first.judged == [1] and silent.judged == second.judged == []  # only the proposer hears its verdict
    assert Speculators([silent]).propose([0], 4, None, 0.0).source == "silent"  # none proposed: the last's, empty


def test_a_registered_speculator_runs_in_generate(repeat, pair, messages, capsys):
    target, _ = pair
    config = GenerateConfig(
        target=target,
        prompt=messages[-1]["content"],
        speculators=[REPEAT],
        mode="speculative",
        max_tokens=16,
        threads=1,
    )
    shown: list[str] = []
    generate(config, lambda text: shown.append(text) or True, lambda: "", lambda line: None)
    model = LlamaModel(target, n_ctx=512, threads=1)
    alone = SpeculativeDecoder(model).generate(
        model.tokenize(chat_prompt(model, [{"role": "user", "content": messages[-1]["content"]}])),
        DecodeSettings(max_tokens=16),
    )
    assert "".join(shown) == alone.text and sum(RepeatLast.proposed) > 0


def test_a_registered_speculator_runs_in_the_bench_alone_and_in_front_of_a_draft(repeat, pair, demo_data, tmp_path):
    target, draft = pair
    config = BenchConfig(
        target=target,
        drafts={"sft": draft},
        data=demo_data,
        out=tmp_path / "bench",
        n=2,
        repeats=1,
        max_tokens=16,
        draft_max=3,
        threads=1,
        speculators=[REPEAT],
        plot=False,
    )
    assert list(config.variants()) == ["sft", REPEAT, f"{REPEAT}+sft"]
    report = bench(config)
    summary = report["summary"]
    for name in config.variants():
        assert summary[name]["identical"] == 2, name
    # every step but each answer's first (the target's own) asked it, and it cost nothing: no model
    assert summary[REPEAT]["repeat_drafted"] > 0 and 0.5 < summary[REPEAT]["repeat_step_share"] < 1
    assert summary[REPEAT]["cost_ratio"] == 0.0 and summary[REPEAT]["ngram_drafted"] == 0
    # in front of the draft, each proposed on some steps, and each step is counted to the one that proposed
    fronted = [row["variants"][f"{REPEAT}+sft"] for row in report["prompts"]]
    by_source = {
        source: sum(v["by_source"].get(source, {}).get("drafted", 0) for v in fronted) for source in (REPEAT, "draft")
    }
    assert by_source[REPEAT] > 0 and by_source["draft"] > 0
    assert by_source[REPEAT] + by_source["draft"] == sum(sum(v["drafted_at"]) for v in fronted)


def test_a_registered_speculator_runs_in_serve(repeat, pair, messages):
    from openai import OpenAI

    target, draft = pair
    model = LlamaModel(target, n_ctx=512, threads=1)
    expected = SpeculativeDecoder(model).generate(
        model.tokenize(chat_prompt(model, messages)), DecodeSettings(max_tokens=24)
    )
    config = ServeConfig(
        target=target, draft=draft, n_ctx=512, threads=1, draft_max=3, speculators=[REPEAT], mode="speculative"
    )
    with running(config) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        reply = client.chat.completions.create(model="spectune", messages=messages, max_tokens=24, temperature=0)
    stats = reply.model_extra["spectune"]
    assert reply.choices[0].message.content == expected.text
    assert stats["by_source"][REPEAT]["steps"] > 0 and sum(RepeatLast.proposed) > 0


def test_an_unknown_speculator_is_a_clear_error(pair):
    with pytest.raises(ValueError, match="no speculator named echo"):
        ServeConfig(target=pair[0], speculators=["echo"])
