"""N-gram drafting: the tables, the proposals, exact answers alone and in front of the draft model, exact sampling."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import running

from spectune.acceptance.meter import lookup_of
from spectune.data.prepare import extract_prompts
from spectune.data.read import read_dialogues
from spectune.export.gguf import export_model
from spectune.runtime.chat import chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.draft_model import DRAFT
from spectune.runtime.llama import LlamaModel
from spectune.runtime.ngram import NGRAM, NgramDrafter, NgramSettings, NgramSetup, NgramTable, domain_table
from spectune.runtime.registry import Variant
from spectune.runtime.sampling import StochasticSampler
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.runtime.stats import SourceCounts
from spectune.serve.config import ServeConfig


def never_ends(token: int) -> bool:
    return False


def test_a_table_counts_what_followed_each_ngram():
    table = NgramTable(min_n=1, max_n=2)
    table.add([1, 2, 3, 1, 2, 4, 1, 2, 3])
    # 3 followed (1, 2) twice, 4 once: its chance counts one unseen continuation, 2 / (3 + 1)
    assert table.lookup([7, 1, 2], 2, min_share=0.0) == (3, 0.5)
    assert table.lookup([7, 1, 2], 2, min_share=0.7) is None  # 2 of 3 is below the share asked for
    assert table.lookup([9, 9], 2, min_share=0.0) is None
    assert table.lookup([3], 1, min_share=0.0) == (1, 0.5)  # seen once: a guess


def test_the_conversation_proposes_what_the_caller_said():
    """A slot value the caller gave comes back as a proposal, chained token by token, up to k."""
    drafter = NgramDrafter(NgramSettings(domain=False, min_n=2, max_n=3))
    caller = [10, 11, 50, 51, 52, 53, 12]  # ... "Sushi Ran at 7" ...
    answer_so_far = [20, 50, 51]
    proposal = drafter.propose([*caller, *answer_so_far], 3, never_ends)
    assert proposal.tokens == [52, 53, 12] and proposal.from_context == 3
    assert drafter.propose([*caller, *answer_so_far], 2, never_ends).tokens == [52, 53]


def test_a_proposal_stops_at_an_end_token_and_at_an_unknown_tail():
    drafter = NgramDrafter(NgramSettings(domain=False, min_n=2, max_n=2))
    sequence = [1, 2, 3, 0, 5, 1, 2]
    assert drafter.propose(sequence, 8, lambda token: token == 0).tokens == [3, 0]
    assert drafter.propose(sequence, 8, never_ends).tokens == [3, 0, 5, 1, 2, 3, 0, 5]  # the cycle it has seen
    assert drafter.propose([7, 8, 9], 4, never_ends).tokens == []


def test_a_new_conversation_rebuilds_the_context_table():
    """Another caller's words are never proposed: a sequence that does not continue the last one starts over."""
    drafter = NgramDrafter(NgramSettings(domain=False, min_n=2, max_n=2))
    assert drafter.propose([1, 2, 3, 4, 1, 2], 1, never_ends).tokens == [3]
    assert drafter.propose([5, 6, 1, 2], 1, never_ends).tokens == []


def test_the_domain_table_proposes_the_targets_phrasing_when_sure_enough():
    answers = [[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 9, 1], [3, 8, 4]]
    settings = NgramSettings(context=False, min_n=2, max_n=2, min_share=0.6)
    drafter = NgramDrafter(settings, domain_table(settings, answers))
    proposal = drafter.propose([30, 7, 8], 4, never_ends)
    assert proposal.tokens == [9, 1] and proposal.from_context == 0  # (9, 1) 2 of 3: sure enough; then unknown
    settings = NgramSettings(context=False, domain=False, min_n=2, max_n=2)
    off = NgramDrafter(settings, domain_table(settings, answers))
    assert off.propose([30, 7, 8], 4, never_ends).tokens == []


def test_a_proposal_stops_where_its_chance_falls_below_what_verifying_costs():
    """With min_chance, a token is proposed only while the whole proposal is likely enough to be kept: each tail
    here was seen once (chance 1/2), so the second token's whole chance, 1/4, is below 0.4."""
    sequence = [1, 2, 3, 4, 5, 1, 2]
    cautious = NgramDrafter(NgramSettings(domain=False, min_n=2, max_n=2, min_chance=0.4))
    assert cautious.propose(sequence, 4, never_ends).tokens == [3]
    assert NgramDrafter(NgramSettings(domain=False, min_n=2, max_n=2)).propose(sequence, 4, never_ends).tokens == [
        3,
        4,
        5,
        1,
    ]


