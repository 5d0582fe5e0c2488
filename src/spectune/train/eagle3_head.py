"""The EAGLE-3 head itself: its shape, its forward step (one layer over the target's fused layer inputs and the
tokens so far), its unrolled draft chain, and its folder on disk; eagle3.py trains it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from spectune.atomic import atomic_path
from spectune.models.load import save_tokenizer
from spectune.speedup import MAX_DRAFT_LEN

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # a name llama.cpp's converter registers for EAGLE-3 heads


def aux_layers(n_layers: int) -> list[int]:
    """The target layers whose inputs the head reads: llama.cpp's converter default (low, middle, high), or for
    the shallow test models one near each end and the middle."""
    if n_layers >= 6:
        return [2, n_layers // 2, n_layers - 3]
    return [min(1, n_layers - 1), n_layers // 2, n_layers - 1]


def head_rope(target: dict[str, Any]) -> dict[str, Any]:
    """The RoPE the head's own attention uses: the target's (its global attention's where each layer type has its
    own, as Gemma 3's sliding and full attention do)."""
    rope = target.get("rope_parameters") or target.get("rope_scaling") or {}
    if "full_attention" in rope:
        rope = rope["full_attention"]
    return {"rope_type": "default", "rope_theta": target.get("rope_theta", 10000.0), **rope}


def head_config(target: dict[str, Any], intermediate_size: int | None, layers: list[int], vocab: int) -> dict[str, Any]:
    """config.json of the head: a one-layer llama with EAGLE-3's keys, as llama.cpp's converter reads it."""
    hidden, heads = target["hidden_size"], target["num_attention_heads"]
    rope = head_rope(target)
    return {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate_size or target["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": target.get("num_key_value_heads", heads),
        "head_dim": target.get("head_dim", hidden // heads),
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": vocab,
        "target_hidden_size": hidden,
        "eagle_aux_hidden_state_layer_ids": layers,
        "tie_word_embeddings": False,
        "bos_token_id": target.get("bos_token_id"),
        "eos_token_id": target.get("eos_token_id"),
    }


def head_module(config: dict[str, Any], embedding: Any, d2t: Any) -> Any:
    """The head as a torch module whose state_dict names are the ones llama.cpp's converter maps."""
    import torch
    from torch import nn

    hidden, width = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    eps = config["rms_norm_eps"]

    def linear(inputs: int, outputs: int) -> nn.Linear:
        return nn.Linear(inputs, outputs, bias=False)

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = linear(3 * config["target_hidden_size"], hidden)
            self.midlayer = nn.Module()
            self.midlayer.input_layernorm = nn.RMSNorm(hidden, eps)
            self.midlayer.hidden_norm = nn.RMSNorm(hidden, eps)
            self.midlayer.self_attn = nn.Module()
            for name, outputs in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
                setattr(self.midlayer.self_attn, name, linear(2 * hidden, outputs * head_dim))
            self.midlayer.self_attn.o_proj = linear(heads * head_dim, hidden)
            self.midlayer.post_attention_layernorm = nn.RMSNorm(hidden, eps)
            self.midlayer.mlp = nn.Module()
            self.midlayer.mlp.gate_proj = linear(hidden, width)
            self.midlayer.mlp.up_proj = linear(hidden, width)
            self.midlayer.mlp.down_proj = linear(width, hidden)
            self.norm = nn.RMSNorm(hidden, eps)
            self.lm_head = linear(hidden, len(d2t))
            self.register_buffer("d2t", d2t - torch.arange(len(d2t)))  # HF's convention: offsets, not ids
            self.register_buffer("draft_ids", d2t, persistent=False)
            self.register_buffer("embedding", embedding, persistent=False)
            self.shape = (heads, kv_heads, head_dim, config["rope_parameters"]["rope_theta"])
            self.layers = config["eagle_aux_hidden_state_layer_ids"]

    return Head()


def rope(x: Any, positions: Any, theta: float) -> Any:
    """HF llama's rotary embedding (rotate_half); the converter permutes q and k into llama.cpp's layout."""
    import torch

    head_dim = x.shape[-1]
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions[:, None].float() * inverse
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    first, second = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return x * cos + torch.cat([-second, first], -1) * sin


def head_step(head: Any, tokens: Any, g: Any, step: int, cache: list[tuple[Any, Any]]) -> tuple[Any, Any, Any]:
    """Unrolled step `step` at every row P (position P + step): the pre-norm output and this step's keys and
    values. Step 0 is causal attention over real entries; step i > 0 attends to the real entries up to P and to
    its own chain's earlier entries (`cache`: the keys and values of steps 0..i-1)."""
    import torch
    import torch.nn.functional as F

    layer, (heads, kv_heads, head_dim, theta) = head.midlayer, head.shape
    batch, length, _ = g.shape
    x = torch.cat([layer.input_layernorm(head.embedding[tokens]), layer.hidden_norm(g)], -1)
    positions = torch.arange(length) + step

    def split(projection: Any, n: int) -> Any:
        return projection(x).view(batch, length, n, head_dim).transpose(1, 2)

    q = rope(split(layer.self_attn.q_proj, heads), positions, theta)
    k = rope(split(layer.self_attn.k_proj, kv_heads), positions, theta)
    v = split(layer.self_attn.v_proj, kv_heads)
    expand = heads // kv_heads
    if not cache:
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(expand, 1), v.repeat_interleave(expand, 1), is_causal=True
        )
    else:
        real_k, real_v = (t.repeat_interleave(expand, 1) for t in cache[0])
        chain = [(ck.repeat_interleave(expand, 1), cv.repeat_interleave(expand, 1)) for ck, cv in cache[1:]]
        chain.append((k.repeat_interleave(expand, 1), v.repeat_interleave(expand, 1)))
        scale = 1.0 / math.sqrt(head_dim)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        real = (q @ real_k.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
        own = torch.stack([(q * ck).sum(-1) * scale for ck, _ in chain], -1)
        weights = torch.cat([real, own], -1).softmax(-1)
        out = weights[..., :length] @ real_v
        out = out + (weights[..., length:, None] * torch.stack([cv for _, cv in chain], -2)).sum(-2)
    attended = layer.self_attn.o_proj(out.transpose(1, 2).reshape(batch, length, heads * head_dim)) + g
    mlp = layer.mlp
    normed = layer.post_attention_layernorm(attended)
    return attended + mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed)), k, v


def shifted(tokens: Any, by: int) -> Any:
    """tokens[:, P + by] at every row P (0 past the end; those rows are masked)."""
    import torch.nn.functional as F

    return F.pad(tokens[:, by:], (0, by))


def unroll(head: Any, features: Any, tokens: Any, steps: int) -> list[Any]:
    """The pre-norm outputs of `steps` unrolled steps at every row (step i predicts token P + i + 2)."""
    g, cache, outputs = head.fc(features), [], []
    for step in range(steps):
        g, k, v = head_step(head, shifted(tokens, step + 1), g, step, cache)
        cache.append((k, v))
        outputs.append(g)
    return outputs


def save_head(head: Any, config: dict[str, Any], tokenizer: Any, out: Path) -> None:
    """The HF layout llama.cpp's converter takes as an EAGLE-3 draft: config.json, model.safetensors (the target's
    tokenizer beside them; the converter reads the target's own through --target-model-dir)."""
    from safetensors.torch import save_file

    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(
            {name: tensor.contiguous() for name, tensor in head.state_dict().items()}, str(tmp / "model.safetensors")
        )
        save_tokenizer(tokenizer, tmp)


def load_head(folder: Path, target: Any) -> Any:
    """A saved head, on the target's token embedding, for measuring."""
    import torch
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    d2t = state["d2t"] + torch.arange(len(state["d2t"]))
    head = head_module(config, target.get_input_embeddings().weight.detach(), d2t)
    head.load_state_dict(state, strict=False)
    return head.eval()


def chain_matches(head: Any, target: Any, prompt: list[int], answer: list[int]) -> list[list[bool]]:
    """At each answer position j >= 1, whether each of the head's up to MAX_DRAFT_LEN drafted tokens there is the
    target's (`answer`: its greedy answer to `prompt`). The chain drafting answer[j] reads the target's features
    at the position of answer[j - 2] (the prompt's last token for j = 1) with answer[j - 1], as llama.cpp does after
    a verify step; teacher-forced tokens equal the drafted ones along every accepted prefix. Index 0: no chain (the
    first token is the target's own)."""
    import torch

    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        hidden = target(input_ids=ids, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[layer] for layer in head.layers], -1)
        outputs = unroll(head, features, ids, MAX_DRAFT_LEN)
        drafted = [head.draft_ids[head.lm_head(head.norm(output[0])).argmax(-1)].tolist() for output in outputs]
    chains: list[list[bool]] = [[]]
    for j in range(1, len(answer)):
        row = len(prompt) + j - 2
        chains.append([drafted[i][row] == answer[j + i] for i in range(min(MAX_DRAFT_LEN, len(answer) - j))])
    return chains
