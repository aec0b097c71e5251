"""The jupyter-book reader turns nbdev directives into MyST-NB tags and hides the directive lines."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / ".book"))
from nbdev_reader import read_nbdev  # noqa: E402


def notebook(*sources):
    cells = [{"cell_type": "code", "metadata": {}, "source": s, "outputs": [], "execution_count": None} for s in sources]
    return json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 4})


@pytest.mark.parametrize("source, tags, remaining", [
    ("#| export\ndef f(): pass", [], "def f(): pass"),
    ("#| hide\nimport os", ["remove-cell"], "import os"),
    ("#| default_exp core", ["remove-cell"], ""),
    ("#| eval: false\nslow()", ["skip-execution"], "slow()"),
    ("#| echo: false\nplot()", ["remove-input"], "plot()"),
    ("#| output: false\nx = 1", ["remove-output"], "x = 1"),
    ("#| include: false\nx = 1", ["remove-cell"], "x = 1"),
    ("#|hide\n#| export\nx = 1", ["remove-cell"], "x = 1"),
    ("x = 1  # not a directive: #| hide", [], "x = 1  # not a directive: #| hide"),
])
def test_directives_become_tags(source, tags, remaining):
    cell = read_nbdev(notebook(source)).cells[0]
    assert cell.metadata.get("tags", []) == tags
    assert cell.source == remaining


def test_repository_notebooks_have_no_directive_left():
    for path in (Path(__file__).parents[1] / "nbs").glob("*.ipynb"):
        for cell in read_nbdev(path.read_text()).cells:
            assert not any(line.lstrip().startswith("#|") for line in cell.source.splitlines()), path.name


@pytest.mark.parametrize("source, folded", [
    ("x = f(2)\ntest_eq(x, 4)", True),
    ("assert g() > 0", True),
    ("test_fail(lambda: f(-1), contains='negative')\nassert True", True),
    ("x = f(2)\ntest_eq(x, 4)\nx", False),  # shows a value
    ("test_eq(f(2), 4)\nprint(f(2))", False),  # prints
    ("fig, ax = plt.subplots()\nassert ax", False),  # draws
    ("#| export\ndef f(x): assert x", False),  # library code
    ("#| hide\nassert x", False),  # removed anyway
    ("%timeit f(2)\nassert True", False),  # a magic
])
def test_cells_that_only_check_fold_into_a_tests_toggle(source, folded):
    cell = read_nbdev(notebook(source)).cells[0]
    assert ("hide-cell" in cell.metadata.get("tags", [])) == folded
    if folded: assert cell.metadata["mystnb"]["code_prompt_show"] == "Tests"


def test_most_test_cells_of_a_chapter_fold():
    cells = read_nbdev((Path(__file__).parents[1] / "nbs" / "11_bank.ipynb").read_text()).cells
    assert sum("hide-cell" in c.metadata.get("tags", []) for c in cells) >= 3
