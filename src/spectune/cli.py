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


def main(argv: list[str] | None = None) -> None:
    """Entry point: a bad input prints what and where, and exits 2."""
    try:
        app(args=argv, prog_name="spectune")
    except SpectuneError as exc:
        # Plain print: rich would wrap long paths, and a user greps these lines.
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
