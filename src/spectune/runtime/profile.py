"""The hardware profile that decides whether speculative decoding can pay on a machine:

- c = one draft step / one target step (both one token), and
- r(n) = target time for a batch of n tokens / target time for one token,

measured here; and what a step reads of a GGUF's weights, the c of a memory-bound GPU (speedup.step_cost_ratio).

On a memory-bound GPU r(n) ≈ 1 for small n; on a small CPU decoding is compute-bound and r(n) grows with n,
so no wall-clock speedup is possible there whatever the acceptance (docs/design.md, "Why CPU and GPU differ").
"""

from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path
from typing import Any

from spectune.errors import SpectuneError
from spectune.runtime.build import read_gguf
from spectune.runtime.llama import LlamaModel
from spectune.runtime.registry import model_speculator
from spectune.runtime.sampling import GreedySampler
from spectune.speedup import Weights

CONTEXT = 64  # tokens already in the cache when a step is timed, like a short voice-bot prompt
FILLER = "The quick brown fox jumps over the lazy dog while the river runs to the sea. "


def gguf_weights(path: str | Path) -> Weights:
    """A GGUF's weights in the bytes they are stored in (a tied model has no `output.weight`; an EAGLE-3 head has no
    embedding table of its own)."""
    reader = read_gguf(path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    architecture = reader.fields["general.architecture"].contents()
    if f"{architecture}.block_count" not in reader.fields:
        raise SpectuneError(f"{path}: no {architecture}.block_count (its layers, which the GPU card's floor needs)")
    layers = int(reader.fields[f"{architecture}.block_count"].contents())
    if "token_embd.weight" not in tensors and "fc.weight" in tensors:  # an EAGLE-3 head reads a row of the target's
        total = sum(int(tensor.n_bytes) for tensor in tensors.values())
        return Weights(total=total, embedding=0, rows=1, tied=False, layers=layers)
    if "token_embd.weight" not in tensors:
        raise SpectuneError(f"{path}: no token_embd.weight tensor (not a language model GGUF?)")
    embedding = tensors["token_embd.weight"]
    return Weights(
        total=sum(int(tensor.n_bytes) for tensor in tensors.values()),
        embedding=int(embedding.n_bytes),
        rows=int(embedding.shape[-1]),  # GGUF lists dimensions innermost first: (width, vocabulary)
        tied="output.weight" not in tensors,
        layers=layers,
    )


def _timed_decode(model: LlamaModel, prompt: list[int], n: int) -> float:
    model.truncate(CONTEXT)
    start = time.perf_counter()
    model.decode(prompt[:n], CONTEXT, all_logits=True)  # verification needs logits at every position
    return time.perf_counter() - start


def measure_profile(
    target_gguf: str | Path,
    draft_gguf: str | Path,
    max_batch: int = 9,
    repeats: int = 7,
    threads: int | None = None,
    exact: bool = True,
) -> dict[str, Any]:
    """Median one-token times of both models and r(n) for n = 2..max_batch, measured interleaved. A head's token
    (an EAGLE-3 head's, an MTP assistant's) is its step beside the target (an EAGLE-3 head's encoder and decoder on
    one position)."""
    n_ctx = CONTEXT + max_batch + 8
    target = LlamaModel(target_gguf, n_ctx=n_ctx, threads=threads, exact=exact)
    draft = LlamaModel(draft_gguf, n_ctx=n_ctx, threads=threads, exact=exact, beside=target)
    head = model_speculator(draft, target) if draft.is_head else None  # before the target decodes: it keeps states
    prompt = (target.tokenize(FILLER * 20))[: CONTEXT + max_batch]
    for model in (target, draft) if head is None else (target,):
        model.decode(prompt[:CONTEXT], 0, all_logits=False)
        _timed_decode(model, prompt[CONTEXT:], max_batch)  # warm-up

    def draft_token() -> float:
        if head is None:
            return _timed_decode(draft, prompt[CONTEXT:], 1)
        start = time.perf_counter()
        head.propose(prompt[: CONTEXT + 1], 1, GreedySampler(), 0.0)  # reads the last position again, drafts one
        return time.perf_counter() - start

    draft_token()  # warm-up
    samples: dict[str, list[float]] = {"draft": []} | {f"target_{n}": [] for n in range(1, max_batch + 1)}
    for _ in range(repeats):  # interleaved, so drifts in machine load hit every measurement alike
        samples["draft"].append(draft_token())
        for n in range(1, max_batch + 1):
            samples[f"target_{n}"].append(_timed_decode(target, prompt[CONTEXT:], n))
    median = {key: statistics.median(values) for key, values in samples.items()}
    one = median["target_1"]
    target.close()
    draft.close()
    return {
        "target_ms_per_token": round(one * 1000, 4),
        "draft_ms_per_token": round(median["draft"] * 1000, 4),
        "cost_ratio": round(median["draft"] / one, 4),
        "verify_ratio": {str(n): round(median[f"target_{n}"] / one, 3) for n in range(2, max_batch + 1)},
        "threads": target.threads,
        "exact": exact,
        "machine": f"{platform.machine()} {platform.processor() or ''} ({_cpu_name()})".strip(),
        "repeats": repeats,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"
