"""The published figures the card model is fitted on (published.yaml beside this file), read into typed rows."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import yaml

from spectune.errors import SpectuneError
from spectune.speedup import Weights

HTTP = "http"  # a server timed by its client: the row carries the server's per-token work


@dataclass(frozen=True)
class CardSpec:
    name: str
    bandwidth: float  # bytes per second, the vendor's figure
    memory_gb: float
    compute: float  # CUDA compute capability


@dataclass(frozen=True)
class ModelShape:
    """A model as one decode step sees it, from the facts a source states."""

    model: str
    quant: str
    arch: str  # dense | hybrid | moe | ple
    layers: int
    file_bytes: float
    params: float
    vocab: int
    hidden: int
    tied: bool | None  # None: not stated, the whole file taken as what a step reads

    def weights(self) -> Weights:
        """Bytes a step reads: the embedding table's share of the file estimated from its shape (its rows at the
        file's mean width), so an untied table costs one row a step, as speedup.Weights counts it."""
        embedding = round(self.file_bytes * self.vocab * self.hidden / self.params)
        tied = self.tied is None or self.tied
        return Weights(round(self.file_bytes), embedding, self.vocab, tied, self.layers)


@dataclass(frozen=True)
class PublishedRow:
    card: CardSpec
    shape: ModelShape
    tokens_per_s: float
    method: str  # llama-bench | http | main
    date: datetime.date
    build: str
    source: str
    depth: int  # tokens already in the context, where the source states it


@dataclass(frozen=True)
class Sweep:
    """A decode micro-batch sweep: tokens per second at micro-batch n, one sequence."""

    source: str
    card: CardSpec
    shape: ModelShape
    tokens_per_s: dict[int, float]


@dataclass(frozen=True)
class Published:
    cards: dict[str, CardSpec]
    rows: list[PublishedRow]
    sweeps: dict[str, Sweep]  # central, low
    reference_card: CardSpec
    story: ModelShape
    story_tokens_per_s: float
    shapes: dict[str, ModelShape]  # every named shape, the planned ones included


def _shape(fields: dict[str, Any]) -> ModelShape:
    return ModelShape(
        fields["model"],
        fields["quant"],
        fields["arch"],
        int(fields["layers"]),
        float(fields["file_gb"]) * 1e9,
        float(fields["params_b"]) * 1e9,
        int(fields["vocab"]),
        int(fields["hidden"]),
        fields["tied"],
    )


def _card(cards: dict[str, CardSpec], name: str, where: str) -> CardSpec:
    if name not in cards:
        raise SpectuneError(f"published.yaml: {where}: no card named {name!r} under `cards`")
    return cards[name]


@cache
def published() -> Published:
    """The table, parsed once; a row naming an unknown card, model or source is an error naming the row."""
    raw = yaml.safe_load(resources.files("spectune.gpu").joinpath("published.yaml").read_text())
    cards = {
        name: CardSpec(name, float(c["bandwidth_gbs"]) * 1e9, float(c["memory_gb"]), float(c["compute"]))
        for name, c in raw["cards"].items()
    }
    shapes = {key: _shape(fields) for key, fields in (raw["models"] | raw["planned"]).items()}
    rows = []
    for index, (source_key, card_name, model_key, speed) in enumerate(raw["rows"]):
        where = f"rows[{index}]"
        if model_key not in shapes or source_key not in raw["sources"]:
            raise SpectuneError(f"published.yaml: {where}: unknown model {model_key!r} or source {source_key!r}")
        source = raw["sources"][source_key]
        rows.append(
            PublishedRow(
                _card(cards, card_name, where),
                shapes[model_key],
                float(speed),
                source["method"],
                source["date"],
                str(source["build"]),
                source["source"],
                int(source.get("depth", 0)),
            )
        )
    sweeps = {
        key: Sweep(
            s["source"],
            _card(cards, s["card"], f"sweeps.{key}"),
            shapes[s["model"]],
            {int(n): float(v) for n, v in s["tokens_per_s"].items()},
        )
        for key, s in raw["sweeps"].items()
    }
    story = raw["story"]
    reference = _card(cards, raw["reference_card"], "reference_card")
    return Published(cards, rows, sweeps, reference, _shape(story), float(story["tokens_per_s"]), shapes)
