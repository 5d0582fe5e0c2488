"""The offline acceptance meter: pick a draft before exporting anything, on HF models.

The target answers held-out prompts greedily; each draft is run teacher-forced on those answers and we record
where its greedy token equals the target's. That gives α (per-token acceptance), the accepted run lengths,
τ(k) (tokens per verify step, simulated on the real match sequence and from α by formula), the best k, and the
predicted speedup S(k) = τ(k) / (r(k+1) + k·c) for a hardware profile. With temperature > 0 the acceptance of
speculative sampling is α = E[Σ_x min(p(x), q(x))], from both distributions.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from spectune.atomic import atomic_path
from spectune.config import Settings
from spectune.data.prepare import read_prompts
from spectune.errors import SpectuneError
from spectune.models.load import check_model_dir, load_tokenizer
from spectune.speedup import GPU_PROFILE, MAX_DRAFT_LEN, expected_tokens, speedup, verify_ratio_at
from spectune.threads import configure_torch_threads
from spectune.train.common import greedy_answer

MAX_K = MAX_DRAFT_LEN
HERE = "here"  # the key of a profile measured on this machine


class AcceptanceSettings(Settings):
    """The offline meter's settings: the `acceptance:` section of a run config and flags of `spectune acceptance`."""

    n: int = Field(30, ge=1, description="Held-out prompts the target answers.")
    max_new_tokens: int = Field(64, ge=1, description="Longest target answer.")
    temperature: float = Field(0.0, ge=0.0, description="Also measure sampling acceptance at this temperature.")


class AcceptanceConfig(AcceptanceSettings):
    """Everything `spectune acceptance` takes."""

    target: Path = Field(description="The (fine-tuned, merged) target folder.")
    drafts: dict[str, Path] = Field(description="Draft folders by name.")
    data: Path = Field(description="Held-out prompts: a chat dataset or a `data prompts` file.")
    profile: Path | None = Field(
        None, description="Measured profile JSON (cost_ratio, verify_ratio): a pair manifest or a bench report."
    )
    json_out: Path | None = Field(None, description="Also write the results as JSON here.")


@dataclass
class Profile:
    """A hardware profile: c (draft step / target step) and r(n) (n-token batch / one token)."""

    key: str  # GPU_PROFILE or HERE
    name: str
    cost_ratio: float
    verify_ratio: dict[str, float] = field(default_factory=dict)  # empty: r = 1 (memory-bound GPU)


@dataclass
class DraftAcceptance:
    name: str
    alpha: float
    tokens: int
    run_lengths: dict[int, int]  # accepted run length (capped at MAX_K) -> count of verify steps, at k = MAX_K
    alpha_by_position: dict[int, float]  # draft position -> acceptance given the ones before accepted, at k = MAX_K
    tau_simulated: dict[int, float]
    tau_formula: dict[int, float]
    speedup: dict[str, dict[int, float]]  # profile name -> k -> S(k)
    best_k: dict[str, int]
    recommended_k: int  # the best k on a memory-bound GPU, at least 1: what bench, serve and llama-server use
    alpha_sampled: float | None = None  # E[Σ min(p, q)] at the given temperature


@dataclass
class Replay:
    """Greedy speculative decoding replayed at one k: tokens per verify step, how the steps' accepted runs were
    distributed, and per draft position (1..k) how many steps verified a proposal there and how many accepted it."""

    tau: float
    runs: Counter[int]
    reached: list[int]
    accepted: list[int]

    def alpha_by_position(self) -> dict[int, float]:
        """Acceptance at draft position i, given the proposals before it were accepted (where the loss is)."""
        return {i + 1: a / r for i, (a, r) in enumerate(zip(self.accepted, self.reached, strict=True)) if r}


def simulate_tau(matches: list[list[bool]], k: int) -> Replay:
    """Greedy speculative decoding replayed on per-position draft==target flags, as the engine runs it.

    The first token is the target's own, in a step of its own (the caller's first words never wait for the draft).
    From then on, at position i the draft proposes up to k tokens; the accepted prefix is the run of matches from i,
    and the verify step adds one token of its own (the correction, or the bonus token after k accepted).
    """
    tokens = steps = 0
    runs: Counter[int] = Counter()
    reached, accepted = [0] * k, [0] * k
    for sequence in matches:
        position = tokens_first = min(1, len(sequence))
        tokens += tokens_first
        steps += tokens_first
        while position < len(sequence):
            run = 0
            while run < k and position + run < len(sequence):
                reached[run] += 1
                if not sequence[position + run]:
                    break
                accepted[run] += 1
                run += 1
            gained = min(run + 1, len(sequence) - position)
            runs[run] += 1
            tokens += gained
            steps += 1
            position += gained
    return Replay(tokens / steps if steps else 0.0, runs, reached, accepted)


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


