"""Every notebook of the table of contents runs top to bottom in a fresh, Colab-like environment.

Once per session: the repository's files (tracked, plus untracked ones git does not ignore, i.e. what a clone will
hold) are copied to a temporary folder, a clean virtual environment is created, and the package is installed into
it from that copy with pip, not in editable mode, with the course extra and ipykernel. The notebooks run in order of
how many extras their Colab cells ask for, and an extra is added (its requirements from settings.ini) just before the
first notebook that asks for it: a notebook that asks only for the course extra runs with nothing more, one that asks
for more may also find an extra a notebook before it asked for (one environment serves them all). The copy's `proton/` folder is then
deleted, so the only `proton` a notebook can import is the installed one. Each notebook then runs in a kernel of
that environment, in a temporary copy of its own folder; a notebook whose Colab cell clones the repository gets a
copy of the whole (package-less) repository instead, as in Colab. Any cell error fails the notebook.

Opt-in, because pip installs torch: `PROTON_COLAB_TEST=1 python -m pytest tests/test_colab_like.py -m colab`.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

ROOT = Path(__file__).parents[1]
BASE = "course"  # brings plot, fastcore and nbdev, which the chapters' test cells import; every Colab cell asks for it
CELL_TIMEOUT = 600

pytestmark = [pytest.mark.colab,
              pytest.mark.skipif(os.environ.get("PROTON_COLAB_TEST") != "1", reason="opt-in: set PROTON_COLAB_TEST=1")]


from toc import TOC_FILES


def extras(notebook):
    "The extras a notebook's Colab cell installs (none for a page without one)."
    cells = json.loads((ROOT / f"{notebook}.ipynb").read_text())["cells"]
    found = [re.search(r'proton-ood\[([a-z,]+)\]', "".join(c["source"])) for c in cells if c["cell_type"] == "code" and "google.colab" in "".join(c["source"])]
    return set(found[0][1].split(",")) if found and found[0] else set()


NOTEBOOKS = sorted(TOC_FILES, key=lambda n: len(extras(n) - {BASE}))  # the table of contents' order among notebooks asking for as much

# Nothing from this machine's user site or PYTHONPATH may leak into the "fresh" environment.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")} | {"PYTHONNOUSERSITE": "1"}


def run(*cmd, cwd=None):
    "Run `cmd`, failing the test with its output if it fails; its stdout."
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=CLEAN_ENV, capture_output=True, text=True)
    if out.returncode: pytest.fail(f"{' '.join(map(str, cmd))} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def copy_repository(dest:Path):
    "The files a clone of the repository would hold (tracked or not ignored, and present), copied to `dest`."
    names = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT).split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


class Colab:
    "A clean virtual environment with the package installed from a copy of the repository, and a kernel spec for it."
    def __init__(self, root:Path):
        self.clone, env = root / "PROTON", root / "env"
        copy_repository(self.clone)
        run(sys.executable, "-m", "venv", env)
        python = env / "bin" / "python"
        self.python, self.installed = python, {BASE}
        run(python, "-m", "pip", "install", "-q", f"{self.clone}[{BASE}]", "ipykernel")
        for leftover in ["proton", "build", *(p.name for p in self.clone.glob("*.egg-info"))]:
            shutil.rmtree(self.clone / leftover, ignore_errors=True)
        origin = Path(run(python, "-c", "import proton; print(proton.__file__)", cwd=root).strip())
        assert origin.is_relative_to(env), f"proton imported from {origin}, not from the fresh environment"
        self.kernels = root / "kernels"
        (self.kernels / "colab").mkdir(parents=True)
        spec = {"argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"], "display_name": "Colab-like",
                "language": "python", "env": {"PYTHONNOUSERSITE": "1", "PYTHONPATH": ""}}
        (self.kernels / "colab" / "kernel.json").write_text(json.dumps(spec))

    def add(self, wanted:set):
        "Install the requirements of the extras in `wanted` that are not installed yet (the package's own files are gone)."
        ini = (ROOT / "settings.ini").read_text()
        for extra in sorted(wanted - self.installed):
            line = re.search(rf"^{extra}_requirements\s*=\s*(.*)$", ini, re.M)
            assert line, f"the Colab cell asks for an extra settings.ini does not define: {extra}"
            run(self.python, "-m", "pip", "install", "-q", *line[1].split())
            self.installed.add(extra)

    def kernel(self):
        return KernelManager(kernel_name="colab", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(self.kernels)]))


@pytest.fixture(scope="session")
def colab():
    with tempfile.TemporaryDirectory(prefix="proton-colab-") as root: yield Colab(Path(root))  # ~6 GB: removed at the end


def clones_repository(nb):
    "Whether the notebook's Colab cell clones the repository (so in Colab it runs inside a checkout)."
    return any(c.cell_type == "code" and "google.colab" in c.source and "git clone" in c.source for c in nb.cells)


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_runs_in_a_fresh_environment(colab, notebook, tmp_path):
    colab.add(extras(notebook))
    nb = nbformat.read(colab.clone / f"{notebook}.ipynb", as_version=4)
    folder = Path(notebook).parent
    if clones_repository(nb):
        shutil.copytree(colab.clone, tmp_path / "PROTON")
        cwd = tmp_path / "PROTON" / folder
    else:
        cwd = tmp_path / folder
        shutil.copytree(colab.clone / folder, cwd)
    km = colab.kernel()
    try: NotebookClient(nb, km=km, timeout=CELL_TIMEOUT, resources={"metadata": {"path": str(cwd)}}).execute()
    finally:  # nbclient leaves a kernel it was handed running
        if km.has_kernel: km.shutdown_kernel(now=True)