def test_the_lookup_learns_how_far_to_trust_its_tables():
    """Rejected lookups of a kind lower its chance until it stops proposing; kept ones raise it again. Only the
    tokens the target judged count: those after the first rejected one were never verified."""
    drafter = NgramDrafter(NgramSettings(domain=False, min_n=2, max_n=2, min_chance=0.4))
    sequence = [1, 2, 3, 4, 5, 1, 2]
    proposal = drafter.propose(sequence, 1, never_ends)
    assert proposal.evidence == [((True, 2), 0.5)] and drafter.chance((True, 2), 0.5) == 0.5
    for _ in range(4):
        drafter.verified(proposal, accepted=0)
    assert drafter.chance((True, 2), 0.5) == pytest.approx(0.5 * 4 / 6)  # kept 0 of an expected 2, 4 prior
    assert drafter.propose(sequence, 1, never_ends).tokens == []
    longer = NgramDrafter(NgramSettings(domain=False, min_n=2, max_n=2)).propose(sequence, 3, never_ends)
    for _ in range(6):
        drafter.verified(longer, accepted=3)
    assert drafter.kept[True, 2] == 18 and drafter.expected[True, 2] == pytest.approx(2 + 6 * 1.5)
    assert drafter.propose(sequence, 1, never_ends).tokens == [3]
    drafter.verified(longer, accepted=1)  # the second token rejected, the third never judged
    assert drafter.kept[True, 2] == 19 and drafter.expected[True, 2] == pytest.approx(12)


def test_offline_acceptance_judges_each_lookup_as_the_target_would():
    """The acceptance stage replays lookups on the target's answers: each proposal is judged there too, so a lookup
    with min_chance learns its trust offline as it does in the real loop."""
    drafter = NgramDrafter(NgramSettings(domain=False, min_n=1, max_n=1))
    flags = lookup_of(drafter, [([5], [1, 2, 1, 3])], never_ends)
    assert flags(0, 3)[:2] == [False, False]  # after 1 came 2 once: it proposes 2, the target said 3
    assert drafter.kept[True, 1] == 0 and drafter.expected[True, 1] == 0.5  # only the first token was judged


def test_min_n_above_max_n_is_refused():
    with pytest.raises(ValueError, match="min_n 3 is above max_n 2"):
        domain_table(NgramSettings(min_n=3, max_n=2), [])


def test_a_looked_up_proposal_keeps_sampling_exact():
    """An n-gram proposes without a distribution (q is one-hot): the target's token is still distributed as p."""
    config = DecodeSettings(temperature=1.0)
    sampler = StochasticSampler(config, np.random.default_rng(0))
    logits = np.log(np.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]))
    firsts = np.zeros(3)
    trials = 20_000
    for _ in range(trials):
        accepted, own = sampler.verify(logits, [1], [])
        firsts[1 if accepted else own] += 1
    assert np.abs(firsts / trials - np.array([0.5, 0.3, 0.2])).max() < 0.015


