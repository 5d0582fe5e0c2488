"""A model named as people name it works wherever a model folder does: a hub id (from huggingface_hub's own cache,
laid out here as huggingface_hub lays it out, with no network: nothing of the resolution is mocked) and a GGUF file
(imported once into the user cache)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spectune.errors import SpectuneError
from spectune.export.gguf import convert
from spectune.models.derive import derive_draft
from spectune.models.resolve import is_hub_id, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo_id: str, folder: Path) -> Path:
    """`folder` as huggingface_hub caches a download of `repo_id` at COMMIT: content-addressed blobs, a snapshot of
    relative links to them, and refs/main naming the commit."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(folder.iterdir()):
        if file.is_file():
            blob = hashlib.sha256(file.read_bytes()).hexdigest()
            (repo / "blobs" / blob).write_bytes(file.read_bytes())
            (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def spectune(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "spectune.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env}, timeout=600)


def test_what_names_a_hub_repository():
    assert is_hub_id("Qwen/Qwen2.5-1.5B-Instruct") and is_hub_id("acme/tiny@v1.0")
    assert not is_hub_id("runs/demo/target/merged/extra") and not is_hub_id("model.gguf") and not is_hub_id("tiny")
    with pytest.raises(SpectuneError, match="no such model folder, GGUF file or hub id"):
        resolve_model("no-such-folder")


def test_a_hub_id_works_offline_from_the_hub_cache_and_a_missing_one_says_which(micro_pair, tmp_path):
    hub = tmp_path / "hub"
    snapshot = hub_cache(hub, "acme/micro-target", micro_pair / "target")
    env = {"HF_HUB_CACHE": str(hub), "SPECTUNE_CACHE": str(tmp_path / "cache")}
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    derived = spectune("models", "derive", "acme/micro-target", str(tmp_path / "draft"), "--layer", "0", env=offline)
    assert derived.returncode == 0, derived.stderr + derived.stdout
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["num_hidden_layers"] == 1
    # No network (nothing listens at the endpoint) and not told to stay offline: the cache answers all the same.
    unreachable = {**env, "HF_HUB_ETAG_TIMEOUT": "2", "HF_ENDPOINT": "http://127.0.0.1:9"}
    unpinned = spectune("models", "derive", "acme/micro-target", str(tmp_path / "d2"), "--layer", "1", env=unreachable)
    assert unpinned.returncode == 0, unpinned.stderr + unpinned.stdout
    at_commit = f"acme/micro-target@{COMMIT}"
    pinned = spectune("models", "derive", at_commit, str(tmp_path / "d4"), "--layer", "1", env=offline)
    assert pinned.returncode == 0, pinned.stderr + pinned.stdout
    assert (snapshot / "config.json").is_file()

    missing = spectune("models", "derive", "acme/absent", str(tmp_path / "d3"), "--layer", "0", env=offline)
    assert missing.returncode != 0
    assert "acme/absent: not in the Hugging Face cache" in missing.stderr + missing.stdout
    assert not (tmp_path / "d3").exists()


def test_a_gguf_file_works_where_a_model_folder_does_and_is_imported_once(tuned_target, tmp_path, monkeypatch):
    gguf = convert(tuned_target, tmp_path / "target.F32.gguf", "F32")
    monkeypatch.setenv("SPECTUNE_CACHE", str(tmp_path / "cache"))
    folder = resolve_model(gguf)
    assert folder.is_relative_to(tmp_path / "cache") and (folder / "spectune_import.json").is_file()
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert resolve_model(gguf) == folder and (folder / "config.json").stat().st_mtime_ns == stamp  # not again
    draft = derive_draft(gguf, [0], tmp_path / "draft")
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
