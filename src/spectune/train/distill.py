"""Distillation losses for the draft: a divergence to the target's distribution at each trained position (forward
KL, reverse KL, JSD, total variation), the teacher's top-k cached once, and the TRL trainer that minimises it."""

from __future__ import annotations

from typing import Any

from spectune.errors import SpectuneError
from spectune.progress import progress


def divergence_loss(student_logits: Any, teacher_logits: Any, mask: Any, kind: str, temperature: float) -> Any:
    """Mean divergence between teacher p and student q over masked positions (logits: [..., vocab])."""
    import torch.nn.functional as F

    log_q = F.log_softmax(student_logits / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits / temperature, dim=-1)
    return divergence(log_p, log_q, mask, kind)


def divergence(log_p: Any, log_q: Any, mask: Any, kind: str) -> Any:
    """Mean divergence between distributions given as log-probabilities ([..., support]) over masked positions."""
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
    elif kind == "greedy_tv":  # TV to the target's greedy choice: 1 - q(argmax p)
        per_token = 1 - log_q.gather(-1, log_p.argmax(-1, keepdim=True)).squeeze(-1).exp()
    else:
        raise SpectuneError(f"unknown divergence {kind!r}")
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp_min(1.0)


def sparse_log_probs(top_log_p: Any, log_q_full: Any, top_ids: Any) -> tuple[Any, Any]:
    """Teacher and student over k+1 buckets: the teacher's top-k tokens and one for the rest of the vocabulary.
    Every divergence on buckets is a lower bound of the full one, equal when the rest is negligible."""
    import torch

    def with_rest(top: Any) -> Any:
        rest = (1 - top.exp().sum(-1, keepdim=True)).clamp_min(1e-30)
        return torch.cat([top, rest.log()], dim=-1)

    return with_rest(top_log_p.float()), with_rest(log_q_full.gather(-1, top_ids.long()))


def row_key(input_ids: Any) -> bytes:
    """A cache key for one example: its token ids (unpadded) as int64 bytes."""
    return input_ids.cpu().long().numpy().tobytes()


def teacher_cache(teacher: Any, datasets: list[Any], top_k: int, temperature: float) -> dict[bytes, tuple]:
    """Per example (keyed by its token ids): the teacher's top-k log-probs and ids at each trained position."""
    import torch
    import torch.nn.functional as F

    cache = {}
    rows = [row for dataset in datasets for row in dataset]
    for row in progress(rows, f"teacher top-{top_k}"):
        ids = torch.tensor([row["input_ids"]])
        trained = torch.tensor(row["labels"][1:]) != -100  # position t predicts token t+1
        with torch.no_grad():
            logits = teacher(input_ids=ids).logits[0, :-1][trained]
        values, indices = F.log_softmax(logits / temperature, dim=-1).topk(min(top_k, logits.shape[-1]), dim=-1)
        cache[row_key(ids[0])] = (values.half(), indices.int())
    return cache


def distillation_trainer(kind: str, temperature: float) -> type:
    """An SFTTrainer whose loss is the divergence to the teacher on assistant positions: `trainer.teacher` (a model,
    run on the fly) or `trainer.teacher_top_k` (cached top-k log-probs per example)."""
    import torch
    import torch.nn.functional as F
    from trl import SFTTrainer

    class DistillSFTTrainer(SFTTrainer):
        teacher: Any = None
        teacher_top_k: dict[bytes, tuple] | None = None

        def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None):
            forward = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "position_ids")}
            outputs = model(**forward)
            # Position t predicts token t+1; train where that token is an assistant token.
            mask = inputs["labels"][:, 1:] != -100
            if self.teacher_top_k is None:
                with torch.no_grad():
                    teacher_logits = self.teacher(**forward).logits
                loss = divergence_loss(outputs.logits[:, :-1], teacher_logits[:, :-1], mask, kind, temperature)
            else:  # rows are right-padded, so masked positions come in the order the cache stored them
                keep = inputs["attention_mask"].bool()
                cached = [self.teacher_top_k[row_key(ids[k])] for ids, k in zip(inputs["input_ids"], keep, strict=True)]
                top_log_p = torch.cat([values for values, _ in cached]).to(outputs.logits.device)
                top_ids = torch.cat([indices for _, indices in cached]).to(outputs.logits.device)
                log_q = F.log_softmax(outputs.logits[:, :-1][mask] / temperature, dim=-1)
                log_p, log_q = sparse_log_probs(top_log_p, log_q, top_ids)
                loss = divergence(log_p, log_q, torch.ones(log_p.shape[0], device=log_p.device), kind)
            return (loss, outputs) if return_outputs else loss

    return DistillSFTTrainer
