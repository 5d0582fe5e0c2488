"""EAGLE-3 (Li et al. 2025): a one-layer head that drafts from the tuned target's own hidden states. Trained here on
the target's answers, converted by llama.cpp's converter, and run by llama.cpp as `--spec-type draft-eagle3`.

The head is llama.cpp's eagle3 graph (src/models/eagle3.cpp of the pinned sources) written in torch, so what
trains here is what runs there:
- encoder: g = fc(concat(h[a], h[b], h[c])), h[i] the input of target layer i (HF's hidden_states[i]);
- decoder at position P reads (token[P+1], g[P]): x = concat(rmsnorm(embed(token)), rmsnorm(g)), attention on x
  (RoPE at P) with g as the residual, a SiLU FFN; its pre-norm output is the next draft step's g;
- logits over a reduced vocabulary (d2t: draft index -> target token); the token embedding is the target's,
  borrowed at run time and not saved.
Training-time test: every position starts a chain of `ttt_steps` unrolled steps. Step i of the chain started at P
sits at position P+i and reads the head's own output of step i-1; it attends to the real (step-0) entries up to P
and its own chain's entries, which is exactly the draft's cache when llama.cpp drafts from P. The labels are the
target's greedy next tokens (its argmax), the only thing greedy verification accepts.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator

from spectune.atomic import atomic_path
from spectune.cache import cache_root, path_hash
from spectune.errors import SpectuneError
from spectune.llama_cpp_pin import HEAD_TARGET_MODEL_TYPES, patched_build
from spectune.models.load import load_tokenizer
from spectune.models.resolve import MODEL_REFERENCE, resolve_model
from spectune.progress import progress
from spectune.speedup import MAX_DRAFT_LEN
from spectune.threads import configure_torch_threads
from spectune.train.common import (
    TrainConfig,
    TrainSettings,
    console,
    load_task_data,
    peak_memory_bytes,
    read_split,
)
from spectune.train.eagle3_head import (
    aux_layers,
    head_config,
    head_module,
    head_rope,
    save_head,
    shifted,
    unroll,
)
from spectune.train.loop import fit_measured

STEP_WEIGHT = 0.8  # the loss of unrolled step i weighs STEP_WEIGHT**i: later steps matter only if earlier ones hit
REPORT = "eagle3.json"
NOT_A_LABEL, OUTSIDE_VOCABULARY = -1, -2  # Batch.labels where no token is predicted / the target's is not draftable
EAGLE3 = "eagle3"  # the head's name among a run's drafts


class Eagle3Settings(TrainSettings):
    """EAGLE-3 head training: the `drafts.eagle3:` section of a run config and the flags of `spectune eagle3`."""

    lr: float = Field(3e-3, gt=0, description="Learning rate.")
    draft_vocab_size: int = Field(
        8192, ge=16, description="Tokens the head can propose: the target's most frequent greedy tokens (d2t)."
    )
    ttt_steps: int = Field(
        4, ge=1, le=MAX_DRAFT_LEN, description="Training-time test: unrolled draft steps, each on the head's own g."
    )
    intermediate_size: int | None = Field(None, ge=1, description="The head's FFN width (default: the target's).")

    @model_validator(mode="after")
    def _no_checkpointing(self) -> Eagle3Settings:
        if self.gradient_checkpointing:
            raise ValueError("gradient_checkpointing: the head is one layer; there is nothing to recompute")
        return self


class Eagle3Config(Eagle3Settings, TrainConfig):
    """Everything `spectune eagle3` takes. `data` is best the target's own answers (seqkd's target_answers.jsonl):
    the labels are the target's argmax either way, but its own answers are the contexts it drafts in."""

    target: Path = Field(description=f"The fine-tuned (merged) target the head drafts for: {MODEL_REFERENCE}.")


@dataclass
class FeatureRows:
    """The target's features and argmax per row, how many were computed (not cached), and the seconds taken."""

    rows: list[tuple[Any, Any]]
    computed: int
    seconds: float


class Eagle3Result(BaseModel):
    model: Path
    aux_layers: list[int]
    draft_vocab_size: int
    coverage: float  # share of the trained labels the draft vocabulary holds
    held_out_coverage: float  # of the held-out ones: those outside are misses in the accuracies below
    parameters: int  # the head's own (the borrowed embedding excluded)
    steps: int
    train_dialogues: int
    trained_tokens: int
    feature_seconds: float  # the target's forward passes over the data, and reading the cached ones
    features_computed: int  # rows whose hidden states were computed (the others came from the cache)
    seconds: float  # training, evaluations included
    accuracy_before: list[float]  # held-out top-1 accuracy against the target's argmax, by unrolled step
    accuracy_after: list[float]
    # by training step: at the start, every checkpoint (since a resume) and the end
    accuracy_by_steps: dict[int, list[float]]
    peak_memory_bytes: int
    peak_memory_how: str


