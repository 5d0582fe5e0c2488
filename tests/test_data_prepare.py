"""Demo generator, split, dedup, prompts and the `spectune data` verbs."""

from __future__ import annotations

import json

from conftest import run_cli

from spectune.data.demo import INTENTS, generate_dialogues
from spectune.data.prepare import dedup, extract_prompts, split_dialogues
from spectune.data.read import Dialogue, read_dialogues, write_jsonl


def test_generator_is_deterministic_covers_every_intent_and_validates(tmp_path):
    first = generate_dialogues(300, seed=7)
    assert [d.messages for d in first] == [d.messages for d in generate_dialogues(300, seed=7)]
    assert [d.messages for d in first] != [d.messages for d in generate_dialogues(300, seed=8)]
    assert {d.source.split(":")[1] for d in first} == set(INTENTS)
    assert len(INTENTS) >= 8
    assert all(2 <= len(d.messages) <= 8 for d in first)
    path = tmp_path / "demo.jsonl"
    write_jsonl(first, path)
    assert len(read_dialogues(path).dialogues) == 300  # the validator accepts every one
    distinct_answers = {t["content"] for d in first for t in d.messages if t["role"] == "assistant"}
    assert len(distinct_answers) > 200  # slots and phrasings vary


def test_split_is_deterministic_dedups_and_counts(tmp_path):
    dialogues, _ = dedup(generate_dialogues(220, seed=1))
    dialogues = dialogues[:200]
    with_dups = dialogues + dialogues[:10]
    split = split_dialogues(with_dups, eval_fraction=0.1, seed=3)
    assert split.dropped == {"exact duplicate": 10}
    assert len(split.train) + len(split.eval) == 200
    assert len(split.eval) == 20
    again = split_dialogues(list(reversed(with_dups)), eval_fraction=0.1, seed=3)
    assert [d.messages for d in again.eval] == [d.messages for d in split.eval]  # order of input irrelevant
    other = split_dialogues(with_dups, eval_fraction=0.1, seed=4)
    assert [d.messages for d in other.eval] != [d.messages for d in split.eval]
    keys = {d.key() for d in split.train}
    assert not keys & {d.key() for d in split.eval}


def test_max_token_filter_counts_drops():
    dialogues = [
        Dialogue([{"role": "user", "content": "a " * n}, {"role": "assistant", "content": "ok"}]) for n in (1, 5, 50)
    ]
    split = split_dialogues(
        dialogues,
        eval_fraction=0.0,
        max_seq_length=10,
        count_tokens=lambda d: len(d.messages[0]["content"].split()),
    )
    assert len(split.train) == 2
    assert split.dropped == {"longer than 10 tokens": 1}


def test_prompts_end_before_an_assistant_turn():
    dialogues = generate_dialogues(100, seed=2)
    prompts = extract_prompts(dialogues, n=30, seed=0)
    assert len(prompts) == 30
    assert prompts == extract_prompts(dialogues, n=30, seed=0)
    for prompt in prompts:
        assert prompt.messages[-1]["role"] == "user"
        cut = len(prompt.messages)
        assert any(
            d.messages[:cut] == prompt.messages and d.messages[cut]["content"] == prompt.reference for d in dialogues
        )


def test_cli_validate_reports_file_line_and_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        '{"messages": [{"role": "bot", "content": "x"}]}\n'
    )
    assert run_cli("data", "validate", str(path)) == 2
    err = capsys.readouterr().err
    assert f"{path}:2 [messages[0].role]: unknown role 'bot'" in err


def test_cli_prepare_writes_nothing_on_bad_input(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("{broken\n")
    out = tmp_path / "out"
    assert run_cli("data", "prepare", str(path), "--out", str(out)) == 2
    assert not out.exists()
    assert run_cli("data", "prepare", "--out", str(out)) == 2  # the dataset, its argument, is required
    assert "[data]: Field required" in capsys.readouterr().err


def test_cli_demo_prepare_prompts(tmp_path, capsys):
    demo = tmp_path / "demo.jsonl"
    assert run_cli("data", "demo", "--demo-dialogues", "120", "--out", str(demo)) == 0
    assert len(demo.read_text().splitlines()) == 120
    assert run_cli("data", "prepare", str(demo), "--out", str(tmp_path / "split"), "--eval-fraction", "0.25") == 0
    n_eval = len((tmp_path / "split" / "eval.jsonl").read_text().splitlines())
    n_train = len((tmp_path / "split" / "train.jsonl").read_text().splitlines())
    assert n_eval == round((n_eval + n_train) * 0.25) and n_eval + n_train > 100
    prompts = tmp_path / "prompts.jsonl"
    assert run_cli("data", "prompts", str(demo), "--n", "5", "--out", str(prompts)) == 0
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert len(rows) == 5 and all(set(r) == {"messages", "reference"} for r in rows)


def test_cli_inspect_sgd_prints_its_table(sgd_dev, tmp_path, capsys):
    out = tmp_path / "stats.json"
    assert run_cli("data", "inspect", str(sgd_dev), "--json-out", str(out)) == 0
    printed = capsys.readouterr().out
    assert "dialogues" in printed and "40" in printed and "assistant words/turn" in printed
    stats = json.loads(out.read_text())
    assert stats["records"] == 40 and stats["invalid_lines"] == 0 and stats["duplicates"] == 0
    assert stats["role_mix"] == {"user": 242, "assistant": 242}


def test_cli_version_and_help(capsys):
    assert run_cli("--version") == 0
    assert "spectune" in capsys.readouterr().out
    for verb in ("inspect", "validate", "prepare", "prompts", "demo"):
        assert run_cli("data", verb, "--help") == 0
