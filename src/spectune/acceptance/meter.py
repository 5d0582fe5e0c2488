"""The offline acceptance meter: pick a draft and its k, on HF models (c on a GPU from their GGUFs where given).

The target answers held-out prompts greedily; each draft is run teacher-forced on those answers and we record
where its greedy token equals the target's. That gives α (per-token acceptance), the accepted run lengths,
τ(k) (tokens per verify step, simulated on the real match sequence and from α by formula), the best k, and the
predicted speedup S(k) = τ(k) / (r(k+1) + k·c) for a hardware profile. With temperature > 0 the acceptance of
speculative sampling is α = E[Σ_x min(p(x), q(x))], from both distributions.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spectune.gpu.card import GROUNDED_PROFILE
from spectune.models.mtp_assistant import assistant_chain_matches, is_assistant
from spectune.runtime.ngram import NGRAM, NgramDrafter, NgramSettings, NgramTable
from spectune.runtime.registry import Variant
from spectune.speedup import (
    GPU_PROFILE,
    MAX_DRAFT_LEN,
    expected_tokens,
    speedup,
    verify_ratio_at,
)
from spectune.train.common import greedy_answer
from spectune.train.eagle3_head import chain_matches


@dataclass
class Profile:
    """A hardware profile: c (draft step / target step) and r(n) (n-token batch / one token)."""

    key: str  # GPU_PROFILE, GROUNDED_PROFILE or HERE
    name: str
    cost_ratio: float
    verify_ratio: dict[str, float] = field(default_factory=dict)  # empty: r = 1 (memory-bound GPU)


@dataclass
class DraftAcceptance:
    name: str
    alpha: float
    tokens: int
    # at k = MAX_DRAFT_LEN: accepted run length -> count of verify steps; draft position -> acceptance given the
    # ones before it were accepted
    run_lengths: dict[int, int]
    alpha_by_position: dict[int, float]
    tau_simulated: dict[int, float]
    tau_formula: dict[int, float]
    cost_ratio: dict[str, float]  # profile key -> c
    speedup: dict[str, dict[int, float]]  # profile key -> k -> S(k)
    best_k: dict[str, int]
    recommended_k: int  # the best k on the GPU, at least 1: what bench, serve and llama-server use
    recommended_by: str  # the profile that k is best on: the reference card's where it has one (ranking_profile)
    alpha_sampled: float | None = None  # E[Σ min(p, q)] at the given temperature
    looked_up: dict[str, float] | None = None  # n-gram variants at the recommended k: see Replay.looked_up


@dataclass
class Replay:
    """Greedy speculative decoding replayed at one k: tokens per verify step, how the steps' accepted runs were
    distributed, per draft position (1..k) how many steps verified a proposal there and how many accepted it, and
    what n-gram lookup proposed (steps, tokens) and had accepted."""

    tau: float
    runs: Counter[int]
    reached: list[int]
    accepted: list[int]
    steps: int = 0
    drafted: int = 0
    looked_up_steps: int = 0
    looked_up_drafted: int = 0
    looked_up_accepted: int = 0

    def alpha_by_position(self) -> dict[int, float]:
        """Acceptance at draft position i, given the proposals before it were accepted (where the loss is)."""
        return {i + 1: a / r for i, (a, r) in enumerate(zip(self.accepted, self.reached, strict=True)) if r}

    @property
    def model_share(self) -> float:
        """The share of drafted tokens the draft model proposed (1 where nothing was looked up)."""
        return (self.drafted - self.looked_up_drafted) / self.drafted if self.drafted else 1.0

    def looked_up(self) -> dict[str, float]:
        """What the lookup did: the share of steps it proposed for, its tokens, and the share of them accepted."""
        return {
            "step_share": self.looked_up_steps / self.steps if self.steps else 0.0,
            "drafted": self.looked_up_drafted,
            "acceptance": self.looked_up_accepted / self.looked_up_drafted if self.looked_up_drafted else 0.0,
        }

    def verify(self, flags: list[bool]) -> int:
        """One step verifying a proposal whose tokens match the target's (`flags`): the accepted run's length."""
        run = 0
        for flag in flags:
            self.reached[run] += 1
            if not flag:
                break
            self.accepted[run] += 1
            run += 1
        return run


# (answer index, position) -> whether each token n-gram lookup proposes there is the target's (None: no proposal)
Lookup = Callable[[int, int], list[bool] | None]


def simulate_tau(
    matches: list[list[bool]], k: int, lookup: Lookup | None = None, model: bool = True, chains: Lookup | None = None
) -> Replay:
    """Greedy speculative decoding replayed on per-position draft==target flags, as the engine runs it.

    The first token is the target's own, in a step of its own (the caller's first words never wait for the draft).
    From then on, at position i the draft proposes up to k tokens; the accepted prefix is the run of matches from i,
    and the verify step adds one token of its own (the correction, or the bonus token after k accepted). With
    `lookup`, a step where the lookup proposes verifies its proposal instead (the runtime's order); without a draft
    `model`, a step where it does not is the target's own. A draft whose proposal depends on where it starts (an
    EAGLE-3 head drafts from its own features) gives its flags per start position as `chains`.
    """
    replay = Replay(0.0, Counter(), [0] * k, [0] * k)
    tokens = 0
    for index, sequence in enumerate(matches):
        position = min(1, len(sequence))
        tokens += position
        replay.steps += position
        while position < len(sequence):
            looked_up = lookup(index, position) if lookup else None
            if looked_up is not None:
                flags = looked_up[: min(k, len(sequence) - position)]
                replay.looked_up_steps += 1
                replay.looked_up_drafted += len(flags)
            elif chains is not None:
                flags = chains(index, position)[: min(k, len(sequence) - position)]
            else:
                flags = sequence[position : position + k] if model else []
            replay.drafted += len(flags)
            run = replay.verify(flags)
            replay.looked_up_accepted += run if looked_up is not None else 0
            gained = min(run + 1, len(sequence) - position)
            replay.runs[run] += 1
            tokens += gained
            replay.steps += 1
            position += gained
    replay.tau = tokens / replay.steps if replay.steps else 0.0
    return replay


def target_continuations(target: Any, tokenizer: Any, prompts: list, max_new_tokens: int) -> list[tuple[list, list]]:
    """(prompt ids, the target's greedy answer ids, end token included) for each prompt."""
    return [greedy_answer(target, tokenizer, prompt.messages, max_new_tokens) for prompt in prompts]


def teacher_forced(model: Any, prompt: list[int], answer: list[int]) -> Any:
    """Logits predicting each answer token (rows: answer positions)."""
    import torch

    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)]


