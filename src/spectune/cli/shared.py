"""What every verb module of the CLI shares: the console and the settings more than one verb takes."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from rich.console import Console

from spectune.config import Settings

console = Console()


class VerboseSettings(Settings):
    verbose: bool = Field(False, description="Show what the libraries say (else kept in the run's logs/ folder).")


class ModelsDirSettings(Settings):
    models_dir: Path | None = Field(None, description="Models directory (default: the user cache).")


class JobsSettings(Settings):
    jobs: int | None = Field(None, ge=1, description="Parallel compile jobs (default: all cores).")
