"""Read nbdev notebooks for jupyter-book: turn `#|` directives into MyST-NB cell tags and drop the directive lines.

jupyter-book knows nothing of nbdev's directives, so on its own it would show every `#| export` line, display
hidden cells and execute `eval: false` cells. `_config.yml` registers `read_nbdev` as the reader of `.ipynb`
files; it maps each directive to the tag MyST-NB and nbclient understand, then removes the directive lines.
A cell that only checks (it ends in an `assert` or a `test_*` call and prints or draws nothing) is folded
into a collapsed "Tests" toggle, so that a page reads as a course; the tests still run when the book is built.
"""
import ast
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


def _call_name(node):
    "The name a call calls: `f` for f(...), `plt.show` for plt.show(...), else ''."
    f = node.func
    if isinstance(f, ast.Name): return f.id
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name): return f"{f.value.id}.{f.attr}"
    return ""


def is_test_cell(source):
    "Whether a code cell only checks: its last statement is an assert or a test_* call, and it prints, shows or draws nothing."
    try: body = ast.parse(source).body
    except SyntaxError: return False  # IPython magics: not a plain test cell
    checks = lambda s: isinstance(s, ast.Assert) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                                                      and _call_name(s.value).startswith("test_"))
    if not body or not checks(body[-1]): return False
    shows = lambda n: isinstance(n, ast.Call) and (_call_name(n) in ("print", "display", "glue") or _call_name(n).startswith(("plt.", "sns.")))
    return not any(shows(n) for n in ast.walk(ast.Module(body=body, type_ignores=[])))


def strip_directives(cell):
    "Remove the `#|` lines heading a code cell, adding the tags they stand for."
    lines = cell.source.splitlines()
    directives = {}
    while lines and (m := DIRECTIVE.match(lines[0])):
        directives[m.group(1)] = m.group(2)
        lines.pop(0)
    cell.source = "\n".join(lines)
    tags = cell_tags(directives) | ({"remove-cell"} if not cell.source.strip() else set())
    if "export" not in directives and not tags & {"remove-cell", "remove-input"} and is_test_cell(cell.source):
        tags.add("hide-cell")
        cell.metadata["mystnb"] = {"code_prompt_show": "Tests", "code_prompt_hide": "Hide the tests"}
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
