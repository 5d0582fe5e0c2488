"""Gemma 4's MTP "assistant": the drafter Google ships with each Gemma 4 model, as llama.cpp runs it
(`--spec-type draft-mtp`, src/models/gemma4-assistant.cpp of the pinned sources) and transformers' classes hold it.

The assistant keeps no cache of its own: every one of its layers reads the target's KV (the last sliding and the last
full layer's). To draft after the target accepted token x[t+1] (whose own KV is not written yet), it reads the pair
(the target's scaled embedding of x[t+1], the target's post-norm hidden state h[t]) at position t+1, attends to the
target's keys 0..t, and says the token after x[t+1]; each further step reads (its own guess, its own projected state)
at the same position against the same keys. So one training row holds every anchor t at once: step i of anchor t is
query t of a causal mask over the target's keys, fed (x[t+1+i], state of step i-1). Greedy verification accepts a
guess only where it is the target's argmax, so the labels are the target's argmax, and while a chain is accepted its
inputs are the tokens the target said: teacher forcing is exact on the target's own answers.

Sliding layers: llama.cpp masks a key j of a query at position p where p - j >= the window; that rule is used here
(transformers' assisted generation flips the window and drafted a few tokens differently in a long context).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spectune.errors import SpectuneError

ASSISTANT_MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
TARGET_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")
STEP_WEIGHT = 0.8  # the loss of unrolled step i weighs STEP_WEIGHT**i: a later guess counts only if earlier ones hit


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's settings of a (possibly multimodal) Gemma 4 config.json."""
    return config.get("text_config") or config


def is_assistant(config: dict[str, Any]) -> bool:
    return config.get("model_type") in ASSISTANT_MODEL_TYPES


def attention_shape(config: dict[str, Any]) -> dict[str, Any]:
    """What an assistant must share with its target to read its cache: head widths (sliding, full) and KV heads."""
    text = text_config(config)
    full = [str(i) for i, kind in enumerate(text.get("layer_types", [])) if kind == "full_attention"]
    per_layer = text.get("per_layer_config") or {}
    full_head = text.get("global_head_dim") or (per_layer.get(full[0], {}).get("head_dim") if full else None)
    return {
        "head_dim": text.get("head_dim"),
        "global_head_dim": full_head,
        "num_key_value_heads": text.get("num_key_value_heads"),
        "sliding_window": text.get("sliding_window"),
    }


def fit_problems(target: dict[str, Any], assistant: dict[str, Any]) -> list[str]:
    """Why `assistant` cannot draft for `target` (their config.json contents), empty if it can."""
    if target.get("model_type") not in TARGET_MODEL_TYPES:
        return [f"the target is {target.get('model_type')!r}, not a Gemma 4 model ({', '.join(TARGET_MODEL_TYPES)})"]
    if not is_assistant(assistant):
        return [f"the assistant is {assistant.get('model_type')!r}, not {' or '.join(ASSISTANT_MODEL_TYPES)}"]
    text, own = text_config(target), text_config(assistant)
    problems = []
    if assistant.get("backbone_hidden_size") != text.get("hidden_size"):
        problems.append(
            f"backbone_hidden_size {assistant.get('backbone_hidden_size')}, the target's hidden_size "
            f"{text.get('hidden_size')}"
        )
    if own.get("vocab_size") != text.get("vocab_size"):
        problems.append(f"vocab_size {own.get('vocab_size')}, the target's {text.get('vocab_size')}")
    if own.get("num_kv_shared_layers") not in (None, own.get("num_hidden_layers")):
        problems.append(f"{own.get('num_kv_shared_layers')} of {own.get('num_hidden_layers')} layers read the target")
    kinds, their_kinds = set(own.get("layer_types") or []), set(text.get("layer_types") or [])
    if kinds != their_kinds:  # each kind of layer reads the target's last layer of that kind (llama.cpp asserts)
        problems.append(f"layer types {sorted(kinds)}, the target's {sorted(their_kinds)}")
    mine, theirs = attention_shape(assistant), attention_shape(target)
    for key in ("head_dim", "global_head_dim", "num_key_value_heads"):
        if mine[key] != theirs[key]:
            problems.append(f"{key} {mine[key]}, the target's {theirs[key]} (it reads the target's cache)")
    return problems


def check_fit(target_dir: Path, target: dict[str, Any], assistant_dir: Path, assistant: dict[str, Any]) -> None:
    """Refuse, before any work, an assistant that cannot read this target's states and cache."""
    problems = fit_problems(target, assistant)
    if problems:
        raise SpectuneError(f"{assistant_dir} cannot draft for {target_dir}: " + "; ".join(problems))


@dataclass
class TargetStates:
    """What the assistant reads of the target for a batch of rows ([B, T] tokens)."""

    embeddings: Any  # [B, T, H]: the target's scaled input embedding of each token
    hidden: Any  # [B, T, H]: the target's post-norm hidden state at each position
    kv: dict[str, tuple[Any, Any]]  # per layer type: (keys, values) [B, kv heads, T, head dim]
    argmax: Any  # [B, T]: the token the target says after each position


