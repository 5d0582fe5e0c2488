"""`spectune call`: a terminal conversation with a spectune server, as a voice bot would hold it."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid

import httpx
import typer

from spectune.errors import SpectuneError


def run_call(server: str, api_key: str | None, speak: bool, system: str | None, timeout: float = 30.0) -> None:
    if not server.startswith(("http://", "https://")):
        raise SpectuneError(f"--server {server}: give a URL with its scheme, e.g. http://127.0.0.1:8000")
    try:
        _converse(server, api_key, speak, system, timeout)
    except httpx.TimeoutException as exc:
        raise SpectuneError(f"--server {server}: no answer within {timeout:g} s ({type(exc).__name__})") from exc
    except httpx.TransportError as exc:
        raise SpectuneError(f"--server {server}: cannot reach it ({type(exc).__name__}: {exc})") from exc


def _converse(server: str, api_key: str | None, speak: bool, system: str | None, timeout: float) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    voice = shutil.which("espeak-ng") if speak else None
    if speak and voice is None:
        typer.echo("espeak-ng is not installed: answers are shown, not spoken")
    messages = [{"role": "system", "content": system}] if system else []
    call_id = f"call-{uuid.uuid4().hex[:12]}"  # the server reuses this call's cached prefix turn after turn
    with httpx.Client(base_url=server, headers=headers, timeout=timeout) as client:
        while True:
            try:
                text = typer.prompt("you", prompt_suffix="> ")
            except (typer.Abort, EOFError):
                return
            messages.append({"role": "user", "content": text})
            body = {"messages": messages, "stream": True, "chunking": "sentence", "user": call_id}
            body["stream_options"] = {"include_usage": True}
            turn = _turn(client, body, voice)
            if turn is None:
                messages.pop()
                continue
            answer, line = turn
            # Kept even when empty (the server takes an empty assistant turn): the roles still alternate.
            messages.append({"role": "assistant", "content": answer})
            typer.echo(f"\n  [{line}]")


def _turn(client: httpx.Client, body: dict, voice: str | None) -> tuple[str, str] | None:
    """One streamed answer, spoken sentence by sentence; (its text, what the caller waited for), or None when the
    server refused the turn."""
    start = time.perf_counter()
    first, answer, stats, usage = None, "", {}, {}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            typer.echo(f"error {response.status_code}: {response.read().decode()}")
            return None
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                typer.echo(f"\n[the answer was cut: {chunk['error']['message']}]")
                break
            if chunk["choices"] and chunk["choices"][0].get("finish_reason") == "abort":
                typer.echo("\n[the server stopped: the answer above is not whole]")
            stats, usage = chunk.get("spectune", stats), chunk.get("usage", usage)
            delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if delta:
                first = first or time.perf_counter() - start
                answer += delta
                typer.echo(delta, nl=False)
                if voice:
                    subprocess.run([voice, delta], check=False)
    said = f"first words after {1000 * (first or 0):.0f} ms"
    if stats:  # the engine's side: its first token, its speed, and what it reused of the conversation
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        said += (
            f"; first token {1000 * stats['ttft_seconds']:.0f} ms, {stats['tokens_per_second']:.0f} tok/s, "
            f"{stats['mean_accepted_len']:.2f} tokens a target pass, {cached}/{usage.get('prompt_tokens', 0)} "
            "prompt tokens cached"
        )
    return answer, said
