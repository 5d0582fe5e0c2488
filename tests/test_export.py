"""Export: GGUF conversion and quantization, pair checks, fidelity, atomic writes, bad inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_cli, swap_two_tokens

from spectune.data.read import read_dialogues
from spectune.engines.handoff import HandoffConfig, hand_off
from spectune.engines.llama_cpp import build_llama_cpp
from spectune.errors import SpectuneError
from spectune.export.gguf import convert, export_model
from spectune.export.pair import TOKENIZER_DIALOGUES, ExportPairConfig, closeness, export_pair, fidelity, write_pair
from spectune.models.load import load_tokenizer
from spectune.models.tokenizer_check import STRESS_STRINGS
from spectune.runtime.llama import LlamaModel
from spectune.runtime.ngram import NgramSettings
from spectune.runtime.pair import check_pair
from spectune.serve.config import ServeConfig


@pytest.fixture(scope="module")
def exported(tuned_target, sft_draft, demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    config = ExportPairConfig(
        target=tuned_target, drafts={"draft": sft_draft}, out=out, data=demo_data, fidelity_dialogues=6, keep_f16=True
    )
    return export_pair(config), out


def test_export_pair_checks_and_reports(exported, demo_data):
    report, out = exported
    held_out = min(TOKENIZER_DIALOGUES, len(read_dialogues(demo_data).dialogues))
    for role in ("target", "draft"):
        entry = report["models"][role]
        assert entry["bytes"] < entry["f16_bytes"]  # 4 bits is smaller than 16
        assert entry["tokenizer_strings_checked"] == STRESS_STRINGS + held_out
        assert entry["fidelity"]["top1_agreement"] > 0.9
        # 4 bits cost a tiny model more than a large one (few weights share each scale); the bound is there to
        # catch a broken conversion (wrong tensor order, a lost norm), which costs far more than rounding
        assert entry["fidelity"]["perplexity_gguf"] < 1.2 * entry["fidelity"]["perplexity_hf"]
    assert report["pairs"]["draft"]["target_tokens"] == report["pairs"]["draft"]["draft_tokens"]
    script = (out / "llama-server.sh").read_text()
    assert "--spec-type draft-simple" in script and "--spec-draft-n-max 8" in script  # no acceptance report: k = 8
    assert "--draft-max" not in script  # removed from the pinned llama.cpp
    assert json.loads((out / "pair.json").read_text())["draft_name"] == "draft"
    assert json.loads((out / "export.json").read_text())["quant"] == "Q4_K_M"


def test_the_pair_served_carries_ngram_lookup_where_it_predicts_best(exported, tuned_target, sft_draft, demo_data):
    """An acceptance report where lookup in front of the draft predicts best on a GPU: pair.json names it (its
    settings, its domain answers relative to the folder), llama-server.sh runs llama.cpp's ngram-simple before the
    draft, and `spectune serve --run` serves it; vLLM is handed the draft alone at the draft's own k."""
    _, out = exported
    run = out.parent / "run-with-ngram"
    (run / "gguf").mkdir(parents=True)
    for name in ("target", "draft"):
        (run / "gguf" / f"{name}.Q4_K_M.gguf").symlink_to(out / f"{name}.Q4_K_M.gguf")
    settings = NgramSettings(min_n=3)
    acceptance = {
        "drafts": [
            {"name": "draft", "recommended_k": 2, "speedup": {"gpu": {"2": 1.4}}},
            {"name": "ngram+draft", "recommended_k": 4, "speedup": {"gpu": {"4": 1.9}}},
            {"name": "ngram", "recommended_k": 8, "speedup": {"gpu": {"8": 2.5}}},  # measured, not servable alone
        ],
        "ngram": settings.model_dump(),
        "ngram_data": str(demo_data),
    }
    config = ExportPairConfig(target=tuned_target, drafts={"draft": sft_draft}, out=run / "gguf")
    chosen = write_pair(config, acceptance)["chosen"]
    assert (chosen["draft_name"], chosen["k"], chosen["ngram"]) == ("draft", 4, settings.model_dump())
    handed = hand_off(HandoffConfig(run=run, engine="vllm"))  # vLLM chains no lookup: the draft alone, at its own k
    assert (
        handed["lookup_left_out"]
        and handed["k"] == chosen["draft_k"] == 2
        and '"num_speculative_tokens": 2' in (handed["command"])
    )
    assert (run / "gguf" / chosen["ngram_data"]).resolve() == demo_data.resolve()
    script = (run / "gguf" / "llama-server.sh").read_text()
    assert "--spec-type ngram-simple,draft-simple" in script and "--spec-ngram-simple-size-n 3" in script
    served = ServeConfig(run=run)
    assert served.ngram == settings and served.ngram_data.resolve() == demo_data.resolve() and served.draft_max == 4
    assert ServeConfig(run=run, engine="llama.cpp").ngram_data is None  # llama-server looks up the conversation
    plain = write_pair(config, {**acceptance, "drafts": acceptance["drafts"][:1]})["chosen"]
    assert plain["ngram"] is None and plain["draft_k"] is None and ServeConfig(run=run).ngram is None


