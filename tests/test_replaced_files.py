"""Every file PROTON replaces — a scoring state, an embedding cache, a Parquet results file, a bank audit — is replaced the same way: whole or not at all, with no temporary file left behind, and with the permissions of the file it replaces."""
import os
import stat

import numpy as np
import pytest
import torch

from proton.bench import EmbeddingCache, SyntheticWorld
from proton.deploy import save_state
from proton.detector import ProtonConfig
from proton.models.score import score_stream, write_audit

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")


def cache(n=300):
    return EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=200, n_per_shift=50).subset(np.arange(n))


def scored(folder, n=300, suffix=".csv"):
    "The results file of a stream of the cache's first `n` images, scored in `folder`."
    src = folder / "c.npz"
    cache(n).save(src)
    out = folder / f"r{suffix}"
    score_stream(src, out, config=ProtonConfig(bank_size=20), warmup=50, chunk_size=64, progress=False)
    return out


def write_state(folder, k): return save_state({"a": torch.full((2,), float(k))}, folder / "s.pt")
def write_cache(folder, k): return cache(100 + k).save(folder / "c2.npz")
def write_parquet(folder, k): return scored(folder, 200 + 100 * k, ".parquet")
def write_audit_file(folder, k):
    if not (folder / "r.csv").exists(): scored(folder)
    write_audit(folder / "r.csv", folder / "audit.csv")
    return folder / "audit.csv"

WRITERS = dict(state=write_state, cache=write_cache, parquet=write_parquet, audit=write_audit_file)
mode = lambda p: stat.S_IMODE(p.stat().st_mode)


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.parametrize("what", WRITERS)
def test_a_replaced_file_keeps_its_permissions(tmp_path, umask022, what):
    "A file made readable to a group (or to its owner only) stays so when the next run replaces it."
    if what == "parquet": pytest.importorskip("pyarrow")
    path = WRITERS[what](tmp_path, 0)
    assert mode(path) == 0o644  # a new file: the umask's permissions, not a temporary file's 0600
    os.chmod(path, 0o640)
    WRITERS[what](tmp_path, 1)
    assert mode(path) == 0o640
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_failed_parquet_rewrite_keeps_the_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    out = scored(tmp_path, 200, ".parquet")
    before, write_table = out.read_bytes(), pq.write_table
    def dying(table, where, **kw):
        write_table(table.slice(0, 10), where, **kw)  # part of the rows on disk, then the disk is full
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(pq, "write_table", dying)
    with pytest.raises(OSError, match="No space"): scored(tmp_path, 300, ".parquet")
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_failed_audit_keeps_the_previous_audit_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = write_audit_file(tmp_path, 0)
    before = path.read_bytes()
    def full(fd): raise OSError(28, "No space left on device")  # the disk fills as the written bytes reach it
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"): write_audit(tmp_path / "r.csv", path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_the_temporary_files_of_a_killed_run_are_removed_by_the_next(tmp_path, suffix):
    "A run killed while it replaced its state (or its Parquet file) left `.<name>.<hex>.tmp` beside it, and they piled up: the next run removes them, and nothing else."
    if suffix == ".parquet": pytest.importorskip("pyarrow")
    out = scored(tmp_path, 200, suffix)
    stale = [f".{out.name}.state.pt.0123456789ab.tmp", f".{out.name}.fedcba987654.tmp"]  # as `replace_atomically` names them
    kept = [f".{out.name}.state.pt.notes.tmp", ".c2.npz.0123456789ab.tmp", "notes.tmp"]  # not what a killed write of this run leaves
    for name in stale + kept: (tmp_path / name).write_bytes(b"half a file")
    scored(tmp_path, 300, suffix)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == sorted(kept)
