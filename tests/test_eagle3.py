"""EAGLE-3 heads: trained on the tuned micro target, converted by llama.cpp's converter, run by llama.cpp's own loop
as `--spec-type draft-eagle3` with the target alone's answers, and measured offline exactly as llama.cpp accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from conftest import running
from test_serve import engine_answer

from spectune.acceptance.meter import simulate_tau
from spectune.acceptance.stage import AcceptanceConfig, load_models, run_acceptance
from spectune.bench.config import BenchConfig
from spectune.bench.llama_cpp_loop import llama_baseline, run_peer
from spectune.bench.run import bench
from spectune.data.prepare import read_prompts
from spectune.engines.handoff import HandoffConfig, hand_off, head_layers
from spectune.engines.llama_cpp import SERVER, SPECULATIVE_TOOL, build_llama_cpp
from spectune.engines.llama_server import free_port, speculation_flags
from spectune.errors import SpectuneError
from spectune.export.gguf import export_model
from spectune.export.pair import ExportPairConfig, export_pair
from spectune.runtime.chat import chat_tokens
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.draft_kinds import DRAFT_MODEL, EAGLE3_HEAD
from spectune.runtime.llama import LlamaModel, draft_kind
from spectune.runtime.ngram import NgramSettings
from spectune.runtime.registry import Variant
from spectune.runtime.speculative import SpeculativeDecoder
from spectune.serve.config import ServeConfig
from spectune.serve.engine import start_llama_server
from spectune.train.common import greedy_answer
from spectune.train.eagle3 import Batch, Eagle3Config, check_target, step_losses, target_features, train_eagle3
from spectune.train.eagle3_head import aux_layers, chain_matches, head_config, head_module

PROMPTS = 4
MAX_TOKENS = 24


def test_a_target_llama_cpp_takes_no_layer_inputs_from_is_refused_before_training(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3"}))
    (tmp_path / "model.safetensors").write_bytes(b"")  # what a model folder has; never read
    with pytest.raises(SpectuneError, match="'phi3'"):
        check_target(tmp_path)
    with pytest.raises(SpectuneError, match="'phi3'"):
        train_eagle3(Eagle3Config(target=tmp_path, data=tmp_path / "none.jsonl", out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_aux_layers_are_layer_inputs_the_target_has():
    assert aux_layers(30) == [2, 15, 27]  # llama.cpp's converter default for SmolLM2's 30 layers
    for layers in range(1, 8):
        assert all(0 <= layer < layers for layer in aux_layers(layers)) and len(aux_layers(layers)) == 3


def test_a_label_outside_the_draft_vocabulary_counts_as_a_miss_in_the_accuracy():
    # llama.cpp cannot accept a token the head cannot draft: leaving such labels out read 0.61 held-out top-1 for a
    # Qwen head whose first drafted token the target took 0.34 of the time
    import torch

    torch.manual_seed(0)
    target = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16}
    target |= {"rms_norm_eps": 1e-6, "vocab_size": 10, "rope_theta": 10000.0}
    draftable = torch.tensor([0, 1, 2])
    head = head_module(head_config(target, None, [0, 1, 2], 3), torch.randn(10, 8), draftable)
    to_draft = torch.full((10,), -1)
    to_draft[draftable] = torch.arange(3)
    row = (torch.randn(6, 24), torch.arange(6), torch.tensor([1, 2, 7, 8, 1, 2]), torch.ones(6, dtype=torch.long))
    batch = Batch([row], to_draft, 1)
    # rows 0-3 predict argmax[1..4] (2, 7, 8, 1: two not draftable); rows 4-5 have no assistant token after
    assert batch.labels[0].tolist() == [[2, -2, -2, 1, -1, -1]]
    [(hits, labels)] = step_losses(head, batch)[1]
    assert labels == 4 and hits <= 2


def test_a_chain_replay_verifies_each_start_positions_own_proposal():
    """A head's proposal depends on where it starts: the replay takes each step's flags from that position."""
    chains = {1: [True, True, False], 4: [False]}
    replay = simulate_tau([[False] * 5], 3, chains=lambda index, position: chains[position])
    # target's first token; from 1: two accepted + its correction (3 tokens); from 4: none + the target's token
    assert replay.steps == 3 and replay.tau == 5 / 3
    assert replay.reached == [2, 1, 1] and replay.accepted == [1, 1, 0]


def test_the_targets_hidden_states_are_computed_once_per_row_and_read_back_as_computed(tuned_target, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(tuned_target), dtype=torch.float32).eval()
    layers = aux_layers(target.config.num_hidden_layers)
    rows = [[1, 5, 9, 13, 17], [2, 4, 6]]
    first = target_features(target, tmp_path, layers, rows, "test")
    assert first.computed == 2 and len(list(tmp_path.glob("*.pt"))) == 2
    again = target_features(target, tmp_path, layers, [rows[1], [3, 3, 3], rows[0]], "test")
    assert again.computed == 1  # only the new row: a run on more dialogues reuses the ones before
    for ids, (cached, argmax) in zip(rows, (again.rows[2], again.rows[0]), strict=True):
        with torch.no_grad():
            out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
        fresh = torch.cat([out.hidden_states[layer][0] for layer in layers], -1)
        assert torch.equal(argmax, out.logits[0].argmax(-1))
        assert torch.allclose(cached, fresh, rtol=1e-3, atol=1e-3)  # float16 on disk, the layers in order


@pytest.fixture(scope="module")
def head(tuned_target, demo_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eagle3")
    steps = {"max_steps": 40, "save_steps": 20}  # a checkpoint halfway: a point of the curve
    settings = {"batch_size": 8, "max_seq_length": 256, "max_eval": 16}
    result = train_eagle3(Eagle3Config(target=tuned_target, data=demo_data, out=out, **steps, **settings))
    assert result.accuracy_after[0] > result.accuracy_before[0] + 0.2  # it learned the target's next tokens
    # the curve: the start, the checkpoint at 20 steps (measured there, not at the end), the end
    assert list(result.accuracy_by_steps) == [0, 20, 40] and result.accuracy_by_steps[40] == result.accuracy_after
    assert result.accuracy_by_steps[20] != result.accuracy_after
    assert json.loads((result.model / "config.json").read_text())["draft_vocab_size"] == result.draft_vocab_size
    return result.model


def heads_in_llama_cpp_accept_what_the_meter_says(
    target_dir: Path, head: Path, target_gguf: Path, head_gguf: Path, demo_data: Path, replayed: bool = True
) -> int:
    """llama.cpp's loop with the head gives the target alone's answers and (`replayed`) accepts, prompt by prompt, as
    many drafted tokens as the meter's replay of the head in torch on the target's own answers; returns the accepted
    tokens."""
    target, models, heads, tokenizer = load_models(target_dir, {"eagle3": head})
    assert not models and list(heads) == ["eagle3"]
    tool = build_llama_cpp() / SPECULATIVE_TOOL
    flags = speculation_flags(head_gguf, 4, 1)
    assert flags[flags.index("--spec-type") + 1] == "draft-eagle3"  # the GGUF says what it is
    accepted = 0
    with llama_baseline(target_gguf, 1, 1024, exact=True) as alone:
        for prompt in read_prompts(demo_data)[-PROMPTS:]:
            text = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
            run = run_peer(tool, target_gguf, head_gguf, text, 4, MAX_TOKENS, 1, 1024, exact=True)
            assert run.text == alone(text, MAX_TOKENS).text
            accepted += run.accepted
            if not replayed:
                continue
            ids, answer = greedy_answer(target, tokenizer, prompt.messages, MAX_TOKENS)
            chains = chain_matches(heads["eagle3"], target, ids, answer)
            replay = simulate_tau([[False] * len(answer)], 4, chains=lambda index, position, c=chains: c[position])
            assert run.accepted == sum(replay.accepted)
    return accepted


def our_loop_accepts(target_gguf: Path, head_gguf: Path, demo_data: Path) -> int:
    """spectune's loop with the head gives the target alone's answers; the drafted tokens it accepted, counted as
    llama.cpp counts them."""
    target = LlamaModel(target_gguf, n_ctx=1024, threads=1)
    head = LlamaModel(head_gguf, n_ctx=1024, threads=1, beside=target)
    ours = SpeculativeDecoder(target, Variant(draft="eagle3").speculators(target, head, {}))
    alone = SpeculativeDecoder(LlamaModel(target_gguf, n_ctx=1024, threads=1))
    accepted = 0
    for prompt in read_prompts(demo_data)[-PROMPTS:]:
        tokens = chat_tokens(target, prompt.messages)
        generation = ours.generate(tokens, DecodeSettings(max_tokens=MAX_TOKENS, draft_max=4))
        assert generation.tokens == alone.generate(tokens, DecodeSettings(max_tokens=MAX_TOKENS)).tokens
        accepted += generation.stats.accepted_as_llama_cpp
        ours.forget()
    return accepted


def test_the_head_drafts_in_llama_cpp_with_the_target_alones_answers_accepting_what_the_meter_says(
    head, tuned_target, demo_data, tmp_path
):
    """F32 GGUFs: every answer is the target alone's, and llama.cpp accepts exactly as many drafted tokens as the
    offline meter's replay of the head on the target's own answers (the head in torch is llama.cpp's graph)."""
    with pytest.raises(SpectuneError, match="target-model-dir"):
        export_model(head, tmp_path / "lost.gguf", "F32")  # the converter needs the target's tokenizer and config
    target_gguf = export_model(tuned_target, tmp_path / "target.gguf", "F32")
    head_gguf = export_model(head, tmp_path / "head.gguf", "F32", target_model_dir=tuned_target)
    assert draft_kind(head_gguf) is EAGLE3_HEAD and draft_kind(target_gguf) is DRAFT_MODEL
    with pytest.raises(SpectuneError, match="beside its target"):
        LlamaModel(head_gguf)  # it borrows the target's embeddings and reads its layer inputs
    in_llama_cpp = heads_in_llama_cpp_accept_what_the_meter_says(tuned_target, head, target_gguf, head_gguf, demo_data)
    assert in_llama_cpp > 0
    # the same steps as llama.cpp's but the last, where ours drafts no further than the token limit (up to k less)
    ours = our_loop_accepts(target_gguf, head_gguf, demo_data)
    assert 0 < ours <= in_llama_cpp and ours >= in_llama_cpp - 4 * PROMPTS
    # spectune's bench takes it as any draft, alone and behind n-gram lookup: its c measured beside the target
    config = BenchConfig(
        target=target_gguf, drafts={"eagle3": head_gguf}, data=demo_data, out=tmp_path / "bench", n=2, repeats=1,
        max_tokens=16, draft_max=2, threads=1, plot=False, ngram=NgramSettings(),
    )  # fmt: skip
    summaries = bench(config)["summary"]
    for variant in ("eagle3", "ngram+eagle3"):
        assert summaries[variant]["identical"] == 2 and summaries[variant]["cost_ratio"] > 0
    assert summaries["eagle3"]["acceptance"] > 0
    report = run_acceptance(
        AcceptanceConfig(target=tuned_target, drafts={"eagle3": head}, data=demo_data, n=PROMPTS, max_tokens=32)
    )
    row = report["drafts"][0]
    assert row["name"] == "eagle3" and row["alpha"] > 0.2 and row["tau_simulated"]["4"] > 1.1


def handed_off_as_each_engine_reads_a_head(run: Path, head: Path) -> None:
    """vLLM takes the head's layers as they are (layer inputs), SGLang from eagle_config, each minus one; the run's
    own head is left as it was (the hand-off's folder hard-links its files)."""
    layers = json.loads((head / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    for engine, algorithm in (("vllm", '"method": "eagle3"'), ("sglang", "--speculative-algorithm EAGLE3")):
        report = hand_off(HandoffConfig(run=run, engine=engine))
        assert report["eagle3"] and report["head_layers"] == layers and algorithm in report["command"]
        handed = json.loads((run / "handoff" / engine / "draft" / "config.json").read_text())
        assert handed["eagle_aux_hidden_state_layer_ids"] == layers
        assert handed.get("eagle_config") == ({"eagle_aux_hidden_state_layer_ids": [layer - 1 for layer in layers]}
                                              if engine == "sglang" else None)  # fmt: skip
    assert "eagle_config" not in json.loads((head / "config.json").read_text())


def test_an_engine_that_runs_no_head_beside_the_target_is_refused_saying_which_it_runs(tmp_path):
    target, head = tmp_path / "target", tmp_path / "head"
    for folder, config in (
        (target, {"architectures": ["Gemma3ForCausalLM"]}),
        (head, {"eagle_aux_hidden_state_layer_ids": [0, 9, 15]}),
    ):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpectuneError, match=r"vllm 0.33.0 runs EAGLE-3 heads beside Llama.*, not Gemma3ForCausalLM"):
        head_layers("vllm", target, head)
    with pytest.raises(SpectuneError, match="SGLang cannot capture layer 0's input"):
        head_layers("sglang", target, head)
    (head / "config.json").write_text("{}")
    with pytest.raises(SpectuneError, match="no eagle_aux_hidden_state_layer_ids"):
        head_layers("sglang", target, head)


def test_a_run_serving_its_head_serves_it_in_spectune_and_in_llama_server(
    head, tuned_target, demo_data, messages, tmp_path
):
    """export_pair exports the head beside the target; spectune's own server drafts with it and answers as the target
    alone; a pair that names it runs llama-server with draft-eagle3, which does the same; vLLM and SGLang are handed
    it in the layout each reads."""
    from openai import OpenAI

    gguf = tmp_path / "run" / "gguf"
    config = ExportPairConfig(target=tuned_target, drafts={"eagle3": head}, out=gguf, data=demo_data)
    config = config.model_copy(update={"fidelity_dialogues": 2})
    report = export_pair(config)
    assert report["models"]["eagle3"]["eagle3"] and report["chosen"]["eagle3"]
    assert "--spec-type draft-eagle3" in (gguf / "llama-server.sh").read_text()
    target = gguf / report["chosen"]["target"]
    ours = ServeConfig(run=tmp_path / "run", mode="speculative", n_ctx=512, threads=1)
    with running(ours) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        reply = client.chat.completions.create(model="spectune", messages=messages, max_tokens=24, temperature=0)
        metrics = httpx.get(f"{url}/metrics").text
    assert reply.choices[0].message.content == engine_answer((target, None), messages, 24)
    drafted = re.search(r"^spectune_acceptance_rate (\S+)$", metrics, re.M)
    assert drafted is not None and float(drafted.group(1)) > 0  # the head drafted, and the target kept some
    handed_off_as_each_engine_reads_a_head(tmp_path / "run", head)
    served = ServeConfig(
        run=tmp_path / "run", engine="llama.cpp", llama_server=build_llama_cpp() / SERVER, port=free_port(),
        n_ctx=512, threads=1,
    )  # fmt: skip
    with open(tmp_path / "server.log", "w+") as log, start_llama_server(served, log) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        reply = client.chat.completions.create(model="spectune", messages=messages, max_tokens=24, temperature=0)
        metrics = httpx.get(f"{server.url}/metrics").text
    assert reply.choices[0].message.content == engine_answer((target, None), messages, 24)
    assert "loading draft model" in (tmp_path / "server.log").read_text()
    drafted = re.search(r"^llamacpp:spec_decode_num_draft_tokens_total (\S+)$", metrics, re.M)
    assert drafted is not None and float(drafted.group(1)) > 0  # the head drafted
