"""The `proton-ood` console command, run as a user runs it: a separate process."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proton.bench import EmbeddingCache, SyntheticWorld


def run(*args):
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)


def test_version_and_help():
    from proton import __version__
    assert run("--version").stdout.strip() == f"proton-ood {__version__}"
    out = run("--help").stdout
    assert all(c in out for c in ("evaluate", "extract", "info"))


def test_unknown_command_is_refused():
    r = run("train")
    assert r.returncode == 2 and "invalid choice: 'train'" in r.stderr


def test_info_checks_a_cache(tmp_path):
    path = tmp_path / "c.npz"
    cache = EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=30, n_per_shift=10)
    cache.save(path)
    r = run("info", str(path))
    assert r.returncode == 0 and cache.content_hash() in r.stdout
    path.write_bytes(path.read_bytes()[:-40])  # truncated
    r = run("info", str(path))
    assert r.returncode != 0 and str(path) in r.stderr


def test_command_help_reaches_the_command():
    r = run("evaluate", "-h")
    assert r.returncode == 0 and "--simulated" in r.stdout


def test_evaluate_on_the_simulated_world(tmp_path):
    out = tmp_path / "results.csv"
    r = run("evaluate", "--simulated", "default", "--permutations", "1", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    header = out.read_text().splitlines()[0]
    assert header == "method,shift,seed,auroc,aupr_out,aupr_in,fpr95,fpr95_ood,n_id,n_ood"
