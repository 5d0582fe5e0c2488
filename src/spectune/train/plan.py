"""Memory planner: from a model config alone (no weights), what QLoRA training and 4-bit inference need.

Estimates, in bytes:
- weights: f16 (2 bytes/param); NF4 with double quantization (4.127 bits per quantized linear weight, embeddings
  and norms kept in 16-bit, as transformers + bitsandbytes do); Q4_K_M GGUF (~4.85 bits/param on average);
- LoRA: rank r on every linear layer of every block, f32 weights + grads + AdamW moments (16 bytes/param);
  the adapter on disk in bf16 (2 bytes/param);
- activations per token and layer kept for backward (16-bit; SDPA/flash attention, so no s² score matrix),
  or with gradient checkpointing only the layer inputs plus one layer's worth; plus the logits (16-bit out,
  f32 upcast and its gradient in the loss: 10 bytes per vocab entry per token);
- inference: Q4_K_M weights plus an f16 KV cache (an upper bound: sliding-window layers are counted in full).
A fixed 10% margin covers the CUDA context, allocator fragmentation and temporaries.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from spectune.config import Settings
from spectune.errors import SpectuneError
from spectune.gpu.card import reference_card
from spectune.speedup import Q4_K_M_BITS, Weights, step_cost_ratio
from spectune.train.common import TrainSettings
from spectune.train.target import FinetuneSettings

GIB = 2**30
NF4_BITS = 4.0 + 8 / 64 + 32 / (64 * 256)  # 4-bit codes, 8-bit absmax per 64, f32 scale per 256 absmax
MARGIN = 1.10


class PlanConfig(Settings):
    """Everything `spectune plan` takes: the fine-tune's sizes under the names (and defaults) `spectune finetune`
    gives them."""

    model: Path = Field(description="A model folder or an HF config.json (no weights needed).")
    gpu_mem: str = Field("16GiB", description="Memory to plan for, e.g. 16GiB or 24 GB.")
    max_seq_length: int = TrainSettings.model_fields["max_seq_length"]
    batch_size: int = TrainSettings.model_fields["batch_size"]
    lora_r: int = FinetuneSettings.model_fields["lora_r"]
    context: int = Field(8192, ge=1, description="Inference context (KV cache) in tokens.")
    draft: Path | None = Field(None, description="The draft's folder or config.json: prints its cost ratio c.")
    json_out: Path | None = Field(None, description="Also write the plan as JSON here.")


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool

    @property
    def linear_params_per_layer(self) -> int:
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * q_out * 2 + self.hidden * kv_out * 2
        return attention + 3 * self.hidden * self.ffn  # gated MLP: gate, up, down

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        norms = self.layers * 2 * self.hidden + self.hidden
        return self.layers * self.linear_params_per_layer + self.embedding_params + norms

    def lora_params(self, rank: int) -> int:
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        pairs = [
            (self.hidden, q_out),
            (self.hidden, kv_out),
            (self.hidden, kv_out),
            (q_out, self.hidden),
            (self.hidden, self.ffn),
            (self.hidden, self.ffn),
            (self.ffn, self.hidden),
        ]
        return self.layers * sum(rank * (a + b) for a, b in pairs)

    def activation_bytes_per_token_layer(self) -> int:
        kv_out = self.kv_heads * self.head_dim
        q_out = self.heads * self.head_dim
        # norm in/out, q/k/v, attention out, o-proj out, MLP gate/up/act/product, residuals: 16-bit each
        values = 4 * self.hidden + q_out + 2 * kv_out + q_out + 4 * self.ffn + 2 * self.hidden
        return 2 * values


def step_weights(shape: Shape) -> Weights:
    """What one decode step of this shape reads at Q4_K_M, in bytes (the type's mean width for every matrix)."""

    def at_width(elements: int) -> int:
        return round(elements * Q4_K_M_BITS / 8)

    return Weights(at_width(shape.params), at_width(shape.vocab * shape.hidden), shape.vocab, shape.tied, shape.layers)


def cost_ratio(target: Shape, draft: Shape) -> dict[str, Any]:
    """c, one draft step over one target step, as the bench reports it: by what a step reads (a tied head is read
    whole, an untied embedding table one row a step), and predicted on the reference card with its band."""
    target_weights, draft_weights = step_weights(target), step_weights(draft)
    card = reference_card()
    return {
        "bytes": step_cost_ratio(draft_weights, target_weights),
        "card": card.label,
        "on_card": card.cost_ratio(draft_weights, target_weights),
        "on_card_band": card.cost_ratio_band(draft_weights, target_weights),
    }


def read_shape(path: str | Path) -> Shape:
    """A model folder or a config.json (nested `text_config` for multimodal Gemma 3 is followed)."""
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise SpectuneError(f"{path}: no config.json (give a model folder or an HF config file)")
    config: dict[str, Any] = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    try:
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        return Shape(
            hidden=hidden,
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            ffn=config["intermediate_size"],
            vocab=config["vocab_size"],
            tied=config.get("tie_word_embeddings", True),
        )
    except KeyError as exc:
        raise SpectuneError(f"{config_file}: missing field {exc.args[0]!r}, needed to plan memory") from None


@dataclass
class Plan:
    params: int
    f16_weights: int
    nf4_weights: int
    lora_params: int
    lora_train_state: int
    adapter_bytes_bf16: int
    activations: int
    activations_checkpointed: int
    logits: int
    qlora_total: int
    qlora_total_checkpointed: int
    lora_f16_total_checkpointed: int
    gguf_q4_k_m: int
    kv_cache: int
    inference_total: int


def estimate(shape: Shape, *, seq: int, batch: int, rank: int, context: int) -> Plan:
    tokens = seq * batch
    linear = shape.layers * shape.linear_params_per_layer
    f16 = 2 * shape.params
    nf4 = int(linear * NF4_BITS / 8) + 2 * (shape.params - linear)
    lora = shape.lora_params(rank)
    per_layer = shape.activation_bytes_per_token_layer()
    activations = tokens * per_layer * shape.layers
    checkpointed = tokens * (2 * shape.hidden * shape.layers + per_layer)
    logits = tokens * shape.vocab * 10
    train_state = 16 * lora
    kv = 2 * shape.layers * context * shape.kv_heads * shape.head_dim * 2
    gguf = int(shape.params * Q4_K_M_BITS / 8)
    return Plan(
        params=shape.params,
        f16_weights=f16,
        nf4_weights=nf4,
        lora_params=lora,
        lora_train_state=train_state,
        adapter_bytes_bf16=2 * lora,
        activations=activations,
        activations_checkpointed=checkpointed,
        logits=logits,
        qlora_total=int(MARGIN * (nf4 + train_state + activations + logits)),
        qlora_total_checkpointed=int(MARGIN * (nf4 + train_state + checkpointed + logits)),
        lora_f16_total_checkpointed=int(MARGIN * (f16 + train_state + checkpointed + logits)),
        gguf_q4_k_m=gguf,
        kv_cache=kv,
        inference_total=int(MARGIN * (gguf + kv)),
    )


def largest_fit(shape: Shape, memory: int, *, rank: int, batch: int, checkpointing: bool) -> int:
    """The longest sequence (a multiple of 128) at `batch` whose QLoRA training fits in `memory`; 0 if none."""
    best, seq = 0, 128
    while seq <= 1 << 20:
        plan = estimate(shape, seq=seq, batch=batch, rank=rank, context=seq)
        if (plan.qlora_total_checkpointed if checkpointing else plan.qlora_total) > memory:
            break
        best, seq = seq, seq + 128
    return best


def parse_memory(text: str) -> int:
    """'16GiB', '16GB', '24 GiB', '512MiB' -> bytes."""
    units = {"gib": GIB, "gb": 10**9, "mib": 2**20, "mb": 10**6}
    cleaned = text.strip().lower().replace(" ", "")
    for unit, factor in units.items():
        if cleaned.endswith(unit):
            try:
                return int(float(cleaned[: -len(unit)]) * factor)
            except ValueError:
                break
    raise SpectuneError(f"memory {text!r}: write a number with a unit, e.g. 16GiB or 24GB")


def plan_report(shape: Shape, memory: int, *, seq: int, batch: int, rank: int, context: int) -> dict[str, Any]:
    plan = estimate(shape, seq=seq, batch=batch, rank=rank, context=context)
    verdicts = {
        "f16 weights load": plan.f16_weights * MARGIN <= memory,
        "QLoRA training": plan.qlora_total <= memory,
        "QLoRA training, gradient checkpointing": plan.qlora_total_checkpointed <= memory,
        "LoRA on a 16-bit base, gradient checkpointing": plan.lora_f16_total_checkpointed <= memory,
        "Q4_K_M inference": plan.inference_total <= memory,
    }
    return {
        "shape": asdict(shape),
        "memory_bytes": memory,
        "seq": seq,
        "batch": batch,
        "rank": rank,
        "context": context,
        "estimate": asdict(plan),
        "fits": verdicts,
        "largest_seq_at_batch": {
            "checkpointing": largest_fit(shape, memory, rank=rank, batch=batch, checkpointing=True),
            "no_checkpointing": largest_fit(shape, memory, rank=rank, batch=batch, checkpointing=False),
        },
    }
