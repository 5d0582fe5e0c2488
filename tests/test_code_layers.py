"""The package layout the README promises: dependencies point down. Read from the sources' imports (no import is
run), so a new upward import fails here before it becomes a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).parent.parent / "src" / "spectune"
# What the lowest layers may import of spectune: the shared top-level modules and each other's kind only.
LOW = {"runtime": {"runtime"}, "data": {"data"}}
SHARED = {"atomic", "cache", "config", "errors", "threads", "speedup", "progress", "layout"}
SHARED |= {"llama_cpp_pin", "llama_cpp_patch"}


def unit(module: str) -> str:
    """A module's unit: its subpackage (`spectune.export.gguf` -> export) or its top-level module name (the
    package's own __init__: spectune)."""
    return module.split(".")[1] if "." in module else module


def imports(node_of=unit) -> nx.DiGraph:
    """Who imports whom, as `node_of` names them (a subpackage, or each module), type-checking imports included."""
    graph = nx.DiGraph()
    for path in PACKAGE.rglob("*.py"):
        module = "spectune." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        source = node_of(module.removesuffix(".__init__"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.startswith("spectune.") and node_of(name) != source:
                    graph.add_edge(source, node_of(name))
    return graph


def test_no_package_imports_one_that_imports_it_back():
    cycles = list(nx.simple_cycles(imports()))
    assert cycles == [], f"import cycles between parts of spectune: {cycles}"


def test_no_module_imports_one_that_imports_it_back():
    cycles = list(nx.simple_cycles(imports(lambda module: module)))
    assert cycles == [], f"import cycles between modules of spectune: {cycles}"


def test_runtime_and_data_import_nothing_above_them():
    graph = imports()
    for low, allowed in LOW.items():
        above = set(graph.successors(low)) - allowed - SHARED if low in graph else set()
        assert not above, f"{low} imports {sorted(above)}"


def test_the_graph_is_read_from_the_sources():
    """The check above reads real edges: export builds on runtime (a test that found no edges would pass anything)."""
    assert imports().has_edge("export", "runtime")


def settings_fields(name: str) -> list[tuple[str, ast.AnnAssign]]:
    """Every class-level definition of a field called `name`: (file, its node)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found += [
                    (path.relative_to(PACKAGE).as_posix(), item)
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == name
                ]
    return found


def test_k_is_defined_once_and_no_answer_length_has_a_default_of_its_own():
    """One definition of the draft length; every answer length defaults to DEFAULT_MAX_TOKENS, none to a number."""
    # bench/summary.py's BenchSummary records the k a bench ran: a result, not a setting
    assert sorted(file for file, _ in settings_fields("draft_max")) == ["bench/summary.py", "runtime/decode.py"]
    lengths = settings_fields("max_tokens")
    assert len(lengths) >= 3  # decoding, the meter's answers, seqkd's answers (and the API's request field)
    for file, node in lengths:
        value = node.value
        default = value.args[0] if isinstance(value, ast.Call) and value.args else value
        assert ast.unparse(default) in ("DEFAULT_MAX_TOKENS", "None"), f"{file}: max_tokens = {ast.unparse(default)}"


def verbs(app, prefix: str = "") -> dict[str, object]:
    """Every command of a Typer app and of the apps added to it (unnamed ones add their verbs to the root)."""
    found = {f"{prefix}{command.name}": command.callback for command in app.registered_commands}
    for group in app.registered_groups:
        found |= verbs(group.typer_instance, f"{prefix}{group.name} " if group.name else prefix)
    return found


def test_every_verbs_flags_are_generated_from_its_settings():
    from spectune.cli import app

    commands = verbs(app)
    assert len(commands) >= 28
    hand_written = sorted(name for name, callback in commands.items() if not hasattr(callback, "settings"))
    assert hand_written == []
