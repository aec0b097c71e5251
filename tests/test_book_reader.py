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