def measure(
    target: Any,
    drafts: dict[str, Any],
    tokenizer: Any,
    prompts: list,
    profiles: list[Profile],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
) -> list[DraftAcceptance]:
    """Acceptance of every draft against the target's own greedy answers to `prompts`."""
    import torch

    pairs = target_continuations(target, tokenizer, prompts, max_new_tokens)
    target_logits = [teacher_forced(target, p, a) for p, a in pairs] if temperature > 0 else []
    results = []
    for name, draft in drafts.items():
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
        flat = [m for sequence in matches for m in sequence]
        alpha = sum(flat) / len(flat) if flat else 0.0
        replays = {k: simulate_tau(matches, k) for k in range(1, MAX_K + 1)}
        tau_sim = {k: replay.tau for k, replay in replays.items()}
        deepest = replays[MAX_K]
        tau_formula = {k: expected_tokens(alpha, k) for k in range(1, MAX_K + 1)}
        speedups = {
            profile.key: {
                k: speedup(tau_sim[k], k, profile.cost_ratio, verify_ratio_at(profile.verify_ratio, k + 1))
                for k in tau_sim
            }
            for profile in profiles
        }
        results.append(
            DraftAcceptance(
                name=name,
                alpha=alpha,
                tokens=len(flat),
                run_lengths=dict(sorted(deepest.runs.items())),
                alpha_by_position=deepest.alpha_by_position(),
                tau_simulated=tau_sim,
                tau_formula=tau_formula,
                speedup=speedups,
                best_k={profile: max(values, key=values.get) for profile, values in speedups.items()},
                recommended_k=max(1, max(speedups[GPU_PROFILE], key=speedups[GPU_PROFILE].get)),
                alpha_sampled=float(torch.cat(overlap).mean()) if overlap else None,
            )
        )
    return results


def load_models(target: Path, drafts: dict[str, Path]) -> tuple[Any, dict[str, Any], Any]:
    import torch
    from transformers import AutoModelForCausalLM

    def load(path: Path) -> Any:
        check_model_dir(path)
        return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()

    return load(target), {name: load(path) for name, path in drafts.items()}, load_tokenizer(target)


def gpu_profile(target: Any, draft: Any) -> Profile:
    """Memory-bound decoding: a step costs what its weights weigh, so c = draft params / target params, r = 1."""
    ratio = sum(p.numel() for p in draft.parameters()) / sum(p.numel() for p in target.parameters())
    return Profile(GPU_PROFILE, "gpu (memory-bound, predicted)", round(ratio, 4))


def read_profile(path: Path) -> Profile:
    """A measured profile from JSON: a profile object, or a pair manifest holding `profile_Q4_K_M`."""
    loaded = json.loads(path.read_text())
    loaded = loaded.get("profile_Q4_K_M", loaded.get("profile", loaded))
    if "cost_ratio" not in loaded or "verify_ratio" not in loaded:
        raise SpectuneError(f"{path}: no cost_ratio / verify_ratio (a profile or a pair manifest)")
    return Profile(
        HERE,
        f"here ({loaded.get('machine', 'measured')})",
        float(loaded["cost_ratio"]),
        {str(n): float(r) for n, r in loaded["verify_ratio"].items()},
    )


def run_acceptance(config: AcceptanceConfig) -> dict[str, Any]:
    """The `spectune acceptance` stage: every draft against the target, on `n` held-out prompts."""
    configure_torch_threads()
    measured = [read_profile(config.profile)] if config.profile is not None else []
    prompts = read_prompts(config.data)[: config.n]
    target_model, draft_models, tokenizer = load_models(config.target, config.drafts)
    profiles = [*measured, gpu_profile(target_model, next(iter(draft_models.values())))]
    results = measure(
        target_model, draft_models, tokenizer, prompts, profiles, config.max_new_tokens, config.temperature
    )
    report = {
        "target": str(config.target),
        "data": str(config.data),
        "prompts": len(prompts),
        "temperature": config.temperature,
        "profiles": [asdict(p) for p in profiles],
        "drafts": [json.loads(json.dumps(asdict(r))) for r in results],  # int keys -> str, as in the file
    }
    if config.json_out is not None:
        with atomic_path(config.json_out) as tmp:
            tmp.write_text(json.dumps(report, indent=2))
    return report
