"""The verbs that decode: `generate`, `bench`, `serve`, and `predict` (the speed on a GPU card)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import typer
from pydantic import Field
from rich.table import Table

from spectune.accelerator import choose
from spectune.bench.config import BenchConfig
from spectune.bench.run import bench as run_bench
from spectune.cli.shared import console
from spectune.config import Settings, positional
from spectune.errors import SpectuneError
from spectune.flags import config_command
from spectune.gpu.predict import STORY_GOALS, PredictConfig
from spectune.gpu.predict import predict as run_predict
from spectune.llama_cpp_pin import binding_patched, patched_build
from spectune.runtime.build import build_features, build_name, gpu_offload, identity_verdict, torch_device
from spectune.runtime.identity_check import BATCH, IdentityCheck, check_identity
from spectune.runtime.llama import LlamaModel, use_tiled_matmul
from spectune.runtime.mode import settle_auto
from spectune.serve.client import run_call
from spectune.serve.config import ServeConfig
from spectune.serve.engine import serve_llama_cpp
from spectune.serve.generate import GenerateConfig
from spectune.serve.generate import generate as run_generate
from spectune.serve.launch import make_uvicorn
from spectune.serve.slots import calibration_conversations, decoder_source
from spectune.threads import thread_count

app = typer.Typer()


@config_command(app, GenerateConfig)
def generate(config: GenerateConfig) -> None:
    """Stream an answer (or a conversation) from the target, with the draft speculating; print the stats."""

    def show(text: str) -> bool:
        sys.stdout.write(text)
        sys.stdout.flush()
        return True

    run_generate(config, show, lambda: typer.prompt("you", prompt_suffix="> "), console.print)


@config_command(app, BenchConfig)
def bench(config: BenchConfig) -> None:
    """Target alone vs target + each draft, interleaved, per prompt: tok/s, speedup, acceptance, identical."""
    run_bench(config)
    console.print((config.out / "report.md").read_text())


@config_command(app, ServeConfig)
def serve(config: ServeConfig) -> None:
    """OpenAI-compatible streaming chat server (/v1/chat/completions, /v1/models, /health, /metrics): spectune's
    own, or llama.cpp's llama-server on the same pair (--engine llama.cpp)."""
    if config.api_key is None and "SPECTUNE_API_KEY" in os.environ:
        if not os.environ["SPECTUNE_API_KEY"].strip():
            raise SpectuneError("SPECTUNE_API_KEY is set but empty: give a key, or unset it to serve without one")
        config.api_key = os.environ["SPECTUNE_API_KEY"]
    if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        console.print(
            f"[yellow]warning: serving on {config.host} with no --api-key: anyone who reaches it can use it[/]"
        )
    if config.engine == "llama.cpp":
        code = serve_llama_cpp(config, typer.echo)
        if code not in (0, -signal.SIGTERM):
            raise SpectuneError(f"llama-server exited with {code}")
        return
    fastest = config.fastest_only
    if config.mode == "auto" and not fastest:  # measured in a child: nothing has decoded here yet
        settled = settle_auto(decoder_source(config), calibration_conversations(config.calibration_data),
                              config.decoding(), config.recalibrate)  # fmt: skip
        config, fastest = config.model_copy(update={"recalibrate": False}), settled.mode == "fastest"
    if fastest:  # a process that decodes only at the fastest settings: no exact model ever decodes in it
        use_tiled_matmul()
    server = make_uvicorn(config, log_level="info")
    choice = server.spectune.choice
    console.print(f"decoding: {choice.mode} ({choice.reason})")
    limits = server.spectune.connection_limits
    console.print(
        f"connections: at most {limits['max_connections']} (open-file limit {limits['open_file_limit']}; "
        "past the cap the oldest without a request makes room)"
    )
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the stop signal again once it has stopped: a normal end
        pass
    finally:
        # A second Ctrl-C skips uvicorn's own shutdown: the generations are still cancelled and joined here, so no
        # model is freed under a running decode. A third one leaves at once, freeing nothing.
        try:
            server.spectune.shutdown()
        except KeyboardInterrupt:
            os._exit(130)


def _band(band: tuple[float, float], unit: str = "x") -> str:
    return f"{band[0]:.2f}-{band[1]:.2f}{unit}"


