"""A long loop says how far it is when its output is not a terminal (a log file, CI, nohup)."""

from __future__ import annotations

from spectune.progress import progress


def test_a_loop_piped_to_a_file_prints_plain_progress_lines(capsys):
    assert list(progress([10, 20, 30], "answers", every_seconds=0.0)) == [10, 20, 30]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == ["answers: 1/3", "answers: 2/3", "answers: 3/3"]
    assert lines[-1].endswith("about 0 s left")


def test_between_lines_it_waits_its_interval_but_always_says_the_end(capsys):
    assert list(progress(range(5), "teacher", every_seconds=3600.0)) == list(range(5))
    assert capsys.readouterr().out.splitlines() == ["teacher: 5/5, 0 s, about 0 s left"]
