"""Errors a user can act on: each says what is wrong and where (file, line, field)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input, located as precisely as the input allows."""

    source: str
    message: str
    line: int | None = None
    field: str | None = None

    def __str__(self) -> str:
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        if self.field:
            where += f" [{self.field}]"
        return f"{where}: {self.message}"


class SpectuneError(Exception):
    """A bad input or setting. The CLI prints it and exits with code 2."""

    exit_code = 2

    def __init__(self, message: str, problems: list[Problem] | None = None) -> None:
        self.problems = problems or []
        super().__init__(message)

    def __str__(self) -> str:
        lines = [self.args[0], *(f"  {p}" for p in self.problems[:50])]
        if len(self.problems) > 50:
            lines.append(f"  ... and {len(self.problems) - 50} more")
        return "\n".join(lines)
