"""The story's user on their own card: the install picks llama.cpp's CUDA build where an NVIDIA card and a CUDA toolkit
are both here (this machine has nvcc and no card: a CPU build), the offload setting reaches llama.cpp's model
parameters and its tools' flags, and doctor says which build runs. Nothing here runs on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from spectune.accelerator import choose
from spectune.engines.llama_server import gpu_flags, server_command
from spectune.export.llama_flags import check_command
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.mode import DecoderSource

ROOT = Path(__file__).parent.parent


def tools(tmp_path: Path, nvidia_smi: str | None, nvcc: bool | str) -> Path:
    """A PATH folder with stand-ins: nvidia-smi printing `nvidia_smi` (None: no such tool), and nvcc in a toolkit
    with cuBLAS and the driver library's stub (True), with cuBLAS only ("no stub"), with neither ("bare"), or none
    (False)."""
    folder = tmp_path / "bin"
    folder.mkdir(parents=True, exist_ok=True)
    scripts = {"nvidia-smi": f"echo {nvidia_smi}" if nvidia_smi is not None else None, "nvcc": "true" if nvcc else None}
    for name, body in scripts.items():
        if body is not None:
            (folder / name).write_text(f"#!/bin/sh\n{body}\n")
            (folder / name).chmod(0o755)
    if nvcc in (True, "no stub"):
        (tmp_path / "lib64" / "stubs").mkdir(parents=True, exist_ok=True)
        (tmp_path / "lib64" / "libcublas.so.13").write_bytes(b"")
    if nvcc is True:
        (tmp_path / "lib64" / "stubs" / "libcuda.so").write_bytes(b"")
    return folder


def cmake_args(tmp_path: Path, nvidia_smi: str | None, nvcc: bool | str, *flags: str) -> subprocess.CompletedProcess:
    """What `make install` passes llama-cpp-python's build, with only the stand-ins (and the system's sh) on PATH."""
    path = f"{tools(tmp_path, nvidia_smi, nvcc)}:/usr/bin:/bin"
    command = [sys.executable, "-m", "spectune.accelerator", *flags]
    env = {"PATH": path, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(command, capture_output=True, text=True, env=env)


@pytest.mark.parametrize(
    ("card", "nvcc", "flags", "expected"),
    [
        ("8.9", True, [], "-DGGML_LLAMAFILE=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=89"),  # the story's card
        ("8.6", True, ["--cuda-arch", "80"], "-DGGML_LLAMAFILE=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=80"),
        ("8.9", False, [], "-DGGML_LLAMAFILE=OFF"),  # a card but nothing to build for it with
        ("8.9", "bare", [], "-DGGML_LLAMAFILE=OFF"),  # a toolkit without cuBLAS: llama.cpp's CUDA build stops
        ("8.9", "no stub", [], "-DGGML_LLAMAFILE=OFF"),  # nor without libcuda (CUDA::cuda_driver)
        (None, True, [], "-DGGML_LLAMAFILE=OFF"),  # a toolkit and no card: this machine, CI
        ("8.9", True, ["--gpu", "cpu"], "-DGGML_LLAMAFILE=OFF"),
        (None, True, ["--gpu", "cuda"], "-DGGML_LLAMAFILE=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=89"),
        (None, False, ["--llamafile", "ON"], "-DGGML_LLAMAFILE=ON"),
    ],
)
def test_the_install_builds_for_the_card_it_finds_or_the_cpu(tmp_path, card, nvcc, flags, expected):
    result = cmake_args(tmp_path, card, nvcc, *flags)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


def test_the_install_says_which_build_and_why(tmp_path):
    said = cmake_args(tmp_path, "8.9", False, "--describe").stdout
    assert said.startswith("llama.cpp: CPU build") and "no CUDA toolkit (nvcc not on PATH)" in said
    said = cmake_args(tmp_path / "a", "8.9", True, "--describe").stdout
    assert "CUDA build for compute capability 89" in said
    refused = cmake_args(tmp_path / "b", None, False, "--gpu", "cuda")
    assert refused.returncode != 0 and "no CUDA toolkit" in refused.stderr  # forced, with nothing to build with
    bare = cmake_args(tmp_path / "d", None, "bare", "--gpu", "cuda")  # this machine's toolkit: nvcc, no cuBLAS
    assert bare.returncode != 0 and "has no cuBLAS nor libcuda" in bare.stderr
    stubless = cmake_args(tmp_path / "e", None, "no stub", "--gpu", "cuda")
    assert stubless.returncode != 0 and "has no libcuda (the driver library" in stubless.stderr
    assert "choose one of auto, cuda, cpu" in cmake_args(tmp_path / "c", None, False, "--gpu", "gpu").stderr


def test_choose_reads_a_card_nvidia_smi_cannot_query_as_none():
    def run(command, **_):
        return subprocess.CompletedProcess(command, 9, "", "NVIDIA-SMI has failed")

    assert choose(which=lambda name: f"/usr/bin/{name}", run=run).name == "cpu"


def test_make_install_hands_the_choice_to_the_build(tmp_path):
    """`make -n`: the recipe asks the chooser with GPU and CUDA_ARCH, says its choice in the log, and builds with it."""
    venv = tmp_path / "venv"
    dry = subprocess.run(
        ["make", "-n", "install", f"VENV={venv}", "GPU=cuda", "CUDA_ARCH=86"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "MAKEFLAGS": ""},
    )
    assert dry.returncode == 0, dry.stderr
    assert "-m spectune.accelerator --gpu 'cuda' --cuda-arch '86' --llamafile OFF --describe" in dry.stdout
    assert "flags=$(PYTHONPATH=src" in dry.stdout and 'CMAKE_ARGS="$flags ' in dry.stdout


def test_the_offload_setting_reaches_each_model_and_llama_cpps_tools(monkeypatch):
    loaded = []

    class Recorder:
        def __init__(self, path, **settings) -> None:
            loaded.append(settings["gpu_layers"])

    monkeypatch.setattr("spectune.runtime.mode.LlamaModel", Recorder)
    monkeypatch.setattr("spectune.runtime.mode.Variant.speculators", lambda *args: [])
    monkeypatch.setattr("spectune.runtime.mode.SpeculativeDecoder", lambda *args: None)
    DecoderSource(Path("t.gguf"), Path("d.gguf"), 512, 1, True, gpu_layers=12).load("speculative")
    DecoderSource(Path("t.gguf"), None, 512, 1, True).load("fastest")
    assert loaded == [12, 12, -1]  # target and draft as told; every layer by default
    assert gpu_flags(-1, draft=True) == ["-ngl", "all", "-ngld", "all"] and gpu_flags(0, draft=False) == ["-ngl", "0"]
    command = server_command(Path("llama-server"), Path("t.gguf"), None, DecodeSettings(), 1, gpu_layers=20)
    check_command(command)  # the pinned llama-server's own argument table knows the flags
    assert command[command.index("-ngl") + 1] == "20"


def test_the_offload_setting_is_a_flag_of_the_verbs_that_load_models():
    from spectune.bench.config import BenchConfig
    from spectune.serve.config import ServeConfig

    for config in (ServeConfig, BenchConfig):
        assert config.model_fields["gpu_layers"].default == -1


def test_doctor_says_which_build_runs_and_what_an_install_here_would_build(capsys):
    assert run_cli("doctor") == 0
    out = capsys.readouterr().out
    assert "llama.cpp build: CPU (every layer on the CPU); training (torch): cpu" in out
    assert "`make install` here builds: CPU build" in out


def test_llama_cpp_loads_a_model_with_the_layers_asked_and_says_where_they_run(pair, monkeypatch):
    import llama_cpp

    from spectune.runtime.llama import LlamaModel

    asked = []
    load = llama_cpp.llama_model_load_from_file

    def recording(path, params):
        asked.append(params.n_gpu_layers)
        return load(path, params)

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", recording)
    models = [LlamaModel(pair[0], n_ctx=64, threads=1, gpu_layers=layers) for layers in (-1, 0, 3)]
    assert asked == [-1, 0, 3]
    assert [model.device for model in models] == ["CPU"] * 3  # this build runs every layer on the CPU


def test_doctor_measures_identity_on_the_gguf_and_refuses_where_logits_differ(pair, capsys, monkeypatch):
    """A GPU build's kernels have no rule: doctor measures there (and on the CPU with --measure) and exits 1 where a
    verification batch's logits differ from one-token decoding."""
    import spectune.cli.decode as decode
    from spectune.runtime.identity_check import IdentityCheck

    assert run_cli("doctor", "--measure", str(pair[0])) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "identical answers: measured (3 batches of 5 tokens against one token at a time, on CPU" in said
    assert "every logit equal" in said
    monkeypatch.setattr(decode, "check_identity", lambda gguf, exact: IdentityCheck(False, 0.5, 3, "CUDA0"))
    assert run_cli("doctor", "--measure", str(pair[0])) == 1
    assert "logits differ by up to 0.5" in " ".join(capsys.readouterr().out.split())