def draft_matches(
    draft: Any, pairs: list[tuple[list, list]], target_logits: list, temperature: float
) -> tuple[list[list[bool]], float | None]:
    """Per answered prompt, where the draft's greedy token is the target's; and E[Σ min(p, q)] at `temperature`."""
    import torch

    matches, overlap = [], []
    for index, (prompt, answer) in enumerate(pairs):
        if not answer:
            continue
        logits = teacher_forced(draft, prompt, answer)
        matches.append((logits.argmax(-1) == torch.tensor(answer)).tolist())
        if temperature > 0:
            p = torch.softmax(target_logits[index] / temperature, -1)
            q = torch.softmax(logits / temperature, -1)
            overlap.append(torch.minimum(p, q).sum(-1))
    return matches, float(torch.cat(overlap).mean()) if overlap else None


def lookup_of(drafter: NgramDrafter, answered: list[tuple[list, list]], is_end: Callable[[int], bool]) -> Lookup:
    """What n-gram lookup proposes at each position of the target's answers (up to MAX_DRAFT_LEN tokens; a proposal at a
    smaller k is its prefix), as match flags; computed once per position, and judged as the target would judge it
    (with min_chance, the lookup learns from it how far to trust its tables, as in the real loop)."""
    proposals: dict[tuple[int, int], list[bool] | None] = {}

    def flags(index: int, position: int) -> list[bool] | None:
        if (index, position) not in proposals:
            prompt, answer = answered[index]
            proposal = drafter.propose(prompt + answer[:position], MAX_DRAFT_LEN, is_end)
            expected = answer[position:]
            matched = [i < len(expected) and t == expected[i] for i, t in enumerate(proposal.tokens)]
            drafter.verified(proposal, accepted=[*matched, False].index(False))
            proposals[index, position] = matched or None
        return proposals[index, position]

    return flags


