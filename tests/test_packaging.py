"""The release files: a source distribution (sdist) built from the checkout builds a wheel in turn, as `pip install` of a
release from PyPI does, and that wheel holds the library, its metadata and its command."""
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[1]


def build(kind, source, out):
    "Build an sdist or a wheel of the project in `source` into `out` with setuptools' PEP 517 backend (no network, no pip); its path."
    code = f"from setuptools import build_meta as b; print(b.build_{kind}({str(out)!r}))"
    run = subprocess.run([sys.executable, "-c", code], cwd=source, capture_output=True, text=True)
    assert run.returncode == 0, f"building the {kind} failed: {run.stderr.strip().splitlines()[-1]}"
    return out / run.stdout.strip().splitlines()[-1]


def test_the_sdist_builds_a_wheel_with_the_library_and_its_command(tmp_path):
    "setup.py reads every field from settings.ini, so the sdist must carry it (MANIFEST.in)."
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    tree = tmp_path / "tree"
    for f in files:
        if (ROOT / f).is_file():
            (tree / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, tree / f)
    sdist = build("sdist", tree, tmp_path / "sdist")
    with tarfile.open(sdist) as t:
        t.extractall(tmp_path / "unpacked", filter="data")
    (top,) = (tmp_path / "unpacked").iterdir()
    wheel = build("wheel", top, tmp_path / "wheel")
    version = next(line.split("=")[1].strip() for line in (ROOT / "settings.ini").read_text().splitlines() if line.startswith("version"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert f"Version: {version}" in z.read(meta).decode() and "proton-ood = proton.cli:main" in z.read(entry).decode()
    assert {"proton/__init__.py", "proton/cli.py", "proton/models/extract.py", "proton/bench/cache.py"} <= set(names)


def third_party_imports(path):
    "The top-level names of every module `path` imports, at any depth of its code, other than the standard library's and proton's."
    import ast
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import): found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module: found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"proton"}


def test_the_core_and_the_openood_post_processor_need_only_the_core_requirements():
    "`pip install proton-ood` alone runs the detector, its deployment tools, the command's dispatch and the OpenOOD-style post-processor (pytorch-ood's detector is the interop extra's; OpenOOD is there when one runs in it)."
    module = {"numpy": "numpy", "torch": "torch", "scikit-learn": "sklearn", "tqdm": "tqdm"}  # distribution -> the module it installs
    line = next(l for l in (ROOT / "settings.ini").read_text().splitlines() if l.startswith("requirements"))
    core = {module[r.split(">")[0].split("=")[0].split("<")[0].strip()] for r in line.split("=", 1)[1].split()}
    for name in ("__init__", "scores", "bank", "proto", "fusion", "detector", "engine", "metrics", "deploy", "interop", "cli"):
        needed = third_party_imports(ROOT / "proton" / f"{name}.py") - ({"pytorch_ood", "openood"} if name == "interop" else set())
        assert needed <= core, f"proton/{name}.py imports {sorted(needed - core)}, not among the core requirements"
