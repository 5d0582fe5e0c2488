"""llama.cpp's command-line flags, read from the argument table of the pinned sources (common/arg.cpp), so that a
command spectune writes for llama.cpp's own tools is checked against the llama.cpp it will run with."""

from __future__ import annotations

import re
from pathlib import Path

from spectune.errors import SpectuneError
from spectune.export.converter import converter_dir

_OPTION = re.compile(r"add_opt\(common_arg\(")
_NAMES = re.compile(r"^\s*((?:\{[^{}]*\}\s*,\s*)+)")  # the leading name groups, e.g. {"--repack"}, {"-nr", ...}
_EXAMPLES = re.compile(r"set_examples\(\{([^}]*)\}\)")


def tool_flags(arg_cpp: Path, example: str) -> dict[str, bool]:
    """Every flag the tool of `example` (e.g. LLAMA_EXAMPLE_SERVER) accepts -> whether it was removed."""
    flags: dict[str, bool] = {}
    for block in _OPTION.split(arg_cpp.read_text(encoding="utf-8"))[1:]:
        names = _NAMES.search(block)
        examples = _EXAMPLES.search(block)
        if names is None:
            continue
        if examples is not None and not {example, "LLAMA_EXAMPLE_COMMON"} & set(re.findall(r"\w+", examples.group(1))):
            continue
        removed = "arg_removed(" in block
        for name in re.findall(r"\"([^\"]+)\"", names.group(1)):
            flags[name] = removed
    return flags


def check_command(command: list[str], example: str = "LLAMA_EXAMPLE_SERVER", arg_cpp: Path | None = None) -> None:
    """Refuse a command line with a flag the pinned llama.cpp does not know or has removed."""
    flags = tool_flags(arg_cpp or converter_dir() / "common" / "arg.cpp", example)
    unknown = [word for word in command[1:] if word.startswith("-") and word not in flags]
    removed = [word for word in command[1:] if flags.get(word)]
    if unknown or removed:
        problems = [f"unknown flag(s) {', '.join(unknown)}"] if unknown else []
        problems += [f"removed flag(s) {', '.join(removed)}"] if removed else []
        raise SpectuneError(f"{command[0]} of the pinned llama.cpp would refuse this command: {'; '.join(problems)}")
