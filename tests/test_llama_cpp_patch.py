"""spectune's patch to the pinned llama.cpp: the qwen2 and gemma3 graphs hand their layers' inputs to an EAGLE-3
head. Both builds carry it (the binding's version says so), and a head trained for a Qwen2 or Gemma 3 target drafts
in llama.cpp's loop exactly as the meter replays it in torch: an unpatched build has no layer inputs for it."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
from conftest import TRAIN, random_model
from test_architectures import MODEL_SHAPE
from test_eagle3 import heads_in_llama_cpp_accept_what_the_meter_says

from spectune.engines.llama_cpp import llama_cpp_source
from spectune.export.gguf import export_model
from spectune.llama_cpp_patch import PatchError, apply_patches, patch_tag, patched_binding_source
from spectune.llama_cpp_pin import (
    HEAD_TARGETS,
    binding_patched,
    binding_version,
    fetch_sdist,
    llama_cpp_version,
    patched_build,
)
from spectune.models.load import load_tokenizer
from spectune.train.draft import DraftConfig, train_draft
from spectune.train.eagle3 import Eagle3Config, train_eagle3

LAYER_INPUT = "res->t_layer_inp[il] = inpL;"
PATCHED_GRAPHS = ("src/models/qwen2.cpp", "src/models/gemma3.cpp")


def test_the_installed_binding_is_built_from_the_patched_sources():
    """`make` builds llama-cpp-python from the patched sdist: its version carries the patches' digest."""
    assert binding_patched(), f"llama-cpp-python {binding_version()}, not {patched_build()}: run `make install`"


def test_the_tools_are_built_from_the_patched_sources():
    source = llama_cpp_source()
    assert patch_tag() in str(source)
    for graph in PATCHED_GRAPHS:
        assert LAYER_INPUT in (source / graph).read_text(), graph
    for architecture in HEAD_TARGETS:  # the one list of targets heads run beside is what the sources do
        assert "t_layer_inp[il]" in (source / "src" / "models" / f"{architecture}.cpp").read_text(), architecture


def fake_sdist(tmp_path: Path, graphs: dict[str, str]) -> Path:
    """A llama-cpp-python sdist holding only the binding's __init__.py and these llama.cpp graph files."""
    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    files = {"llama_cpp/__init__.py": 'from .llama_cpp import *\n\n__version__ = "0.3.36"\n'}
    files |= {f"vendor/llama.cpp/{name}": text for name, text in graphs.items()}
    with tarfile.open(sdist, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-0.3.36/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return sdist


def release_graphs() -> dict[str, str]:
    """The graphs the patch edits, as the pinned release's sdist holds them."""
    prefix = f"llama_cpp_python-{llama_cpp_version()}/vendor/llama.cpp/"
    with tarfile.open(fetch_sdist()) as archive:
        return {graph: archive.extractfile(prefix + graph).read().decode() for graph in PATCHED_GRAPHS}


def test_the_binding_source_is_patched_and_labelled_and_a_foreign_one_refused(tmp_path):
    release = release_graphs()
    assert all(LAYER_INPUT not in text for text in release.values())  # what the patch is for
    source = patched_binding_source(fake_sdist(tmp_path, release), tmp_path / "out")
    assert f'__version__ = "0.3.36+{patch_tag()}"' in (source / "llama_cpp" / "__init__.py").read_text()
    assert all(LAYER_INPUT in (source / "vendor/llama.cpp" / graph).read_text() for graph in PATCHED_GRAPHS)
    foreign = tmp_path / "foreign"
    (foreign / "src/models").mkdir(parents=True)
    for graph in PATCHED_GRAPHS:
        (foreign / graph).write_text("// another llama.cpp\n")
    with pytest.raises(PatchError, match=r"layer-inputs\.patch"):
        apply_patches(foreign)


@pytest.mark.parametrize("architecture", ["qwen2", "gemma3_text"])
def test_a_head_for_a_patched_architecture_drafts_in_llama_cpp_as_the_meter_says(
    architecture, micro_pair, demo_data, tmp_path
):
    """A tiny target of the architecture, trained on the demo dialogues until its answers can be guessed, and a
    head trained for it."""
    tokenizer = load_tokenizer(micro_pair / "target")
    shape = {**MODEL_SHAPE[architecture], "num_hidden_layers": 4}
    untrained = random_model(tokenizer, tmp_path / architecture, architecture, **shape)
    trained = DraftConfig(
        target=untrained,
        draft=untrained,
        method="sft",
        data=demo_data,
        out=tmp_path / "trained",
        max_steps=200,
        lr=5e-3,
    )
    target = train_draft(trained.model_copy(update=TRAIN)).model
    config = Eagle3Config(
        target=target,
        data=demo_data,
        out=tmp_path / "head",
        max_steps=40,
        batch_size=8,
        max_seq_length=256,
        max_eval=16,
    )
    head = train_eagle3(config).model
    target_gguf = export_model(target, tmp_path / "target.gguf", "F32")
    head_gguf = export_model(head, tmp_path / "head.gguf", "F32", target_model_dir=target)
    # The tiny Qwen2 carries the demo pairs' tokenizer, which llama.cpp's qwen2 vocabulary rules split and end
    # differently from HF on some prompts: there HF's replay is not llama.cpp's path, so only Gemma 3 is replayed.
    replayed = architecture != "qwen2"
    assert heads_in_llama_cpp_accept_what_the_meter_says(target, head, target_gguf, head_gguf, demo_data, replayed) > 0
