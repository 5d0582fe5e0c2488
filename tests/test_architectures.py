"""Users bring their own local HF folders: Qwen2/3, Mistral and Gemma 2/3 go through the same stages as the demo
world's Llama pairs. Each architecture here is a tiny random model carrying the micro pair's tokenizer."""

from __future__ import annotations

import pytest
from conftest import random_model

from spectune.data.read import read_dialogues
from spectune.errors import SpectuneError
from spectune.export.gguf import convert
from spectune.export.pair import fidelity
from spectune.models.load import check_model_dir, load_tokenizer
from spectune.runtime.chat import chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.draft_model import DraftModel
from spectune.runtime.llama import LlamaModel
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.train.target import FinetuneConfig, finetune

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
ARCHITECTURES = {
    "qwen2": {"num_key_value_heads": 2},
    "qwen3": {"num_key_value_heads": 2, "head_dim": 16},
    "mistral": {"num_key_value_heads": 2, "sliding_window": None},
    # Real Gemma checkpoints set query_pre_attn_scalar = head_dim (llama.cpp assumes it); the default is 256.
    "gemma2": {"num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16},
    "gemma3_text": {"num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16},
}
# Each architecture's full shape; peaked logits (a wide init) so top-1 comparisons are not decided by rounding.
MODEL_SHAPE = {name: {**SHAPE, **extra, "initializer_range": 0.2} for name, extra in ARCHITECTURES.items()}
# llama.cpp converts Gemma 2 only with its sentencepiece tokenizer.model (as real Gemma 2 folders have); this test's
# tokenizer is the demo world's byte-level BPE, so Gemma 2 stops after fine-tuning here.
SENTENCEPIECE_ONLY = {"gemma2"}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def model_dir(request, micro_pair, tmp_path_factory):
    tokenizer = load_tokenizer(micro_pair / "target")
    folder = random_model(
        tokenizer, tmp_path_factory.mktemp(request.param), request.param, **MODEL_SHAPE[request.param]
    )
    return folder, request.param


def test_finetune_export_and_decode(model_dir, demo_data, tmp_path):
    model_dir, architecture = model_dir
    check_model_dir(model_dir)
    result = finetune(
        FinetuneConfig(model=model_dir, data=demo_data, out=tmp_path / "ft", max_steps=2, batch_size=2, max_eval=2)
    )
    assert (result.adapter / "adapter_config.json").is_file()

    tokenizer = load_tokenizer(model_dir)
    dialogues = read_dialogues(demo_data).dialogues[:3]
    texts = [tokenizer.apply_chat_template(d.messages, tokenize=False) for d in dialogues]
    if architecture in SENTENCEPIECE_ONLY:
        with pytest.raises(SpectuneError, match=r"tokenizer\.model"):
            convert(model_dir, tmp_path / "model.F32.gguf", "F32")
        return
    gguf = convert(model_dir, tmp_path / "model.F32.gguf", "F32")
    report = fidelity(model_dir, gguf, texts, threads=1)
    assert report["top1_agreement"] > 0.97, report

    model = LlamaModel(gguf, n_ctx=512, threads=1)
    ids = model.tokenize(chat_prompt(model, dialogues[0].messages[:1]))
    config = DecodeSettings(max_tokens=12, draft_max=4)
    plain = SpeculativeDecoder(model).generate(ids, config)
    speculative = SpeculativeDecoder(model, [DraftModel(LlamaModel(gguf, n_ctx=512, threads=1), model)]).generate(
        ids, config
    )
    stats = speculative.stats
    assert (
        speculative.tokens == plain.tokens and stats.accepted == stats.drafted
    )  # a model drafting for itself is always right

    # A draft that is mostly wrong (another random model with the same tokenizer; a Qwen2 one, since random Gemma 3
    # models with tied embeddings all echo their input token and would agree): every rejection is a verification
    # whose later rows are thrown away, the case where batched logits must equal one-token ones.
    rival_dir = random_model(tokenizer, tmp_path / "rival", "qwen2", seed=1, **MODEL_SHAPE["qwen2"])
    rival = SpeculativeDecoder(
        model, [DraftModel(LlamaModel(convert(rival_dir, tmp_path / "rival.F32.gguf", "F32"), threads=1), model)]
    )
    drafted = accepted = 0
    for dialogue in read_dialogues(demo_data).dialogues[:12]:
        ids = model.tokenize(chat_prompt(model, dialogue.messages[:1]))
        generation = rival.generate(ids, DecodeSettings(max_tokens=16, draft_max=3))
        assert generation.tokens == SpeculativeDecoder(model).generate(ids, DecodeSettings(max_tokens=16)).tokens
        drafted, accepted = drafted + generation.stats.drafted, accepted + generation.stats.accepted
    assert drafted >= 60 and accepted < drafted / 2, (drafted, accepted)  # rejections happened, most steps
