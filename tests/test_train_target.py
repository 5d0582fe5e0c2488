"""QLoRA fine-tuning of the target on the micro pair, merge, resume, and the memory planner."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli

from spectune.data.prepare import extract_prompts
from spectune.data.read import read_dialogues
from spectune.errors import SpectuneError
from spectune.gpu.card import reference_card
from spectune.models.load import load_tokenizer
from spectune.train.common import greedy_answer
from spectune.train.plan import (
    GIB,
    cost_ratio,
    estimate,
    largest_fit,
    parse_memory,
    plan_report,
    read_shape,
    step_weights,
)
from spectune.train.target import FinetuneConfig, MergeConfig, finetune, load_base, merge

FAST = {"max_steps": 12, "lr": 3e-3, "batch_size": 4, "max_seq_length": 256, "max_eval": 24, "lora_r": 8}


@pytest.fixture(scope="module")
def tuned(micro_pair, demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("finetune")
    return finetune(FinetuneConfig(model=micro_pair / "target", data=demo_data, out=out, **FAST)), out


def test_qlora_lowers_eval_loss_and_reports(tuned):
    result, out = tuned
    # read off the model trained, not the setting: every linear layer of the 2 blocks (q, k, v, o, gate, up, down)
    assert result.four_bit and result.nf4_linear_layers == 7 * 2
    assert result.eval_loss_after < result.eval_loss_before - 0.5
    assert 0 < result.trainable_parameters < result.total_parameters / 10
    assert result.adapter_bytes > 0 and (out / "adapter" / "adapter_model.safetensors").is_file()
    assert result.peak_memory_bytes > 0 and result.steps == FAST["max_steps"]
    report = json.loads((out / "finetune.json").read_text())
    assert report["result"]["eval_loss_after"] == result.eval_loss_after


def test_4bit_base_really_is_nf4(micro_pair):
    import bitsandbytes as bnb

    model = load_base(micro_pair / "target", four_bit=True)
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, bnb.nn.Linear4bit)
    assert layer.weight.quant_state.quant_type == "nf4"


def test_adapter_reloads_to_the_trained_model(tuned, micro_pair, demo_data):
    """The saved adapter on a freshly loaded 4-bit base gives exactly the trained model's eval loss."""
    from peft import PeftModel
    from trl import SFTConfig, SFTTrainer

    from spectune.models.load import load_tokenizer
    from spectune.train.common import load_task_data, trainer_settings

    result, out = tuned
    config = FinetuneConfig(model=micro_pair / "target", data=demo_data, out=out, **FAST)
    tokenizer = load_tokenizer(config.model)
    data = load_task_data(tokenizer, config)
    reloaded = PeftModel.from_pretrained(load_base(config.model, four_bit=True), str(out / "adapter"))
    settings = trainer_settings(config.model_copy(update={"out": out / "reload"}))
    trainer = SFTTrainer(
        model=reloaded,
        args=SFTConfig(**settings),
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
    )
    reloaded_loss = trainer.evaluate()["eval_loss"]
    # Equal up to float reassociation (prepare_model_for_kbit_training's casts differ from a plain reload).
    assert reloaded_loss == pytest.approx(result.eval_loss_after, rel=1e-4)
    assert result.eval_loss_before - reloaded_loss > 0.5  # and far from the base without the adapter