def test_q4_k_m_loads_and_generates(exported):
    from spectune.runtime.decode import DecodeSettings
    from spectune.runtime.speculative import SpeculativeDecoder

    _, out = exported
    model = LlamaModel(out / "target.Q4_K_M.gguf", n_ctx=256, threads=1)
    generation = SpeculativeDecoder(model).generate(
        model.tokenize("<|im_start|>user\nHi<|im_end|>\n"), DecodeSettings(max_tokens=8)
    )
    assert generation.stats.generated == len(generation.tokens) > 0


def test_f32_fidelity_is_exact(tuned_target, tmp_path):
    gguf = convert(tuned_target, tmp_path / "t.f32.gguf", "F32")
    result = fidelity(tuned_target, gguf, ["<|im_start|>user\nWhere is my order?<|im_end|>\n<|im_start|>assistant\n"])
    assert result["top1_agreement"] == 1.0
    assert result["perplexity_gguf"] == pytest.approx(result["perplexity_hf"], rel=1e-3)


def test_pair_with_a_modified_vocabulary_is_refused(exported, sft_draft, tmp_path):
    _, out = exported
    other = swap_two_tokens(sft_draft, tmp_path / "other")
    modified = convert(other, tmp_path / "other.gguf", "F16")
    with pytest.raises(SpectuneError, match="token 300 differs") as caught:
        check_pair(out / "target.Q4_K_M.gguf", modified)
    assert "target b'" in str(caught.value) and "draft b'" in str(caught.value)  # both texts are shown
    check_pair(out / "target.Q4_K_M.gguf", out / "draft.Q4_K_M.gguf")  # the real pair passes


def test_interrupted_export_leaves_no_final_file(sft_draft, tmp_path, monkeypatch):
    import llama_cpp

    def crash(source, destination, params):
        with open(destination, "wb") as handle:
            handle.write(b"GGUF partial")
        raise KeyboardInterrupt  # Ctrl-C in the middle of quantization

    monkeypatch.setattr(llama_cpp, "llama_model_quantize", crash)
    final = tmp_path / "draft.Q4_K_M.gguf"
    with pytest.raises(KeyboardInterrupt):
        export_model(sft_draft, final, "Q4_K_M")
    assert list(tmp_path.iterdir()) == []


