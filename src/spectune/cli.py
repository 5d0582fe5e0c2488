"""The `spectune` command: one verb per pipeline stage, each a thin call into that stage's entry function."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from spectune import __version__
from spectune.errors import SpectuneError

console = Console()
app = typer.Typer(
    help="QLoRA-tune a target, train a draft that thinks like it, run both with speculative decoding.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
data_app = typer.Typer(help="Read, check, split and inspect chat datasets; make demo data.", no_args_is_help=True)
app.add_typer(data_app, name="data")
models_app = typer.Typer(
    help="The demo world: offline tokenizer and generic target/draft base pairs.", no_args_is_help=True
)
app.add_typer(models_app, name="models")
tools_app = typer.Typer(help="Build the external tools benchmarks compare against.", no_args_is_help=True)
app.add_typer(tools_app, name="tools")

DataFile = Annotated[
    Path, typer.Argument(help="Chat JSONL (OpenAI messages, ShareGPT or Alpaca) or a save_to_disk folder.")
]
SystemOpt = Annotated[str | None, typer.Option(help="System prompt to prepend where a record has none.")]
SkipOpt = Annotated[bool, typer.Option("--skip-invalid", help="Drop invalid records (counted) instead of failing.")]
TokenizerOpt = Annotated[Path | None, typer.Option(help="Local tokenizer folder to count tokens with.")]


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
    from spectune.models.load import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _read(path: Path, system: str | None, skip_invalid: bool):
    from spectune.data.read import read_dialogues

    result = read_dialogues(path, system=system, skip_invalid=skip_invalid)
    if result.dropped:
        reasons = ", ".join(f"{n} {why}" for why, n in result.drop_reasons().most_common())
        console.print(f"[yellow]dropped {len(result.dropped)} of {result.records} records:[/] {reasons}")
        for problem in result.dropped[:5]:
            console.print(f"  {problem}", markup=False)
    return result


@data_app.command("validate")
def data_validate(path: DataFile, system: SystemOpt = None) -> None:
    """Check every record; list each problem with file, line and field (exit 2 if any)."""
    result = _read(path, system, skip_invalid=False)
    console.print(f"{path}: {len(result.dialogues)} dialogues in {result.format} format, all valid")


@data_app.command("inspect")
def data_inspect(
    path: DataFile,
    tokenizer: TokenizerOpt = None,
    system: SystemOpt = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the numbers as JSON.")] = None,
) -> None:
    """Records, turns, tokens per turn (median, p95), role mix, duplicates, invalid lines."""
    from spectune.data.prepare import dataset_stats

    result = _read(path, system, skip_invalid=True)
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
    if json_out:
        json_out.write_text(json.dumps(stats, indent=2))


@data_app.command("prepare")
def data_prepare(
    path: DataFile,
    out: Annotated[Path, typer.Option(help="Folder for train.jsonl and eval.jsonl.")],
    eval_fraction: Annotated[float, typer.Option(help="Share of dialogues held out for eval.")] = 0.1,
    seed: Annotated[int, typer.Option(help="Seed of the split.")] = 0,
    dedup: Annotated[bool, typer.Option(help="Remove exact duplicates.")] = True,
    max_tokens: Annotated[int | None, typer.Option(help="Drop dialogues longer than this (needs --tokenizer).")] = None,
    tokenizer: TokenizerOpt = None,
    system: SystemOpt = None,
    skip_invalid: SkipOpt = False,
) -> None:
    """Dedup, filter and split a dataset (deterministic by seed); every drop is counted."""
    from spectune.data.prepare import save_split, split_dialogues

    result = _read(path, system, skip_invalid)
    count_tokens = None
    if max_tokens is not None:
        if tokenizer is None:
            raise SpectuneError("--max-tokens needs --tokenizer")
        from spectune.data.render import render
        from spectune.models.load import load_tokenizer

        loaded = load_tokenizer(tokenizer)
        count_tokens = lambda d: len(render(loaded, d.messages).input_ids)  # noqa: E731
    split = split_dialogues(
        result.dialogues,
        eval_fraction=eval_fraction,
        seed=seed,
        remove_duplicates=dedup,
        max_tokens=max_tokens,
        count_tokens=count_tokens,
    )
    for why, n in split.dropped.items():
        console.print(f"dropped {n}: {why}")
    paths = save_split(split, out)
    console.print(f"train: {len(split.train)} -> {paths['train']}\neval: {len(split.eval)} -> {paths['eval']}")


@data_app.command("prompts")
def data_prompts(
    path: DataFile,
    out: Annotated[Path, typer.Option(help="JSONL of {messages, reference}.")],
    n: Annotated[int, typer.Option(help="How many prompts.")] = 50,
    seed: Annotated[int, typer.Option(help="Seed of the choice.")] = 0,
    system: SystemOpt = None,
) -> None:
    """Extract (context, reference answer) pairs at assistant turns, for bench and acceptance."""
    from spectune.data.prepare import extract_prompts, write_prompts

    prompts = extract_prompts(_read(path, system, skip_invalid=False).dialogues, n, seed)
    write_prompts(prompts, out)
    console.print(f"{len(prompts)} prompts -> {out}")


@data_app.command("demo")
def data_demo(
    out: Annotated[Path, typer.Option(help="Where to write the dialogues (JSONL).")],
    n: Annotated[int, typer.Option(min=100, max=50_000, help="How many dialogues.")] = 2000,
    seed: Annotated[int, typer.Option(help="Seed: the same seed gives the same dialogues.")] = 0,
) -> None:
    """Generate phone voice-bot dialogues (9 intents, slots, 2–8 turns)."""
    from spectune.data.demo import generate_dialogues
    from spectune.data.read import write_jsonl

    count = write_jsonl(generate_dialogues(n, seed), out)
    console.print(f"{count} dialogues -> {out}")


ModelsDirOpt = Annotated[Path | None, typer.Option(help="Models directory (default: the user cache).")]


@models_app.command("list")
def models_list(models_dir: ModelsDirOpt = None) -> None:
    """The pair sizes, their shapes, and which are built here."""
    from spectune.models.world import RECIPES, pair_dir, read_manifest

    table = Table(title="demo-world pairs")
    for column in ("size", "target (hidden x layers)", "draft", "built", "params target / draft", "c (Q4_K_M)"):
        table.add_column(column)
    for size, recipe in RECIPES.items():
        folder = pair_dir(size, models_dir)
        built = (folder / "manifest.json").is_file()
        manifest = read_manifest(folder) if built else {}
        params = f"{manifest['target']['parameters']:,} / {manifest['draft']['parameters']:,}" if built else "-"
        profile = manifest.get("profile_Q4_K_M", {})
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
    profile: Annotated[bool, typer.Option(help="Export Q4_K_M GGUFs and measure c and r(n) here.")] = True,
) -> None:
    """Build a pair (cached by recipe), export it to Q4_K_M and measure its hardware profile."""
    from spectune.models.world import build_pair, profile_pair, read_manifest

    folder = build_pair(size, models_dir, force=force)
    manifest = read_manifest(folder)
    console.print(f"{size} pair: {folder} (built in {manifest['build_seconds']} s)")
    if profile:
        _print_profile(profile_pair(folder, force=force))


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


@models_app.command("info")
def models_info(folder: Annotated[Path, typer.Argument(help="A built pair folder.")]) -> None:
    """Print a pair's manifest: recipe, parameter counts, sizes, timings, hardware profile."""
    from spectune.models.world import read_manifest

    console.print_json(json.dumps(read_manifest(folder)))


