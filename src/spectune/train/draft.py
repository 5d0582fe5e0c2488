"""Drafts that think like the target. A draft only speeds the target up if it proposes what the target says.

Methods (`DraftConfig.method`):
- `sft`: fine-tune the draft on the same data as the target (the reference story's method), TRL SFTTrainer.
- `kd`: white-box distillation on the same data: at every assistant position the draft's next-token
  distribution is pulled towards the fine-tuned target's (forward KL, reverse KL, JSD or total variation at a
  temperature). TRL has no off-policy KD trainer with these losses, so this is an SFTTrainer whose loss is
  replaced. Target distributions are computed on the fly, or (`teacher_top_k`) once per example as the top-k
  log-probabilities plus one bucket for the rest, cached to disk, so the teacher is not in memory while the draft
  trains and later epochs or reruns do not pay its forward passes again.
- `seqkd`: sequence-level KD: every assistant turn of the data is replaced by the target's own greedy answer
  (exactly what it will verify at serve time), then SFT on that.
- `onpolicy`: on-policy distillation (GKD, Agarwal et al. 2023) with TRL's DistillationTrainer: the draft answers
  the dataset's prompts itself and is pulled towards the target's distribution on its own answers (generalized
  JSD: forward_kl, jsd or reverse_kl).
- `speckd`: distillation on the positions speculative decoding asks the draft about, with a loss that tracks
  acceptance. Whatever the draft proposes, the prefix it continues from is always the target's own output:
  accepted tokens are the target's tokens, and a rejected one is replaced by the target's. So under greedy
  verification the draft is only ever queried on the target's greedy path, and each position of that path is
  proposed once (as draft position 1 after a correction, or deeper after accepted ones), all but the bonus tokens
  after k accepted. That path is seqkd's data (the target's greedy answers to each turn's context, cached), so
  speckd trains on it teacher-forced, where the draft's own rollouts (TRL's on-policy sampling) would reach it only
  up to their first rejection. Usually started from seqkd's draft (`drafts.start_from: {speckd: seqkd}`).
Losses: speculative sampling accepts a token with probability 1 − TV(p, q), so `tv` (at the serving temperature)
tracks sampling's acceptance. Greedy verification accepts only the target's argmax, whatever the rest of p: there
`greedy_tv` = 1 − q(argmax p), the draft's chance of proposing the target's greedy token, tracks acceptance, and
speckd uses it by default. Pulling a draft towards a flat p with `tv` can move its argmax off the target's: on the
demo pair (target eval loss 4.4 nats) tv took seqkd's greedy α from 92% to 64%.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from spectune.atomic import atomic_path
from spectune.cache import cache_root
from spectune.data.read import Dialogue, write_jsonl
from spectune.errors import SpectuneError
from spectune.export.gguf import check_quant, export_model
from spectune.layout import DEFAULT_QUANT
from spectune.models.load import load_tokenizer
from spectune.models.resolve import MODEL_REFERENCE, resolve_model
from spectune.progress import progress
from spectune.runtime.chat import chat_tokens
from spectune.runtime.decode import DEFAULT_MAX_TOKENS, DecodeSettings
from spectune.runtime.llama import LlamaModel
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.threads import configure_torch_threads
from spectune.train.common import (
    Timer,
    TrainConfig,
    TrainResult,
    TrainSettings,
    console,
    folder_bytes,
    greedy_answer,
    load_task_data,
    model_identity,
    prompt_ids,
    read_split,
    train_and_save,
    trainer_settings,
    write_report,
)
from spectune.train.distill import distillation_trainer, teacher_cache

Method = Literal["sft", "kd", "seqkd", "onpolicy", "speckd"]
TARGET_ANSWERS = "target_answers.jsonl"  # seqkd: the dialogues up to the last turn the target answered
METHODS: tuple[Method, ...] = typing.get_args(Method)
# TRL's generalized JSD interpolates with beta: 0 is forward KL, 1 reverse KL.
JSD_BETA = {"forward_kl": 0.0, "jsd": 0.5, "reverse_kl": 1.0}
Divergence = Literal["forward_kl", "reverse_kl", "jsd", "tv", "greedy_tv"]
# speckd's default tracks greedy verification's acceptance (what bench and serve run); tv tracks sampling's.
DEFAULT_DIVERGENCE: dict[str, Divergence] = {"kd": "forward_kl", "onpolicy": "forward_kl", "speckd": "greedy_tv"}
TARGET_PATH_METHODS = ("seqkd", "speckd")  # trained on the target's own greedy answers
TEACHER_METHODS = ("kd", "speckd")  # a divergence to the target's distribution at each trained position


class DraftSettings(TrainSettings):
    """Draft training's settings: the `drafts:` section of a run config and the flags of `spectune draft`."""

    lr: float = Field(1e-3, gt=0, description="Learning rate.")
    divergence: Divergence | None = Field(
        None, description="kd/speckd/onpolicy loss (default: greedy_tv for speckd, else forward_kl; onpolicy: no tv)."
    )
    kd_temperature: float = Field(1.0, gt=0, description="kd/speckd: the distillation temperature.")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, description="seqkd/onpolicy: longest answer the model generates.")
    teacher_top_k: int = Field(
        0, ge=0, description="kd: cache the target's top-k log-probs once (0: run the target on the fly)."
    )
    answers_by: Literal["llama.cpp", "hf"] = Field(
        "llama.cpp", description="seqkd/speckd: generate the target's answers with llama.cpp (a GGUF export) or HF."
    )
    answers_quant: str | None = Field(
        None,
        description="seqkd/speckd by llama.cpp: the type of the target's GGUF that answers (default: the type it is "
        f"served at, export.quant in a run, {DEFAULT_QUANT} for `spectune draft`), so the draft learns that file's "
        "choices.",
    )

    @field_validator("answers_quant")
    @classmethod
    def _known_quant(cls, quant: str | None) -> str | None:
        return None if quant is None else check_quant(quant)

    def divergence_for(self, method: str) -> Divergence:
        """The loss a method trains with: the setting, or the method's default."""
        return self.divergence or DEFAULT_DIVERGENCE.get(method, "forward_kl")