def check_target(target: Path) -> dict[str, Any]:
    """The target's config.json, or an error before any training where llama.cpp cannot run a head for it."""
    config = json.loads((target / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in HEAD_TARGET_MODEL_TYPES:
        raise SpectuneError(
            f"{target}: an EAGLE-3 head drafts from the target's layer inputs, and the pinned llama.cpp "
            f"({patched_build()}) hands them over only for {', '.join(HEAD_TARGET_MODEL_TYPES)}; this target is "
            f"{model_type!r} (its graph does not set t_layer_inp)"
        )
    rope_type = head_rope(config)["rope_type"]
    if rope_type != "default":
        raise SpectuneError(f"{target}: RoPE scaling {rope_type!r}: the head trains with plain RoPE only, for now")
    return config


def feature_cache(target: Path, layers: list[int]) -> Path:
    """The folder of the target's cached hidden states for these layers: one file per row, named by its tokens'
    digest, so a run on more dialogues (or another split) reuses every row computed before."""
    return cache_root() / "eagle3-features" / f"{path_hash(target)}-{'-'.join(map(str, layers))}"


def target_features(target: Any, folder: Path, layers: list[int], rows: list[list[int]], what: str) -> FeatureRows:
    """Per row of token ids: the target's inputs of `layers`, concatenated ([T, 3H], kept as float16: Qwen2.5's
    outliers reach 4,352, far inside its range), and its argmax at each position (the token it says next); from
    `folder` (feature_cache) where computed before."""
    import torch

    collected, started, computed = [], time.perf_counter(), 0
    for ids in progress(rows, f"the target's hidden states ({what})"):
        path = folder / f"{hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:24]}.pt"
        if path.is_file():
            row = torch.load(path, weights_only=True)
        else:
            with torch.no_grad():
                out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
            features = torch.cat([out.hidden_states[layer][0] for layer in layers], -1)
            row = {"features": features.half(), "argmax": out.logits[0].argmax(-1)}  # as a cached row reads back
            with atomic_path(path) as tmp:
                torch.save(row, tmp)
            computed += 1
        collected.append((row["features"].float(), row["argmax"]))
    return FeatureRows(collected, computed, time.perf_counter() - started)


def draft_vocabulary(labels: list[Any], target_vocab: int, size: int) -> Any:
    """The `size` target tokens most often the target's greedy choice in the training answers (ties and unseen
    tokens by id), ascending: d2t."""
    import torch

    counts = torch.bincount(torch.cat(labels), minlength=target_vocab)
    order = torch.argsort(-counts, stable=True)[: min(size, target_vocab)]
    return order.sort().values


class Batch:
    """Rows padded to one length: features, tokens, the labels as draft-vocabulary indices (-1: not a label) per
    unrolled step."""

    def __init__(self, items: list[tuple[Any, Any, Any, Any]], to_draft: Any, steps: int) -> None:
        import torch
        from torch.nn.utils.rnn import pad_sequence

        self.features = pad_sequence([f for f, _, _, _ in items], batch_first=True)
        self.tokens = pad_sequence([t for _, t, _, _ in items], batch_first=True)
        argmax = pad_sequence([a for _, _, a, _ in items], batch_first=True)
        trained = pad_sequence([m for _, _, _, m in items], batch_first=True)  # token t is an assistant token
        self.labels = []
        for step in range(steps):
            # row P of step i predicts the token after P + i + 1: the target's argmax there, if an assistant token
            label = to_draft[shifted(argmax, step + 1)]
            assistant = shifted(trained, step + 2).bool()
            outside = torch.full_like(label, OUTSIDE_VOCABULARY)
            self.labels.append(torch.where(assistant, torch.where(label >= 0, label, outside), NOT_A_LABEL))


def step_losses(head: Any, batch: Batch) -> tuple[Any, list[tuple[int, int]]]:
    """The weighted cross-entropy over the unrolled steps, and per step (hits, labels)."""
    import torch
    import torch.nn.functional as F

    outputs = unroll(head, batch.features, batch.tokens, len(batch.labels))
    total, counts = torch.zeros(()), []
    for step, (output, labels) in enumerate(zip(outputs, batch.labels, strict=True)):
        keep = labels >= 0
        logits = head.lm_head(head.norm(output[keep]))
        if keep.any():
            total = total + STEP_WEIGHT**step * F.cross_entropy(logits, labels[keep])
        # a label outside the draft vocabulary is a miss the head cannot avoid, as in llama.cpp's loop
        counts.append((int((logits.argmax(-1) == labels[keep]).sum()), int((labels != NOT_A_LABEL).sum())))
    return total, counts


def accuracy(head: Any, batches: list[Batch]) -> list[float]:
    """Top-1 accuracy against the target's argmax by unrolled step (teacher-forced tokens, the head's own g)."""
    import torch

    totals = [[0, 0] for _ in batches[0].labels] if batches else []
    with torch.no_grad():
        for batch in batches:
            for total, (hits, labels) in zip(totals, step_losses(head, batch)[1], strict=True):
                total[0] += hits
                total[1] += labels
    return [round(hits / labels, 4) if labels else 0.0 for hits, labels in totals]


def initialise(head: Any, target: Any) -> None:
    """A start that already predicts something: g is the highest feature layer, the head and final norm are the
    target's own rows for the draft vocabulary, and the layer adds little until trained."""
    import torch

    with torch.no_grad():
        hidden = head.fc.weight.shape[0]
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * hidden :] = torch.eye(hidden)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[head.draft_ids])
        head.norm.weight.copy_(target.model.norm.weight)
        for small in (head.midlayer.self_attn.o_proj, head.midlayer.mlp.down_proj):
            small.weight.normal_(0.0, 0.002)