ConfigOpt = Annotated[Path | None, typer.Option("--config", help="YAML with these options; flags override it.")]


EvalDataOpt = Annotated[Path | None, typer.Option(help="Held-out dataset (default: a split of --data).")]
EpochsOpt = Annotated[float | None, typer.Option(help="Epochs over the data.")]
MaxStepsOpt = Annotated[int | None, typer.Option(help="Stop after this many steps (overrides epochs).")]
BatchOpt = Annotated[int | None, typer.Option(help="Dialogues per step.")]
LrOpt = Annotated[float | None, typer.Option(help="Learning rate.")]
MaxTokensOpt = Annotated[int | None, typer.Option(help="Longest sequence; longer dialogues are cut on turns.")]
SaveStepsOpt = Annotated[int | None, typer.Option(help="Checkpoint every N steps.")]
SeedOpt = Annotated[int | None, typer.Option(help="Seed (data split, init, order).")]
ResumeOpt = Annotated[bool | None, typer.Option("--resume", help="Continue from the last complete checkpoint.")]


@app.command()
def finetune(
    model: Annotated[Path | None, typer.Option(help="Local HF model folder (the target).")] = None,
    data: Annotated[Path | None, typer.Option(help="Task dataset (chat JSONL or save_to_disk folder).")] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder: adapter/, checkpoints/, finetune.json.")] = None,
    config: ConfigOpt = None,
    eval_data: EvalDataOpt = None,
    four_bit: Annotated[bool | None, typer.Option("--4bit/--no-4bit", help="QLoRA (NF4 base) or plain LoRA.")] = None,
    lora_r: Annotated[int | None, typer.Option(help="LoRA rank.")] = None,
    lora_alpha: Annotated[int | None, typer.Option(help="LoRA alpha.")] = None,
    lora_dropout: Annotated[float | None, typer.Option(help="LoRA dropout.")] = None,
    epochs: EpochsOpt = None,
    max_steps: MaxStepsOpt = None,
    batch_size: BatchOpt = None,
    lr: LrOpt = None,
    max_tokens: MaxTokensOpt = None,
    save_steps: SaveStepsOpt = None,
    chat_template: Annotated[Path | None, typer.Option(help="Jinja chat template file, if the model has none.")] = None,
    system: SystemOpt = None,
    seed: SeedOpt = None,
    resume: ResumeOpt = None,
) -> None:
    """Fine-tune the target with QLoRA (4-bit NF4 base + LoRA adapter) on assistant tokens."""
    values = {key: value for key, value in locals().items() if key != "config"}
    from spectune.config import load_config
    from spectune.train.target import FinetuneConfig
    from spectune.train.target import finetune as run_finetune

    result = run_finetune(load_config(FinetuneConfig, config, values))
    console.print(
        f"eval loss {result.eval_loss_before:.4f} -> {result.eval_loss_after:.4f} | adapter {result.adapter} "
        f"({result.adapter_bytes / 1e6:.2f} MB) | peak memory {result.peak_memory_bytes / 2**30:.2f} GiB "
        f"({result.peak_memory_how}) | {result.seconds:.0f} s"
    )


