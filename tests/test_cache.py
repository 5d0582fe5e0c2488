"""The user cache: what two processes build at once is built once, and a failed build leaves nothing."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from spectune.cache import built_once


def build_slowly(final: Path, log: Path) -> str:
    def build(tmp: Path) -> None:
        with log.open("a") as handle:
            handle.write("built\n")
        time.sleep(0.3)  # the other process arrives while this one builds
        tmp.mkdir()
        (tmp / "tool").write_text("ok")

    return str(built_once(final, lambda folder: (folder / "tool").is_file(), build))


def test_two_processes_building_the_same_thing_build_it_once(tmp_path):
    final, log = tmp_path / "tools", tmp_path / "builds.log"
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        found = pool.starmap(build_slowly, [(final, log), (final, log)])
    assert found == [str(final)] * 2 and (final / "tool").read_text() == "ok"
    assert log.read_text() == "built\n"


def test_a_build_that_fails_leaves_nothing_and_the_next_one_builds(tmp_path):
    final = tmp_path / "tools"

    def broken(tmp: Path) -> None:
        tmp.mkdir()
        raise RuntimeError("compiler died")

    with pytest.raises(RuntimeError):
        built_once(final, Path.is_dir, broken)
    assert not final.exists() and [p.name for p in tmp_path.iterdir()] == [".tools.lock"]
    assert built_once(final, Path.is_dir, lambda tmp: tmp.mkdir()) == final and final.is_dir()
