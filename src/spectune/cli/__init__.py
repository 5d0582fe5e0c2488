"""The `spectune` command: one verb per pipeline stage, each a thin call into that stage's entry function, its flags
generated from the stage's settings (flags.py). The verbs live by what they do: data.py, models.py (and tools),
train.py, export.py, decode.py (generate, bench, serve, call, doctor, predict), run.py (run, demo)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from spectune import __version__
from spectune.cli import data, decode, export, models, run, train
from spectune.cli.shared import console
from spectune.errors import SpectuneError

app = typer.Typer(
    help="QLoRA-tune a target, train a draft that thinks like it, run both with speculative decoding.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(data.app, name="data")
app.add_typer(models.models_app, name="models")
app.add_typer(models.tools_app, name="tools")
for verbs in (train.app, export.app, decode.app, run.app):
    app.add_typer(verbs)  # unnamed: their verbs are the root's own


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


def main(argv: list[str] | None = None) -> None:
    """Entry point: a bad input prints what and where, and exits 2."""
    try:
        app(args=argv, prog_name="spectune")
    except SpectuneError as exc:
        # Plain print: rich would wrap long paths, and a user greps these lines.
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
