"""The demo world: generic Llama-architecture base pairs (a target and a smaller draft, one tokenizer),
pretrained offline on the general corpus. They stand in for "a 12B target and an off-the-shelf 1B draft".

A pair is built once per recipe into the models directory and reused; the manifest records the recipe hash,
sizes, parameter counts and timings, and (after `measure_profile`) the hardware profile c and r(n).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from rich.console import Console
from rich.progress import Progress

from spectune.atomic import atomic_path
from spectune.cache import cache_root
from spectune.data.demo import generate_dialogues
from spectune.errors import SpectuneError
from spectune.models.corpus import generate_chats, generate_corpus
from spectune.models.tokenizer import save_tokenizer, train_tokenizer
from spectune.threads import configure_torch_threads

WORLD_VERSION = 2  # bump when the corpus, tokenizer or training code changes what a recipe builds


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    ffn: int
    steps: int  # pretraining steps
    lr: float = 3e-3


@dataclass(frozen=True, kw_only=True)
class WorldRecipe:
    """What every demo world's pair is built from: its vocabulary, corpus and pretraining batches."""

    world: ClassVar[int] = WORLD_VERSION
    vocab_size: int = 8192
    tokenizer_docs: int = 6000
    corpus_docs: int = 6000
    chat_docs: int = 2000
    seq_len: int = 128
    batch: int = 8
    seed: int = 0

    def digest(self) -> str:
        blob = json.dumps({"world": self.world, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PairRecipe(WorldRecipe):
    name: str
    target: Shape
    draft: Shape


RECIPES = {
    # Deeper targets diverge at 3e-3 on this corpus (a 2-layer micro target stalled at loss 4.8): lower lr.
    # micro has its own small vocabulary: its embeddings must learn in a 30-second build.
    "micro": PairRecipe(
        "micro",
        Shape(256, 2, 4, 512, 150, 2e-3),
        Shape(128, 1, 2, 256, 150),
        vocab_size=2048,
        corpus_docs=2000,
        chat_docs=600,
    ),
    "small": PairRecipe("small", Shape(512, 4, 8, 1408, 400, 1.5e-3), Shape(256, 1, 4, 768, 400)),
    # `spectune demo`'s pair: small's target with a draft whose Q4_K_M is 0.125 of the target's, near a 12B target's
    # 1B draft (0.085); 128 wide, the narrowest that keeps 64-wide heads (its rows fall back to Q5_0/Q8_0).
    # Pretrained for 130 steps (small's 400 took 10 of the demo's 15 minutes; 150 took 232 s): QLoRA on the task
    # does the rest.
    "demo": PairRecipe("demo", Shape(512, 4, 8, 1408, 130, 1.5e-3), Shape(128, 1, 2, 384, 260)),
    "medium": PairRecipe(
        "medium", Shape(512, 8, 8, 1792, 1200, 1e-3), Shape(256, 1, 4, 768, 600), corpus_docs=20000, chat_docs=6000
    ),
}


def default_models_dir() -> Path:
    return cache_root() / "models"


def pair_dir(size: str, models_dir: Path | None = None) -> Path:
    return (models_dir or default_models_dir()) / size


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / "manifest.json"
    if not path.is_file():
        raise SpectuneError(f"{folder}: no manifest.json (not a built pair)")
    return json.loads(path.read_text())


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    with atomic_path(folder / "manifest.json") as tmp:
        tmp.write_text(json.dumps(manifest, indent=2))


def tokenizer_texts(docs: int) -> list[str]:
    """What a demo world's vocabulary is learnt from: general documents, generic chats and voice-bot dialogues."""
    texts = generate_corpus(docs, seed=1000)
    texts += [turn["content"] for chat in generate_chats(docs // 3, seed=1000) for turn in chat]
    return texts + [turn["content"] for d in generate_dialogues(2000, seed=1000) for turn in d.messages]


def build_tokenizer(recipe: PairRecipe) -> Any:
    return train_tokenizer(tokenizer_texts(recipe.tokenizer_docs), recipe.vocab_size)


def corpus_blocks(tokenizer: Any, docs: int, chats: int, seq_len: int, seed: int) -> Any:
    """The general corpus (plain documents and generic chats), packed into seq_len blocks."""
    import torch

    documents = generate_corpus(docs, seed=seed)
    documents += [tokenizer.apply_chat_template(chat, tokenize=False) for chat in generate_chats(chats, seed=seed)]
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed)).tolist()
    stream: list[int] = []
    for index in order:
        stream += tokenizer(documents[index], add_special_tokens=False)["input_ids"] + [tokenizer.bos_token_id]
    usable = len(stream) // seq_len * seq_len
    return torch.tensor(stream[:usable]).view(-1, seq_len)


def pretraining_blocks(recipe: PairRecipe, tokenizer: Any) -> Any:
    return corpus_blocks(tokenizer, recipe.corpus_docs, recipe.chat_docs, recipe.seq_len, recipe.seed)


def llama_config(shape: Shape, recipe: PairRecipe, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def llama_model(shape: Shape, recipe: PairRecipe, tokenizer: Any) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(recipe.seed)
    return LlamaForCausalLM(llama_config(shape, recipe, tokenizer))


def pretrain(model: Any, shape: Shape, recipe: WorldRecipe, blocks: Any, label: str) -> tuple[Any, dict]:
    """Plain causal-LM pretraining of a fresh `model` with AdamW and a cosine schedule; deterministic by the recipe's
    seed (the caller seeds torch before building the model)."""
    import torch

    model = model.float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, shape.steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, shape.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    generator = torch.Generator().manual_seed(recipe.seed)
    model.train()
    start = time.perf_counter()
    losses = []
    with Progress(transient=True) as progress:
        task = progress.add_task(f"pretraining {label}", total=shape.steps)
        for _step in range(shape.steps):
            rows = torch.randint(0, len(blocks), (recipe.batch,), generator=generator)
            batch = blocks[rows]
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            progress.update(task, advance=1, description=f"pretraining {label} loss {loss.item():.3f}")
    model.eval()
    stats = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "shape": asdict(shape),
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "train_seconds": round(time.perf_counter() - start, 2),
        "tokens_seen": shape.steps * recipe.batch * recipe.seq_len,
    }
    return model, stats


def build_pair(size: str | PairRecipe, models_dir: Path | None = None, force: bool = False) -> Path:
    """Build (or find cached) a pair: target/ and draft/ (each with the tokenizer) and manifest.json."""
    if isinstance(size, PairRecipe):
        recipe = size
    elif size in RECIPES:
        recipe = RECIPES[size]
    else:
        raise SpectuneError(f"unknown size {size!r}: choose one of {', '.join(RECIPES)}")
    size = recipe.name
    folder = pair_dir(size, models_dir)
    manifest_file = folder / "manifest.json"
    if not force and manifest_file.is_file() and read_manifest(folder).get("recipe_hash") == recipe.digest():
        return folder

    threads = configure_torch_threads()
    start = time.perf_counter()
    console = Console(stderr=True)
    # a line per phase as well as the live bars, which a log file or a pipe does not show
    console.print(f"building the {size} pair (once per recipe, then cached in {folder.parent})")
    with console.status(f"building the {size} pair: its tokenizer and pretraining corpus"):
        tokenizer = build_tokenizer(recipe)
        blocks = pretraining_blocks(recipe, tokenizer)
    with atomic_path(folder) as tmp:
        manifest: dict[str, Any] = {
            "size": size,
            "recipe": asdict(recipe),
            "recipe_hash": recipe.digest(),
            "world_version": WORLD_VERSION,
            "threads": threads,
            "corpus_tokens": int(blocks.numel()),
        }
        for role, shape in (("target", recipe.target), ("draft", recipe.draft)):
            model, stats = pretrain(llama_model(shape, recipe, tokenizer), shape, recipe, blocks, f"{size} {role}")
            console.print(
                f"  {role}: {stats['parameters'] / 1e6:.1f}M parameters, {shape.steps} steps,"
                f" loss {stats['final_loss']:.3f}, {stats['train_seconds']:.0f} s"
            )
            model.save_pretrained(str(tmp / role))
            save_tokenizer(tokenizer, tmp / role)
            stats["bytes_on_disk"] = sum(f.stat().st_size for f in (tmp / role).iterdir())
            manifest[role] = stats
        manifest["build_seconds"] = round(time.perf_counter() - start, 2)
        write_manifest(tmp, manifest)
    return folder
