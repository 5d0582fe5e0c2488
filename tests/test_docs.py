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


def test_the_readme_table_is_the_one_the_committed_results_render():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "benchmarks" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (ROOT / "README.md").read_text()
    assert module.headline_table() in readme and module.table() in readme and module.heads_table() in readme


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
