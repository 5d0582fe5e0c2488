"""A draft made from its target, for targets with no small sibling that shares their tokenizer (most fine-tunes):
a few of the target's decoder layers with its embeddings, final norm and output head. It speaks the target's
vocabulary by construction (llama.cpp accepts the pair), and starts much closer to the target than a random model;
the draft methods then train it to think like the tuned target.
"""

from __future__ import annotations

from pathlib import Path

from spectune.atomic import atomic_path
from spectune.errors import SpectuneError
from spectune.models.load import load_tokenizer, save_tokenizer
from spectune.models.resolve import resolve_model


def derive_draft(target_dir: Path, layers: list[int], out: Path) -> Path:
    """Write an HF folder holding `layers` of the target (negative indices count from the end)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    target_dir = resolve_model(target_dir)
    config = AutoConfig.from_pretrained(str(target_dir), local_files_only=True)
    text = config.get_text_config()
    total = text.num_hidden_layers
    chosen = [layer % total for layer in layers if -total <= layer < total]
    if len(chosen) != len(layers) or len(set(chosen)) != len(chosen) or not chosen:
        raise SpectuneError(f"draft layers {layers}: give distinct indices of the target's {total} layers")
    chosen.sort()
    for key, value in list(vars(text).items()):  # per-layer settings (e.g. Gemma 3's layer_types) follow the layers
        if isinstance(value, list) and len(value) == total:
            setattr(text, key, [value[i] for i in chosen])
    text.num_hidden_layers = len(chosen)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), local_files_only=True, dtype=torch.float32)
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = draft.state_dict()
    renamed = {f".layers.{old}.": f".layers.{new}." for new, old in enumerate(chosen)}
    for name, tensor in target.state_dict().items():
        if ".layers." in name:
            old = next((key for key in renamed if key in name), None)
            if old is None:
                continue
            name = name.replace(old, renamed[old])
        if name in state:
            state[name] = tensor
    draft.load_state_dict(state)
    with atomic_path(out) as tmp:
        draft.save_pretrained(str(tmp))
        save_tokenizer(load_tokenizer(target_dir), tmp)
    return out
