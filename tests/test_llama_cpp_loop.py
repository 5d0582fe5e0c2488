"""The llama.cpp peer: the command it runs and how its output is read.

Building llama.cpp's tool takes ~8 minutes, too long for the suite; `benchmarks/speculative.py --peer` runs the real
one. Here a stand-in script prints llama-speculative-simple's closing lines (captured from the real tool) and,
like the real one about half the time, loses them on its first run.
"""

from __future__ import annotations

import errno
import os
import platform
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from spectune.bench.llama_cpp_loop import generated_text, run_peer
from spectune.engines.llama_cpp import defaults_env
from spectune.engines.llama_server import server_env, speculation_flags
from spectune.errors import SpectuneError
from spectune.runtime.ngram import NGRAM

REAL_TAIL = """0.00.060.465 I encoded    3 tokens in    0.001 seconds, speed: 5976.096 t/s
0.00.060.466 I decoded   37 tokens in    0.016 seconds, speed: 2303.861 t/s
0.00.060.466 I
0.00.060.467 I n_draft   = 4
0.00.060.467 I n_predict = 37
0.00.060.467 I n_drafted = 47
0.00.060.467 I n_accept  = 25
0.00.060.469 I accept    = 53.191%
"""


def stand_in(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "llama-speculative-simple"
    script.write_text(f'#!/bin/bash\necho "$@" > {tmp_path}/args\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_reads_stats_and_retries_when_the_log_is_lost(tmp_path):
    (tmp_path / "tail").write_text(REAL_TAIL)
    body = f"""printf '\\n\\nhi, the answer\\n\\n\\n\\n'
if [ -f {tmp_path}/ran ]; then cat {tmp_path}/tail >&2; else touch {tmp_path}/ran; fi"""
    draft = header_only_gguf(tmp_path / "d.gguf", "llama")
    run = run_peer(stand_in(tmp_path, body), Path("t.gguf"), draft, "hi", 4, 32, 2, 512, exact=True)
    assert (run.decoded_tokens, run.drafted, run.accepted) == (37, 47, 25)
    assert run.seconds == pytest.approx(0.016) and run.tokens_per_second == pytest.approx(37 / 0.016)
    assert run.text == ", the answer"  # the echoed prompt and the closing lines cut off, exactly
    args = (tmp_path / "args").read_text().split()
    for flag, value in (("-md", str(draft)), ("--spec-type", "draft-simple"), ("--spec-draft-n-max", "4"), ("-t", "2")):
        assert args[args.index(flag) + 1] == value
    assert "--no-repack" in args and args[args.index("-fa") + 1] == "off"


def test_a_failing_tool_is_reported(tmp_path):
    draft = header_only_gguf(tmp_path / "d.gguf", "llama")
    with pytest.raises(SpectuneError, match="exit 3"):
        run_peer(stand_in(tmp_path, "echo boom >&2; exit 3"), Path("t"), draft, "hi", 4, 8, 1, 512, exact=False)
    with pytest.raises(SpectuneError, match="could not find"):
        run_peer(stand_in(tmp_path, "echo no stats"), Path("t"), draft, "hi", 4, 8, 1, 512, exact=False)


def test_the_tools_answer_is_cut_exactly_from_its_output():
    prompt = "<|im_start|>user\nA table for two.<|im_end|>\n<|im_start|>assistant\n"
    printed = f"\n\n<|endoftext|>{prompt}Sure. For when?\n\n\n\n"  # a BOS it added, printed before the prompt
    assert generated_text(printed, prompt) == "Sure. For when?"
    assert generated_text(f"\n\n{prompt}\n\n\n\n", prompt) == ""  # an empty answer is empty, not "contained"
    assert generated_text(f"\n\n{prompt}Sure. For when? At 7\n\n\n\n", prompt) != "Sure. For when?"
    assert generated_text(f"\n\n{prompt}Sure. For when?\n\n", prompt) == "Sure. For when?"  # the exit's line lost
    assert generated_text(f"\n\n{prompt}Sure.", prompt) is None  # the output was cut short


def header_only_gguf(path: Path, architecture: str) -> Path:
    """A GGUF holding only its architecture: all the flags read of a draft."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_llama_cpps_ngram_speculator_goes_in_front_of_the_draft_or_alone(tmp_path):
    """The flags both llama.cpp tools get: ngram-simple sized like spectune's lookup, before draft-simple."""
    draft = header_only_gguf(tmp_path / "d.gguf", "llama")
    both = speculation_flags(draft, 4, 2, (NGRAM,), ngram_n=2)
    assert both[both.index("--spec-type") + 1] == "ngram-simple,draft-simple"
    assert both[both.index("--spec-ngram-simple-size-n") + 1] == "2"
    assert both[both.index("--spec-ngram-simple-size-m") + 1] == "4" and "-md" in both
    alone = speculation_flags(None, 4, 2, (NGRAM,), ngram_n=2)
    assert alone[alone.index("--spec-type") + 1] == "ngram-simple" and "-md" not in alone and "-td" not in alone
    assert speculation_flags(None, 4, 2) == []  # the target alone
    hashed = speculation_flags(draft, 2, 2, (NGRAM,), ngram_n=2, ngram_type="ngram-mod")
    assert hashed[hashed.index("--spec-type") + 1] == "ngram-mod,draft-simple"
    assert hashed[hashed.index("--spec-ngram-mod-n-max") + 1] == "2"  # a short answer's proposals, not 48 tokens
    assert hashed[hashed.index("--spec-ngram-mod-n-min") + 1] == "1" and "--spec-ngram-simple-size-n" not in hashed
    with pytest.raises(SpectuneError, match="has no speculator for repeat"):
        speculation_flags(None, 4, 2, ("repeat",))  # one only spectune's loop runs is not handed over silently


def test_a_drafts_kind_is_its_ggufs(tmp_path):
    """An EAGLE-3 head and a Gemma 4 assistant are named by their GGUF's architecture, nothing to pass along."""
    for architecture, kind in (
        ("eagle3", "draft-eagle3"),
        ("gemma4-assistant", "draft-mtp"),
        ("gemma4", "draft-simple"),
    ):
        flags = speculation_flags(header_only_gguf(tmp_path / f"{architecture}.gguf", architecture), 3, 1)
        assert flags[flags.index("--spec-type") + 1] == kind


# x86-64 Linux system call numbers: arch_prctl, getpid
SYS_ARCH_PRCTL, SYS_GETPID, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 39, 0x1023, 18
PROBE = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
refused = libc.syscall({SYS_ARCH_PRCTL}, {ARCH_REQ_XCOMP_PERM}, {XFEATURE_XTILEDATA})
print(refused, ctypes.get_errno(), libc.syscall({SYS_GETPID}) == os.getpid())
"""


@pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux", reason="AMX is x86-64 Linux only")
def test_llama_cpp_at_its_defaults_gets_amx_refused_on_a_cpu_with_amx(tmp_path):
    """The pinned llama.cpp's AMX kernels crash (exit 139) on an Intel Xeon with AMX: at its defaults a tool runs
    with the AMX permission refused (EPERM, which no kernel answers by itself), every other system call passed on."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nflags : fpu sse avx512f amx_bf16 amx_tile amx_int8\n")
    env = defaults_env(cpuinfo)
    probe = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["-1", str(errno.EPERM), "True"]
    cpuinfo.write_text("processor : 0\nflags : fpu sse avx512f\n")
    assert defaults_env(cpuinfo) == {}
    assert "LD_PRELOAD" not in server_env(exact=True, api_key=None)  # spectune's identity settings use no AMX
