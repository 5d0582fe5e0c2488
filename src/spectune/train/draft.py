"""Drafts that think like the target. A draft only speeds the target up if it proposes what the target says.

Methods (`DraftConfig.method`):
- `sft`: fine-tune the draft on the same data as the target (the reference story's method), TRL SFTTrainer.
- `kd`: white-box distillation on the same data: at every assistant position the draft's next-token
  distribution is pulled towards the fine-tuned target's (forward KL, reverse KL, JSD or total variation at a
  temperature). TRL has no off-policy KD trainer with these losses, so this is an SFTTrainer whose loss is
  replaced; target distributions are computed on the fly.
- `onpolicy`: sequence-level KD: every assistant turn of the data is replaced by the target's own greedy answer
  (exactly what it will verify at serve time), then SFT on that.
Greedy speculative acceptance is 1 − TV(p, q) per token, so `tv` optimises acceptance directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from spectune.data.read import Dialogue
from spectune.errors import SpectuneError
from spectune.models.load import check_model_dir, load_tokenizer
from spectune.train.common import (
    TrainConfig,
    console,
    folder_bytes,
    greedy_answer,
    load_task_data,
    peak_memory_bytes,
    read_split,
    train_and_save,
    trainer_settings,
    write_report,
)

Method = Literal["sft", "kd", "onpolicy"]
Divergence = Literal["forward_kl", "reverse_kl", "jsd", "tv"]


class DraftConfig(TrainConfig):
    """Everything `spectune draft` takes."""

    target: Path  # the fine-tuned (merged) target: teacher for kd, author of the answers for onpolicy
    draft: Path  # the base draft to start from
    method: Method = "sft"
    divergence: Divergence = "forward_kl"
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(96, ge=1)  # onpolicy: longest target answer generated
    lr: float = Field(1e-3, gt=0)


class DraftResult(BaseModel):
    model: Path
    method: str
    eval_loss_before: float
    eval_loss_after: float
    steps: int
    train_dialogues: int
    trained_tokens: int
    seconds: float
    peak_memory_bytes: int
    model_bytes: int


def divergence_loss(student_logits: Any, teacher_logits: Any, mask: Any, kind: str, temperature: float) -> Any:
    """Mean divergence between teacher p and student q over masked positions (logits: [..., vocab])."""
    import torch.nn.functional as F

    log_q = F.log_softmax(student_logits / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits / temperature, dim=-1)
    if kind == "forward_kl":  # KL(p || q): mode-covering
        per_token = (log_p.exp() * (log_p - log_q)).sum(-1)
    elif kind == "reverse_kl":  # KL(q || p): mode-seeking
        per_token = (log_q.exp() * (log_q - log_p)).sum(-1)
    elif kind == "jsd":
        import math

        log_m = (0.5 * (log_p.exp() + log_q.exp())).clamp_min(1e-30).log()
        per_token = 0.5 * ((log_p.exp() * (log_p - log_m)).sum(-1) + (log_q.exp() * (log_q - log_m)).sum(-1))
        per_token = per_token / math.log(2)
    elif kind == "tv":  # 1 - acceptance probability of speculative sampling
        per_token = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    else:
        raise SpectuneError(f"unknown divergence {kind!r}")
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp_min(1.0)


def distillation_trainer(teacher: Any, kind: str, temperature: float) -> type:
    """An SFTTrainer whose loss is the divergence to `teacher` on assistant positions."""
    import torch
    from trl import SFTTrainer

    class DistillSFTTrainer(SFTTrainer):
        def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None):
            labels = inputs["labels"]
            forward = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "position_ids")}
            outputs = model(**forward)
            with torch.no_grad():
                teacher_logits = teacher(**forward).logits
            # Position t predicts token t+1; train where that token is an assistant token.
            mask = labels[:, 1:] != -100
            loss = divergence_loss(outputs.logits[:, :-1], teacher_logits[:, :-1], mask, kind, temperature)
            return (loss, outputs) if return_outputs else loss

    return DistillSFTTrainer


def _load_causal_lm(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)


def target_answers(target: Any, tokenizer: Any, dialogues: list[Dialogue], max_new_tokens: int) -> list[Dialogue]:
    """Each assistant turn replaced by the target's greedy answer to the dataset's context before it."""
    from rich.progress import track

    rewritten = []
    for dialogue in track(dialogues, description="target answers (onpolicy)", transient=True):
        turns = []
        for index, turn in enumerate(dialogue.messages):
            if turn["role"] == "assistant":
                _, answer_ids = greedy_answer(target, tokenizer, dialogue.messages[:index], max_new_tokens)
                answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
                turn = {"role": "assistant", "content": answer or turn["content"]}
            turns.append(turn)
        rewritten.append(Dialogue(turns, dialogue.source, dialogue.line))
    return rewritten


def train_draft(config: DraftConfig) -> DraftResult:
    """Train a draft with `config.method`; returns the trained draft folder (a full HF model)."""
    from transformers import set_seed
    from trl import SFTConfig, SFTTrainer

    from spectune.threads import configure_torch_threads

    configure_torch_threads()
    check_model_dir(config.target)
    check_model_dir(config.draft)
    tokenizer = load_tokenizer(config.draft, config.chat_template)
    target_tokenizer = load_tokenizer(config.target, config.chat_template)
    if target_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise SpectuneError(f"{config.draft} and {config.target} do not share a tokenizer: a draft must")
    set_seed(config.seed)
    split = None
    teacher = None
    if config.method in ("kd", "onpolicy"):
        teacher = _load_causal_lm(config.target).eval()
    if config.method == "onpolicy":  # train and evaluate on what the target itself says
        split = tuple(target_answers(teacher, tokenizer, part, config.max_new_tokens) for part in read_split(config))
    data = load_task_data(tokenizer, config, split)
    model = _load_causal_lm(config.draft)
    trainer_class = (
        distillation_trainer(teacher, config.divergence, config.temperature) if config.method == "kd" else SFTTrainer
    )
    trainer = trainer_class(
        model=model,
        args=SFTConfig(**trainer_settings(config)),
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
    )
    console.print(
        f"draft ({config.method}) from {config.draft}: {sum(p.numel() for p in model.parameters()):,} "
        f"parameters, {len(data.train)} dialogues, {data.trained_tokens:,} trained tokens"
    )
    out_model = config.out / "model"
    outcome = train_and_save(trainer, tokenizer, config, out_model)
    peak, _how = peak_memory_bytes()
    result = DraftResult(
        model=out_model,
        method=config.method,
        eval_loss_before=outcome.eval_loss_before,
        eval_loss_after=outcome.eval_loss_after,
        steps=outcome.steps,
        train_dialogues=len(data.train),
        trained_tokens=data.trained_tokens,
        seconds=outcome.seconds,
        peak_memory_bytes=peak,
        model_bytes=folder_bytes(out_model),
    )
    write_report(config.out / "draft.json", config, result, data)
    return result
