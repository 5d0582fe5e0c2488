"""The server's Prometheus metrics (`GET /metrics`)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from spectune.runtime.mode import ModeChoice
from spectune.serve.prefix_cache import PrefixStore


def make_metrics(registry: CollectorRegistry) -> dict[str, Any]:
    latency = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
    return {
        "requests": Counter(
            "spectune_requests", "Requests by status (499: the caller hung up)", ["status"], registry=registry
        ),
        "ttft": Histogram(
            "spectune_ttft_seconds",
            "Time to first token as the caller sees it: from the request's arrival, the wait for a slot included",
            registry=registry,
            buckets=latency,
        ),
        "queue_wait": Histogram(
            "spectune_queue_wait_seconds", "Time a request waited for a slot", registry=registry, buckets=latency
        ),
        "tps": Histogram(
            "spectune_tokens_per_second",
            "Decode tokens/s per request",
            registry=registry,
            buckets=(5, 10, 20, 40, 80, 160, 320, 640, 1280),
        ),
        "acceptance": Gauge("spectune_acceptance_rate", "Acceptance rate of the last request", registry=registry),
        "accepted_len": Gauge("spectune_mean_accepted_len", "Tokens per target pass, last request", registry=registry),
        "queue": Gauge("spectune_queue_depth", "Requests waiting for a slot", registry=registry),
        "connections_closed": Counter(
            "spectune_connections_closed",
            "Connections the server closed: header_timeout, body_timeout (answered 408), evicted (the oldest without "
            "a request, to make room past max_connections; an upload answered 503), full, answered_before_body, "
            "shutdown (an upload answered 503 at the stop)",
            ["reason"],
            registry=registry,
        ),
        "slots_in_use": Gauge("spectune_slots_in_use", "Slots running a generation", registry=registry),
        "cached_tokens": Counter(
            "spectune_prompt_tokens_cached", "Prompt tokens served from a cached prefix", registry=registry
        ),
        "stages": Histogram(
            "spectune_stage_seconds",
            "Time before the first token, per stage: tokenize, queue, restore (a saved prefix into the slot), prefill, "
            "first_step; and save (the conversation kept after the answer)",
            ["stage"],
            registry=registry,
            buckets=latency,
        ),
        "prefix_bytes": Gauge("spectune_prefix_cache_bytes", "Host memory the saved prefixes hold", registry=registry),
        "prefix_entries": Gauge(
            "spectune_prefix_cache_entries", "Saved prefixes: system prompts and conversations", registry=registry
        ),
    }


def prefix_metrics(metrics: dict[str, Any], store: PrefixStore) -> None:
    """The gauges read the store when scraped, never a copy."""
    metrics["prefix_bytes"].set_function(lambda: store.bytes)
    metrics["prefix_entries"].set_function(lambda: len(store.entries))


def mode_metrics(registry: CollectorRegistry, choice: ModeChoice) -> None:
    """The way this server decodes, and what --mode auto measured at start, in /metrics."""
    mode = Gauge(
        "spectune_mode", "1 for the way this server decodes: speculative, fastest", ["mode"], registry=registry
    )
    measured = Gauge(
        "spectune_mode_calibration_tokens_per_second",
        "Decode speed --mode auto measured at start, per mode",
        ["mode"],
        registry=registry,
    )
    for name in ("speculative", "fastest"):
        mode.labels(mode=name).set(1 if name == choice.mode else 0)
        rate = getattr(choice, f"{name}_tokens_per_second")
        if rate is not None:
            measured.labels(mode=name).set(rate)
