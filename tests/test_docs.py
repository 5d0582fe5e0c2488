"""The README and docs/ as a newcomer reads them: the two commands exist, every relative link leads somewhere, and the
results table is the one the committed results render."""

from __future__ import annotations

import importlib.util
import json
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
    """The README's one table and docs/results.md's, each block exactly what benchmarks/readme_table.py renders."""
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "benchmarks" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for page, tables in module.BLOCKS.items():
        text = (ROOT / page).read_text()
        for name, render in tables.items():
            assert module.blocks_of(text, name) == [render()], f"{page}: table {name}: run readme_table.py --write"
    readme_tables = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("|---")]
    assert len(readme_tables) == 2  # the headline, and the stages' verbs


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


RESULTS = ROOT / "benchmarks" / "results"
QWEN = ("gpu_grounded.json", "results", "speculative_qwen_sgd.json", "drafts")
CUTS = ("gpu_grounded.json", "bench_reports", "speculative_qwen_sgd_cuts.json")
QWEN_HEAD = ("gpu_grounded.json", "results", "llama_cpp_files_qwen_sgd_head_500_dialogues.json", "drafts")
DOMAIN = ("gpu_grounded.json", "bench_reports", "speculative_qwen_sgd_domain.json")
HEADS = ("gpu_grounded.json", "results", "eagle3_smollm2_sgd.json", "drafts")
DEMO = ("speculative_demo.json", "drafts")
NEVER_SLOWER = ("never_slower_qwen_sgd.json", "servers")
# Every speedup the README's prose quotes, read from the committed result it comes from: the README's words around
# it, and each number in them as (file and keys to the value, how the README writes it), in the order written.
README_FIGURES = [
    (
        "predict 0.94-1.03x there (1.13-1.24x by bytes)",
        [
            ((*QWEN, "generic", "grounded"), "{:.2f}"),
            ((*QWEN, "seqkd", "grounded"), "{:.2f}"),
            ((*QWEN, "generic", "bytes_only_committed"), "{:.2f}"),
            ((*QWEN, "seqkd", "bytes_only_committed"), "{:.2f}"),
        ],
    ),
    (
        "1.08x (1.06-1.08x) predicted, 1.27x (1.27-1.32x) with lookup in front",
        [
            ((*CUTS, "cut4", "grounded"), "{:.2f}"),
            ((*CUTS, "cut4", "grounded_band", 0), "{:.2f}"),
            ((*CUTS, "cut4", "grounded_band", 1), "{:.2f}"),
            ((*CUTS, "ngram+cut4", "grounded"), "{:.2f}"),
            ((*CUTS, "ngram+cut4", "grounded_band", 0), "{:.2f}"),
            ((*CUTS, "ngram+cut4", "grounded_band", 1), "{:.2f}"),
        ],
    ),
    ("0.99x predicted on a GPU", [((*DEMO, "generic", "predicted_speedup_gpu"), "{:.2f}")]),
    ("predicts 3.1x", [((*DEMO, "seqkd", "predicted_speedup_gpu"), "{:.1f}")]),
    ("On this CPU it does not pay (0.95x)", [((*DEMO, "seqkd", "aggregate_speedup"), "{:.2f}")]),
    (
        "it decodes at 0.98x llama-server at its defaults (median per prompt 0.96x); made to speculate with the 0.5B "
        "it is 0.22x",
        [
            ((*NEVER_SLOWER, "spectune serve --mode auto", "total_ratio_to_llama_server"), "{:.2f}"),
            ((*NEVER_SLOWER, "spectune serve --mode auto", "median_ratio_to_llama_server"), "{:.2f}"),
            ((*NEVER_SLOWER, "spectune serve --mode speculative", "total_ratio_to_llama_server"), "{:.2f}"),
        ],
    ),
    (
        "1.42x predicted by bytes, 1.43x (1.43-1.48x) on the reference card, where the standalone draft predicts 0.97x "
        "by bytes, 1.16x (1.15-1.16x) on the card",
        [
            ((*HEADS, "eagle3", "bytes_only_committed"), "{:.2f}"),
            ((*HEADS, "eagle3", "grounded"), "{:.2f}"),
            ((*HEADS, "eagle3", "grounded_band", 0), "{:.2f}"),
            ((*HEADS, "eagle3", "grounded_band", 1), "{:.2f}"),
            ((*HEADS, "seqkd", "bytes_only_committed"), "{:.2f}"),
            ((*HEADS, "seqkd", "grounded"), "{:.2f}"),
            ((*HEADS, "seqkd", "grounded_band", 0), "{:.2f}"),
            ((*HEADS, "seqkd", "grounded_band", 1), "{:.2f}"),
        ],
    ),
    ("first sentence 0.86x alone's with lookup", [((*DOMAIN, "ngram", "first_sentence", "card"), "{:.2f}")]),
    ("the best Qwen variant predicts 1.27x (lookup, then the cut)", [((*CUTS, "ngram+cut4", "grounded"), "{:.2f}")]),
    (
        "predicted 1.25x (1.25-1.31x) on the card behind lookup",
        [
            ((*QWEN_HEAD, "ngram+eagle3", "grounded"), "{:.2f}"),
            ((*QWEN_HEAD, "ngram+eagle3", "grounded_band", 0), "{:.2f}"),
            ((*QWEN_HEAD, "ngram+eagle3", "grounded_band", 1), "{:.2f}"),
        ],
    ),
]
STORY_GOALS = {"1.7", "2.2"}  # the reference story's speedups, goals rather than measurements
QUOTED = re.compile(r"\d+\.\d+(?=x|-\d+\.\d+x)")  # a speedup, or the low end of a range of them


def value_at(keys: tuple) -> float:
    value = json.loads((RESULTS / keys[0]).read_text())
    for key in keys[1:]:
        value = value[key]
    return value


def readme_prose() -> str:
    """The README outside its tables, its lines joined (a quote may wrap)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    return " ".join(" ".join(line.split()) for line in lines if not line.startswith("|"))


@pytest.mark.parametrize("words, sources", README_FIGURES, ids=[words[:40] for words, _ in README_FIGURES])
def test_a_figure_the_readme_quotes_is_the_committed_results(words, sources):
    rendered = [form.format(value_at(keys)) for keys, form in sources]
    assert QUOTED.findall(words) == rendered, (words, rendered)
    assert words in readme_prose(), words


def test_every_speedup_in_the_readme_prose_is_traced():
    prose = readme_prose()
    for words, _ in README_FIGURES:
        prose = prose.replace(words, "")
    stray = [number for number in QUOTED.findall(prose) if number not in STORY_GOALS]
    assert not stray, f"README speedups with no committed source in README_FIGURES: {stray}"
