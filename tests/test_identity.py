"""Identical answers where rounding decides them: a model whose width is not a multiple of 256 (so Q4_K_M falls back
to Q5_0 / Q8_0, the types llamafile's batched kernels take) with near-uniform random logits, and a draft that
rejects, so every step verifies k + 1 tokens. Under a build with llamafile compiled in these tests fail."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_model

from spectune.data.prepare import extract_prompts
from spectune.data.read import read_dialogues
from spectune.export.gguf import export_model
from spectune.models.load import load_tokenizer
from spectune.runtime.build import identity_verdict, llamafile_compiled, matrix_types
from spectune.runtime.chat import chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.draft_model import DraftModel
from spectune.runtime.llama import LlamaModel
from spectune.runtime.speculative import SpeculativeDecoder

WIDTH = 320  # not a multiple of 256: no K-quant block fits a row
QUANTS = ("Q4_K_M", "Q8_0")


def odd_model(micro_pair, folder, hidden: int, layers: int, seed: int):
    # Near-uniform logits (initializer 0.02): the top token is often decided by the last bits.
    shape = {"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers}
    heads = {"num_attention_heads": hidden // 64, "num_key_value_heads": 1}  # grouped-query, as most real models
    return random_model(
        load_tokenizer(micro_pair / "target"), folder, "llama", seed, initializer_range=0.02, **shape, **heads
    )


@pytest.fixture(scope="module")
def odd_ggufs(micro_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("odd")
    target = odd_model(micro_pair, root / "target", WIDTH, 2, seed=1)
    draft = odd_model(micro_pair, root / "draft", 64 * 3, 1, seed=2)
    return {
        quant: {
            role: export_model(folder, root / f"{role}.{quant}.gguf", quant)
            for role, folder in (("target", target), ("draft", draft))
        }
        for quant in QUANTS
    }


def test_the_default_install_promises_identity_for_these_types(odd_ggufs):
    assert not llamafile_compiled(), "llama.cpp must be built with -DGGML_LLAMAFILE=OFF (make install)"
    types = matrix_types(odd_ggufs["Q4_K_M"]["target"])
    assert {"Q5_0", "Q8_0"} & types.keys(), types  # the fallback types this test is about
    assert identity_verdict(odd_ggufs["Q4_K_M"]["target"], exact=True)["guaranteed"]
    refused = identity_verdict(odd_ggufs["Q8_0"]["target"], exact=False)
    assert not refused["guaranteed"] and "exact is off" in refused["reasons"][0]


@pytest.mark.parametrize("quant", QUANTS)
def test_batched_logits_equal_one_token_logits_bit_for_bit(odd_ggufs, quant):
    """Every batch of 4 (a k = 3 verification) at every context length up to 300 against the same positions decoded
    one at a time. Under llamafile the differences are sparse (found at a few positions of 300), so all are tried."""
    model = LlamaModel(odd_ggufs[quant]["target"], n_ctx=512, threads=1, exact=True)
    tokens = model.tokenize("The caller asked to book a table for four at seven tonight, near the station. " * 30)
    tokens = tokens[:304]
    one_by_one = np.concatenate([model.decode([token], position) for position, token in enumerate(tokens)])
    differing = []
    for start in range(1, len(tokens) - 4):
        batched = model.decode(tokens[start : start + 4], start)
        if not np.array_equal(batched, one_by_one[start : start + 4]):
            differing.append(start)
        model.decode([tokens[start]], start)  # the cache again as one-token decoding wrote it
    assert not differing, f"batched logits differ at context lengths {differing}"


@pytest.mark.parametrize("quant", QUANTS)
def test_a_rejecting_draft_gives_the_target_s_own_answers(odd_ggufs, demo_data, quant):
    target = LlamaModel(odd_ggufs[quant]["target"], n_ctx=512, threads=1, exact=True)
    draft = LlamaModel(odd_ggufs[quant]["draft"], n_ctx=512, threads=1, exact=True)
    plain, speculative = SpeculativeDecoder(target), SpeculativeDecoder(target, [DraftModel(draft, target)])
    config = DecodeSettings(max_tokens=64, draft_max=3)
    drafted = accepted = 0
    for prompt in extract_prompts(read_dialogues(demo_data).dialogues, 12, seed=11):
        ids = target.tokenize(chat_prompt(target, prompt.messages))
        generation = speculative.generate(ids, config)
        assert generation.tokens == plain.generate(ids, config).tokens, prompt.messages[-1]
        drafted, accepted = drafted + generation.stats.drafted, accepted + generation.stats.accepted
    assert drafted > 100 and accepted / drafted < 0.2  # the hard case: nearly every step verifies k + 1 rows
