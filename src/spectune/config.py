"""Configs from YAML (and CLI overrides), validated by pydantic before anything runs.

Every problem is reported at once with its YAML path (e.g. `finetune.lora_r: Input should be ...`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from spectune.errors import Problem, SpectuneError

Config = TypeVar("Config", bound=BaseModel)


class Settings(BaseModel):
    """A stage's settings: the one definition of each, its default and its help (the YAML section, the stage's
    config and the CLI flags are all made from it). Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # nan and inf are no setting's value


def positional(description: str) -> dict[str, Any]:
    """Field(...) keywords for a setting a verb takes as its argument rather than as a flag (a dataset's path)."""
    return {"description": description, "json_schema_extra": {"positional": True}}


def _is_positional(field: Any) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("positional"))


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise SpectuneError(f"{path}: no such config file")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else None
        raise SpectuneError(f"{path}: invalid YAML", [Problem(str(path), str(exc).splitlines()[0], line)]) from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise SpectuneError(f"{path}: the top level must be a mapping of keys to values")
    return loaded


def validate(model: type[Config], values: dict[str, Any], source: str) -> Config:
    """Build `model` from `values`; all errors at once, each with its dotted path."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        problems = [
            Problem(
                source,
                f"{error['msg']} (got {error.get('input')!r})"[:300],
                field=".".join(str(part) for part in error["loc"]) or None,
            )
            for error in exc.errors()
        ]
        raise SpectuneError(f"{source}: {len(problems)} config error(s)", problems) from None


def load_config(model: type[Config], yaml_path: Path | None, overrides: dict[str, Any]) -> Config:
    """YAML values, then CLI options that were given (not None) on top."""
    values = read_yaml(yaml_path) if yaml_path else {}
    unknown = sorted(set(values) - set(model.model_fields))
    if unknown and (arguments := [key for key, field in model.model_fields.items() if _is_positional(field)]):
        # the easy slip `spectune run --config run.yaml`: say so, not "Extra inputs" for every section
        raise SpectuneError(
            f"{yaml_path}: {', '.join(unknown)}: not settings of this command; --config takes the command's own "
            f"settings, and a file for its {arguments[0].upper()} argument is given without --config"
        )
    values.update({key: value for key, value in overrides.items() if value is not None})
    return validate(model, values, str(yaml_path) if yaml_path else "command line")
