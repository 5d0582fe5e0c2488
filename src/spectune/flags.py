"""CLI flags generated from a settings class (as litgpt does from a signature): each field becomes an option with
its description as help; `--config FILE.yaml` gives values in bulk and flags override them; pydantic validates the
result, so a flag, a YAML key and a run-config section can never disagree on a name, a type or a default."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from spectune.config import load_config
from spectune.errors import SpectuneError

Config = TypeVar("Config", bound=BaseModel)
SCALARS = (bool, int, float, str, Path)


def _flag_type(annotation: Any) -> tuple[Any, str]:
    """(the type the option parses, a note for its help) for a field's annotation."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    origin = typing.get_origin(annotation)
    if annotation in SCALARS:
        return annotation, ""
    if origin is Literal:
        return str, " | ".join(str(arg) for arg in typing.get_args(annotation))
    if origin in (types.UnionType, typing.Union):
        if len(args) == 1:
            return _flag_type(args[0])
        choices = [_flag_type(arg)[1] for arg in args if typing.get_origin(arg) is Literal]
        return str, " or ".join(["a number", *choices]) if int in args and choices else ""
    if origin is list:
        inner, note = _flag_type(args[0])
        return list[inner], f"{note}; repeatable" if note else "repeatable"
    if origin is dict:
        return list[str], "NAME=VALUE; repeatable"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return list[str], f"on, or NAME=VALUE of {', '.join(annotation.model_fields)}; repeatable"
    raise TypeError(f"no CLI flag for a field of type {annotation}")


def _option(name: str, field: FieldInfo) -> inspect.Parameter:
    kind, note = _flag_type(field.annotation)
    parts = [field.description or name.replace("_", " ")]
    if note:
        parts.append(f"({note})")
    if field.is_required():
        parts.append("(required)")
    elif (default := field.get_default(call_default_factory=True)) not in (None, {}, []):
        parts.append(f"(default: {default})")
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if extra.get("positional"):
        option = typer.Argument(help=" ".join(parts), show_default=False)
    else:  # a flag of its own where the field's name is not the word a user types (--for, --from)
        declared = [str(extra["flag"])] if "flag" in extra else []
        option = typer.Option(*declared, help=" ".join(parts), show_default=False)
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind | None, option]
    )


def _settings_class(annotation: Any) -> bool:
    """A field whose value is a settings section of its own (optional or not)."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)] or [annotation]
    return len(args) == 1 and inspect.isclass(args[0]) and issubclass(args[0], BaseModel)


def _named_values(model: type[BaseModel], values: dict[str, Any]) -> dict[str, Any]:
    """NAME=VALUE items of dict-typed and section-typed fields into mappings (`on`: a section's defaults)."""
    out = dict(values)
    for name, field in model.model_fields.items():
        section = _settings_class(field.annotation)
        if (section or typing.get_origin(field.annotation) is dict) and values.get(name) is not None:
            pairs = {}
            for item in values[name]:
                if section and item == "on":
                    continue
                key, sep, value = item.partition("=")
                if not sep or not key:
                    raise SpectuneError(f"--{name.replace('_', '-')} {item}: expected NAME=VALUE")
                pairs[key] = value
            out[name] = pairs
    return out


def config_command(
    app: typer.Typer, model: type[Config], name: str | None = None, exclude: tuple[str, ...] = ()
) -> Callable[[Callable[[Config], None]], Callable[[Config], None]]:
    """Register `function(config: model)` as a command whose flags are `model`'s fields."""

    def register(function: Callable[[Config], None]) -> Callable[[Config], None]:
        def command(**values: Any) -> None:
            yaml_path = values.pop("config")
            function(load_config(model, yaml_path, _named_values(model, values)))

        config_flag = inspect.Parameter(
            "config",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[Path | None, typer.Option(help="YAML with these settings; flags override it.")],
        )
        chosen = [(key, field) for key, field in model.model_fields.items() if key not in exclude]
        chosen.sort(key=lambda item: not item[1].is_required())  # what must be given first
        fields = [_option(key, field) for key, field in chosen]
        command.__signature__ = inspect.Signature([config_flag, *fields])  # type: ignore[attr-defined]
        command.__doc__ = function.__doc__
        command.settings = model  # type: ignore[attr-defined]  # what its flags were generated from
        app.command(name or function.__name__.replace("_", "-"))(command)
        return function

    return register