def batches(items: list[tuple], size: int, to_draft: Any, steps: int) -> list[Batch]:
    return [Batch(items[i : i + size], to_draft, steps) for i in range(0, len(items), size)]


def data_items(
    target: Any, folder: Path, data: Any, layers: list[int]
) -> tuple[list[tuple], list[tuple], list[FeatureRows]]:
    """(features, tokens, argmax, assistant mask) per train and held-out row, and how each split's features were
    had (computed or cached, and the seconds)."""
    import torch

    def items(dataset: Any, what: str) -> tuple[list[tuple], FeatureRows]:
        rows = list(dataset["input_ids"])
        features = target_features(target, folder, layers, rows, what)
        masks = [torch.tensor(mask) for mask in dataset["assistant_masks"]]
        rowed = zip(features.rows, rows, masks, strict=True)
        return [(f, torch.tensor(ids), a, m) for (f, a), ids, m in rowed], features

    (train, train_features), (held_out, held_out_features) = items(data.train, "train"), items(data.eval, "held out")
    return train, held_out, [train_features, held_out_features]


def draft_index(d2t: Any, vocab_size: int) -> Any:
    """Each target token's place in the draft vocabulary, -1 where it has none."""
    import torch

    to_draft = torch.full((vocab_size,), -1, dtype=torch.long)
    to_draft[d2t] = torch.arange(len(d2t))
    return to_draft


def covered(indices: Any) -> float:
    """The share of labels (as draft-vocabulary indices, -1: none) the draft vocabulary holds; 0 where none."""
    return round(float((indices >= 0).float().mean()), 4) if len(indices) else 0.0


def train_eagle3(config: Eagle3Config) -> Eagle3Result:
    """Train an EAGLE-3 head for the target on `data`; write OUT/model (HF layout) and OUT/eagle3.json."""
    import torch
    from transformers import AutoModelForCausalLM, set_seed

    configure_torch_threads()
    config = config.model_copy(update={"target": resolve_model(config.target)})
    target_config = check_target(config.target)
    set_seed(config.seed)
    tokenizer = load_tokenizer(config.target, config.chat_template)
    data = load_task_data(tokenizer, config, read_split(config))
    target = AutoModelForCausalLM.from_pretrained(str(config.target), local_files_only=True, dtype=torch.float32)
    layers = aux_layers(target_config["num_hidden_layers"])
    cache = feature_cache(config.target, layers)
    train_items, eval_items, feature_runs = data_items(target.eval(), cache, data, layers)
    labels = [argmax[shifted(mask[None], 1)[0].bool()] for _, _, argmax, mask in train_items]
    d2t = draft_vocabulary(labels, target_config["vocab_size"], config.draft_vocab_size)
    to_draft = draft_index(d2t, target_config["vocab_size"])
    shape = head_config(target_config, config.intermediate_size, layers, len(d2t))
    head = head_module(shape, target.get_input_embeddings().weight.detach(), d2t)
    initialise(head, target)
    del target
    held_out = batches(eval_items, config.batch_size, to_draft, config.ttt_steps)
    fitted = fit_measured(
        head,
        train_items,
        lambda rows: step_losses(head, Batch(rows, to_draft, config.ttt_steps))[0],
        lambda: accuracy(head, held_out),
        config,
        "eagle3 head",
    )
    save_head(head, shape, tokenizer, config.out / "model")
    all_labels = torch.cat(labels)
    held_out_labels = torch.cat([batch.labels[0][batch.labels[0] != NOT_A_LABEL] for batch in held_out])
    peak, how = peak_memory_bytes()
    result = Eagle3Result(
        model=config.out / "model",
        aux_layers=layers,
        draft_vocab_size=len(d2t),
        coverage=covered(to_draft[all_labels]),
        held_out_coverage=covered(held_out_labels),
        parameters=sum(p.numel() for p in head.parameters()),
        steps=fitted.steps,
        train_dialogues=len(train_items),
        trained_tokens=len(all_labels),
        feature_seconds=round(sum(part.seconds for part in feature_runs), 2),
        features_computed=sum(part.computed for part in feature_runs),
        seconds=round(fitted.seconds, 2),
        accuracy_before=fitted.before,
        accuracy_after=fitted.after,
        accuracy_by_steps=fitted.by_steps,
        peak_memory_bytes=peak,
        peak_memory_how=how,
    )
    with atomic_path(config.out / REPORT) as tmp:
        tmp.write_text(
            json.dumps({"config": config.model_dump(mode="json"), "result": result.model_dump(mode="json")}, indent=2)
        )
    console.print(f"eagle3 head: {result.parameters:,} parameters, accuracy by step {fitted.before} -> {fitted.after}")
    return result
