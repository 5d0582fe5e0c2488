"""Shared fixtures. Tests run with 1 thread (torch and llama.cpp): set before anything imports torch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("SPECTUNE_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

SGD_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "sgd"


@pytest.fixture(scope="session")
def sgd_dev() -> Path:
    path = SGD_DIR / "dev.jsonl"
    assert path.is_file(), f"the SGD dev set must be present beside the repo at {path}"
    return path


def run_cli(*args: str) -> int:
    """Run the real entry point in-process; returns its exit code."""
    from spectune.cli import main

    try:
        main(list(args))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


@pytest.fixture(scope="session")
def micro_pair(tmp_path_factory) -> Path:
    """The micro demo pair, built once per test session (under a minute with 1 thread)."""
    from spectune.models.world import build_pair

    return build_pair("micro", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """300 generated voice-bot dialogues."""
    from spectune.data.demo import generate_dialogues
    from spectune.data.read import write_jsonl

    path = tmp_path_factory.mktemp("data") / "demo.jsonl"
    write_jsonl(generate_dialogues(300, seed=0), path)
    return path
