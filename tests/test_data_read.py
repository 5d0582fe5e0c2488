"""Readers and validation: every error kind names file, line and field; each format round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spectune.data.read import Dialogue, read_dialogues, write_jsonl
from spectune.errors import SpectuneError

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}


def write_lines(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("bad", "message", "field"),
    [
        ("{not json", "invalid JSON", None),
        (
            {"messages": [{"role": "robot", "content": "x"}, GOOD["messages"][1]]},
            "unknown role 'robot'",
            "messages[0].role",
        ),
        (
            {"messages": [{"role": "user", "content": "  "}, GOOD["messages"][1]]},
            "empty content",
            "messages[0].content",
        ),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant turn", None),
        (
            {"messages": [{"role": "user", "content": 42}, GOOD["messages"][1]]},
            "wrong type: expected a string",
            "messages[0].content",
        ),
        ({"messages": "hello"}, "wrong type: expected a list", "messages"),
        ({"messages": [{"role": "user"}, GOOD["messages"][1]]}, "missing field 'content'", "messages[0]"),
        ({"messages": []}, "no turns", "messages"),
        ({"prompt": "x", "completion": "y"}, "unknown record format", None),
        ([1, 2], "wrong type: expected a JSON object", None),
        (
            {"messages": [GOOD["messages"][0], {"role": "system", "content": "late"}, GOOD["messages"][1]]},
            "a system turn must come first",
            "messages[1].role",
        ),
        (
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            "record is in sharegpt format but the file is in messages format",
            None,
        ),
    ],
)
def test_each_error_kind_names_file_line_and_field(tmp_path, bad, message, field):
    path = write_lines(tmp_path, GOOD, bad, GOOD)
    with pytest.raises(SpectuneError) as caught:
        read_dialogues(path)
    (problem,) = caught.value.problems
    assert problem.line == 2
    assert problem.source == str(path)
    assert message in problem.message
    assert problem.field == field
    assert f"{path}:2" in str(caught.value)


def test_skip_invalid_keeps_going_and_counts(tmp_path):
    path = write_lines(tmp_path, GOOD, "{oops", {"messages": [{"role": "user", "content": "q"}]}, GOOD)
    result = read_dialogues(path, skip_invalid=True)
    assert len(result.dialogues) == 2
    assert [p.line for p in result.dropped] == [2, 3]
    assert result.drop_reasons() == {"invalid JSON": 1, "no assistant turn": 1}


def test_all_invalid_is_an_error_even_when_skipping(tmp_path):
    with pytest.raises(SpectuneError, match="no usable dialogues"):
        read_dialogues(write_lines(tmp_path, "{oops"), skip_invalid=True)


def test_missing_file_and_non_utf8(tmp_path):
    with pytest.raises(SpectuneError, match="no such file"):
        read_dialogues(tmp_path / "absent.jsonl")
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(SpectuneError, match="not UTF-8"):
        read_dialogues(path)


EXPECTED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Book a table\n\nfor two"},
    {"role": "assistant", "content": "Done."},
]


@pytest.mark.parametrize(
    "record",
    [
        {"messages": EXPECTED},
        {
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": EXPECTED[1]["content"]},
                {"from": "gpt", "value": "Done."},
            ]
        },
        {"instruction": "Book a table", "input": "for two", "output": "Done.", "system": "Be brief."},
    ],
    ids=["messages", "sharegpt", "alpaca"],
)
def test_formats_read_to_the_same_turns_and_round_trip(tmp_path, record):
    result = read_dialogues(write_lines(tmp_path, record))
    assert result.dialogues[0].messages == EXPECTED
    out = tmp_path / "out.jsonl"
    write_jsonl(result.dialogues, out)
    again = read_dialogues(out)
    assert again.format == "messages"
    assert again.dialogues[0].messages == EXPECTED


def test_system_prompt_prepended_only_where_missing(tmp_path):
    with_system = {"messages": [{"role": "system", "content": "Own."}, *GOOD["messages"]]}
    result = read_dialogues(write_lines(tmp_path, GOOD, with_system), system="Default.")
    assert result.dialogues[0].messages[0] == {"role": "system", "content": "Default."}
    assert result.dialogues[1].messages[0] == {"role": "system", "content": "Own."}


def test_datasets_save_to_disk_folder(tmp_path):
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_list([{"messages": EXPECTED}, GOOD]).save_to_disk(str(folder))
    result = read_dialogues(folder)
    assert [d.messages for d in result.dialogues] == [EXPECTED, GOOD["messages"]]
    with pytest.raises(SpectuneError, match="not one saved by datasets"):
        read_dialogues(tmp_path)


def test_sgd_sample_loads_with_expected_counts(sgd_dev):
    result = read_dialogues(sgd_dev)
    assert result.records == len(result.dialogues) == 40
    roles = [t["role"] for d in result.dialogues for t in d.messages]
    assert roles.count("user") == roles.count("assistant") == 242
    assert result.dropped == []


def test_write_is_atomic(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")

    def broken():
        yield Dialogue(GOOD["messages"])
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError):
        write_jsonl(broken(), out)
    assert out.read_text() == "previous\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]