@pytest.fixture(scope="module")
def q8_pair(tuned_target, sft_draft, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ngram-ggufs")
    return tuple(
        LlamaModel(export_model(source, folder / f"{role}.gguf", "Q8_0"), n_ctx=512, threads=1, exact=True)
        for role, source in (("target", tuned_target), ("draft", sft_draft))
    )


def test_ngram_alone_and_in_front_of_the_draft_give_the_targets_own_answers(q8_pair, demo_data):
    """Greedy answers equal the target alone's, whichever source proposed; the n-gram's share is counted apart."""
    target, draft = q8_pair
    dialogues = read_dialogues(demo_data).dialogues
    answers = [target.tokenize(turn["content"], special=False) for d in dialogues[:200] for turn in d.messages[1::2]]
    plain = SpeculativeDecoder(target)
    domain = domain_table(NgramSettings(), answers)
    setup = {NGRAM: NgramSetup(NgramSettings(), domain)}
    looked_up = SpeculativeDecoder(target, Variant((NGRAM,)).speculators(target, None, setup))
    combined = SpeculativeDecoder(target, Variant((NGRAM,), "sft").speculators(target, draft, setup))
    cautious_setup = {NGRAM: NgramSetup(NgramSettings(min_chance=0.5), domain)}
    cautious = SpeculativeDecoder(target, Variant((NGRAM,)).speculators(target, None, cautious_setup))
    config = DecodeSettings(max_tokens=40, draft_max=4)
    totals = {"ngram": [0, 0, 0], "combined": [0, 0, 0], "caught_up": [0, 0], "cautious": [0, 0]}
    for prompt in extract_prompts(dialogues, 12, seed=3):
        ids = target.tokenize(chat_prompt(target, prompt.messages))
        expected = plain.generate(ids, config).tokens
        alone, both = looked_up.generate(ids, config), combined.generate(ids, config)
        assert alone.tokens == expected and both.tokens == expected, prompt.messages[-1]
        sure = cautious.generate(ids, config)
        assert sure.tokens == expected, prompt.messages[-1]
        totals["cautious"][0] += sure.stats.accepted
        totals["cautious"][1] += sure.stats.drafted
        lookup, both_lookup = (generation.stats.by_source.get(NGRAM, SourceCounts()) for generation in (alone, both))
        assert lookup.drafted == alone.stats.drafted  # no draft model: every proposal was looked up
        assert both_lookup.accepted <= both.stats.accepted and both_lookup.drafted <= both.stats.drafted
        model = both.stats.by_source.get(DRAFT, SourceCounts())
        assert both_lookup.drafted + model.drafted == both.stats.drafted  # every proposal is counted to its source
        totals["ngram"][0] += lookup.accepted
        totals["ngram"][1] += lookup.steps
        totals["ngram"][2] += lookup.drafted
        totals["combined"][0] += both_lookup.steps
        totals["combined"][1] += both.stats.verify_steps - both_lookup.steps
        totals["combined"][2] += both.stats.accepted - both_lookup.accepted
        # the draft model reads what was looked up before it proposes again: batches of 2 tokens or more, recorded
        assert alone.stats.draft_catch_ups == [] and all(n > 1 for n in both.stats.draft_catch_ups)
        assert len(both.stats.draft_catch_ups) <= both.stats.verify_steps - both_lookup.steps
        totals["caught_up"][0] += sum(both.stats.draft_catch_ups)
        totals["caught_up"][1] += both_lookup.accepted
    assert totals["ngram"][0] > 0 and totals["ngram"][1] > 0  # the demo's phrasing repeats: lookups get accepted
    assert totals["combined"][0] > 0 and totals["combined"][1] > 0  # both sources proposed
    assert totals["combined"][2] > 0  # and the draft model's proposals were still accepted where it proposed
    assert totals["caught_up"][0] > totals["caught_up"][1] > 0  # it read every accepted looked-up token, and more
    # proposing only what is likely to be kept: fewer tokens, a larger share of them kept
    assert 0 < totals["cautious"][1] < totals["ngram"][2]
    assert totals["cautious"][0] / totals["cautious"][1] > totals["ngram"][0] / totals["ngram"][2]


def test_a_server_with_ngram_lookup_answers_as_the_target_alone(pair, messages, demo_data):
    """`spectune serve --ngram`: the same answer, the looked-up share reported; and never one caller's words
    proposed to another (the conversation's table starts anew with a conversation that does not continue it)."""
    from openai import OpenAI

    target, draft = pair
    model = LlamaModel(target, n_ctx=512, threads=1)
    expected = SpeculativeDecoder(model).generate(
        model.tokenize(chat_prompt(model, messages)), DecodeSettings(max_tokens=24)
    )
    config = ServeConfig(
        target=target,
        draft=draft,
        n_ctx=512,
        threads=1,
        draft_max=4,
        ngram=NgramSettings(),
        ngram_data=demo_data,
        mode="speculative",
    )
    with running(config) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        reply = client.chat.completions.create(model="spectune", messages=messages, max_tokens=24, temperature=0)
        stats = reply.model_extra["spectune"]
    assert reply.choices[0].message.content == expected.text
    lookup = stats["by_source"][NGRAM]
    assert 0 < lookup["drafted"] <= stats["drafted"] and lookup["accepted"] <= stats["accepted"]


def test_the_domain_answers_keep_only_turns_the_target_answered():
    """seqkd answers a turn only while its context is under max_seq_length: the turns after it are the dataset's own
    words and stay out of the domain table."""
    from spectune.data.read import Dialogue
    from spectune.train.draft import only_answered

    turns = [
        {"role": "user", "content": "aaaa"},
        {"role": "assistant", "content": "target"},
        {"role": "user", "content": "bbbb"},
        {"role": "assistant", "content": "dataset"},
    ]
    dialogues = [Dialogue(turns, "t.jsonl", 1), Dialogue(turns[:2], "t.jsonl", 2)]

    def characters(messages):
        return sum(len(turn["content"]) for turn in messages)

    kept = only_answered(dialogues, characters, max_seq_length=12)
    assert [d.messages for d in kept] == [turns[:2], turns[:2]]
    assert only_answered(dialogues, characters, max_seq_length=4) == []
