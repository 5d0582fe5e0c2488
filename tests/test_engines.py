"""llama.cpp's own llama-server on the tuned micro pair, for real: built from the pinned sources once per user cache
(~10 minutes on 2 cores, shared with the bench's peer), started by `spectune serve --engine llama.cpp`'s code,
asked through the official openai client, and stopped."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import run_cli, swap_two_tokens
from test_serve import engine_answer

from spectune.engines.handoff import HandoffConfig, hand_off
from spectune.engines.llama_cpp import SERVER, build_llama_cpp
from spectune.engines.llama_server import free_port
from spectune.errors import SpectuneError
from spectune.serve.config import ServeConfig
from spectune.serve.engine import start_llama_server

KEY = "sk-engine-test"


@pytest.fixture(scope="module")
def llama_server():
    return build_llama_cpp() / SERVER


def port_is_free(port: int) -> bool:
    """Whether a new server could listen on `port` (as servers do, past the closed connections' TIME_WAIT)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {name: float(value) for name, value in re.findall(r"^llamacpp:(spec_decode_\w+_total) (\S+)$", text, re.M)}


def test_llama_server_serves_the_tuned_pair_with_the_targets_own_answers(llama_server, pair, messages, tmp_path):
    from openai import AuthenticationError, OpenAI

    target, draft = pair
    port = free_port()
    config = ServeConfig(
        target=target, draft=draft, draft_max=4, engine="llama.cpp", llama_server=llama_server, port=port,
        api_key=KEY, n_ctx=512, threads=1, max_tokens=6,
    )  # fmt: skip
    with open(tmp_path / "server.log", "w+") as log, start_llama_server(config, log) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
        reply = client.chat.completions.create(model="spectune", messages=messages, max_tokens=24, temperature=0)
        text = reply.choices[0].message.content
        timings = reply.model_extra["timings"]
        stream = client.chat.completions.create(
            model="spectune", messages=messages, max_tokens=24, temperature=0, stream=True
        )
        streamed = "".join(part.choices[0].delta.content or "" for part in stream if part.choices)
        # what a request leaves unset is the server's: its answer length (-n) and greedy decoding (--temp 0)
        unset = client.chat.completions.create(model="spectune", messages=messages).choices[0].message.content
        counters = spec_counters(server.url)
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{server.url}/v1", api_key="wrong").models.list()
        assert "--spec-type" in server.command and "--no-repack" in server.command
    # The draft was used (llama.cpp's own counts) and changed nothing: the answer is spectune's greedy target's.
    assert timings["draft_n"] > 0 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    assert counters["spec_decode_num_draft_tokens_total"] >= timings["draft_n"]
    assert text == engine_answer(pair, messages, 24) and streamed == text
    assert unset == engine_answer(pair, messages, 6)
    assert server.process.returncode is not None and wait_until(lambda: port_is_free(port))


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie waiting for its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(condition, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_serve_command_leaves_no_llama_server_behind(llama_server, pair, how):
    """`spectune serve --engine llama.cpp` as a user runs it: ready, then stopped (SIGTERM, as a service manager
    does) or killed outright; either way llama-server goes with it and its port is free again."""
    port = free_port()
    command = [sys.executable, "-m", "spectune.cli", "serve", "--engine", "llama.cpp", "--target", str(pair[0])]
    command += ["--draft", str(pair[1]), "--llama-server", str(llama_server), "--port", str(port), "--threads", "1"]
    parent = subprocess.Popen([*command, "--n-ctx", "512"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in parent.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "ready at" in line:
                break
        assert lines and "ready at" in lines[-1], "".join(lines[-20:])
        child = int(re.search(r"pid (\d+)", lines[-1]).group(1))  # type: ignore[union-attr]
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        parent.send_signal(how)
        assert parent.wait(30) == (0 if how == signal.SIGTERM else -signal.SIGKILL)
    finally:
        parent.kill()
    assert wait_until(lambda: not alive(child))
    assert wait_until(lambda: port_is_free(port))


def test_settings_of_spectunes_own_server_are_refused_for_llama_cpp(pair):
    with pytest.raises(ValueError, match="max_seconds: settings of spectune's own server"):
        ServeConfig(target=pair[0], engine="llama.cpp", max_seconds=5)
    with pytest.raises(ValueError, match="stop: settings of spectune's own server"):
        ServeConfig(target=pair[0], engine="llama.cpp", stop=["\n"])


def finished_run(folder: Path, target: Path, draft: Path) -> Path:
    """A run folder as `spectune run` leaves it, as far as hand-off reads it (gguf/pair.json)."""
    chosen = {"target": "t.gguf", "draft": "d.gguf", "draft_name": "sft", "k": 5}
    (folder / "gguf").mkdir(parents=True)
    (folder / "gguf" / "pair.json").write_text(json.dumps(chosen | {"target_hf": str(target), "draft_hf": str(draft)}))
    return folder


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_export_for_an_engine_writes_loadable_folders_and_its_command(tuned_target, sft_draft, tmp_path, engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = finished_run(tmp_path / "run", tuned_target, sft_draft)
    assert run_cli("export", "--for", engine, str(run)) == 0
    out = run / "handoff" / engine
    report = json.loads((out / "handoff.json").read_text())
    command = shlex.split(report["command"])
    for role, source in (("target", tuned_target), ("draft", sft_draft)):
        model = AutoModelForCausalLM.from_pretrained(out / role)  # the engines load these folders the same way
        assert model.config.vocab_size == AutoModelForCausalLM.from_pretrained(source).config.vocab_size
        assert (
            AutoTokenizer.from_pretrained(out / role).get_vocab() == AutoTokenizer.from_pretrained(source).get_vocab()
        )
    if engine == "vllm":
        assert command[:3] == ["vllm", "serve", str(out / "target")]
        speculative = json.loads(command[command.index("--speculative-config") + 1])
        assert speculative == {"method": "draft_model", "model": str(out / "draft"), "num_speculative_tokens": 5}
    else:
        assert command[command.index("--speculative-algorithm") + 1] == "STANDALONE"
        assert command[command.index("--speculative-draft-model-path") + 1] == str(out / "draft")
        steps, tokens = (
            int(command[command.index(flag) + 1])
            for flag in ("--speculative-num-steps", "--speculative-num-draft-tokens")
        )
        assert (steps, tokens) == (5, 6)  # SGLang's rule with eagle-topk 1: draft tokens = steps + 1
    script = (out / "serve.sh").read_text()
    assert report["command"] in script and os.access(out / "serve.sh", os.X_OK)


def test_export_for_an_engine_refuses_a_draft_with_another_tokenizer(tuned_target, tmp_path):
    other = swap_two_tokens(tuned_target, tmp_path / "other")
    run = finished_run(tmp_path / "run", tuned_target, other)
    with pytest.raises(SpectuneError, match="tokenizer differs from the target's \\(vocabulary"):
        hand_off(HandoffConfig(run=run, engine="vllm"))
    assert not (run / "handoff").exists()
    (run / "gguf" / "pair.json").write_text(json.dumps({"target": "t", "draft": "d", "draft_name": "sft", "k": 3}))
    with pytest.raises(SpectuneError, match="predates hand-off"):
        hand_off(HandoffConfig(run=run, engine="sglang"))


def test_bench_checks_its_baseline_against_llama_cpp(llama_server, pair, demo_data, tmp_path):
    """--peer: llama.cpp's speculative tool on the pair and its own target-alone loop (llama-server), beside ours."""
    from spectune.bench.config import BenchConfig
    from spectune.bench.run import bench
    from spectune.runtime.mode import faster

    target, draft = pair
    config = BenchConfig(
        target=target, drafts={"sft": draft}, data=demo_data, out=tmp_path, n=2, repeats=1, max_tokens=48,
        draft_max=3, threads=1, peer=True, plot=False,
    )  # fmt: skip
    report = bench(config)
    summary = report["summary"]["sft"]
    assert summary["identical"] == summary["llama_cpp_identical"] == summary["llama_cpp_target_identical"] == 2
    # Counted llama.cpp's way (k per step, past an end token), our drafts are its drafts and our accepts its accepts,
    # but for the first step: ours is the target's own (the first token never waits for the draft), llama.cpp's tool
    # drafts k there. (Not at the length limit: asked for 0 drafts there, llama.cpp drafts k.)
    ended = [row["variants"]["sft"] for row in report["prompts"] if row["variants"]["sft"]["tokens"] < 47]
    assert ended
    for ours in ended:
        theirs = ours["llama_cpp"]
        assert (
            abs(ours["offered"] - theirs["drafted"]) <= 3
            and abs(ours["accepted_as_llama_cpp"] - theirs["accepted"]) <= 3
        )
    assert summary["baseline_vs_llama_cpp"] > 0 and summary["aggregate_speedup_over_llama_cpp"] > 0
    assert summary["llama_cpp_target_total"][0] > 0
    # and at llama.cpp's own defaults (on a CPU with AMX, AMX refused: its kernels crash the pinned build)
    assert summary["llama_cpp_defaults_target_total"][0] > 0
    assert summary["aggregate_speedup_over_fastest_llama_cpp"] == min(
        summary["aggregate_speedup_over_llama_cpp"], summary["aggregate_speedup_over_llama_cpp_defaults"]
    )
    report_text = (tmp_path / "report.md").read_text()
    assert "With this bench's settings:" in report_text and "At its defaults:" in report_text
    # what serving would choose here, by the same rule as serve's --mode auto, and what that yields beside
    # llama-server at its defaults (the fastest row is the target alone at llama.cpp's fastest settings)
    serving = report["serving"]
    speeds = (serving["best_variant_tokens_per_second"], serving["fastest_tokens_per_second"])
    assert serving["mode"] == faster(*speeds) and serving["over_llama_server_defaults"] > 0
    assert "Serving here: `spectune serve --mode auto` would decode" in report_text
    assert isinstance(report["retimed"], list) and "Stalls:" in report_text


def test_bench_runs_ngram_variants_beside_llama_cpps_own(llama_server, pair, demo_data, tmp_path):
    """--ngram: lookup alone and in front of each tuned draft, identical answers, acceptance split by source, and
    llama.cpp's ngram-simple (alone and before draft-simple) on the same prompts."""
    from spectune.bench.config import BenchConfig
    from spectune.bench.run import bench
    from spectune.runtime.ngram import NgramSettings

    target, draft = pair
    config = BenchConfig(
        target=target, drafts={"generic": draft, "sft": draft}, data=demo_data, out=tmp_path, n=3, repeats=1,
        max_tokens=32, draft_max=3, threads=1, peer=True, plot=False, ngram=NgramSettings(), ngram_data=demo_data,
    )  # fmt: skip
    summary = bench(config)["summary"]
    assert list(summary) == ["generic", "sft", "ngram", "ngram+sft"]  # no n-gram in front of the untrained control
    for name in ("ngram", "ngram+sft"):
        assert summary[name]["identical"] == summary[name]["llama_cpp_identical"] == 3
    alone, combined = summary["ngram"], summary["ngram+sft"]
    assert alone["cost_ratio"] == 0.0 and alone["gpu_cost_ratio"] == 0.0  # a lookup costs no model step
    assert alone["ngram_step_share"] > 0 and alone["ngram_drafted"] == round(
        alone["mean_drafted_per_step"] * sum(row["variants"]["ngram"]["verify_steps"] for row in bench_rows(tmp_path))
    )
    # in front of the draft, the model's cost is paid only on the share it drafted
    assert 0 < combined["ngram_step_share"] < 1 and combined["cost_ratio"] < summary["sft"]["cost_ratio"]


def bench_rows(folder):
    return json.loads((folder / "report.json").read_text())["prompts"]
