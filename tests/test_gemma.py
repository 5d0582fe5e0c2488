"""Gemma's chat format through training masks, export and the runtime, on a tiny random Gemma 3 model.

Gemma's template has no system role: a system prompt is folded into the first user turn. The template is the one
spectune gives Gemma GGUFs that carry none (models/templates/gemma.jinja); the real model's export
checks run in `spectune export` (tokenizer and template against HF)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_model
from gguf import GGUFReader
from sentencepiece import sentencepiece_model_pb2 as spm
from transformers import AutoConfig, AutoModelForCausalLM

from spectune.data.read import read_dialogues
from spectune.data.render import render
from spectune.errors import SpectuneError
from spectune.export.gguf import convert, export_model
from spectune.models.imported import TEMPLATES
from spectune.models.load import load_tokenizer
from spectune.models.tokenizer_check import check_template, check_tokenizer
from spectune.runtime.chat import chat_prompt
from spectune.runtime.llama import LlamaModel

SYSTEM = "You are the bakery's phone assistant. Answer briefly."
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
GEMMA = {"num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16}


@pytest.fixture(scope="module")
def gemma_dir(micro_pair, tmp_path_factory):
    tokenizer = load_tokenizer(micro_pair / "target")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = (TEMPLATES / "gemma.jinja").read_text()  # what a Gemma import gets
    tokenizer.eos_token = "<end_of_turn>"
    return random_model(tokenizer, tmp_path_factory.mktemp("gemma"), "gemma3_text", **SHAPE, **GEMMA)


def with_system(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, *[m for m in messages if m["role"] != "system"]]


def test_the_system_prompt_is_folded_into_the_first_user_turn_and_only_model_turns_train(gemma_dir, demo_data):
    tokenizer = load_tokenizer(gemma_dir)
    messages = with_system(read_dialogues(demo_data).dialogues[0].messages)
    rendered = render(tokenizer, messages)
    text = tokenizer.decode(rendered.input_ids)
    assert "<start_of_turn>system" not in text
    assert f"<start_of_turn>user\n{SYSTEM}\n\n{messages[1]['content'].strip()}<end_of_turn>" in text
    trained = tokenizer.decode([t for t, m in zip(rendered.input_ids, rendered.assistant_mask, strict=True) if m])
    answers = [m["content"].strip() for m in messages if m["role"] == "assistant"]
    assert trained == "".join(f"{answer}<end_of_turn>" for answer in answers)  # answers and their end markers only


def test_the_gguf_renders_and_tokenizes_as_hf(gemma_dir, demo_data, tmp_path):
    tokenizer = load_tokenizer(gemma_dir)
    gguf = export_model(gemma_dir, tmp_path / "gemma.Q8_0.gguf", "Q8_0")
    conversations = [with_system(d.messages) for d in read_dialogues(demo_data).dialogues[:20]]
    assert check_template(tokenizer, gguf, conversations) >= 20
    assert check_tokenizer(tokenizer, gguf, [tokenizer.apply_chat_template(m, tokenize=False) for m in conversations])
    tokenizer.chat_template = tokenizer.chat_template.replace("<start_of_turn>model", "<start_of_turn>assistant")
    with pytest.raises(SpectuneError, match=r"renders (\d+) of \1 prompts unlike HF's:\n  from character \d+: HF"):
        check_template(tokenizer, gguf, conversations)  # every prompt differs, and each is named
    model = LlamaModel(gguf, n_ctx=256, threads=1)
    prompt = chat_prompt(model, conversations[0][:2])
    assert prompt.startswith(f"{tokenizer.bos_token}<start_of_turn>user\n{SYSTEM}\n\n")
    assert prompt.endswith("<start_of_turn>model\n")


def sentencepiece_gemma(folder):
    """A tiny Gemma 3 whose vocabulary is a sentencepiece tokenizer.model holding user-defined pieces, as Gemma's
    does for whitespace and newline runs (and as `models import` rebuilds it from a GGUF)."""
    kinds = spm.ModelProto.SentencePiece
    pieces = [("<pad>", kinds.CONTROL), ("<eos>", kinds.CONTROL), ("<bos>", kinds.CONTROL), ("<unk>", kinds.UNKNOWN)]
    pieces += [(f"<0x{byte:02X}>", kinds.BYTE) for byte in range(256)]
    pieces += [("\u2581\u2581", kinds.USER_DEFINED), ("\n\n", kinds.USER_DEFINED)]
    pieces += [(piece, kinds.NORMAL) for piece in ("\u2581", "a", "b", "\u2581a", "\u2581b")]
    model = spm.ModelProto()
    model.trainer_spec.model_type = spm.TrainerSpec.BPE
    model.trainer_spec.byte_fallback = True
    model.normalizer_spec.add_dummy_prefix = False
    for piece, kind in pieces:
        # "\u2581\u2581" scores below "\u2581b": no merge builds it, only the user-defined rule keeps it whole.
        model.pieces.add(piece=piece, score=-100.0 if piece == "\u2581\u2581" else -1.0, type=kind)
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(model.SerializeToString())
    ids = {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
    config = AutoConfig.for_model("gemma3_text", vocab_size=len(pieces), **ids, **SHAPE, **GEMMA)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder, {piece: index for index, (piece, _) in enumerate(pieces)}


def test_user_defined_pieces_stay_whole_in_the_gguf(tmp_path):
    """llama.cpp's converter reads user-defined pieces only from tokenizer_config.json; a folder without that table
    (one `models import` wrote) must still keep them whole, or llama.cpp splits '  Glad' as ' ', ' Glad' where HF's
    Gemma tokenizer keeps '  ', 'Glad' (found on Gemma 3 270M: 1,407 of 2,500 strings differed)."""
    folder, ids = sentencepiece_gemma(tmp_path / "spm-gemma")
    gguf = convert(folder, tmp_path / "spm-gemma.F32.gguf", "F32")
    token_types = GGUFReader(gguf).fields["tokenizer.ggml.token_type"].contents()
    assert [token_types[ids["\u2581\u2581"]], token_types[ids["\n\n"]]] == [4, 4]  # USER_DEFINED
    model = LlamaModel(gguf, n_ctx=64, threads=1)
    assert model.tokenize("a  b") == [ids["a"], ids["\u2581\u2581"], ids["b"]]
    assert model.tokenize("a\n\nb") == [ids["a"], ids["\n\n"], ids["b"]]
    assert model.tokenize("a b") == [ids["a"], ids["\u2581b"]]
