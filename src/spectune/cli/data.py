"""`spectune data ...`: read, check, split and inspect chat datasets; make demo data."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from spectune.cli.shared import console
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
from spectune.errors import SpectuneError
from spectune.flags import config_command
from spectune.models.load import load_tokenizer

app = typer.Typer(help="Read, check, split and inspect chat datasets; make demo data.", no_args_is_help=True)


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


@config_command(app, ReadConfig, name="validate")
def data_validate(config: ReadConfig) -> None:
    """Check every record; list each problem with file, line and field (exit 2 if any)."""
    result = _read(config.data, config.system, skip_invalid=False)
    console.print(f"{config.data}: {len(result.dialogues)} dialogues in {result.format} format, all valid")


@config_command(app, InspectConfig, name="inspect")
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


@config_command(app, PrepareConfig, name="prepare")
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


@config_command(app, PromptsConfig, name="prompts")
def data_prompts(config: PromptsConfig) -> None:
    """Extract (context, reference answer) pairs at assistant turns, for bench and acceptance."""
    prompts = extract_prompts(_read(config.data, config.system, skip_invalid=False).dialogues, config.n, config.seed)
    write_prompts(prompts, config.out)
    console.print(f"{len(prompts)} prompts -> {config.out}")


@config_command(app, DemoDataConfig, name="demo")
def data_demo(config: DemoDataConfig) -> None:
    """Generate phone voice-bot dialogues (9 intents, slots, 2–8 turns)."""
    count = write_jsonl(generate_dialogues(config.demo_dialogues, config.seed), config.out)
    console.print(f"{count} dialogues -> {config.out}")