@app.command()
def merge(
    base: Annotated[Path, typer.Option(help="The base model folder the adapter was trained on.")],
    adapter: Annotated[Path, typer.Option(help="The LoRA adapter folder.")],
    out: Annotated[Path, typer.Option(help="Where to write the merged HF model.")],
) -> None:
    """Merge a (Q)LoRA adapter into its base reloaded unquantized; checks merged == base + adapter."""
    from spectune.train.target import merge as run_merge

    result = run_merge(base, adapter, out)
    console.print(f"merged -> {result.model} (max logit difference vs base + adapter: {result.max_logit_diff:.1e})")


@app.command()
def draft(
    target: Annotated[Path | None, typer.Option(help="The fine-tuned (merged) target folder.")] = None,
    draft_model: Annotated[Path | None, typer.Option("--draft", help="The base draft folder to start from.")] = None,
    data: Annotated[Path | None, typer.Option(help="The same task dataset the target was tuned on.")] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder: model/, checkpoints/, draft.json.")] = None,
    method: Annotated[str | None, typer.Option(help="sft | kd | seqkd | onpolicy.")] = None,
    config: ConfigOpt = None,
    divergence: Annotated[
        str | None, typer.Option(help="kd/onpolicy loss: forward_kl | reverse_kl | jsd | tv (tv: kd only).")
    ] = None,
    temperature: Annotated[float | None, typer.Option(help="Distillation temperature.")] = None,
    teacher_top_k: Annotated[
        int | None, typer.Option(help="kd: cache the target's top-k log-probs once (0: run it on the fly).")
    ] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="seqkd/onpolicy: longest generated answer.")] = None,
    max_train: Annotated[int | None, typer.Option(help="Use only the first N train dialogues (0: all).")] = None,
    eval_data: EvalDataOpt = None,
    epochs: EpochsOpt = None,
    max_steps: MaxStepsOpt = None,
    batch_size: BatchOpt = None,
    lr: LrOpt = None,
    max_tokens: MaxTokensOpt = None,
    save_steps: SaveStepsOpt = None,
    system: SystemOpt = None,
    seed: SeedOpt = None,
    resume: ResumeOpt = None,
) -> None:
    """Train a draft that thinks like the target: sft (same data), kd (distillation), seqkd (the target's own
    answers) or onpolicy (TRL on-policy distillation)."""
    values = {key: value for key, value in locals().items() if key not in ("config", "draft_model")}
    values["draft"] = draft_model
    from spectune.config import load_config
    from spectune.train.draft import DraftConfig, train_draft

    result = train_draft(load_config(DraftConfig, config, values))
    console.print(
        f"draft ({result.method}): eval loss {result.eval_loss_before:.4f} -> {result.eval_loss_after:.4f} "
        f"| {result.model} | {result.seconds:.0f} s"
    )


