"""Shared fixtures. Tests run with 1 thread (torch and llama.cpp): set before anything imports torch."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("SPECTUNE_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# What makes a test slow: training a model, building llama.cpp's tools. `make test-fast` leaves out every test that
# uses one of these, and the tests marked slow by hand (a model made in the test itself, a subprocess of torchrun).
SLOW_FIXTURES = {"micro_pair", "tuned_target", "sft_draft", "pair", "llama_server", "gemma4_pair"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def sgd_dev() -> Path:
    """40 real SGD dev dialogues shipped with the tests (tests/data/README.md: source and licence)."""
    return Path(__file__).parent / "data" / "sgd_dev_sample.jsonl"


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
    from spectune.models.demo_pair import build_pair

    return build_pair("micro", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """300 generated voice-bot dialogues."""
    from spectune.data.demo import generate_dialogues
    from spectune.data.read import write_jsonl

    path = tmp_path_factory.mktemp("data") / "demo.jsonl"
    write_jsonl(generate_dialogues(300, seed=0), path)
    return path


TRAIN = {"batch_size": 8, "max_seq_length": 256, "max_eval": 16}


def tuned(base: Path, data: Path, out: Path) -> Path:
    """`base` after QLoRA on `data` (100 steps), merged: an HF folder under `out`."""
    from spectune.train.target import FinetuneConfig, MergeConfig, finetune, merge

    result = finetune(FinetuneConfig(model=base, data=data, out=out, max_steps=100, lr=5e-3, **TRAIN))
    return merge(MergeConfig(base=base, adapter=result.adapter, out=out / "merged")).model


@pytest.fixture(scope="session")
def tuned_target(micro_pair, demo_data, tmp_path_factory) -> Path:
    """The micro target after QLoRA on the demo data, merged (an HF folder)."""
    return tuned(micro_pair / "target", demo_data, tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def sft_draft(micro_pair, tuned_target, demo_data, tmp_path_factory) -> Path:
    """The micro draft fine-tuned on the same data (the reference story's method)."""
    from spectune.train.draft import DraftConfig, train_draft

    out = tmp_path_factory.mktemp("sft")
    config = DraftConfig(
        target=tuned_target,
        draft=micro_pair / "draft",
        data=demo_data,
        out=out,
        method="sft",
        max_steps=60,
        lr=3e-3,
        **TRAIN,
    )
    return train_draft(config).model


@pytest.fixture(scope="session")
def pair(tuned_target, sft_draft, tmp_path_factory) -> tuple[Path, Path]:
    """The tuned micro target and its sft draft as Q8_0 GGUFs (what the server tests serve)."""
    from spectune.export.gguf import export_model

    folder = tmp_path_factory.mktemp("serve")
    return export_model(tuned_target, folder / "t.gguf", "Q8_0"), export_model(sft_draft, folder / "d.gguf", "Q8_0")


@pytest.fixture(scope="session")
def messages(demo_data) -> list[dict[str, str]]:
    """A held-out conversation up to an assistant turn."""
    from spectune.data.prepare import extract_prompts
    from spectune.data.read import read_dialogues

    return extract_prompts(read_dialogues(demo_data).dialogues, 4, seed=9)[0].messages


@contextmanager
def running(config) -> Iterator[str]:
    """A spectune server on a free loopback port for the block; its URL."""
    from spectune.serve.launch import serve_in_thread

    instance, thread, url = serve_in_thread(config)
    try:
        yield url
    finally:
        instance.stop()
        thread.join(timeout=30)


def swap_two_tokens(folder: Path, out: Path) -> Path:
    """A copy of a model folder whose tokenizer has tokens 300 and 301 swapped: an incompatible draft."""
    import json
    import shutil

    shutil.copytree(folder, out)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out


def random_model(tokenizer, folder: Path, model_type: str, seed: int = 0, **shape) -> Path:
    """A tiny random model of `model_type` carrying `tokenizer`, saved with it in `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