def test_bad_inputs(sft_draft, tmp_path, capsys):
    with pytest.raises(SpectuneError, match=r"unknown quant type 'Q3_X'"):
        export_model(sft_draft, tmp_path / "x.gguf", "Q3_X")
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(sft_draft, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(SpectuneError, match=r"no tokenizer\.json or tokenizer\.model"):
        export_model(no_tokenizer, tmp_path / "x.gguf", "F16")
    alien = tmp_path / "alien"
    shutil.copytree(sft_draft, alien)
    config = json.loads((alien / "config.json").read_text())
    config["architectures"] = ["TotallyNewForCausalLM"]
    (alien / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpectuneError, match=r"TotallyNewForCausalLM.*not supported.*LlamaForCausalLM"):
        export_model(alien, tmp_path / "x.gguf", "F16")
    assert not (tmp_path / "x.gguf").exists()
    assert run_cli("export", "--model", str(tmp_path / "absent"), "--out", str(tmp_path / "y.gguf")) == 2


def test_an_importance_matrix_from_the_task_weights_the_quantization(tuned_target, demo_data, tmp_path):
    """Quantized with a matrix of the model on the task's dialogues: other rounding than plain, a working GGUF as
    faithful to the HF weights, and the matrix computed once per model and text."""
    build_llama_cpp()  # llama-imatrix and llama-quantize (cached)
    tokenizer = load_tokenizer(tuned_target)
    dialogues = read_dialogues(demo_data).dialogues
    text = "\n".join(tokenizer.apply_chat_template(d.messages, tokenize=False) for d in dialogues[:200])
    report: dict = {}
    weighted = export_model(tuned_target, tmp_path / "w.gguf", "Q4_K_M", calibration=text, report=report)
    plain = export_model(tuned_target, tmp_path / "p.gguf", "Q4_K_M")
    assert Path(report["imatrix"]["file"]).is_file() and weighted.read_bytes() != plain.read_bytes()
    held_out = [tokenizer.apply_chat_template(d.messages, tokenize=False) for d in dialogues[-6:]]
    assert fidelity(tuned_target, weighted, held_out)["top1_agreement"] > 0.9
    again: dict = {}
    export_model(tuned_target, tmp_path / "w2.gguf", "Q4_K_M", calibration=text, report=again)
    assert again["imatrix"] == report["imatrix"] | {"seconds": 0.0}  # from the cache
    assert (tmp_path / "w2.gguf").read_bytes() == weighted.read_bytes()
    with pytest.raises(SpectuneError, match="no calibration text"):
        export_model(tuned_target, tmp_path / "e.gguf", "Q4_K_M", calibration="  ")
    assert not (tmp_path / "e.gguf").exists()


def test_the_pair_export_quantizes_with_each_models_matrix_where_training_dialogues_are_given(
    tuned_target, sft_draft, demo_data, tmp_path
):
    build_llama_cpp()
    config = ExportPairConfig(
        target=tuned_target, drafts={"draft": sft_draft}, out=tmp_path, data=demo_data, calibration_data=demo_data
    )
    report = export_pair(config)
    matrices = {role: report["models"][role]["imatrix"]["file"] for role in ("target", "draft")}
    assert len(set(matrices.values())) == 2  # each model its own
    assert report["imatrix"]["used"] is True
    # Weighted and plain compared by fidelity on the held-out dialogues: the closer file is the one on disk
    for role, folder in (("target", tuned_target), ("draft", sft_draft)):
        entry, weighing = report["models"][role], report["models"][role]["imatrix"]
        assert entry["fidelity"] == max(weighing["weighted_fidelity"], weighing["plain_fidelity"], key=closeness)
        assert entry["fidelity"] == weighing["weighted_fidelity" if weighing["kept"] else "plain_fidelity"]
        tokenizer = load_tokenizer(folder)
        texts = [tokenizer.apply_chat_template(d.messages, tokenize=False) for d in read_dialogues(demo_data).dialogues]
        assert fidelity(folder, Path(entry["gguf"]), texts[: config.fidelity_dialogues]) == entry["fidelity"]
    # nothing left beside the GGUFs: no F16, no plain file
    assert sorted(path.name for path in tmp_path.iterdir() if ".gguf" in path.name) == [
        "draft.Q4_K_M.gguf",
        "target.Q4_K_M.gguf",
    ]
    off = export_pair(config.model_copy(update={"imatrix": "off", "out": tmp_path / "off"}))
    assert "imatrix" not in off["models"]["target"] and off["imatrix"] == {"used": False, "why": "imatrix off"}