@app.command()
def acceptance(
    target: Annotated[Path, typer.Option(help="The (fine-tuned, merged) target folder.")],
    draft_models: Annotated[list[str], typer.Option("--draft", help="NAME=FOLDER or FOLDER; repeat for several.")],
    data: Annotated[Path, typer.Option(help="Held-out prompts: a chat dataset or a `data prompts` file.")],
    n: Annotated[int, typer.Option(help="How many prompts.")] = 30,
    max_new_tokens: Annotated[int, typer.Option(help="Longest target answer.")] = 64,
    temperature: Annotated[float, typer.Option(help="Also measure sampling acceptance at this temperature.")] = 0.0,
    profile: Annotated[
        Path | None,
        typer.Option(
            help="Measured profile JSON (cost_ratio, verify_ratio), e.g. a pair manifest's profile or a bench report."
        ),
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results as JSON.")] = None,
) -> None:
    """Offline acceptance: α, accepted run lengths, τ(k), best k and predicted speedup, per draft."""
    from spectune.train.acceptance import run_acceptance

    drafts = dict(_named(item) for item in draft_models)
    report = run_acceptance(
        target,
        drafts,
        data,
        n=n,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        profile_file=profile,
        json_out=json_out,
    )
    _print_acceptance(report)


def _named(item: str) -> tuple[str, Path]:
    name, _, path = item.rpartition("=")
    return (name or Path(path).name), Path(path)


def _print_acceptance(report: dict) -> None:
    table = Table(title=f"acceptance on {report['prompts']} held-out prompts (target's greedy answers)")
    for column in ("draft", "α", "tokens", *(f"τ(k*) / k* / S ({p['name']})" for p in report["profiles"])):
        table.add_column(column)
    for row in report["drafts"]:
        cells = [row["name"], f"{row['alpha']:.1%}", str(row["tokens"])]
        for profile in report["profiles"]:
            k = row["best_k"][profile["name"]]
            cells.append(f"{row['tau_simulated'][str(k)]:.2f} / {k} / {row['speedup'][profile['name']][str(k)]:.2f}x")
        table.add_row(*cells)
    console.print(table)


QuantOpt = Annotated[str, typer.Option(help="Q4_K_M (default), Q4_0, Q4_K_S, Q5_K_M, Q6_K, Q8_0, F16, F32.")]


@app.command()
def export(
    model: Annotated[Path, typer.Option(help="HF model folder (a merged target, or a draft).")],
    out: Annotated[Path, typer.Option(help="The .gguf file to write.")],
    quant: QuantOpt = "Q4_K_M",
    keep_f16: Annotated[bool, typer.Option(help="Keep the F16 GGUF the quantization started from.")] = False,
) -> None:
    """HF -> GGUF with llama.cpp's own converter, then quantize with libllama (atomic)."""
    from spectune.export.gguf import export_model

    path = export_model(model, out, quant, keep_f16=keep_f16)
    console.print(f"{path} ({path.stat().st_size / 1e6:.1f} MB, {quant})")


@app.command("export-pair")
def export_pair(
    target: Annotated[Path, typer.Option(help="The merged target folder.")],
    draft_model: Annotated[Path, typer.Option("--draft", help="The draft folder.")],
    out: Annotated[Path, typer.Option(help="Output folder for both GGUFs, export.json and llama-server.sh.")],
    quant: QuantOpt = "Q4_K_M",
    data: Annotated[Path | None, typer.Option(help="Eval dialogues for the fidelity report.")] = None,
    n: Annotated[int, typer.Option(help="Eval dialogues used for fidelity.")] = 20,
) -> None:
    """Export a target and its draft, check they form a valid speculative pair, report fidelity and sizes."""
    from spectune.export.pair import export_pair as run_export_pair

    texts = None
    if data is not None:
        from spectune.data.read import read_dialogues
        from spectune.models.load import load_tokenizer

        tokenizer = load_tokenizer(target)
        texts = [tokenizer.apply_chat_template(d.messages, tokenize=False) for d in read_dialogues(data).dialogues[:n]]
    report = run_export_pair(target, draft_model, out, quant, texts)
    table = Table(title=f"export ({quant})")
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
    console.print(f"pair accepted by llama.cpp's rules; serve with llama.cpp: {out / 'llama-server.sh'}")


ThreadsOpt = Annotated[int | None, typer.Option(help="Threads for llama.cpp (default: $SPECTUNE_THREADS or all).")]
ExactOpt = Annotated[
    bool,
    typer.Option(
        help="Bit-identical batched logits (no repack, no tiled matmul): "
        "speculative greedy output equals the target's own."
    ),
]


DraftMaxOpt = Annotated[int, typer.Option(help="Draft length k.")]
PMinOpt = Annotated[float, typer.Option(help="Stop drafting below this draft confidence.")]
AdaptiveOpt = Annotated[bool, typer.Option(help="Adapt k to the running acceptance.")]


@app.command()
def generate(
    target: Annotated[Path, typer.Option(help="Target GGUF.")],
    draft_model: Annotated[Path | None, typer.Option("--draft", help="Draft GGUF (speculative decoding).")] = None,
    prompt: Annotated[str | None, typer.Option(help="One user message; omit with --chat.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="An interactive conversation.")] = False,
    system: SystemOpt = None,
    max_tokens: Annotated[int, typer.Option(help="Longest answer.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Top-k (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Top-p.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    draft_max: DraftMaxOpt = 8,
    draft_p_min: PMinOpt = 0.0,
    adaptive: AdaptiveOpt = False,
    threads: ThreadsOpt = None,
    exact: ExactOpt = True,
) -> None:
    """Stream an answer (or a conversation) from the target, with the draft speculating; print the stats."""
    from spectune.runtime.chat import chat_prompt
    from spectune.runtime.llama import LlamaModel
    from spectune.runtime.speculative import SamplingConfig, SpeculativeDecoder

    if prompt is None and not chat:
        raise SpectuneError("give --prompt TEXT or --chat")
    model = LlamaModel(target, threads=threads, exact=exact)
    decoder = SpeculativeDecoder(model, LlamaModel(draft_model, threads=threads, exact=exact) if draft_model else None)
    config = SamplingConfig(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        draft_max=draft_max,
        draft_p_min=draft_p_min,
        adaptive=adaptive,
    )
    messages = [{"role": "system", "content": system}] if system else []
    shown: list[int] = []

    def show(tokens: list[int]) -> bool:
        before = model.detokenize(shown)
        shown.extend(tokens)
        sys.stdout.write(model.detokenize(shown)[len(before) :])
        sys.stdout.flush()
        return True

    while True:
        text = prompt if prompt is not None else typer.prompt("you", prompt_suffix="> ")
        messages.append({"role": "user", "content": text})
        shown.clear()
        answer, stats = decoder.generate(model.tokenize(chat_prompt(model, messages)), config, show)
        messages.append({"role": "assistant", "content": model.detokenize(answer)})
        console.print(
            f"\n[dim]{stats.generated} tokens, {stats.tokens_per_second:.1f} tok/s, TTFT "
            f"{stats.ttft_seconds * 1000:.0f} ms, acceptance {stats.acceptance_rate:.0%}, "
            f"{stats.mean_accepted_len:.2f} tokens per target pass[/]"
        )
        if not chat:
            break


@app.command()
def bench(
    target: Annotated[Path, typer.Option(help="Target GGUF.")],
    draft_models: Annotated[list[str], typer.Option("--draft", help="NAME=GGUF; repeat for several drafts.")],
    data: Annotated[Path, typer.Option(help="Prompts: a chat dataset or a `data prompts` file.")],
    out: Annotated[Path, typer.Option(help="Folder for report.json, report.md, report.png.")] = Path("bench"),
    n: Annotated[int, typer.Option(help="Prompts.")] = 30,
    repeats: Annotated[int, typer.Option(help="Interleaved repeats per prompt (medians).")] = 3,
    max_tokens: Annotated[int, typer.Option(help="Longest answer.")] = 64,
    draft_max: DraftMaxOpt = 8,
    draft_p_min: PMinOpt = 0.0,
    adaptive: AdaptiveOpt = False,
    threads: ThreadsOpt = None,
    exact: ExactOpt = True,
    peer: Annotated[
        str | None,
        typer.Option(help="llama.cpp: also run llama.cpp's own speculative decoder on each pair (ours vs theirs)."),
    ] = None,
) -> None:
    """Target alone vs target + each draft, interleaved, per prompt: tok/s, speedup, acceptance, identical."""
    from spectune.bench.run import BenchConfig
    from spectune.bench.run import bench as run_bench

    if peer not in (None, "llama.cpp"):
        raise SpectuneError(f"--peer {peer}: the only peer is llama.cpp")
    drafts = dict(_named(item) for item in draft_models)
    run_bench(
        BenchConfig(
            target=target,
            drafts=drafts,
            data=data,
            out=out,
            n=n,
            repeats=repeats,
            max_tokens=max_tokens,
            draft_max=draft_max,
            draft_p_min=draft_p_min,
            adaptive=adaptive,
            threads=threads,
            exact=exact,
            peer=peer is not None,
        )
    )
    console.print((out / "report.md").read_text())


@tools_app.command("build-llama-cpp")
def build_llama_cpp(
    cmake_arg: Annotated[
        list[str] | None, typer.Option(help="Extra cmake flag, e.g. -DGGML_CUDA=on; repeatable.")
    ] = None,
    variant: Annotated[str, typer.Option(help="Name of this build (cpu, cuda, ...): each is cached apart.")] = "cpu",
    jobs: Annotated[int | None, typer.Option(help="Parallel compile jobs (default: all cores).")] = None,
) -> None:
    """Build llama.cpp's llama-speculative-simple from the pinned sources (for `bench --peer llama.cpp`)."""
    from spectune.bench.peer import build_llama_cpp as build

    console.print(f"built {build(tuple(cmake_arg or ()), variant, jobs)}")


@app.command("run")
def run_command(
    config: Annotated[Path, typer.Argument(help="Run config (YAML); see configs/ for examples.")],
    from_stage: Annotated[str | None, typer.Option("--from", help="Rerun from this stage on.")] = None,
    only: Annotated[str | None, typer.Option(help="Rerun only this stage.")] = None,
) -> None:
    """The whole pipeline: data -> QLoRA target -> merge -> drafts -> acceptance -> export -> bench -> report."""
    from spectune.pipeline import load_run_config, run_pipeline

    summary = run_pipeline(load_run_config(config), from_stage, only)
    console.print(summary["line"], markup=False)


DEMO_SETTINGS = {
    # Sized so the small pair's whole story fits in about 15 minutes on 2 CPU cores after install.
    "small": {
        "finetune": {"max_steps": 150, "lr": 2e-3, "max_tokens": 256},
        "drafts": {"max_steps": 150, "lr": 2e-3, "max_tokens": 256},
        "acceptance": {"n": 20, "max_new_tokens": 48},
        "bench": {"n": 10, "repeats": 2, "max_tokens": 48},
    },
    "micro": {
        "finetune": {"max_steps": 100, "lr": 5e-3, "max_tokens": 256},
        "drafts": {"max_steps": 80, "lr": 3e-3, "max_tokens": 256},
        "acceptance": {"n": 10, "max_new_tokens": 32},
        "bench": {"n": 5, "repeats": 1, "max_tokens": 32},
    },
    "medium": {
        "finetune": {"max_steps": 400, "lr": 1e-3, "max_tokens": 256},
        "drafts": {"max_steps": 400, "lr": 2e-3, "max_tokens": 256},
        "acceptance": {"n": 30, "max_new_tokens": 64},
        "bench": {"n": 20, "repeats": 3, "max_tokens": 64},
    },
}


@app.command()
def demo(
    size: Annotated[str, typer.Option(help="small (default), micro (a quick look) or medium (~1 h).")] = "small",
    run_dir: Annotated[Path | None, typer.Option(help="Where the run goes (default runs/demo-SIZE).")] = None,
) -> None:
    """The whole story on the built-in default: demo pair, generated voice-bot dialogues, all stages."""
    from spectune.config import validate
    from spectune.pipeline import RunConfig, run_pipeline

    if size not in DEMO_SETTINGS:
        raise SpectuneError(f"unknown demo size {size!r}: choose one of {', '.join(DEMO_SETTINGS)}")
    values = {"run_dir": str(run_dir or Path("runs") / f"demo-{size}"), "models": {"size": size}, **DEMO_SETTINGS[size]}
    config = validate(RunConfig, values, "demo")
    summary = run_pipeline(config)
    gguf = config.run_dir / "gguf"
    bench = summary["bench"]
    best = max((name for name in bench if name != "generic"), key=lambda n: bench[n]["predicted_speedup_gpu"])
    profile = bench[best]["profile"]
    console.print()
    console.print(summary["line"], markup=False)
    console.print(
        f"\nWhy the two speedups differ: on this machine verifying {bench[best]['draft_max'] + 1} tokens costs "
        f"{bench[best]['verify_ratio']:.1f}x one token (r), because decoding on a small CPU is compute-bound. On a GPU "
        "decoding is memory-bound, a batch of k+1 tokens costs about what one does (r = 1), and the same acceptance "
        f"gives the predicted speedup. Measured here: target {profile['target_ms_per_token']:.2f} ms/token, "
        f"draft {profile['draft_ms_per_token']:.2f} ms/token (c = {profile['cost_ratio']:.3f})."
    )
    console.print(
        f"\nChat with the result:\n  spectune generate --chat --target {gguf / 'target.Q4_K_M.gguf'} "
        f"--draft {gguf / (best + '.Q4_K_M.gguf')}\n"
        f"Serve it to a voice bot (OpenAI-compatible, streaming):\n  spectune serve --target "
        f"{gguf / 'target.Q4_K_M.gguf'} --draft {gguf / (best + '.Q4_K_M.gguf')}\n"
        f"or with llama.cpp's own server: {gguf / 'llama-server.sh'}"
    )


@app.command()
def serve(
    target: Annotated[Path, typer.Option(help="Target GGUF.")],
    draft_model: Annotated[Path | None, typer.Option("--draft", help="Draft GGUF (speculative decoding).")] = None,
    host: Annotated[str, typer.Option(help="Bind address (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8000,
    slots: Annotated[int, typer.Option(help="Concurrent generations (each its own contexts).")] = 1,
    n_ctx: Annotated[int, typer.Option(help="Context length per slot.")] = 4096,
    draft_max: DraftMaxOpt = 8,
    queue_timeout: Annotated[float, typer.Option(help="Seconds a request may wait for a slot, then 503.")] = 30.0,
    api_key: Annotated[str | None, typer.Option(envvar="SPECTUNE_API_KEY", help="Require this bearer token.")] = None,
    threads: ThreadsOpt = None,
    exact: ExactOpt = True,
) -> None:
    """OpenAI-compatible streaming chat server (/v1/chat/completions, /v1/models, /health, /metrics)."""
    import uvicorn

    from spectune.serve.app import ServeConfig, create_app

    config = ServeConfig(
        target=target,
        draft=draft_model,
        slots=slots,
        n_ctx=n_ctx,
        threads=threads,
        exact=exact,
        draft_max=draft_max,
        queue_timeout=queue_timeout,
        api_key=api_key,
    )
    uvicorn.run(create_app(config), host=host, port=port, log_level="info")


@app.command()
def call(
    server: Annotated[str, typer.Option(help="Server URL, e.g. http://127.0.0.1:8000.")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option(envvar="SPECTUNE_API_KEY", help="Bearer token.")] = None,
    speak: Annotated[bool, typer.Option(help="Speak each sentence with espeak-ng (if installed).")] = False,
    system: SystemOpt = None,
) -> None:
    """A terminal phone call with the server: streams answers by sentence and shows the time to first words."""
    from spectune.serve.client import run_call

    run_call(server, api_key, speak, system)


@app.command()
def plan(
    model: Annotated[Path, typer.Option(help="A model folder or an HF config.json (no weights needed).")],
    gpu_mem: Annotated[str, typer.Option(help="Memory to plan for, e.g. 16GiB.")] = "16GiB",
    seq: Annotated[int, typer.Option(help="Training sequence length.")] = 2048,
    batch: Annotated[int, typer.Option(help="Training batch size.")] = 1,
    rank: Annotated[int, typer.Option(help="LoRA rank.")] = 16,
    context: Annotated[int, typer.Option(help="Inference context (KV cache) in tokens.")] = 8192,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the plan as JSON.")] = None,
) -> None:
    """Estimate what QLoRA training and 4-bit inference need, and what fits in --gpu-mem."""
    from spectune.train.plan import GIB, parse_memory, plan_report, read_shape

    shape = read_shape(model)
    report = plan_report(shape, parse_memory(gpu_mem), seq=seq, batch=batch, rank=rank, context=context)
    numbers = report["estimate"]
    table = Table(title=f"{model}: {numbers['params'] / 1e9:.2f}B parameters; seq {seq} x batch {batch}, rank {rank}")
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
        (f"KV cache at {context} tokens (f16)", "kv_cache"),
        ("Q4_K_M inference total", "inference_total"),
    ]
    for label, key in rows:
        table.add_row(label, f"{numbers[key] / GIB:.2f}")
    console.print(table)
    for what, fits in report["fits"].items():
        console.print(f"{'[green]fits[/]' if fits else '[red]does not fit[/]'} in {gpu_mem}: {what}")
    longest = report["largest_seq_at_batch"]
    console.print(
        f"longest QLoRA sequence at batch {batch}: {longest['checkpointing']} tokens with gradient "
        f"checkpointing, {longest['no_checkpointing']} without"
    )
    if json_out:
        json_out.write_text(json.dumps(report, indent=2))


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
