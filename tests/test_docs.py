"""The README and docs/ as a newcomer reads them: the two commands exist, every relative link leads somewhere, and the
results table is the one the committed results render."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def test_the_readme_starts_with_the_two_commands_and_make_has_them():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```")[1]
    assert "make demo" in first_block and "make test" in first_block
    targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
    assert {"demo", "test", "test-fast"} <= set(targets)
    assert len(readme.splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target} does not exist"
        if anchor:
            assert anchor in anchors(linked), f"{page.name}: no heading #{anchor} in {linked.name}"


def test_every_results_table_is_the_one_the_committed_results_render():
    """The README's tables and docs/results.md's, each block exactly what benchmarks/tables.py renders."""
    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for page, tables in module.BLOCKS.items():
        text = (ROOT / page).read_text()
        for name, render in tables.items():
            assert module.blocks_of(text, name) == [render()], f"{page}: table {name}: run benchmarks/tables.py --write"
    readme_tables = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("|---")]
    assert len(readme_tables) == 4  # the two commands' times, the headline, the verbs, the first token


def test_the_code_cites_pages_that_exist():
    cited = set()
    for source in (ROOT / "src").rglob("*.py"):
        cited |= set(re.findall(r"docs/[\w-]+\.md", source.read_text()))
    assert cited and all((ROOT / page).is_file() for page in cited), cited


CARD_FIGURE = re.compile(r"on the card|RTX \d{4}|grounded")
GPU_FIGURE = re.compile(r"on a GPU")
SPEEDUP = re.compile(r"\d\.\d\dx")
BAND = re.compile(r"\d\.\d\d-\d\.\d\dx|band|previous model")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_gpu_figure_says_it_is_predicted_and_on_the_card_carries_its_band(page):
    # A speedup on a GPU no card here has timed is a prediction, and one on a named card carries the fit's band (or
    # says it is the previous model's, in the results' history); tables state it in their header
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if line.startswith("|") or not SPEEDUP.search(line):
            continue
        if CARD_FIGURE.search(line) or GPU_FIGURE.search(line):
            assert "predict" in line.lower() or "measured" in line.lower(), f"{page.name}:{number}: {line}"
        if CARD_FIGURE.search(line):
            assert BAND.search(line), f"{page.name}:{number}: a figure on the card with no band: {line}"


STORY_GOALS = {"1.7", "2.2"}  # the reference story's speedups, goals rather than measurements
FIGURE = re.compile(r"\d+(?:\.\d+)?(?: ?(?:x|ms|%|tok/s| min| s)\b)")  # a measured figure: a ratio, a time, a rate


def prose(page: Path) -> str:
    """A page outside its tables and code blocks, its lines joined (a figure may wrap)."""
    lines, code = [], False
    for line in page.read_text().splitlines():
        code = code != line.startswith("```")
        if not code and not line.startswith(("|", "```")):
            lines.append(" ".join(line.split()))
    return " ".join(lines)


# (page, most lines, most words or None): the README a user follows, the results a newcomer reads
SHORT_PAGES = [("README.md", 120, 1000), ("docs/results.md", 300, None)]


@pytest.mark.parametrize(("name", "most_lines", "most_words"), SHORT_PAGES, ids=[page for page, *_ in SHORT_PAGES])
def test_a_short_page_whose_figures_are_all_generated(name, most_lines, most_words):
    """Every figure the page shows is in a table benchmarks/tables.py renders from committed results (the test above
    checks they are today's): its prose quotes none, so no edit of a result leaves a stale sentence."""
    page = ROOT / name
    text = page.read_text()
    assert len(text.splitlines()) <= most_lines and (most_words is None or len(text.split()) <= most_words)
    assert all(len(line) <= 120 for line in text.splitlines() if not line.startswith(("|", "python ", "spectune ")))
    stray = [figure for figure in FIGURE.findall(prose(page)) if figure.rstrip("x") not in STORY_GOALS]
    assert not stray, f"figures in {name}'s prose (put them in a generated table): {stray}"


RESULTS = ROOT / "benchmarks" / "results"


def test_the_committed_results_are_few_small_and_each_read_by_a_table_or_a_test():
    files = [path for path in RESULTS.rglob("*") if path.is_file()]
    assert len(files) <= 30 and all(path.stat().st_size <= 1_000_000 for path in files)
    readers = [ROOT / "benchmarks" / script for script in ("tables.py", "grounded_gpu.py")]
    readers += [*(ROOT / "tests").glob("*.py"), *(ROOT / "docs").glob("*.md")]
    text = " ".join(reader.read_text() for reader in readers)
    named = re.sub(r"(\w+)\.\{json,md\}", r"\1.json \1.md", text)  # a result's JSON and its rendering named at once
    unread = [path.name for path in files if path.name.removesuffix(".gz") not in named]
    assert not unread, f"committed results nothing reads: {unread}"


def code_map() -> dict[str, str]:
    """design.md's code map: each folder's (or top-level module's) text, from its line to the next one's."""
    design = (ROOT / "docs" / "design.md").read_text()
    block = design.split("```\nsrc/spectune/\n", 1)[1].split("\ntests/", 1)[0]
    entries: dict[str, str] = {}
    name = ""
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):  # "  runtime/  ...": an entry's first line
            name, _, line = line.strip().partition(" ")
        entries[name] = entries.get(name, "") + " " + line
    return entries


def test_the_code_map_names_every_module_in_its_folder():
    """A module added without a line in docs/design.md's code map fails here, as does one the map names in the wrong
    folder."""
    entries, source = code_map(), ROOT / "src" / "spectune"
    top = " ".join(text + " " + name for name, text in entries.items() if not name.endswith("/"))
    for module in sorted(source.rglob("*.py")):
        if module.name == "__init__.py":
            continue
        folder = module.parent.relative_to(source).as_posix()
        where = top if folder == "." else entries.get(f"{folder}/", "")
        assert module.name in where, f"docs/design.md's code map: {module.relative_to(source)} is not in it"


def test_the_stage_diagram_shows_every_stage_a_run_can_have():
    from spectune.pipeline.config import RunConfig
    from spectune.pipeline.stages import stages

    design = (ROOT / "docs" / "design.md").read_text()
    diagram = design.split("## The stages", 1)[1].split("```")[1]
    every_kind = {"eagle3": {}, "assistant": {}}
    config = RunConfig.model_validate({"data": {"path": "d.jsonl"}, "drafts": every_kind})
    for stage in stages(config):
        assert stage.name.split(":")[0] in diagram, f"docs/design.md's stage diagram lacks {stage.name}"
