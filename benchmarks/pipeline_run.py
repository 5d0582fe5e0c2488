"""What the result scripts share: a pipeline config from the command line, run (finished stages reused)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from spectune.config import validate
from spectune.pipeline.config import RunConfig, demo_config, load_run_config
from spectune.pipeline.run import run_pipeline

RESULTS = Path(__file__).parent / "results"


def write_result(name: str, report: dict[str, Any]) -> None:
    """results/NAME as JSON, the user's home written as ~ (committed files name no one's machine)."""
    (RESULTS / name).write_text(json.dumps(report, indent=2).replace(str(Path.home()), "~"))


def command_line(doc: str | None, switches: dict[str, str] | None = None) -> argparse.Namespace:
    """`SCRIPT CONFIG.yaml --name NAME` and the script's own on/off `switches` (flag -> help)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a run config YAML, or demo:SIZE for what `spectune demo --size SIZE` runs")
    parser.add_argument("--name", required=True, help="suffix of the result files")
    for flag, help_text in (switches or {}).items():
        parser.add_argument(flag, action="store_true", help=help_text)
    if set(LEAN_SWITCHES) <= set(switches or {}):  # the lean runs may also bench fewer prompts
        parser.add_argument("--prompts", type=int, default=None, help="bench only the first N prompts (bench.n)")
    return parser.parse_args()


# Switches that trim a long real-model run to what a result needs (benchmarks/speculative.py and eagle3.py)
LEAN_SWITCHES = {
    "--methods-seqkd": "train only the seqkd draft (drafts.methods: [seqkd])",
    "--one-repeat": "one timed run per prompt and variant after the warm-up (bench.repeats: 1)",
}


def lean_overrides(args: argparse.Namespace, overrides: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`overrides` with what the LEAN_SWITCHES given on the command line set."""
    if args.methods_seqkd:
        overrides.setdefault("drafts", {})["methods"] = ["seqkd"]
    if args.one_repeat:
        overrides.setdefault("bench", {})["repeats"] = 1
    if args.prompts is not None:
        overrides.setdefault("bench", {})["n"] = args.prompts
    return overrides


def config_from_command_line(source: str, overrides: dict[str, dict[str, Any]] | None = None) -> RunConfig:
    """The run config named by `source` (a YAML or demo:SIZE), settings of its sections overridden by `overrides`
    ({"bench": {"peer": True}}: a changed bench setting reruns the bench stage alone)."""
    demo_size = source.removeprefix("demo:") if source.startswith("demo:") else None
    config = demo_config(demo_size) if demo_size else load_run_config(Path(source))
    update = {}
    for section, values in (overrides or {}).items():
        current = getattr(config, section)
        update[section] = validate(type(current), {**current.model_dump(), **values}, f"{source}: {section}")
    return config.model_copy(update=update)


def run_from_command_line(
    doc: str | None,
    args: argparse.Namespace | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    rerun_from: str | None = None,
) -> tuple[RunConfig, dict[str, Any], str]:
    """(the run config, the run's summary, the result-file suffix) for `SCRIPT CONFIG.yaml --name NAME`, the config's
    settings overridden by `overrides` (see config_from_command_line). Finished stages are reused from the run
    directory, but `rerun_from` and every stage after it run again: a result file names the commit it ran on, so
    what it measures must not come from an earlier commit's run."""
    args = args or command_line(doc)
    config = config_from_command_line(args.config, overrides)
    summary = run_pipeline(config, force_from=rerun_from)
    RESULTS.mkdir(exist_ok=True)
    return config, summary, args.name