def method_problems(method: str, settings: DraftSettings) -> list[str]:
    """Settings that do not fit a method."""
    problems = []
    if method == "onpolicy" and settings.divergence_for(method) not in JSD_BETA:
        problems.append(f"onpolicy takes divergence {', '.join(JSD_BETA)} (TRL's generalized JSD), not tv")
    if settings.teacher_top_k and method not in TEACHER_METHODS:
        problems.append(f"teacher_top_k caches the teacher for {' and '.join(TEACHER_METHODS)} only")
    if settings.teacher_top_k and settings.divergence_for(method) == "greedy_tv":
        problems.append("greedy_tv needs the target's argmax, which the top-k cache's rest bucket can hide")
    return problems


class DraftConfig(DraftSettings, TrainConfig):
    """Everything `spectune draft` takes."""

    target: Path = Field(description="The fine-tuned (merged) target: the teacher for every method but sft.")
    draft: Path = Field(
        description=f"The draft to start from (the base draft, or another method's): {MODEL_REFERENCE}."
    )
    method: Method = Field("sft", description="How the draft learns the target.")

    @model_validator(mode="after")
    def _fits_method(self) -> DraftConfig:
        problems = method_problems(self.method, self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


class DraftResult(TrainResult):
    model: Path
    method: str
    teacher_seconds: float  # making the teacher's data first (seqkd answers, kd top-k cache)
    model_bytes: int


def cached_teacher(config: DraftConfig, teacher: Any, trainer: Any) -> dict[bytes, tuple]:
    """The top-k cache for the trainer's (processed) datasets, read from disk when made before with these settings."""
    import torch

    path = config.out / f"teacher_top{config.teacher_top_k}.pt"
    settings = {"target": model_identity(config.target), "temperature": config.kd_temperature}
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved["settings"] == settings:
            return saved["cache"]
    datasets = [trainer.train_dataset, trainer.eval_dataset]
    cache = teacher_cache(teacher, datasets, config.teacher_top_k, config.kd_temperature)
    with atomic_path(path) as tmp:
        torch.save({"settings": settings, "cache": cache}, tmp)
    return cache


def conversation_prompts(dialogues: list[Dialogue]) -> list[list[dict[str, str]]]:
    """Each assistant turn's context (the dataset's messages before it): the prompts the draft answers on-policy."""
    return [d.messages[:i] for d in dialogues for i, turn in enumerate(d.messages) if turn["role"] == "assistant"]


def onpolicy_trainer(config: DraftConfig, model: Any, teacher: Any, tokenizer: Any, split: tuple) -> Any:
    """TRL's on-policy DistillationTrainer over the dataset's prompts (it samples the draft's own answers)."""
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    settings = trainer_settings(config)
    for sft_only in ("max_length", "packing", "include_num_input_tokens_seen"):
        del settings[sft_only]
    args = DistillationConfig(
        **settings,
        beta=JSD_BETA[config.divergence_for("onpolicy")],
        temperature=config.kd_temperature,
        max_completion_length=config.max_tokens,
    )
    train, held_out = (
        Dataset.from_dict({"prompt": prompts})
        for prompts in (conversation_prompts(split[0]), conversation_prompts(split[1])[: config.max_eval])
    )
    generating = copy.deepcopy(tokenizer)
    generating.padding_side = "left"  # batched generation pads on the left
    return DistillationTrainer(
        model=model,
        teacher_model=teacher,
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
        processing_class=generating,
    )


def _load_causal_lm(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)


def target_answers(
    answer: Callable[[list[dict[str, str]]], str],
    dialogues: list[Dialogue],
    prompt_tokens: Callable[[list[dict[str, str]]], int],
    max_seq_length: int,
) -> list[Dialogue]:
    """Each assistant turn replaced by the target's greedy answer to the dataset's context before it. A turn whose
    rewritten context already holds `max_seq_length` tokens is left as it is: training cuts dialogues on turns at
    `max_seq_length`, so it would never be trained on, and answering it would be wasted work."""
    rewritten = []
    for dialogue in progress(dialogues, "the target's answers (seqkd)"):
        turns: list[dict[str, str]] = []
        for index, turn in enumerate(dialogue.messages):
            if turn["role"] == "assistant" and prompt_tokens(turns) < max_seq_length:
                turn = {"role": "assistant", "content": answer(dialogue.messages[:index]) or turn["content"]}
            turns.append(turn)
        rewritten.append(Dialogue(turns, dialogue.source, dialogue.line))
    return rewritten


def only_answered(
    dialogues: list[Dialogue], prompt_tokens: Callable[[list[dict[str, str]]], int], max_seq_length: int
) -> list[Dialogue]:
    """Each dialogue up to its last turn the target answered (target_answers' rule; the rest is the dataset's own
    words): the target's phrasing alone, for n-gram lookup (the bench's domain table)."""
    kept = []
    for dialogue in dialogues:
        answered = [
            index
            for index, turn in enumerate(dialogue.messages)
            if turn["role"] == "assistant" and prompt_tokens(dialogue.messages[:index]) < max_seq_length
        ]
        if answered:
            kept.append(Dialogue(dialogue.messages[: answered[-1] + 1], dialogue.source, dialogue.line))
    return kept


def answers_type(config: DraftConfig) -> str:
    """The type of the target's GGUF that answers: the one it is served at unless told otherwise."""
    return config.answers_quant or DEFAULT_QUANT


def teacher_gguf(config: DraftConfig) -> Path:
    """seqkd's target export, kept beside the draft."""
    return config.out / f"teacher.{answers_type(config)}.gguf"


def answers_key(config: DraftConfig, split: tuple[list[Dialogue], list[Dialogue]]) -> str:
    """What the target's answers depend on: the target's files, how they are generated, the dialogues."""
    identity = {
        "target": model_identity(config.target),
        "settings": [config.answers_by, config.max_tokens, config.max_seq_length],
        "type": answers_type(config) if config.answers_by == "llama.cpp" else None,
        "dialogues": [[d.messages for d in part] for part in split],
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def seqkd_split(
    config: DraftConfig, split: tuple[list[Dialogue], list[Dialogue]], teacher: Any, tokenizer: Any
) -> tuple[list[Dialogue], list[Dialogue]]:
    """The train and eval dialogues with the target's answers, cached in the user cache (reruns, other draft
    shapes and other runs on the same target and dialogues reuse them)."""
    path = cache_root() / "seqkd-answers" / f"{answers_key(config, split)}.json"

    def prompt_tokens(messages: list[dict[str, str]]) -> int:
        return len(prompt_ids(tokenizer, messages)) if messages else 0

    if path.is_file():
        train, held_out = ([Dialogue(**d) for d in part] for part in json.loads(path.read_text()))
        write_jsonl(only_answered(train, prompt_tokens, config.max_seq_length), config.out / TARGET_ANSWERS)
        return train, held_out
    answer = (
        llama_answerer(export_model(config.target, teacher_gguf(config), answers_type(config)), config.max_tokens)
        if config.answers_by == "llama.cpp"
        else hf_answerer(teacher, tokenizer, config.max_tokens)
    )
    train, held_out = (target_answers(answer, part, prompt_tokens, config.max_seq_length) for part in split)
    write_jsonl(only_answered(train, prompt_tokens, config.max_seq_length), config.out / TARGET_ANSWERS)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps([[dataclasses.asdict(d) for d in part] for part in (train, held_out)]))
    return train, held_out


def hf_answerer(target: Any, tokenizer: Any, max_new_tokens: int) -> Callable[[list[dict[str, str]]], str]:
    """The target's greedy answers with HF generate."""

    def answer(messages: list[dict[str, str]]) -> str:
        _, answer_ids = greedy_answer(target, tokenizer, messages, max_new_tokens)
        return tokenizer.decode(answer_ids, skip_special_tokens=True).strip()

    return answer


def llama_answerer(gguf: Path, max_new_tokens: int) -> Callable[[list[dict[str, str]]], str]:
    """The target's greedy answers from its GGUF run by llama.cpp (as a user with a GPU would make them):
    consecutive turns of a dialogue reuse the cached prefix."""
    model = LlamaModel(gguf, n_ctx=4096, threads=None, exact=False)
    decoder = SpeculativeDecoder(model)
    sampling = DecodeSettings(max_tokens=max_new_tokens)

    def answer(messages: list[dict[str, str]]) -> str:
        prompt = chat_tokens(model, messages)[-(model.n_ctx - max_new_tokens - 1) :]
        return decoder.generate(prompt, sampling).text.strip()

    return answer


def method_trainer(
    config: DraftConfig, model: Any, teacher: Any, tokenizer: Any, split: tuple, data: Any
) -> tuple[Any, float]:
    """The trainer of `config.method` and the seconds spent on the teacher's top-k cache; kd and speckd get the
    target's distributions on the fly or from that cache (made here, on first use)."""
    from trl import SFTConfig, SFTTrainer

    if config.method == "onpolicy":
        return onpolicy_trainer(config, model, teacher, tokenizer, split), 0.0
    distils = config.method in TEACHER_METHODS
    trainer_class = (
        distillation_trainer(config.divergence_for(config.method), config.kd_temperature) if distils else SFTTrainer
    )
    trainer = trainer_class(
        model=model,
        args=SFTConfig(**trainer_settings(config)),
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
    )
    if distils and config.teacher_top_k:  # the cache replaces the teacher: the draft trains without it in memory
        with Timer() as cache_time:
            trainer.teacher_top_k = cached_teacher(config, teacher, trainer)
        return trainer, cache_time.seconds
    if distils:
        trainer.teacher = teacher
    return trainer, 0.0


def train_draft(config: DraftConfig) -> DraftResult:
    """Train a draft with `config.method`; returns the trained draft folder (a full HF model)."""
    from transformers import set_seed

    from spectune.train.steps import show_steps  # imports transformers

    configure_torch_threads()
    config = config.model_copy(update={"target": resolve_model(config.target), "draft": resolve_model(config.draft)})
    tokenizer = load_tokenizer(config.draft, config.chat_template)
    target_tokenizer = load_tokenizer(config.target, config.chat_template)
    if target_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise SpectuneError(f"{config.draft} and {config.target} do not share a tokenizer: a draft must")
    set_seed(config.seed)
    split = read_split(config)
    needs_hf_teacher = config.method in (*TEACHER_METHODS, "onpolicy") or (
        config.method == "seqkd" and config.answers_by == "hf"
    )
    teacher = _load_causal_lm(config.target).eval() if needs_hf_teacher else None
    with Timer() as teacher_time:
        if config.method in TARGET_PATH_METHODS:  # train and evaluate on what the target itself says
            split = seqkd_split(config, split, teacher, tokenizer)
    data = load_task_data(tokenizer, config, split)
    model = _load_causal_lm(config.draft)
    trainer, cache_seconds = method_trainer(config, model, teacher, tokenizer, split, data)
    teacher_time.seconds += cache_seconds
    del teacher  # the trainer holds it if it runs it on the fly
    console.print(
        f"draft ({config.method}) from {config.draft}: {sum(p.numel() for p in model.parameters()):,} "
        f"parameters, {len(data.train)} dialogues, {data.trained_tokens:,} trained tokens"
    )
    out_model = config.out / "model"
    show_steps(trainer, f"draft {config.method}")
    outcome = train_and_save(trainer, tokenizer, config, out_model, data)
    result = DraftResult(
        **outcome.model_dump(),
        model=out_model,
        method=config.method,
        teacher_seconds=round(teacher_time.seconds, 2),
        model_bytes=folder_bytes(out_model),
    )
    write_report(config.out / "draft.json", config, result, data)
    return result