def target_states(target: Any, tokens: Any) -> TargetStates:
    """One forward pass of the (frozen) target over `tokens`, padded rows allowed (their tail is never a label)."""
    import torch

    with torch.no_grad():
        text_model = target.get_decoder()
        out = text_model(input_ids=tokens, use_cache=False, return_shared_kv_states=True)
        logits = target.get_output_embeddings()(out.last_hidden_state)
        embeddings = target.get_input_embeddings()(tokens)
    kv = {kind: (keys.detach(), values.detach()) for kind, (keys, values) in out.shared_kv_states.items()}
    return TargetStates(embeddings, out.last_hidden_state, kv, logits.argmax(-1))


def anchor_masks(length: int, window: int | None, batch: int) -> dict[str, Any]:
    """Boolean [B, 1, T, T] masks: query t (an assistant step at position t+1) sees the target's keys 0..t, and on
    sliding layers only those with t + 1 - j < window (llama.cpp's rule)."""
    import torch

    query = torch.arange(length)[:, None]
    key = torch.arange(length)[None, :]
    full = key <= query
    sliding = full & (query + 1 - key < window) if window else full
    return {
        "full_attention": full.expand(batch, 1, length, length),
        "sliding_attention": sliding.expand(batch, 1, length, length),
    }


def assistant_step(assistant: Any, embeddings: Any, states: Any, kv: dict, masks: dict) -> tuple[Any, Any]:
    """One drafting step for every anchor at once: (logits [B, T, V], projected states [B, T, H])."""
    import torch

    inputs = assistant.pre_projection(torch.cat([embeddings, states], dim=-1))
    length = inputs.shape[1]
    positions = (torch.arange(length) + 1).expand(inputs.shape[0], length)
    # every row is kept (an index tensor): with an int, transformers 5.24 slices per-layer inputs the assistant lacks
    out = assistant.model(
        inputs_embeds=inputs,
        attention_mask=masks,
        position_ids=positions,
        shared_kv_states=kv,
        use_cache=False,
        logits_to_keep=torch.arange(length),
    )
    last = out.last_hidden_state
    return assistant.lm_head(last), assistant.post_projection(last)


def unroll(assistant: Any, states: TargetStates, tokens: Any, steps: int, window: int | None) -> list[Any]:
    """Logits of `steps` chained drafting steps from every anchor: step i of anchor t reads token t+1+i (the token
    the chain would have accepted) and says the token after it. Rows past the end read padding: never labels."""
    import torch

    masks = anchor_masks(tokens.shape[1], window, tokens.shape[0])
    embed = states.embeddings
    state = states.hidden
    outputs = []
    for step in range(steps):
        shifted = torch.roll(embed, shifts=-(step + 1), dims=1)  # row t holds token t+1+step
        logits, state = assistant_step(assistant, shifted, state, states.kv, masks)
        outputs.append(logits)
    return outputs


def step_labels(argmax: Any, trained: Any, steps: int) -> list[Any]:
    """Per step, [B, T] labels (-1: none): step i of anchor t predicts the target's argmax at t+1+i, where the token
    it predicts (t+2+i) is one the data trains on and inside the row."""
    import torch

    length = argmax.shape[1]
    labels = []
    for step in range(steps):
        label = torch.full_like(argmax, -1)
        keep = length - (step + 2)
        if keep > 0:
            wanted = trained[:, step + 2 :].bool()
            label[:, :keep] = torch.where(wanted, argmax[:, step + 1 : step + 1 + keep], -1)
        labels.append(label)
    return labels


def chain_losses(outputs: list[Any], labels: list[Any]) -> tuple[Any, list[tuple[int, int]]]:
    """The weighted cross-entropy over the unrolled steps, and per step (hits, labels)."""
    import torch
    import torch.nn.functional as F

    total, counts = torch.zeros(()), []
    for step, (logits, label) in enumerate(zip(outputs, labels, strict=True)):
        keep = label >= 0
        if keep.any():
            total = total + STEP_WEIGHT**step * F.cross_entropy(logits[keep].float(), label[keep])
        counts.append((int((logits[keep].argmax(-1) == label[keep]).sum()), int(keep.sum())))
    return total, counts


def assistant_chain_matches(
    assistant: Any, target: Any, prompt: list[int], answer: list[int], steps: int
) -> list[list[bool]]:
    """At each answer position j >= 1, whether each of the assistant's up to `steps` chained guesses there is the
    target's (`answer`: its greedy answer to `prompt`): the chain drafting answer[j] reads the target's state at the
    position of answer[j - 2] (the prompt's last token for j = 1) with answer[j - 1], as llama.cpp's draft-mtp does
    after a verify step. Index 0: no chain (the first token is the target's own). The same flags as EAGLE-3's
    chain_matches, so the meter replays both alike."""
    import torch

    ids = torch.tensor([prompt + answer])
    states = target_states(target, ids)
    window = getattr(target.config.get_text_config(), "sliding_window", None)
    with torch.no_grad():
        guesses = [logits.argmax(-1)[0].tolist() for logits in unroll(assistant, states, ids, steps, window)]
    chains: list[list[bool]] = [[]]
    for j in range(1, len(answer)):
        anchor = len(prompt) + j - 2
        chains.append([guesses[i][anchor] == answer[j + i] for i in range(min(steps, len(answer) - j))])
    return chains
