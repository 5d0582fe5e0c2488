"""`spectune call`: a terminal conversation with a spectune server, as a voice bot would hold it: the caller's words
are sent as they are typed (prefilled while the caller goes on), and each answer streams by sentence."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import termios
import threading
import time
import tty
import uuid
from collections.abc import Callable

import httpx
import typer

from spectune.errors import SpectuneError
from spectune.serve.voice import Voice


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
    voice = Voice.find() if speak else None
    if speak and voice is None:
        typer.echo("espeak-ng is not installed: answers are shown, not spoken")
    elif voice is not None and voice.player is None:
        typer.echo("no audio player (aplay, paplay): answers are synthesized and timed, not heard")
    first_audio: list[float] = []  # per turn, seconds from the end of the caller's turn
    try:
        _calls(server, headers, voice, system, timeout, first_audio)
    finally:
        if first_audio:
            typer.echo(
                f"time to first audio: median {1000 * statistics.median(first_audio):.0f} ms over "
                f"{len(first_audio)} turns"
            )


def _calls(
    server: str,
    headers: dict[str, str],
    voice: Voice | None,
    system: str | None,
    timeout: float,
    first_audio: list[float],
) -> None:
    messages = [{"role": "system", "content": system}] if system else []
    call_id = f"call-{uuid.uuid4().hex[:12]}"  # the server reuses this call's cached prefix turn after turn
    with httpx.Client(base_url=server, headers=headers, timeout=timeout) as client:
        while True:

            def heard(partial: str) -> None:  # the words so far, prefilled while the caller goes on (serving.md)
                body = {"messages": [*messages, {"role": "user", "content": partial}], "max_tokens": 0}
                with contextlib.suppress(httpx.HTTPError):
                    client.post("/v1/chat/completions", json={**body, "user": call_id})

            try:
                text = read_turn(heard)
            except (typer.Abort, EOFError, KeyboardInterrupt):
                return
            messages.append({"role": "user", "content": text})
            body = {"messages": messages, "stream": True, "chunking": "sentence", "user": call_id}
            body["stream_options"] = {"include_usage": True}
            turn = _turn(client, body, voice)
            if turn is None:
                messages.pop()
                continue
            answer, line = turn
            if voice is not None and (audio := voice.finish()) is not None:
                first_audio.append(audio)
                line += f"; first audio {1000 * audio:.0f} ms after your turn"
            # Kept even when empty (the server takes an empty assistant turn): the roles still alternate.
            messages.append({"role": "assistant", "content": answer})
            typer.echo(f"\n  [{line}]")


PARTIAL_GAP_SECONDS = 0.3  # partial transcripts at most this often, as a streaming recognizer sends them


def read_turn(heard: Callable[[str], None]) -> str:
    """The caller's next line. At a terminal, the words so far go to `heard` (on a thread, at most every 0.3 s) at
    each space, as a recognizer's partial transcripts would; from a pipe, the line as a whole."""
    if not sys.stdin.isatty():
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")
    typer.echo("you> ", nl=False)
    typed, sent = "", 0.0
    descriptor = sys.stdin.fileno()
    saved = termios.tcgetattr(descriptor)
    tty.setcbreak(descriptor, termios.TCSANOW)  # keeps what was typed ahead (TCSAFLUSH would drop it)
    try:
        while (key := sys.stdin.read(1)) not in ("\n", "\r"):
            if not key or key == "\x04":  # Ctrl-D
                raise EOFError
            typed = typed[:-1] if key in ("\x7f", "\b") else typed + key
            typer.echo("\b \b" if key in ("\x7f", "\b") else key, nl=False)
            if key == " " and typed.strip() and time.monotonic() - sent >= PARTIAL_GAP_SECONDS:
                sent = time.monotonic()
                threading.Thread(target=heard, args=(typed.strip(),), daemon=True).start()
    finally:
        termios.tcsetattr(descriptor, termios.TCSADRAIN, saved)
    typer.echo("")
    return typed.strip()  # what the partials sent: a trailing space would change the last tokens


def _turn(client: httpx.Client, body: dict, voice: Voice | None) -> tuple[str, str] | None:
    """One streamed answer, spoken clause by clause; (its text, what the caller waited for), or None when the
    server refused the turn."""
    start = time.perf_counter()
    if voice is not None:
        voice.turn(start)
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
                if voice is not None:
                    voice.say(delta)
    said = f"first words after {1000 * (first or 0):.0f} ms"
    if stats:  # the engine's side: its first token, its speed, and what it reused of the conversation
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        said += (
            f"; first token {1000 * stats['ttft_seconds']:.0f} ms, {stats['tokens_per_second']:.0f} tok/s, "
            f"{stats['mean_accepted_len']:.2f} tokens a target pass, {cached}/{usage.get('prompt_tokens', 0)} "
            "prompt tokens cached"
        )
    return answer, said