def acceptance_row(
    name: str,
    matches: list[list[bool]],
    profiles: list[Profile],
    lookup: Lookup | None = None,
    model: bool = True,
    alpha_sampled: float | None = None,
    chains: Lookup | None = None,
) -> DraftAcceptance:
    """A draft's (or n-gram variant's) figures from its replays at every k. A looked-up token costs nothing: the
    draft model's c is paid on its share of the drafted tokens. With `chains`, `matches` holds each chain's first
    flag, none at position 0 (the target's own first token): α is acceptance at draft position 1, as for a draft
    model."""
    replays = {k: simulate_tau(matches, k, lookup, model, chains) for k in range(1, MAX_DRAFT_LEN + 1)}
    tau_sim = {k: replay.tau for k, replay in replays.items()}
    deepest = replays[MAX_DRAFT_LEN]
    if lookup is None:
        flat = [m for sequence in matches for m in (sequence[1:] if chains else sequence)]
        alpha = sum(flat) / len(flat) if flat else 0.0
        tokens, tau_formula = len(flat), {k: expected_tokens(alpha, k) for k in range(1, MAX_DRAFT_LEN + 1)}
    else:  # the lookup's proposals are not one per position: α is the share of drafted tokens accepted
        alpha = sum(deepest.accepted) / deepest.drafted if deepest.drafted else 0.0
        tokens, tau_formula = deepest.drafted, {}
    speedups = {
        profile.key: {
            k: speedup(
                tau_sim[k], k, profile.cost_ratio * replay.model_share, verify_ratio_at(profile.verify_ratio, k + 1)
            )
            for k, replay in replays.items()
        }
        for profile in profiles
    }
    ranked_by = ranking_profile(speedups)
    best = max(speedups[ranked_by], key=speedups[ranked_by].get)
    return DraftAcceptance(
        name=name,
        alpha=alpha,
        tokens=tokens,
        run_lengths=dict(sorted(deepest.runs.items())),
        alpha_by_position=deepest.alpha_by_position(),
        tau_simulated=tau_sim,
        tau_formula=tau_formula,
        cost_ratio={profile.key: profile.cost_ratio for profile in profiles},
        speedup=speedups,
        best_k={profile: max(values, key=values.get) for profile, values in speedups.items()},
        recommended_k=max(1, best),
        recommended_by=ranked_by,
        alpha_sampled=alpha_sampled,
        looked_up=replays[best].looked_up() if lookup else None,
    )


def ranking_profile(speedups: dict[str, Any]) -> str:
    """The profile a draft's k is chosen by: the reference card's (c and r fitted on published llama.cpp figures,
    with their error), where the draft's GGUF gave its layers; else bytes only. Bytes only puts r(k+1) at 1, so it
    prefers longer drafts than the card does (a head: k 3-4 where the card's best is 1-2)."""
    return GROUNDED_PROFILE if GROUNDED_PROFILE in speedups else GPU_PROFILE


def head_chains(head: Any, target: Any, prompt: list[int], answer: list[int]) -> list[list[bool]]:
    """A head's chained guesses at every answer position: an MTP assistant's or an EAGLE-3 head's."""
    config = getattr(head, "config", None)  # an EAGLE-3 head is a plain module
    if config is not None and is_assistant(config.to_dict()):
        return assistant_chain_matches(head, target, prompt, answer, MAX_DRAFT_LEN)
    return chain_matches(head, target, prompt, answer)


def measure(
    target: Any,
    drafts: dict[str, Any],
    tokenizer: Any,
    prompts: list,
    profiles: dict[str, list[Profile]],
    max_tokens: int,
    temperature: float = 0.0,
    ngram: tuple[NgramSettings, NgramTable] | None = None,
    heads: dict[str, Any] | None = None,
) -> list[DraftAcceptance]:
    """Acceptance of every draft against the target's own greedy answers to `prompts` (`profiles`: each draft's
    and EAGLE-3 head's); with `ngram` (its settings and domain table), of lookup alone (`ngram`) and in front of
    each draft. `heads`: EAGLE-3 heads and MTP assistants by name, run on the target's hidden states."""
    heads = heads or {}
    pairs = target_continuations(target, tokenizer, prompts, max_tokens)
    target_logits = [teacher_forced(target, p, a) for p, a in pairs] if temperature > 0 else []
    results, all_matches, all_chains = [], {}, {}
    for name, draft in drafts.items():
        all_matches[name], alpha_sampled = draft_matches(draft, pairs, target_logits, temperature)
        results.append(acceptance_row(name, all_matches[name], profiles[name], alpha_sampled=alpha_sampled))
    for name, head in heads.items():
        per_answer = [head_chains(head, target, prompt, answer) for prompt, answer in pairs if answer]
        all_chains[name] = lambda index, position, chains=per_answer: chains[index][position]
        all_matches[name] = [[False] + [chain[0] for chain in chains[1:]] for chains in per_answer]
        results.append(acceptance_row(name, all_matches[name], profiles[name], chains=all_chains[name]))
    if ngram is not None:
        answered = [(prompt, answer) for prompt, answer in pairs if answer]
        configured = target.generation_config.eos_token_id
        end_ids = {tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])}
        lookup = lookup_of(NgramDrafter(*ngram), answered, end_ids.__contains__)
        lengths = [[False] * len(answer) for _, answer in answered]
        free = [dataclasses.replace(profile, cost_ratio=0.0) for profile in next(iter(profiles.values()))]
        results.append(acceptance_row(NGRAM, lengths, free, lookup, model=False))
        for name in all_matches:
            chains = all_chains.get(name)
            fronted = Variant((NGRAM,), name).name
            results.append(acceptance_row(fronted, all_matches[name], profiles[name], lookup, chains=chains))
    return results


def encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    """Token ids of `text`; with `special`, the tokenizer's own (a BOS where it adds one)."""
    return tokenizer.encode(text, add_special_tokens=special)
