"""The course's structure: every chapter is in the table of contents, installs itself in Colab only, and ends with a summary and exercises."""
import json
import re
from pathlib import Path

import pytest
from toc import TOC_FILES

ROOT = Path(__file__).parents[1]


CHAPTERS = [f for f in TOC_FILES if f not in ("nbs/index",) and not f.endswith("references")]


def cells(name):
    return json.loads((ROOT / f"{name}.ipynb").read_text())["cells"]


def test_toc_and_notebooks_agree():
    listed = set(TOC_FILES)
    assert all((ROOT / f"{f}.ipynb").exists() for f in listed), [f for f in listed if not (ROOT / f"{f}.ipynb").exists()]
    orphans = [p.stem for p in (ROOT / "nbs").glob("*.ipynb") if f"nbs/{p.stem}" not in listed and not p.stem.startswith("_")]
    assert not orphans, f"notebooks missing from _toc.yml: {orphans}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_installs_itself_only_in_colab(chapter):
    code = ["".join(c["source"]) for c in cells(chapter) if c["cell_type"] == "code"]
    colab = [c for c in code if "google.colab" in c]
    assert colab, f"{chapter} has no Colab set-up cell"
    cell = colab[0]
    assert cell.lstrip().startswith("#| hide"), f"{chapter}: the Colab cell must be hidden in the book"
    assert re.search(r'if "google.colab" in sys.modules:\n(\s+.*\n?)*\s+%pip install -q "proton-ood\[course', cell), f"{chapter}: install only under Colab, with the course extra"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_ends_with_summary_and_exercises(chapter):
    headings = [line for c in cells(chapter) if c["cell_type"] == "markdown" for line in "".join(c["source"]).splitlines() if line.startswith("## ")]
    assert "## Summary" in headings and "## Exercises" in headings, f"{chapter}: missing Summary or Exercises"
    assert headings.index("## Summary") < headings.index("## Exercises")