def test_merge_gives_the_model_as_trained(tuned, micro_pair, demo_data, tmp_path):
    """Merged into the NF4 base it was trained on (dequantized): the merged model answers as the trained one."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, out = tuned
    merged = merge(MergeConfig(base=micro_pair / "target", adapter=out / "adapter", out=tmp_path / "merged"))
    assert merged.max_logit_diff < 1e-3 and merged.merged_into == "nf4 base, dequantized"
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    trained = PeftModel.from_pretrained(load_base(micro_pair / "target", four_bit=True), str(out / "adapter")).eval()
    tokenizer = load_tokenizer(tmp_path / "merged")
    prompts = extract_prompts(read_dialogues(demo_data).dialogues, 6, seed=3)
    for prompt in prompts:
        ids, answer = greedy_answer(model, tokenizer, prompt.messages, 24)
        assert answer == greedy_answer(trained, tokenizer, prompt.messages, 24)[1]
        with torch.no_grad():  # and not only the argmax: merged into the unquantized base they differed by 0.48
            sequence = torch.tensor([ids + answer])
            difference = (model(sequence).logits - trained(sequence).logits).abs().max()
        assert difference < 1e-3


def test_resume_continues_from_the_saved_step(micro_pair, demo_data, tmp_path):
    from safetensors.torch import load_file

    def run(out, **extra):
        settings = {**FAST, "max_steps": 6, "save_steps": 3, **extra}
        return finetune(FinetuneConfig(model=micro_pair / "target", data=demo_data, out=out, **settings))

    run(tmp_path / "straight")
    interrupted = tmp_path / "interrupted"
    run(interrupted)
    # As if killed after the checkpoint at step 3: later state is gone.
    import shutil

    shutil.rmtree(interrupted / "checkpoints" / "checkpoint-6")
    shutil.rmtree(interrupted / "adapter")
    resumed = run(interrupted, resume=True)
    assert resumed.steps == 6
    state = json.loads((interrupted / "checkpoints" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    straight = load_file(str(tmp_path / "straight" / "adapter" / "adapter_model.safetensors"))
    again = load_file(str(interrupted / "adapter" / "adapter_model.safetensors"))
    assert straight.keys() == again.keys()
    for key in straight:
        assert torch.allclose(straight[key], again[key], atol=1e-5), key


def test_bad_inputs_exit_2_and_write_nothing(micro_pair, demo_data, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_cli("finetune", "--model", str(tmp_path / "absent"), "--data", str(demo_data), "--out", str(out)) == 2
    assert "no such model folder" in capsys.readouterr().err
    with pytest.raises(SpectuneError, match="no trainable tokens"):
        finetune(FinetuneConfig(model=micro_pair / "target", data=demo_data, out=out, max_seq_length=16))
    with pytest.raises(SpectuneError, match="larger than the narrowest layer"):
        finetune(FinetuneConfig(model=micro_pair / "target", data=demo_data, out=out, lora_r=4096))
    assert not (out / "adapter").exists()
    config = tmp_path / "bad.yaml"
    config.write_text("model: x\nlora_r: -1\nunknown_key: 3\n")
    assert run_cli("finetune", "--config", str(config)) == 2
    err = capsys.readouterr().err
    assert "[lora_r]" in err and "[unknown_key]" in err and "[data]" in err


def test_no_chat_template_is_a_clear_error(micro_pair, demo_data, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(micro_pair / "target", model)
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(SpectuneError, match="no chat template"):
        finetune(FinetuneConfig(model=model, data=demo_data, out=tmp_path / "o", **FAST))


GEMMA = "tests/data/gemma3-12b-config.json"


def test_planner_reproduces_the_reference_facts():
    shape = read_shape(GEMMA)
    assert abs(shape.params - 11_765_788_416) / 11_765_788_416 < 1e-3  # published Gemma 3 12B text size
    report = plan_report(shape, parse_memory("16GiB"), seq=1024, batch=1, rank=16, context=8192)
    numbers = report["estimate"]
    assert 23e9 < numbers["f16_weights"] < 25e9  # "the f16 model is 24 GB"
    assert not report["fits"]["f16 weights load"]
    assert report["fits"]["QLoRA training, gradient checkpointing"]  # "the 4-bit one fits"
    assert numbers["nf4_weights"] < 0.4 * numbers["f16_weights"]
    assert 125e6 < numbers["adapter_bytes_bf16"] < 137e6  # the reference adapter: 131 MB
    assert report["fits"]["Q4_K_M inference"]


def test_planner_gives_the_reference_pair_s_cost_ratio(tmp_path):
    # Gemma 3 1B drafting for 12B: by what a step reads (both tied: the parameter ratio) near 0.085, and on the
    # reference card dearer, each layer's floor counted: what `spectune predict --story` says of the same pair
    target, draft = read_shape(GEMMA), read_shape("tests/data/gemma3-1b-config.json")
    c = cost_ratio(target, draft)
    assert c["bytes"] == pytest.approx(draft.params / target.params) and 0.08 < c["bytes"] < 0.09
    assert c["on_card_band"][0] <= c["on_card"] <= c["on_card_band"][1] and "predicted" in c["card"]
    assert c["on_card"] == pytest.approx(reference_card().cost_ratio(step_weights(draft), step_weights(target)))
    assert 0.15 < c["on_card"] < 0.2
    assert (
        run_cli(
            "plan",
            "--model",
            GEMMA,
            "--draft",
            "tests/data/gemma3-1b-config.json",
            "--json-out",
            str(tmp_path / "p.json"),
        )
        == 0
    )
    assert json.loads((tmp_path / "p.json").read_text())["draft"]["cost_ratio"]["bytes"] < 0.09


def test_planner_rules():
    shape = read_shape(GEMMA)
    small = estimate(shape, seq=512, batch=1, rank=16, context=1024)
    large = estimate(shape, seq=2048, batch=1, rank=16, context=4096)
    assert large.activations == 4 * small.activations  # linear in tokens (no s² term with SDPA)
    assert large.kv_cache == 4 * small.kv_cache
    assert small.activations_checkpointed < small.activations
    assert estimate(shape, seq=512, batch=1, rank=32, context=1).lora_params == 2 * small.lora_params
    fits_16 = largest_fit(shape, 16 * GIB, rank=16, batch=1, checkpointing=True)
    fits_24 = largest_fit(shape, 24 * GIB, rank=16, batch=1, checkpointing=True)
    assert 0 < fits_16 < fits_24
    assert largest_fit(shape, 4 * GIB, rank=16, batch=1, checkpointing=True) == 0
    assert parse_memory("16GiB") == 16 * GIB and parse_memory("24 GB") == 24 * 10**9
    with pytest.raises(SpectuneError):
        parse_memory("lots")


def test_plan_cli_on_a_model_folder(micro_pair, capsys):
    assert run_cli("plan", "--model", str(micro_pair / "target"), "--gpu-mem", "1GiB", "--max-seq-length", "256") == 0
    assert "fits in 1GiB: QLoRA training" in capsys.readouterr().out
