"""The library's three wings, checked on the import graph: the core (`proton`), the evaluation bench (`proton.bench`) and the
model backends (`proton.models`). The core imports neither wing, the bench does not import the models, no module imports
itself back through others, and `import proton` loads nothing heavy."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PKG = ROOT / "proton"
HEAVY = ("matplotlib", "seaborn", "pandas", "sklearn.manifold", "open_clip", "transformers", "proton.bench", "proton.models")


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path):
    "Every proton module that `path` imports, at any depth of its code (function-level imports included)."
    name, found = module_name(path), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import): found |= {a.name for a in node.names if a.name.split(".")[0] == "proton"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "proton": continue
            for a in node.names:  # `from proton.x import y` imports proton.x, or the module proton.x.y
                found.add(f"{base}.{a.name}" if (PKG.parent / f"{base}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                          or (PKG.parent / f"{base}.{a.name}".replace(".", "/") / "__init__.py").exists() else base)
    return found - {name}


GRAPH = {module_name(p): imports(p) for p in PKG.rglob("*.py") if p.name != "_modidx.py"}
WING = lambda m: "bench" if m.startswith("proton.bench") else "models" if m.startswith("proton.models") else "cli" if m == "proton.cli" else "core"


def test_the_graph_is_read():
    assert {"proton.detector", "proton.bench.evaluation", "proton.models.extract", "proton.bench.experiments.main_table"} <= set(GRAPH)
    assert "proton.engine" in GRAPH["proton.detector"] and "proton.bench.cache" in GRAPH["proton.models.extract"]


@pytest.mark.parametrize("wing,forbidden", [("core", ("bench", "models", "cli")), ("bench", ("models", "cli")), ("models", ("cli",))])
def test_wings_import_only_downwards(wing, forbidden):
    wrong = {m: sorted(d for d in deps if WING(d) in forbidden) for m, deps in GRAPH.items() if WING(m) == wing}
    assert not {m: d for m, d in wrong.items() if d}, f"{wing} imports from {forbidden}"


def test_no_import_cycles():
    "Depth-first search for a cycle; a module reaching its own package's __init__ is not one (Python imports parents first)."
    state, path = {}, []
    def visit(m):
        state[m] = "open"; path.append(m)
        for d in sorted(GRAPH.get(m, ())):
            if m.startswith(d + "."): continue
            if state.get(d) == "open": pytest.fail("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state: visit(d)
        state[m] = "done"; path.pop()
    for m in sorted(GRAPH): 
        if m not in state: visit(m)


def test_import_proton_loads_only_the_core():
    code = f"import sys, proton; print([m for m in sys.modules if m.startswith({HEAVY!r})])"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    assert loaded == "[]", f"import proton loaded {loaded}"


def test_the_package_docstring_is_one_line():
    import proton
    assert proton.__doc__ and "\n" not in proton.__doc__.strip() and not hasattr(proton, "_all_")


def test_a_source_tree_that_was_never_installed_imports():
    "PYTHONPATH=<checkout> python -c 'import proton', as on a machine where nothing was pip-installed: the version comes from settings.ini."
    code = ("import importlib.metadata as md\n"
            "def missing(name): raise md.PackageNotFoundError(name)\n"
            "md.version = missing  # no installed distribution's metadata, as without pip install\n"
            "import proton; print(proton.__version__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr.strip().splitlines()[-1]
    version = next(line.split("=")[1].strip() for line in (ROOT / "settings.ini").read_text().splitlines() if line.startswith("version"))
    assert run.stdout.strip() == version


def test_every_module_compiles_without_a_warning():
    "A chapter's lead becomes its module's docstring: LaTeX in it ($\\gamma$) is an invalid escape, a SyntaxWarning from Python 3.12 on."
    import warnings
    for path in sorted(PKG.rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(), str(path), "exec")
