"""The demo world's Gemma 4 pair: a small `Gemma4ForCausalLM` target and its MTP assistant
(`Gemma4AssistantForCausalLM`), both built offline as Google ships them for a Gemma 4 model: the target pretrained
on the general corpus, the assistant then trained for that base target (reading its states and cache, labelled by
its greedy tokens) on the same corpus. So the assistant stands in for "the drafter Google trained for the base
model", which a user then finds drafting for their QLoRA-tuned target.

The shapes keep what makes Gemma 4 itself: sliding and full attention layers with their own head widths (the full
layers' `global_head_dim` twice the sliding one's; equal widths leave the converter's `per_layer_config` empty and
it stops), grouped KV heads, logit soft-capping, tied embeddings. No per-layer input embeddings (the E-models' PLE)
and no centroid output head on the assistant: the pinned converter skips that head's tensors.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from rich.console import Console

from spectune.atomic import atomic_path
from spectune.errors import SpectuneError
from spectune.models.demo_pair import (
    Shape,
    WorldRecipe,
    corpus_blocks,
    pair_dir,
    pretrain,
    read_manifest,
    tokenizer_texts,
)
from spectune.models.demo_pair import write_manifest as write_pair_manifest
from spectune.models.gemma4_tokenizer import train_gemma4_tokenizer
from spectune.models.mtp_assistant import chain_losses, step_labels, target_states, unroll
from spectune.progress import Ticker
from spectune.threads import configure_torch_threads

GEMMA4_WORLD_VERSION = 3  # bump when the corpus, tokenizer or training code changes what a recipe builds


@dataclass(frozen=True)
class Gemma4Recipe(WorldRecipe):
    world: ClassVar[int] = GEMMA4_WORLD_VERSION
    name: str
    target: Shape  # heads: query heads; their width is head_dim (sliding) and 2 x head_dim (full layers)
    assistant: Shape
    kv_heads: int = 2
    head_dim: int = 64
    sliding_window: int = 256
    draft_steps: int = 3  # chained steps the assistant trains for (llama.cpp's --spec-draft-n-max)


GEMMA4_RECIPES = {
    # A 4-layer target (three sliding layers, then a full one, as Gemma 4's 5:1 pattern ends) and a 2-layer assistant
    # a quarter its width, near the 12B's own ratio of assistant to target layers' width.
    "gemma4-micro": Gemma4Recipe(
        "gemma4-micro",
        Shape(256, 2, 4, 512, 150, 2e-3),
        Shape(64, 2, 2, 256, 120, 2e-3),
        corpus_docs=2000,
        chat_docs=600,
        vocab_size=2048,
    ),
    "gemma4-demo": Gemma4Recipe(
        "gemma4-demo", Shape(256, 4, 4, 1024, 400, 2e-3), Shape(128, 2, 4, 512, 400, 2e-3), vocab_size=4096
    ),
}


def layer_types(layers: int) -> list[str]:
    return ["sliding_attention"] * (layers - 1) + ["full_attention"]


def text_config(shape: Shape, recipe: Gemma4Recipe, tokenizer: Any, shared: bool = False) -> Any:
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=recipe.kv_heads,
        head_dim=recipe.head_dim,
        global_head_dim=2 * recipe.head_dim,
        layer_types=layer_types(shape.layers),
        sliding_window=recipe.sliding_window,
        max_position_embeddings=4096,
        vocab_size_per_layer_input=0,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=shape.layers if shared else 0,
        final_logit_softcapping=None if shared else 30.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def target_model(recipe: Gemma4Recipe, tokenizer: Any) -> Any:
    import torch
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(recipe.seed)
    return Gemma4ForCausalLM(text_config(recipe.target, recipe, tokenizer))


def assistant_model(recipe: Gemma4Recipe, tokenizer: Any) -> Any:
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    torch.manual_seed(recipe.seed + 1)
    config = Gemma4AssistantConfig(
        text_config=text_config(recipe.assistant, recipe, tokenizer, shared=True),
        backbone_hidden_size=recipe.target.hidden,
        use_ordered_embeddings=False,
    )
    assistant = Gemma4AssistantForCausalLM(config).float()
    assistant.generation_config.num_assistant_tokens = recipe.draft_steps
    return assistant


def train_base_assistant(assistant: Any, target: Any, recipe: Gemma4Recipe, blocks: Any) -> dict[str, Any]:
    """The assistant trained for the base target on the general corpus, as its maker would: AdamW, cosine decay,
    the target frozen, every position an anchor of `draft_steps` chained guesses."""
    import torch

    shape, steps = recipe.assistant, recipe.assistant.steps
    optimizer = torch.optim.AdamW(assistant.parameters(), lr=shape.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
    )
    generator = torch.Generator().manual_seed(recipe.seed + 1)
    target.eval()
    assistant.train()
    started, ticker, hits = time.perf_counter(), Ticker(steps, "training the assistant for the base target"), []
    for step in range(steps):
        batch = blocks[torch.randint(0, len(blocks), (recipe.batch,), generator=generator)]
        states = target_states(target, batch)
        labels = step_labels(states.argmax, torch.ones_like(batch), recipe.draft_steps)
        loss, counts = chain_losses(unroll(assistant, states, batch, recipe.draft_steps, recipe.sliding_window), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(assistant.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        hits.append([h / max(1, n) for h, n in counts])
        ticker.update(step + 1, f"loss {loss.item():.3f}")
    ticker.close()
    assistant.eval()
    last = hits[-10:]
    return {
        "parameters": sum(p.numel() for p in assistant.parameters()),
        "shape": asdict(shape),
        "train_accuracy_by_step": [round(sum(row[i] for row in last) / len(last), 4) for i in range(len(last[0]))],
        "train_seconds": round(time.perf_counter() - started, 2),
    }


def build_gemma4_pair(name: str, models_dir: Path | None = None, force: bool = False) -> Path:
    """Build (or find cached) the Gemma 4 pair `name`: target/, draft/ (the assistant; each with the tokenizer) and
    manifest.json."""
    if name not in GEMMA4_RECIPES:
        raise SpectuneError(f"unknown Gemma 4 pair {name!r}: choose one of {', '.join(GEMMA4_RECIPES)}")
    recipe = GEMMA4_RECIPES[name]
    folder = pair_dir(name, models_dir)
    if (
        not force
        and (folder / "manifest.json").is_file()
        and read_manifest(folder).get("recipe_hash") == recipe.digest()
    ):
        return folder
    threads = configure_torch_threads()
    console, started = Console(stderr=True), time.perf_counter()
    console.print(f"building the {name} pair (once per recipe, then cached in {folder.parent})")
    tokenizer = train_gemma4_tokenizer(tokenizer_texts(recipe.tokenizer_docs), recipe.vocab_size)
    blocks = corpus_blocks(tokenizer, recipe.corpus_docs, recipe.chat_docs, recipe.seq_len, recipe.seed)
    with atomic_path(folder) as tmp:
        target, target_stats = pretrain(
            target_model(recipe, tokenizer), recipe.target, recipe, blocks, f"{name} target"
        )
        console.print(
            f"  target: {target_stats['parameters'] / 1e6:.1f}M parameters, loss {target_stats['final_loss']:.3f}"
        )
        assistant = assistant_model(recipe, tokenizer)
        assistant_stats = train_base_assistant(assistant, target, recipe, blocks)
        console.print(
            f"  assistant: {assistant_stats['parameters'] / 1e6:.2f}M parameters, guesses the base target's "
            f"tokens {assistant_stats['train_accuracy_by_step']} by step (training batches)"
        )
        for role, model in (("target", target), ("draft", assistant)):  # "draft": a pair's roles, as every pair's
            model.save_pretrained(str(tmp / role))
            tokenizer.save_pretrained(str(tmp / role))
        manifest = {
            "size": name,
            "family": "gemma4",
            "recipe": asdict(recipe),
            "recipe_hash": recipe.digest(),
            "world_version": GEMMA4_WORLD_VERSION,
            "threads": threads,
            "corpus_tokens": int(blocks.numel()),
            "target": target_stats,
            "draft": assistant_stats,
            "build_seconds": round(time.perf_counter() - started, 2),
        }
        write_pair_manifest(tmp, manifest)
    return folder
