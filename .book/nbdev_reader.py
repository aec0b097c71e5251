"""Read nbdev notebooks for jupyter-book: turn `#|` directives into MyST-NB cell tags and drop the directive lines.

jupyter-book knows nothing of nbdev's directives, so on its own it would show every `#| export` line, display
hidden cells and execute `eval: false` cells. `_config.yml` registers `read_nbdev` as the reader of `.ipynb`
files; it maps each directive to the tag MyST-NB and nbclient understand, then removes the directive lines.
"""
import re

import nbformat

DIRECTIVE = re.compile(r"^\s*#\|\s*([\w-]+)\s*:?\s*(.*?)\s*$")
FALSE = {"false", "False", "no", "0"}


def cell_tags(directives):
    "MyST-NB tags for a cell's nbdev directives, given as {name: value}."
    tags = set()
    if "hide" in directives or directives.get("include") in FALSE or "default_exp" in directives: tags.add("remove-cell")
    if directives.get("echo") in FALSE or "hide_input" in directives: tags.add("remove-input")
    if directives.get("output") in FALSE or "hide_output" in directives: tags.add("remove-output")
    if directives.get("eval") in FALSE: tags.add("skip-execution")
    return tags


def strip_directives(cell):
    "Remove the `#|` lines heading a code cell, adding the tags they stand for."
    lines = cell.source.splitlines()
    directives = {}
    while lines and (m := DIRECTIVE.match(lines[0])):
        directives[m.group(1)] = m.group(2)
        lines.pop(0)
    cell.source = "\n".join(lines)
    tags = cell_tags(directives) | ({"remove-cell"} if not cell.source.strip() else set())
    if tags: cell.metadata["tags"] = sorted(set(cell.metadata.get("tags", [])) | tags)


def read_nbdev(text, **kwargs):
    "A notebook from `text`, with nbdev directives replaced by MyST-NB tags."
    nb = nbformat.reads(text, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code": strip_directives(cell)
    return nb


def setup(app):
    "A Sphinx extension in name only: `_config.yml` loads this module so that `read_nbdev` is importable."
    return {"parallel_read_safe": True, "parallel_write_safe": True}
