"""`spectune call --speak`: an answer spoken clause by clause as it streams, as a voice bot's TTS speaks it, and the
time from the end of the caller's turn to the first audio sample of the answer (time to first audio).

espeak-ng synthesizes each clause to a WAV stream (`--stdout`); the first bytes past its header are the first
sample. A player (aplay, paplay) plays them where one is installed; without one the audio is made and timed, not
heard. Synthesis and playing run on a thread of their own, so the answer keeps streaming while a clause is spoken.
"""

from __future__ import annotations

import queue
import shutil
import subprocess
import threading
import time

WAV_HEADER_BYTES = 44  # RIFF, fmt and data chunk headers: what espeak-ng writes before the first sample
PLAYERS = (["aplay", "-q"], ["paplay"])


class Voice:
    """Speaks clauses in order on its own thread; times each turn's first audio sample."""

    def __init__(self, synthesizer: str, player: list[str] | None) -> None:
        self.synthesizer, self.player = synthesizer, player
        self.clauses: queue.Queue[str] = queue.Queue()
        self.turn_ended = 0.0  # perf_counter when the caller's turn ended
        self.first_audio: float | None = None  # seconds from it to the turn's first sample
        self.thread = threading.Thread(target=self._speak, daemon=True)
        self.thread.start()

    @classmethod
    def find(cls) -> Voice | None:
        """espeak-ng with the first player installed, or None without espeak-ng."""
        synthesizer = shutil.which("espeak-ng")
        if synthesizer is None:
            return None
        return cls(synthesizer, next((player for player in PLAYERS if shutil.which(player[0])), None))

    def turn(self, ended: float) -> None:
        """A new answer: its first audio is timed from `ended` (the caller's turn ended then)."""
        self.turn_ended, self.first_audio = ended, None

    def say(self, clause: str) -> None:
        if clause.strip():
            self.clauses.put(clause)

    def finish(self) -> float | None:
        """Wait until the turn's clauses are spoken; its time to first audio in seconds (None: nothing spoken)."""
        self.clauses.join()
        return self.first_audio

    def _speak(self) -> None:
        while True:
            clause = self.clauses.get()
            try:
                self._clause(clause)
            finally:
                self.clauses.task_done()

    def _clause(self, clause: str) -> None:
        with subprocess.Popen([self.synthesizer, "--stdout", clause], stdout=subprocess.PIPE) as synthesis:
            assert synthesis.stdout is not None
            audio = synthesis.stdout.read(WAV_HEADER_BYTES + 1)  # blocks until the first sample
            if self.first_audio is None and len(audio) > WAV_HEADER_BYTES:
                self.first_audio = time.perf_counter() - self.turn_ended
            audio += synthesis.stdout.read()
        if self.player is not None:
            subprocess.run(self.player, input=audio, check=False, capture_output=True)
