"""`spectune call`: a terminal conversation with a spectune server, as a voice bot would hold it."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid

import httpx
import typer


def run_call(server: str, api_key: str | None, speak: bool, system: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    voice = shutil.which("espeak-ng") if speak else None
    if speak and voice is None:
        typer.echo("espeak-ng is not installed: answers are shown, not spoken")
    messages = [{"role": "system", "content": system}] if system else []
    call_id = f"call-{uuid.uuid4().hex[:12]}"  # the server reuses this call's cached prefix turn after turn
    with httpx.Client(base_url=server, headers=headers, timeout=120) as client:
        while True:
            try:
                text = typer.prompt("you", prompt_suffix="> ")
            except (typer.Abort, EOFError):
                return
            messages.append({"role": "user", "content": text})
            start = time.perf_counter()
            first = None
            answer = ""
            body = {"messages": messages, "stream": True, "chunking": "sentence", "user": call_id}
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    typer.echo(f"error {response.status_code}: {response.read().decode()}")
                    messages.pop()
                    continue
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        typer.echo(f"\nerror: {chunk['error']['message']}")
                        break
                    delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                    if not delta:
                        continue
                    first = first or time.perf_counter() - start
                    answer += delta
                    typer.echo(delta, nl=False)
                    if voice:
                        subprocess.run([voice, delta], check=False)
            messages.append({"role": "assistant", "content": answer})
            typer.echo(f"\n  [first words after {1000 * (first or 0):.0f} ms]")
