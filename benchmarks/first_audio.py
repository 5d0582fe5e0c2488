"""Time to first audio as a caller of `spectune call --speak` has it: from the end of the caller's turn to the first
audio sample espeak-ng makes of the answer (serve/voice.py), each answer streamed clause by clause. SGD dialogues'
caller turns are piped into `spectune call` as whole lines, one call per dialogue, behind first_token.py's operator
system prompt; the server is `spectune serve` on the target as a user starts it.

Usage: python benchmarks/first_audio.py --target T.gguf --data dev.jsonl --name NAME [--calls 6] [--turns 4]
Writes benchmarks/results/first_audio_NAME.json.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from first_token import SYSTEM_PROMPT, target_and_data
from never_slower import RESULTS, shown

from spectune.data.read import read_dialogues
from spectune.engines.llama_server import LlamaServer, free_port
from spectune.runtime.build import build_name
from spectune.serve.engine import READY_SECONDS

SPECTUNE = str(Path(sys.executable).parent / "spectune")
TURN_LINE = re.compile(r"first words after (\d+) ms.*; first audio (\d+) ms after your turn")


def main() -> None:
    parser = target_and_data()
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    calls = []
    for dialogue in read_dialogues(args.data, need_answer=False).dialogues:
        turns = [m["content"].replace("\n", " ") for m in dialogue.messages if m["role"] == "user"][: args.turns]
        calls += [turns] if len(turns) == args.turns else []
    calls = calls[: args.calls]
    port = free_port()
    command = [SPECTUNE, "serve", "--target", str(args.target), "--threads", str(args.threads), "--port", str(port)]
    command += ["--n-ctx", "4096", "--max-tokens", "48"]
    turns_seen = []
    with tempfile.TemporaryFile("w+") as log, LlamaServer(command, {}, f"http://127.0.0.1:{port}", log) as server:
        server.wait_ready(READY_SECONDS)
        for turns in calls:
            call = [SPECTUNE, "call", "--server", server.url, "--speak", "--system", SYSTEM_PROMPT]
            done = subprocess.run(call, input="\n".join(turns) + "\n", capture_output=True, text=True, timeout=600)
            found = [(int(words), int(audio)) for words, audio in TURN_LINE.findall(done.stdout)]
            if done.returncode != 0 or len(found) != len(turns):
                raise SystemExit(f"spectune call failed:\n{done.stdout}\n{done.stderr}")
            turns_seen += [{"turn": i + 1, "first_words_ms": w, "first_audio_ms": a} for i, (w, a) in enumerate(found)]
            print(" ".join(f"{a}" for _, a in found), "ms to first audio", flush=True)
    later = [turn["first_audio_ms"] for turn in turns_seen if turn["turn"] > 1]
    report = {
        "target": shown(args.target),
        "data": shown(args.data),
        "command": " ".join(["python", "benchmarks/first_audio.py", *sys.argv[1:]]).replace(str(Path.home()), "~"),
        "build": build_name(),
        "synthesizer": subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True).stdout.strip(),
        "median_first_audio_ms": statistics.median(turn["first_audio_ms"] for turn in turns_seen),
        "median_first_audio_ms_first_turns": statistics.median(
            turn["first_audio_ms"] for turn in turns_seen if turn["turn"] == 1
        ),
        "median_first_audio_ms_later_turns": statistics.median(later),
        "median_first_words_ms": statistics.median(turn["first_words_ms"] for turn in turns_seen),
        "turns": turns_seen,
    }
    out = RESULTS / f"first_audio_{args.name}.json"
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "turns"}, indent=2))


if __name__ == "__main__":
    main()