@config_command(app, PredictConfig)
def predict(config: PredictConfig) -> None:
    """Predict a pair's decode speed on a GPU card, before or after training it, with the fit's band; no model
    loaded. `plan` says what fits in memory; `predict` says how fast it will run."""
    result = run_predict(config)
    console.print(f"All figures {result['label']}: a fit on published llama.cpp figures (docs/design.md).")
    if "story" in result:
        story = result["story"]
        console.print(
            f"{story['target']} alone: {story['target_tokens_per_s']:.1f} tok/s "
            f"({_band(story['target_band'], ' tok/s')}); the reference story published "
            f"{story['published_tokens_per_s']:.0f} tok/s."
        )
        table = Table(title="what a draft must guess (the same α at every position, its best k)")
        for column in ("draft", "c (band)", "α for 1.7x (band)", "α for 2.2x (band)"):
            table.add_column(column, justify="left" if column == "draft" else "right", overflow="fold")
        for name, row in story["drafts"].items():
            needed = [row[f"alpha_for_{goal}x"] for goal in STORY_GOALS]
            cells = [
                "out of reach"
                if alpha[0] is None
                else f"{alpha[0]:.2f} ({alpha[1] or 0:.2f}-"
                + ("out of reach" if alpha[2] is None else f"{alpha[2]:.2f}")
                + ")"
                for alpha in needed
            ]
            table.add_row(name, f"{row['c']:.3f} ({row['c_band'][0]:.3f}-{row['c_band'][1]:.3f})", *cells)
        console.print(table)
        return
    if result["report"]:
        console.print(f"acceptance from {result['report']}", soft_wrap=True)  # a path a user copies whole
    console.print(f"target alone: {result['target_tokens_per_s']:.1f} tok/s ({_band(result['target_band'], ' tok/s')})")
    table = Table(title=f"speculative decoding on the {result['card']}, the target alone = 1.00x")
    for column in ("draft", "c (band)", "k", "τ", "speedup (band)", "tok/s"):
        table.add_column(column, justify="left" if column == "draft" else "right")
    for name, row in result["drafts"].items():
        table.add_row(
            name,
            f"{row['c']:.3f} ({row['c_band'][0]:.3f}-{row['c_band'][1]:.3f})",
            str(row["k"]),
            f"{row['tau']:.2f}",
            f"{row['speedup']:.2f}x ({_band(row['speedup_band'])})",
            f"{row['tokens_per_s']:.0f}",
        )
    console.print(table)


class DoctorConfig(Settings):
    ggufs: list[Path] = Field(
        [], **positional("Target GGUF files to check (the draft only proposes: its types do not matter).")
    )
    exact: bool = Field(True, description="Check for the exact setting (the bench and server default).")
    measure: bool = Field(
        False, description="Also measure identity on the CPU (a GPU build always measures: its kernels have no rule)."
    )


@config_command(app, DoctorConfig)
def doctor(config: DoctorConfig) -> None:
    """Say which llama.cpp build this install runs and whether it gives identical answers with these targets.

    Exits 1 when a GGUF cannot be promised identical answers, so a script can stop before relying on it."""
    features = [name if value == "1" else f"{name}={value}" for name, value in build_features().items() if value != "0"]
    console.print(f"{build_name()}; threads {thread_count()}; compiled in: {', '.join(features)}")
    backend = "CUDA (layers offloaded to the GPU)" if gpu_offload() else "CPU (every layer on the CPU)"
    console.print(f"llama.cpp build: {backend}; training (torch): {torch_device()}")
    console.print(f"`make install` here builds: {choose().describe().removeprefix('llama.cpp: ')}")
    if binding_patched():
        console.print(f"llama.cpp patches: applied ({patched_build()}: EAGLE-3 layer inputs for qwen2, gemma3)")
    else:  # llama.cpp's own tools are built patched; spectune's own loop runs in this binding
        console.print(f"[yellow]llama.cpp patches: not in this binding[/] (want {patched_build()}): `make install`")
    refused = 0
    for gguf in config.ggufs:
        if not gguf.is_file():
            raise SpectuneError(f"{gguf}: no such GGUF file")
        verdict = identity_verdict(gguf, config.exact)
        types = ", ".join(f"{count} {name}" for name, count in verdict["matrix_types"].items())
        on_gpu = gpu_offload()
        check = check_identity(gguf, config.exact) if on_gpu or config.measure else None
        device = check.device if check else LlamaModel(gguf, n_ctx=64, threads=1).device  # one load either way
        console.print(f"{gguf}: weight matrices {types}; runs on {device}")
        if not on_gpu:  # the rule is the CPU kernels': a GPU's are measured, not assumed
            if verdict["guaranteed"]:
                console.print("  [green]identical answers: guaranteed[/] (batched logits equal one-token logits)")
            for reason in verdict["reasons"]:
                console.print(f"  [red]identical answers not guaranteed[/]: {reason}")
        measured = report_measured(check) if check else True
        refused += not (measured and (on_gpu or verdict["guaranteed"]))
    if refused:
        raise typer.Exit(1)


def report_measured(check: IdentityCheck) -> bool:
    """Say what the measured check found; whether answers are identical there."""
    tried = f"{check.batches} batches of {BATCH} tokens against one token at a time, on {check.device}"
    if check.equal:
        console.print(f"  [green]identical answers: measured[/] ({tried}: every logit equal)")
    else:
        console.print(
            f"  [red]identical answers not guaranteed[/]: measured ({tried}): logits differ by up to "
            f"{check.max_difference:.3g}; speculative answers may differ from the target alone's"
        )
    return check.equal


class CallConfig(Settings):
    server: str = Field("http://127.0.0.1:8000", description="Server URL.")
    api_key: str | None = Field(None, description="Bearer token (default: $SPECTUNE_API_KEY).")
    speak: bool = Field(False, description="Speak each sentence with espeak-ng (if installed).")
    system: str | None = Field(None, description="System prompt.")
    timeout: float = Field(
        30.0, ge=0.1, description="Seconds to wait for the server's next bytes before giving the turn up."
    )


@config_command(app, CallConfig)
def call(config: CallConfig) -> None:
    """A terminal phone call with the server: streams answers by sentence and shows the time to first words."""
    api_key = config.api_key or os.environ.get("SPECTUNE_API_KEY")
    run_call(config.server, api_key, config.speak, config.system, config.timeout)
