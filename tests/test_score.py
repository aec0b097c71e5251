"""`proton-ood score`: incremental runs, a killed run resumed, the bank audit against the detector, and one-line errors."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import proton.models.score as score_module
from proton.bench import EmbeddingCache, SyntheticWorld
from proton.deploy import Monitor, save_state
from proton.detector import ProtonConfig
from proton.models.score import Results, class_prompts_from, read_reference_scores, row_columns, score_stream, write_audit

CONFIG = ProtonConfig(bank_size=20)
N = 700  # 400 ID images and 100 of each of the three shifts


def cache_file(path, n=None):
    "A simulated cache of N images (or its first `n`), saved at `path`."
    cache = EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=400, n_per_shift=100)
    if n is not None: cache = cache.subset(np.arange(n))
    cache.save(path)
    return path


def run(source, out, **kw):
    return score_stream(source, out, config=CONFIG, warmup=50, chunk_size=64, progress=False, **kw)


@pytest.mark.parametrize("half", [256, 300])
def test_two_runs_give_the_rows_of_one(tmp_path, half):
    once = run(cache_file(tmp_path / "c.npz"), tmp_path / "once.csv")
    assert once == (N, N)
    run(cache_file(tmp_path / "c.npz", half), tmp_path / "two.csv")  # today's images
    assert run(cache_file(tmp_path / "c.npz"), tmp_path / "two.csv") == (N - half, N)  # tomorrow's: only the new ones
    a, b = [Path(tmp_path / f).read_text().splitlines() for f in ("once.csv", "two.csv")]
    if half % 64 == 0: assert a == b  # the same chunks: byte for byte
    else:
        import pandas as pd
        x, y = pd.read_csv(tmp_path / "once.csv"), pd.read_csv(tmp_path / "two.csv")
        num = ["score", "confidence", "alpha", "base", "proto"]
        pd.testing.assert_frame_equal(x.drop(columns=num + ["drift", "threshold"]), y.drop(columns=num + ["drift", "threshold"]))
        np.testing.assert_allclose(x[num].to_numpy(), y[num].to_numpy(), atol=1e-5)  # batch invariance, up to float32 rounding


def test_two_runs_at_the_default_chunk_size_give_the_decisions_of_one_and_its_numbers_up_to_rounding(tmp_path):
    "Today's 300 images, then tomorrow's 700, at the default chunk size: the second run's chunks (engine-sized) start where one run's do not."
    go = lambda n, out: score_stream(cache_file(tmp_path / "c.npz", n), out, config=CONFIG, warmup=50, progress=False)
    go(None, tmp_path / "once.csv"); go(300, tmp_path / "two.csv")
    assert go(None, tmp_path / "two.csv") == (N - 300, N)
    once, two = (Results(tmp_path / f).load()[1] for f in ("once.csv", "two.csv"))
    columns = row_columns(["class 0", "class 1"])
    numbers = ["score", "threshold", "confidence", "alpha", "base", "proto", "drift"]
    keep = [j for j, c in enumerate(columns) if c not in numbers]
    assert [[r[j] for j in keep] for r in two] == [[r[j] for j in keep] for r in once]  # paths, flags, classes, bank entries and counts, alarms, status
    col = lambda rows, c: np.array([float(r[columns.index(c)]) if r[columns.index(c)] else np.nan for r in rows])
    tau = EmbeddingCache.load(tmp_path / "c.npz").temperature
    tol = 1e-5 + 4 * np.finfo(np.float32).eps / min(tau, 1)  # the batch invariance of the engine's tests and the deployment chapter's promises
    for c in numbers[:-1]: np.testing.assert_allclose(col(two, c), col(once, c), rtol=0, atol=tol, equal_nan=True, err_msg=c)
    sigma = Results(tmp_path / "once.csv").load()[0]["monitor"]["threshold"]["std"]
    bound = np.nancumsum(np.abs(col(two, "score") - col(once, "score"))) / sigma  # CUSUM is 1-Lipschitz: it adds up the standardised differences
    assert (np.nan_to_num(np.abs(col(two, "drift") - col(once, "drift"))) <= bound + 1e-9).all()


@pytest.mark.parametrize("k", [0, 1, 4])
def test_a_killed_run_resumes_to_identical_results(tmp_path, monkeypatch, k):
    cache = cache_file(tmp_path / "c.npz")
    run(cache, tmp_path / "once.csv")
    calls = []
    def dying(state, path):
        if len(calls) == k + 1: raise KeyboardInterrupt("killed")  # after the header and k chunks; this chunk's rows are on disk, its state is not
        calls.append(path); return save_state(state, path)
    monkeypatch.setattr(score_module, "save_state", dying)
    with pytest.raises(KeyboardInterrupt): run(cache, tmp_path / "killed.csv")
    monkeypatch.setattr(score_module, "save_state", save_state)
    assert len((tmp_path / "killed.csv").read_text().splitlines()) == 1 + 64 * (k + 1)  # one chunk more than committed
    assert run(cache, tmp_path / "killed.csv") == (N - 64 * k, N)
    assert (tmp_path / "killed.csv").read_bytes() == (tmp_path / "once.csv").read_bytes()


def test_a_cache_whose_source_names_repeat_is_refused_before_any_file(tmp_path):
    "Two sites export IM000000...: a cache's rows are known by their source names, so a repeated name would leave images without a row on resume."
    from dataclasses import replace
    c = EmbeddingCache.load(cache_file(tmp_path / "c.npz", 70))
    replace(c, source=[f"IM{i % 35:06d}" for i in range(70)]).save(tmp_path / "dup.npz")
    with pytest.raises(ValueError, match=r"dup\.npz names 'IM000000' more than once"): run(tmp_path / "dup.npz", tmp_path / "r.csv")
    assert not list(tmp_path.glob("r.csv*"))
    replace(c, source=[f"site{'AB'[i // 35]}/IM{i % 35:06d}" for i in range(70)]).save(tmp_path / "dup.npz")  # distinct names: one row each
    assert run(tmp_path / "dup.npz", tmp_path / "r.csv") == (70, 70)


def test_the_audit_names_the_bank_entries(tmp_path):
    cache = cache_file(tmp_path / "c.npz")
    run(cache, tmp_path / "r.csv")
    audit = write_audit(tmp_path / "r.csv", tmp_path / "audit.csv")
    saved, rows = Results(tmp_path / "r.csv").load()
    det = Monitor.from_state_dict(saved["monitor"]).detector
    c = EmbeddingCache.load(cache)
    E = torch.as_tensor(c.image_embeddings); E = E / E.norm(dim=1, keepdim=True)
    names = list(c.source) if c.source is not None else [f"c.npz#{i}" for i in range(len(c))]
    assert len(audit) == int(det.bank.counts.sum()) == 2 * CONFIG.bank_size
    for cls, slot, path, t in audit:
        assert rows[t][1] == path
        torch.testing.assert_close(det.bank.entries[list(c.class_names).index(cls), slot], E[names.index(path)], atol=1e-6, rtol=0)
    assert (tmp_path / "audit.csv").read_text().splitlines()[0] == "class,slot,path,index"


def test_parquet_holds_the_rows_of_the_csv(tmp_path):
    pytest.importorskip("pyarrow")
    import pandas as pd
    cache = cache_file(tmp_path / "c.npz", 300)
    run(cache, tmp_path / "r.csv"); run(cache, tmp_path / "r.parquet")
    a, b = pd.read_csv(tmp_path / "r.csv"), pd.read_parquet(tmp_path / "r.parquet")
    pd.testing.assert_frame_equal(a, b, check_dtype=False)
    assert run(cache_file(tmp_path / "c.npz"), tmp_path / "r.parquet") == (N - 300, N)


def test_a_run_writes_its_parquet_file_once_not_once_a_chunk(tmp_path, monkeypatch):
    "A Parquet file cannot be appended to; rewritten whole at every chunk, a stream of n images cost time in n squared."
    pq = pytest.importorskip("pyarrow.parquet")
    writes, write_table = [], pq.write_table
    monkeypatch.setattr(pq, "write_table", lambda table, where, **kw: (writes.append(table.num_rows), write_table(table, where, **kw))[1])
    run(cache_file(tmp_path / "c.npz", 300), tmp_path / "r.parquet")  # five chunks of 64
    assert writes[-1] == 300 and len(writes) <= 2, writes  # when the stream begins, and when the run ends
    writes.clear()
    assert run(cache_file(tmp_path / "c.npz"), tmp_path / "r.parquet") == (N - 300, N)  # seven chunks more
    assert writes == [N]


def parquet_rows(path):
    import pandas as pd
    return pd.read_parquet(path)


@pytest.mark.parametrize("k", [0, 4, 10, 11])
def test_a_killed_parquet_run_resumes_to_identical_results(tmp_path, monkeypatch, k):
    "Killed after the start and k chunks (k = 11: after the last chunk, while the file is rewritten): the next run ends with the same file."
    pytest.importorskip("pyarrow")
    import pandas as pd
    cache = cache_file(tmp_path / "c.npz")
    run(cache, tmp_path / "once.parquet")
    calls = []
    def dying(state, path):
        if len(calls) == k + 1: raise KeyboardInterrupt("killed")
        calls.append(path); return save_state(state, path)
    monkeypatch.setattr(score_module, "save_state", dying)
    with pytest.raises(KeyboardInterrupt): run(cache, tmp_path / "killed.parquet")
    monkeypatch.setattr(score_module, "save_state", save_state)
    assert len(Results(tmp_path / "killed.parquet").load()[1]) == min(64 * k, N)
    assert run(cache, tmp_path / "killed.parquet") == (N - min(64 * k, N), N)
    pd.testing.assert_frame_equal(parquet_rows(tmp_path / "killed.parquet"), parquet_rows(tmp_path / "once.parquet"))


def test_a_parquet_run_killed_before_its_file_was_rewritten_is_completed_by_the_next(tmp_path, monkeypatch):
    "Every row committed, the file not yet rewritten: the next run has no new image and still writes the file."
    pq = pytest.importorskip("pyarrow.parquet")
    import pandas as pd
    cache = cache_file(tmp_path / "c.npz", 300)
    run(cache, tmp_path / "once.parquet")
    write_table = pq.write_table
    def dying(table, where, **kw):
        if table.num_rows: raise KeyboardInterrupt("killed")
        return write_table(table, where, **kw)
    monkeypatch.setattr(pq, "write_table", dying)
    with pytest.raises(KeyboardInterrupt): run(cache, tmp_path / "killed.parquet")
    monkeypatch.setattr(pq, "write_table", write_table)
    assert len(Results(tmp_path / "killed.parquet").load()[1]) == 300  # committed, though not yet in the file
    assert run(cache, tmp_path / "killed.parquet") == (0, 300)
    pd.testing.assert_frame_equal(parquet_rows(tmp_path / "killed.parquet"), parquet_rows(tmp_path / "once.parquet"))


def test_a_reader_that_loaded_the_state_before_the_parquet_file_was_rewritten_finds_every_row(tmp_path, monkeypatch):
    "`write_audit` in another process may read the state just before a run rewrites the file, and the journal just after."
    pytest.importorskip("pyarrow")
    from proton.deploy import torch_load_safely
    cache, out, before = cache_file(tmp_path / "c.npz", 300), tmp_path / "r.parquet", []
    finish = Results.finish
    def spy(self, *args):
        before.append(torch_load_safely(self.state_path, "a scoring state")); finish(self, *args)
    monkeypatch.setattr(Results, "finish", spy)
    run(cache, out)
    monkeypatch.setattr(score_module, "torch_load_safely", lambda path, what: dict(before[-1]))
    assert len(Results(out).load()[1]) == 300


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_loading_some_columns_gives_those_columns_of_every_committed_row(tmp_path, monkeypatch, suffix):
    "A run reads only the paths of the rows before it; from the file and from the journal alike, and not beyond the committed rows."
    if suffix == ".parquet": pytest.importorskip("pyarrow")
    out = tmp_path / f"r{suffix}"
    run(cache_file(tmp_path / "c.npz", 300), out)
    def dying(state, path):
        if state["rows"] > 428: raise KeyboardInterrupt("killed")  # this chunk's rows are on disk, its state is not
        return save_state(state, path)
    monkeypatch.setattr(score_module, "save_state", dying)
    with pytest.raises(KeyboardInterrupt): run(cache_file(tmp_path / "c.npz"), out)  # 300 rows in the file, 128 more committed, 64 beyond
    monkeypatch.undo()
    rows = Results(out).load()[1]
    assert len(rows) == 428
    for columns in (["path"], ["bank:class 1", "index", "score"]):
        j = [row_columns(["class 0", "class 1"]).index(c) for c in columns]
        assert Results(out).load(columns=columns)[1] == [[r[k] for k in j] for r in rows]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(suffix=st.sampled_from([".csv", ".parquet"]), chunk=st.integers(16, 120), first=st.integers(0, N), kill=st.integers(0, 60))
@example(suffix=".csv", chunk=16, first=0, kill=0)  # killed between the header and the first state: the file without a state was refused
def test_any_kill_in_any_run_of_a_growing_stream_resumes_to_the_rows_of_one_run(tmp_path_factory, suffix, chunk, first, kill):
    "A stream scored in two runs (the first `first` images, then all), the second killed at its `kill`-th state write and run again."
    if suffix == ".parquet": pytest.importorskip("pyarrow")
    tmp = tmp_path_factory.mktemp("stream")
    go = lambda source, out: score_stream(source, out, config=CONFIG, warmup=50, chunk_size=chunk, progress=False)
    go(cache_file(tmp / "c.npz"), tmp / f"once{suffix}")
    out, writes = tmp / f"twice{suffix}", []
    if first: go(cache_file(tmp / "c.npz", first), out)
    def dying(state, path):
        if len(writes) == kill: raise KeyboardInterrupt("killed")
        writes.append(path); return save_state(state, path)
    score_module.save_state = dying
    try: go(cache_file(tmp / "c.npz"), out)
    except KeyboardInterrupt: pass
    finally: score_module.save_state = save_state
    assert go(tmp / "c.npz", out)[1] == N
    once, twice = Results(tmp / f"once{suffix}").load()[1], Results(out).load()[1]
    if first % chunk == 0: assert twice == once  # the same chunks: the same rows, to the last digit
    else:  # other chunk boundaries: the same decisions, scores equal up to float32 rounding (batch invariance)
        floats = [row_columns(["class 0", "class 1"]).index(c) for c in ("score", "confidence", "alpha", "base", "proto", "drift", "threshold")]
        assert [[v for j, v in enumerate(r) if j not in floats] for r in twice] == [[v for j, v in enumerate(r) if j not in floats] for r in once]
        for j in floats[:5]:
            a, b = (np.array([float(r[j]) if r[j] else np.nan for r in rows]) for rows in (once, twice))
            np.testing.assert_allclose(b, a, atol=1e-5, equal_nan=True)
    if suffix == ".parquet":
        import pandas as pd
        assert len(pd.read_parquet(out)) == N  # the file itself, rewritten by the last run


def test_other_settings_are_refused(tmp_path):
    cache = cache_file(tmp_path / "c.npz", 100)
    run(cache, tmp_path / "r.csv")
    with pytest.raises(ValueError, match=r"other settings \(warmup\)"):
        score_stream(cache, tmp_path / "r.csv", config=CONFIG, warmup=60, chunk_size=64, progress=False)
    with pytest.raises(ValueError, match="brings its own embeddings"): run(cache, tmp_path / "x.csv", classes="a,b")


def test_the_recorded_weights_do_not_depend_on_the_working_folder(tmp_path, monkeypatch):
    "--checkpoint none was recorded as os.path.abspath('none'), so the stream continued from another folder was refused as 'other settings (checkpoint)'."
    weights = lambda model, checkpoint: score_module._settings(model, checkpoint, None, ["a", "b"], None, CONFIG, 50, 0.95, None, 0.5, 5.0, "name")["checkpoint"]
    (tmp_path / "sub").mkdir(); (tmp_path / "w.pt").write_bytes(b"weights")  # read for its SHA-256
    monkeypatch.chdir(tmp_path)
    here = [weights("unimed-clip", "none"), weights("flair", "w.pt"), weights("open_clip:ViT-S-32/w.pt", None)]
    monkeypatch.chdir(tmp_path / "sub")
    assert [weights("unimed-clip", "none"), weights("flair", "../w.pt"), weights("open_clip:ViT-S-32/../w.pt", None)] == here
    assert here == [None, str(tmp_path / "w.pt"), str(tmp_path / "w.pt")]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_reference_stream_scored_with_other_settings_is_refused(tmp_path, suffix):
    "The threshold is a quantile of reference scores: scores of another detector (γ, M, model, classes) are on another scale."
    cache = cache_file(tmp_path / "c.npz", 300)
    run(cache, tmp_path / f"ref{suffix}")
    saved, rows = Results(tmp_path / f"ref{suffix}").load(columns=["score", "calibrated"])
    theta = np.quantile([float(s) for s, c in rows if c == "True"], 0.95, method="higher")
    run(cache, tmp_path / "same.csv", reference=tmp_path / f"ref{suffix}")
    assert float(Results(tmp_path / "same.csv").load(columns=["threshold"])[1][-1][0]) == theta  # the reference's calibrated scores set θ
    cache_file(tmp_path / "other_cache.npz", 200)  # known-ID images extracted into a cache of their own: another file, the same VLM
    run(tmp_path / "other_cache.npz", tmp_path / "from_other_cache.csv", reference=tmp_path / f"ref{suffix}")
    with pytest.raises(ValueError, match=rf"ref\{suffix} was scored by a detector with other settings \(config\)"):
        score_stream(cache, tmp_path / "other.csv", config=ProtonConfig(bank_size=30), warmup=50, chunk_size=64, progress=False,
                     reference=tmp_path / f"ref{suffix}")


def proton_ood(*args):
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)


def one_line_error(r):
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    return r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr and lines[0].startswith("proton-ood score: error: ")


def test_images_dicom_included_through_the_command(tmp_path):
    from PIL import Image
    from test_dicom import write_dicom
    folder = tmp_path / "in" / "sub"; folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(6): Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    write_dicom(folder / "scan.dcm", rng.integers(0, 4096, (40, 40)).astype(np.uint16))
    (folder / "notes.txt").write_text("not an image")
    r = proton_ood("score", str(tmp_path / "in"), "--out", str(tmp_path / "r.csv"), "--model", "open_clip:ViT-S-32/none",
                   "--classes", "a,b", "--gamma", "0.5", "--no-progress", "--audit", str(tmp_path / "a.csv"))
    assert r.returncode == 0, r.stderr
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert len(lines) == 8 and lines[0].startswith("index,path,score,flag,threshold,status") and lines[0].endswith("bank:a,bank:b")
    assert "scan.dcm" in lines[-1]  # by name: 0.png ... 5.png, scan.dcm
    assert "scored 7 new images" in r.stdout


@pytest.mark.parametrize("case", ["empty folder", "unknown model", "unreadable list", "missing source"])
def test_errors_are_one_line(tmp_path, case):
    from PIL import Image
    (tmp_path / "empty").mkdir(); (tmp_path / "photos").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "photos" / "x.png")
    (tmp_path / "list.txt").write_bytes(b"\xff\xfe\x00 not text")
    source, model, message = {"empty folder": ("empty", "open_clip:ViT-S-32/none", "no images in"),
                              "unknown model": ("photos", "biomedclip", "unknown VLM 'biomedclip'"),
                              "unreadable list": ("list.txt", "open_clip:ViT-S-32/none", "cannot read the file list"),
                              "missing source": ("absent", "open_clip:ViT-S-32/none", "no embedding cache, image folder or file list at")}[case]
    r = proton_ood("score", str(tmp_path / source), "--out", str(tmp_path / "r.csv"), "--model", model, "--classes", "a,b")
    assert one_line_error(r) and message in r.stderr, r.stderr


def photo_folder(folder, n=7, broken=(3,)):
    "n small random PNG files named 0.png ...; those in `broken` hold bytes no decoder reads."
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        if i in broken: (folder / f"{i}.png").write_bytes(b"\x89PNG\r\n\x1a\n half copied")
        else: Image.fromarray(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


@pytest.fixture(scope="module")
def random_vlm():
    from proton.models import load_vlm
    return load_vlm("open_clip:ViT-S-32/none")


def run_images(source, out, vlm, **kw):
    "`score_stream` on image files, two images a chunk unless `kw` says otherwise."
    return score_stream(source, out, vlm, "a,b", **(dict(config=CONFIG, warmup=50, chunk_size=2, progress=False) | kw))


def test_an_unreadable_image_is_left_out_and_tried_again_next_run(tmp_path, random_vlm):
    folder = photo_folder(tmp_path / "in")
    with pytest.warns(UserWarning, match=r"1 of 7 images could not be read.*3\.png"):
        assert run_images(folder, tmp_path / "r.csv", random_vlm, chunk_size=1) == (6, 6)
    good = tmp_path / "good.txt"; good.write_text("\n".join(f"in/{i}.png" for i in (0, 1, 2, 4, 5, 6)))
    run_images(good, tmp_path / "good.csv", random_vlm, chunk_size=1)  # one image a forward pass in both: the same floats
    assert (tmp_path / "r.csv").read_text() == (tmp_path / "good.csv").read_text()  # the same stream as without the file
    photo_folder(folder, broken=())  # the copy finished
    assert run_images(folder, tmp_path / "r.csv", random_vlm) == (1, 7)
    assert (tmp_path / "r.csv").read_text().splitlines()[-1].split(",")[1].endswith("3.png")
    with pytest.raises(ValueError, match=r"cannot read image .*3\.png"): run_images(photo_folder(tmp_path / "again"), tmp_path / "s.csv", random_vlm, strict=True)


@pytest.mark.parametrize("k", [0, 1])
def test_a_killed_run_with_an_unreadable_image_resumes_to_identical_results(tmp_path, monkeypatch, random_vlm, k):
    folder = photo_folder(tmp_path / "in", n=9, broken=(1,))
    with pytest.warns(UserWarning): run_images(folder, tmp_path / "once.csv", random_vlm)
    calls = []
    def dying(state, path):
        if len(calls) == k + 1: raise KeyboardInterrupt("killed")
        calls.append(path); return save_state(state, path)
    monkeypatch.setattr(score_module, "save_state", dying)
    with pytest.raises(KeyboardInterrupt): run_images(folder, tmp_path / "killed.csv", random_vlm)
    monkeypatch.setattr(score_module, "save_state", save_state)
    with pytest.warns(UserWarning, match="1 of"): run_images(folder, tmp_path / "killed.csv", random_vlm)
    assert (tmp_path / "killed.csv").read_text() == (tmp_path / "once.csv").read_text()


def test_a_malformed_dicom_file_is_left_out_with_a_warning_naming_it(tmp_path, random_vlm):
    "A multi-valued RescaleSlope (one value in the standard) makes one file unreadable, not the stream."
    from test_dicom import write_dicom
    folder = photo_folder(tmp_path / "in", n=3, broken=())
    write_dicom(folder / "IM000001", (np.arange(64 * 64) % 4096).astype(np.uint16).reshape(64, 64), RescaleSlope=[1, 1])
    with pytest.warns(UserWarning, match=r"1 of 4 images could not be read.*IM000001: .*RescaleSlope") as caught:
        assert run_images(folder, tmp_path / "r.csv", random_vlm) == (3, 3)
    said = next(str(w.message) for w in caught if "could not be read" in str(w.message))
    assert said.count(str(folder / "IM000001")) == 1, f"the file is named more than once: {said}"
    with pytest.raises(ValueError, match="cannot read image") as stopped: run_images(folder, tmp_path / "s.csv", random_vlm, strict=True)
    assert str(stopped.value).count(str(folder / "IM000001")) == 1, f"the file is named more than once: {stopped.value}"


def test_no_readable_image_at_all_is_an_error(tmp_path, random_vlm):
    folder = photo_folder(tmp_path / "in", n=2, broken=(0, 1))
    with pytest.raises(ValueError, match=r"none of the 2 images .* could be read, e\.g\. .*0\.png"):
        run_images(folder, tmp_path / "r.csv", random_vlm)


def test_the_command_reports_unreadable_images_and_goes_on(tmp_path):
    folder = photo_folder(tmp_path / "in")
    r = proton_ood("score", str(folder), "--out", str(tmp_path / "r.csv"), "--model", "open_clip:ViT-S-32/none", "--classes", "a,b", "--no-progress")
    assert r.returncode == 0 and "Traceback" not in r.stderr and "Warning" not in r.stderr, r.stderr
    assert "scored 6 new images" in r.stdout and "1 of 7 images could not be read" in r.stdout and "3.png" in r.stdout, r.stdout
    r = proton_ood("score", str(folder), "--out", str(tmp_path / "s.csv"), "--model", "open_clip:ViT-S-32/none", "--classes", "a,b", "--strict", "--no-progress")
    assert one_line_error(r) and "cannot read image" in r.stderr, r.stderr


def test_an_image_over_pils_size_limit_is_left_out_like_an_unreadable_one(tmp_path, random_vlm, monkeypatch):
    from PIL import Image
    folder = photo_folder(tmp_path / "in", n=3, broken=())
    Image.new("RGB", (40, 40)).save(folder / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 600)  # 24 x 24 = 576 pixels pass, 40 x 40 = 1,600 > 2 x 600 is refused
    with pytest.warns(UserWarning, match=r"1 of 4 images could not be read.*big\.png.*decompression bomb"):
        assert run_images(folder, tmp_path / "r.csv", random_vlm) == (3, 3)


def test_a_file_list_saved_with_a_byte_order_mark_and_crlf_lines_is_read(tmp_path):
    "Windows editors and spreadsheet exports start a UTF-8 file with a BOM and end lines with CRLF; neither is part of a path."
    from proton.models.score import list_images
    folder = photo_folder(tmp_path / "in", n=2, broken=())
    (tmp_path / "list.txt").write_bytes("\ufeffin/1.png\r\nin/0.png\r\n".encode("utf-8"))
    assert list_images(tmp_path / "list.txt") == [str(folder / "1.png"), str(folder / "0.png")]
    (tmp_path / "ref.txt").write_bytes("\ufeff0.25\r\n0.5\r\n".encode("utf-8"))
    assert read_reference_scores(tmp_path / "ref.txt").tolist() == [0.25, 0.5]
    (tmp_path / "prompts.json").write_bytes('\ufeff{"a": ["an a"], "b": ["a b"]}'.encode("utf-8"))
    assert class_prompts_from(None, tmp_path / "prompts.json") == {"a": ["an a"], "b": ["a b"]}
    (tmp_path / "utf16.txt").write_text("an a\na b\n", encoding="utf-16")  # another encoding: named, with the file
    with pytest.raises(ValueError, match=r"cannot read the prompt file .*utf16\.txt.*UTF-8"): class_prompts_from(None, tmp_path / "utf16.txt")
    (tmp_path / "gone.txt").write_text("in/1.png\nin/9.png\n")
    with pytest.raises(ValueError, match=r"names 1 file that does not exist, e\.g\. .*9\.png"): list_images(tmp_path / "gone.txt")


def test_one_image_as_the_source_is_named_as_an_image_not_read_as_a_file_list(tmp_path):
    "`proton-ood score IMAGE` read the image as a file list: a PNG was 'not UTF-8', a small TIFF printed its header's NUL and control bytes as file names."
    from PIL import Image
    from proton.models.score import list_images
    for name in ("photo.png", "tiny.tif"):
        Image.new("L", (4, 4)).save(tmp_path / name)
        with pytest.raises(ValueError) as e: list_images(tmp_path / name)
        assert str(e.value) == f"{tmp_path / name} is an image file, not a folder of images, a file list or a cache: score its folder, or a file list that names it"
    (tmp_path / "odd.txt").write_text("in/\x00a\x1bb.png\n")
    with pytest.raises(ValueError, match=r"e\.g\. '.*in/\\x00a\\x1bb\.png'$"): list_images(tmp_path / "odd.txt")  # escaped, as the terminal can show it


def test_a_file_list_from_a_pipe_is_read_whole(tmp_path):
    "`ls ... | proton-ood score /dev/stdin`: the image-file check read the pipe's first 8 KiB (looking for a DICOM marker), and those images were silently left out."
    from PIL import Image
    (tmp_path / "in").mkdir()
    paths = [str(tmp_path / "in" / f"im{i:05d}.png") for i in range(300)]
    for i, p in enumerate(paths): Image.new("RGB", (4, 4), (i % 256, 0, 0)).save(p)
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    r = subprocess.run([exe, "score", "/dev/stdin", "--out", str(tmp_path / "r.csv"), "--model", "open_clip:ViT-S-32/none", "--classes", "a,b",
                        "--no-progress"], input="".join(p + "\n" for p in paths), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "scored 300 new images" in r.stdout, r.stdout + r.stderr
    fifo = tmp_path / "list"; os.mkfifo(fifo)  # a named pipe: read once, never waited on a second time
    writer = subprocess.Popen(["sh", "-c", 'cat > "$1"', "sh", str(fifo)], stdin=subprocess.PIPE, text=True)
    child = subprocess.Popen([sys.executable, "-c", "import sys; from proton.models.score import list_images; print(len(list_images(sys.argv[1])))",
                              str(fifo)], stdout=subprocess.PIPE, text=True)
    writer.communicate("".join(p + "\n" for p in paths[:8]), timeout=60)
    try: assert child.communicate(timeout=60)[0].strip() == "8"
    finally: child.kill(); child.wait()


def test_hidden_files_and_folders_are_not_images_to_score(tmp_path):
    from PIL import Image
    from proton.models.score import list_images
    root = tmp_path / ".cache" / "in"  # a hidden folder above the source does not matter
    (root / ".ipynb_checkpoints").mkdir(parents=True); (root / "day1").mkdir()
    for p in (root / "day1" / "a.png", root / ".ipynb_checkpoints" / "b.png", root / "day1" / ".c.png"): Image.new("RGB", (8, 8)).save(p)
    (root / "day1" / "._a.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")  # macOS's resource fork beside a copied file
    assert list_images(root) == [str(root / "day1" / "a.png")]


def test_dicom_files_without_a_suffix_are_images_to_score(tmp_path):
    "A PACS export names its files IM000001 or by UID (1.2.840....4.17): the DICM marker makes them images, DICOMDIR (the index) is not one."
    pytest.importorskip("pydicom")
    from test_dicom import write_dicom
    from proton.models.score import list_images
    series = tmp_path / "export" / "series1"; series.mkdir(parents=True)
    scans = [write_dicom(series / name, np.zeros((8, 8), np.uint16)) for name in ("IM000001", "1.2.840.113619.2.55.4.17", "b.dcm")]
    write_dicom(tmp_path / "export" / "DICOMDIR", np.zeros((8, 8), np.uint16)); write_dicom(series / "dicomdir", np.zeros((8, 8), np.uint16))
    (series / "notes").write_text("not an image"); (series / "zeros").write_bytes(b"\0" * 200)
    assert list_images(tmp_path / "export") == sorted(str(p) for p in scans)


@pytest.mark.skipif(sys.platform == "win32", reason="the lock is POSIX's flock")
def test_a_second_run_on_the_same_results_is_refused_while_the_first_writes(tmp_path):
    "Two runs appending to one results file would interleave their rows: while one holds the lock, the other stops and writes nothing."
    cache, out = cache_file(tmp_path / "c.npz", 100), tmp_path / "r.csv"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
                               "print('locked', flush=True); time.sleep(60)", str(tmp_path / "r.csv.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=r"another run is writing .*r\.csv"): run(cache, out)
        assert not out.exists() and not (tmp_path / "r.csv.state.pt").exists()
    finally: holder.kill(); holder.wait()
    assert run(cache, out) == (100, 100)  # the lock goes with its process


def test_a_link_to_the_results_and_its_target_share_one_lock_and_one_state(tmp_path):
    "The lock, state and journal were named after --out as typed: link.csv and the target.csv it points to took two locks, and two runs could append to one file."
    cache, link, target = cache_file(tmp_path / "c.npz", 100), tmp_path / "link.csv", tmp_path / "target.csv"
    link.symlink_to("target.csv")
    with Results(link).lock():
        with pytest.raises(ValueError, match=r"^another run is writing .*target\.csv \(it holds target\.csv\.lock\)"): run(cache, target)
    assert run(cache, link) == (100, 100) and run(cache, target) == (0, 100)  # one stream, whichever name
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["c.npz", "link.csv", "target.csv", "target.csv.lock", "target.csv.state.pt"]


def test_a_stream_through_a_link_stays_one_when_an_empty_stream_is_discarded(tmp_path, monkeypatch):
    "Results.discard unlinked --out as typed: through a link it removed the link, the next chunk wrote a plain link.csv, and its rows and the state beside target.csv parted for good."
    cache, link, target = cache_file(tmp_path / "c.npz", 100), tmp_path / "link.csv", tmp_path / "target.csv"
    link.symlink_to("target.csv")
    commit = Results.commit
    def killed(self, *a, **k): raise KeyboardInterrupt("killed before the first chunk was committed")
    monkeypatch.setattr(Results, "commit", killed)
    with pytest.raises(KeyboardInterrupt): run(cache, link)
    monkeypatch.setattr(Results, "commit", commit)
    assert run(cache, link, drift_h=4.) == (100, 100)  # other settings on a stream of 0 rows: it is discarded and begun anew
    assert link.is_symlink() and run(cache, target, drift_h=4.) == (0, 100) and run(cache, link, drift_h=4.) == (0, 100)


def test_a_link_into_a_missing_folder_is_named_as_typed(tmp_path):
    "A link --out pointing into a folder that does not exist failed on the lock beside its target: '[Errno 2] No such file or directory: .../gone/t.csv.lock'."
    link = tmp_path / "dl.csv"; link.symlink_to("gone/t.csv")
    with pytest.raises(ValueError, match=r"^cannot write .*dl\.csv: .*gone \(where dl\.csv links\) is not a folder$"): Results(link)


def test_the_audit_reads_the_committed_rows_without_cutting_the_file(tmp_path, monkeypatch):
    "`write_audit` may run while a run appends: it reads the committed rows and leaves the rest of the file to the run that wrote it."
    cache = cache_file(tmp_path / "c.npz", 200)
    def dying(state, path):
        if Path(path).exists(): raise KeyboardInterrupt("killed")  # the chunk's rows are on disk, its state is not
        return save_state(state, path)
    monkeypatch.setattr(score_module, "save_state", dying)
    with pytest.raises(KeyboardInterrupt): run(cache, tmp_path / "r.csv")
    size = (tmp_path / "r.csv").stat().st_size
    assert len(write_audit(tmp_path / "r.csv", tmp_path / "a.csv")) == 0  # no committed row yet
    assert (tmp_path / "r.csv").stat().st_size == size > 0


def test_the_temporary_file_of_a_killed_audit_write_is_removed_by_the_next_but_not_a_live_ones(tmp_path):
    "write_audit took no lock, so it could not tell a killed write's temporary from a live one's: a killed audit write left `.a.csv.<12 hex>.tmp` for good."
    from proton.deploy import hold_lock
    out, audit = tmp_path / "r.csv", tmp_path / "a.csv"
    run(cache_file(tmp_path / "c.npz", 100), out)
    stale = tmp_path / ".a.csv.0123456789ab.tmp"; stale.write_text("a killed audit write's")
    write_audit(out, audit)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "c.npz", "r.csv", "r.csv.lock", "r.csv.state.pt"]  # nor a lock left behind
    live = tmp_path / ".a.csv.ba9876543210.tmp"; live.write_text("being written")
    with hold_lock(tmp_path / "a.csv.lock"):  # as another run writing the audit holds it
        with pytest.raises(ValueError, match=r"^another run is writing the audit .*a\.csv \(it holds a\.csv\.lock\)"): write_audit(out, audit)
    assert live.read_text() == "being written"


@pytest.mark.parametrize("bad,message", [(dict(batch_size=0), "batch_size must be an integer from 1 to 65536, got 0"),
                                         (dict(batch_size=2.5), "batch_size must be an integer from 1 to 65536, got 2.5"),
                                         (dict(device="tpu"), "unknown device 'tpu'"),
                                         (dict(warmup=1), "warmup must be an integer from 2 to 16777216, got 1"),
                                         (dict(id_recall=1.5), r"id_recall must be in \(0, 1\)"),
                                         (dict(drift_h=0), "need k >= 0 and h > 0")])
def test_a_bad_argument_stops_the_run_before_it_writes_a_stream(tmp_path, bad, message):
    folder = photo_folder(tmp_path / "in", broken=())
    with pytest.raises(ValueError, match=message):
        score_stream(folder, tmp_path / "r.csv", "open_clip:ViT-S-32/none", "a,b", progress=False, **bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"], "no results, state or lock file"


def test_the_command_scores_with_flair_from_local_weights_and_tokenizer(tmp_path):
    "An offline site: FLAIR's weights and Bio_ClinicalBERT's vocabulary are local files, named on the command line."
    from proton.models.flair import random_flair
    (tmp_path / "vocab").mkdir()
    (tmp_path / "vocab" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "normal", "glaucoma"]) + "\n")
    torch.save(random_flair(0).state_dict(), tmp_path / "flair.pth")
    folder = photo_folder(tmp_path / "in", n=3, broken=())
    r = proton_ood("score", str(folder), "--out", str(tmp_path / "r.csv"), "--model", "flair", "--checkpoint", str(tmp_path / "flair.pth"),
                   "--tokenizer", str(tmp_path / "vocab"), "--classes", "normal,glaucoma", "--no-progress")
    assert r.returncode == 0 and "scored 3 new images" in r.stdout, r.stderr


def test_an_audit_that_cannot_be_written_stops_the_command_before_it_scores(tmp_path):
    folder = photo_folder(tmp_path / "in", broken=())
    r = proton_ood("score", str(folder), "--out", str(tmp_path / "r.csv"), "--model", "open_clip:ViT-S-32/none", "--classes", "a,b",
                   "--no-progress", "--audit", str(tmp_path / "absent" / "a.csv"))
    assert one_line_error(r) and "cannot write the audit" in r.stderr and "absent" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"], "nothing scored, nothing written"


def without_root_powers(cmd):
    "`cmd` as a command that a read-only folder stops: as root, without the capabilities that override file permissions."
    if os.geteuid() != 0: return cmd
    if not shutil.which("setpriv"): pytest.skip("root without setpriv: no folder is read-only to it")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]


@pytest.mark.parametrize("case", ["a folder", "in a read-only folder"])
def test_an_audit_that_is_a_folder_or_in_a_read_only_folder_stops_the_command_before_it_scores(tmp_path, case):
    "Only the audit's folder was checked: the whole stream was scored and committed, then the audit failed with a raw errno line."
    cache, folder = cache_file(tmp_path / "c.npz"), tmp_path / "audits"
    folder.mkdir()
    audit = folder if case == "a folder" else folder / "a.csv"
    if case != "a folder": folder.chmod(0o555)
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    r = subprocess.run(without_root_powers([exe, "score", str(cache), "--out", str(tmp_path / "r.csv"), "--no-progress", "--audit", str(audit)]),
                       capture_output=True, text=True, timeout=600)
    folder.chmod(0o755)
    assert one_line_error(r) and f"cannot write {audit}" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audits", "c.npz"] and not any(folder.iterdir()), "nothing scored, nothing written"


@pytest.mark.parametrize("text,message", [("0.1\nnan\n0.2\n", r"ref\.txt: 1 of the 3 reference scores is not finite"),
                                          ("0.1\n", r"ref\.txt: θ needs at least 2 reference scores, got 1")])
def test_a_bad_reference_is_named_before_the_model_loads(tmp_path, monkeypatch, text, message):
    import proton.models
    monkeypatch.setattr(proton.models, "load_vlm", lambda *a, **k: pytest.fail("the model was loaded before the reference was read"))
    (tmp_path / "ref.txt").write_text(text)
    with pytest.raises(ValueError, match=message):
        score_stream(photo_folder(tmp_path / "in", broken=()), tmp_path / "r.csv", "open_clip:ViT-S-32/none", "a,b",
                     reference=tmp_path / "ref.txt", progress=False)
    assert not (tmp_path / "r.csv").exists() and not (tmp_path / "r.csv.state.pt").exists()


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_first_run_that_scored_nothing_does_not_bind_the_next_runs_settings(tmp_path, random_vlm, monkeypatch, suffix):
    folder, out = photo_folder(tmp_path / "in", broken=()), tmp_path / f"r{suffix}"
    def out_of_memory(*a, **k): raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(random_vlm, "encode_images", out_of_memory)  # the first run dies in its first chunk
    with pytest.raises(torch.cuda.OutOfMemoryError): run_images(folder, out, random_vlm)
    assert Results(out).load()[1] == [] and Results(out).state_path.exists()  # nothing scored, a stream begun
    monkeypatch.undo()
    three = dict(config=CONFIG, warmup=60, chunk_size=2, progress=False)  # other classes and warm-up: another header, other settings
    assert score_stream(folder, out, random_vlm, "a,b,c", **three) == (7, 7)
    score_stream(folder, tmp_path / f"fresh{suffix}", random_vlm, "a,b,c", **three)
    assert Results(out).load()[1] == Results(tmp_path / f"fresh{suffix}").load()[1]  # the stream a fresh run gives
    with pytest.raises(ValueError, match="other settings"): run_images(folder, out, random_vlm)  # now it holds rows: refused


def test_a_state_without_its_results_file_is_named(tmp_path):
    run(cache_file(tmp_path / "c.npz", 100), tmp_path / "r.csv")
    (tmp_path / "r.csv").unlink()
    with pytest.raises(ValueError, match="holds 0 committed rows, its state says 100"): Results(tmp_path / "r.csv").load()


def test_one_class_is_scored_with_a_warning_that_says_what_it_means(tmp_path, random_vlm):
    folder = photo_folder(tmp_path / "in", broken=())
    with pytest.warns(UserWarning, match="one class: .* every image passes the gate"):
        assert score_stream(folder, tmp_path / "one.csv", random_vlm, "a", config=CONFIG, warmup=50, progress=False) == (7, 7)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # two classes: nothing to say
        run_images(folder, tmp_path / "two.csv", random_vlm)


def test_the_command_prints_a_warning_as_one_line(tmp_path):
    folder = photo_folder(tmp_path / "in", n=3, broken=())
    r = proton_ood("score", str(folder), "--out", str(tmp_path / "r.csv"), "--model", "open_clip:ViT-S-32/none", "--classes", "normal", "--no-progress")
    assert r.returncode == 0 and "scored 3 new images" in r.stdout, r.stderr
    assert r.stderr.startswith("proton-ood score: warning: one class: ") and r.stderr.count("\n") == 1, r.stderr


def test_images_read_in_parallel_threads_give_the_rows_of_one_thread(tmp_path, random_vlm):
    folder = photo_folder(tmp_path / "in", n=9, broken=(4,))
    for workers in (1, 4):
        with pytest.warns(UserWarning, match="1 of 9 images could not be read"):
            run_images(folder, tmp_path / f"w{workers}.csv", random_vlm, chunk_size=5, workers=workers)
    assert (tmp_path / "w1.csv").read_text() == (tmp_path / "w4.csv").read_text()
    with pytest.raises(ValueError, match="workers must be an integer from 1 to 1024, got 0"): run_images(folder, tmp_path / "w0.csv", random_vlm, workers=0)
    with pytest.raises(ValueError, match=r"cannot read image .*4\.png"): run_images(folder, tmp_path / "s.csv", random_vlm, workers=4, strict=True)


def test_the_summary_counts_one_image_in_the_singular(tmp_path, capsys):
    from proton.models.score import score_main
    cache, out = cache_file(tmp_path / "c.npz", 1), tmp_path / "r.csv"
    assert score_main([str(cache), "--out", str(out), "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"scored 1 new image; {out} holds 1"
    cache_file(tmp_path / "c.npz", 3)
    assert score_main([str(cache), "--out", str(out), "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"scored 2 new images; {out} holds 3"


@pytest.mark.parametrize("audit", ["r.csv", "r.csv.state.pt", "r.csv.lock", "c.npz", "sub/../r.csv", "linked.csv"])
def test_an_audit_that_would_overwrite_the_results_state_or_source_is_refused(tmp_path, capsys, audit):
    "--audit naming the results file, a file beside it or the stream's source would destroy them: one line, and nothing already written changes."
    from proton.cli import main
    cache = cache_file(tmp_path / "c.npz")
    (tmp_path / "sub").mkdir()
    args = ["score", str(cache), "--out", str(tmp_path / "r.csv"), "--no-progress", "--warmup", "50", "--bank-size", "20"]
    assert main(args) == 0
    os.link(tmp_path / "r.csv", tmp_path / "linked.csv")  # the results under another name
    before, _ = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}, capsys.readouterr()
    assert main(args + ["--audit", str(tmp_path / audit)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("proton-ood score: error: ") and err.count("\n") == 1 and "would overwrite" in err, err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("classes,message", [("", "no class names in ''"), (" , ", "no class names in ' , '"), ([], "no class names in []"),
                                             ("a,b,a", "the class 'a' is named twice"), (["x", "y", "y"], "the class 'y' is named twice")])
def test_class_names_that_cannot_make_a_classifier_are_named(classes, message):
    with pytest.raises(ValueError, match=re.escape(message)): class_prompts_from(classes, None)


@pytest.mark.parametrize("model,options,message", [("nosuch", {}, "unknown VLM 'nosuch'"),
                                                    ("open_clip:ViT-S-32/none", dict(checkpoint="absent.pt"), "no checkpoint file or folder at absent.pt"),
                                                    ("quiltnet", dict(tokenizer="vocab"), "a tokenizer is for flair and unimed-clip, not quiltnet")])
def test_a_wrong_model_is_named_before_any_file_is_written(tmp_path, model, options, message):
    "A model that cannot load is refused before the lock, the state or the results exist: the folder is left as it was."
    folder = photo_folder(tmp_path / "in", broken=())
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)):
        score_stream(folder, tmp_path / "r.csv", model, "a,b", progress=False, **options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_checkpoint_that_fails_as_it_loads_leaves_the_folder_as_it_was(tmp_path):
    "check_vlm finds a checkpoint's file, not its keys: a wrong one failed in load_vlm, under the lock, and left r.csv.lock behind."
    folder = photo_folder(tmp_path / "in", broken=())
    torch.save(torch.nn.Linear(2, 3).state_dict(), tmp_path / "w.pt")
    for lock in (False, True):  # a lock file that was there before (an earlier run's) stays
        if lock: (tmp_path / "r.csv.lock").touch()
        with pytest.raises(ValueError, match="does not match the model"):
            score_stream(folder, tmp_path / "r.csv", "open_clip:ViT-S-32/", "a,b", checkpoint=tmp_path / "w.pt", progress=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in", *["r.csv.lock"] * lock, "w.pt"]


@pytest.mark.parametrize("name", ["C.NPZ", "cache", "c.cache"])
def test_a_cache_is_known_by_its_content_not_only_its_suffix(tmp_path, name):
    "A cache saved under another name (extract --out takes any) is scored as a cache, not read as a file list."
    cache_file(tmp_path / "c.npz", 100)
    (tmp_path / "c.npz").rename(tmp_path / name)
    assert run(tmp_path / name, tmp_path / "r.csv") == (100, 100)


def test_a_file_list_naming_a_folder_says_so(tmp_path):
    folder = photo_folder(tmp_path / "in", broken=())
    (tmp_path / "list.txt").write_text("in/0.png\nin\n")
    with pytest.raises(ValueError, match=r"the file list .*list\.txt names a folder, not an image file: .*in$"):
        score_module.read_file_list(tmp_path / "list.txt")


def test_a_gpu_out_of_memory_says_to_rerun_with_a_smaller_batch(tmp_path, capsys, monkeypatch):
    "The committed chunks stay, and the batch size is not a setting of the stream: the same command with a smaller --batch-size continues it."
    from proton.cli import main
    from proton.models.vlm import VLM
    monkeypatch.setattr(VLM, "encode_images", lambda self, *a, **k: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")))
    folder = photo_folder(tmp_path / "in", broken=())
    assert main(["score", str(folder), "--out", str(tmp_path / "r.csv"), "--model", "open_clip:ViT-S-32/none", "--classes", "a,b",
                 "--no-progress", "--batch-size", "64"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the GPU ran out of memory with --batch-size 64" in err and "smaller" in err, err


def test_a_zip_of_images_is_named_as_an_archive_to_unpack(tmp_path):
    "A zip file that is not a cache was read as a cache (and the model refused), or failed on a missing 'header'."
    import zipfile
    folder = photo_folder(tmp_path / "in", broken=())
    with zipfile.ZipFile(tmp_path / "images.zip", "w") as z: z.write(folder / "0.png", "0.png")
    with pytest.raises(ValueError, match=r"images\.zip is a zip archive, not an embedding cache: unpack it into a folder"):
        score_stream(tmp_path / "images.zip", tmp_path / "r.csv", "open_clip:ViT-S-32/none", "a,b", progress=False)


@pytest.mark.parametrize("flag, name, low, high", [("--bank-size", "bank_size", 1, 2**20), ("--k-min", "k_min", 1, 2**20), ("--warmup", "warmup", 2, 2**24),
                                                   ("--chunk-size", "chunk_size", 1, 2**16), ("--batch-size", "batch_size", 1, 2**16), ("--workers", "workers", 1, 1024)])
@pytest.mark.parametrize("past", [False, True])
def test_the_command_refuses_a_size_past_its_bound_in_one_line(tmp_path, capsys, flag, name, low, high, past):
    "--workers 1000000 or --bank-size 10**12 was taken (threads, a bank the allocator refused); past int64 the line said 'must be a positive integer'."
    from proton.cli import main
    cache, v = cache_file(tmp_path / "c.npz", 20), 10**20 if past else high + 1
    assert main(["score", str(cache), "--out", str(tmp_path / "r.csv"), "--no-progress", flag, str(v)]) == 1
    assert capsys.readouterr().err == f"proton-ood score: error: {name} must be an integer from {low} to {high}, got {v}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"], "no results, state or lock file"


def test_sizes_at_their_bound_are_taken(tmp_path):
    cache = cache_file(tmp_path / "c.npz", 20)
    assert score_stream(cache, tmp_path / "r.csv", warmup=2**24, chunk_size=2**16, batch_size=2**16, workers=1024, progress=False) == (20, 20)


def test_the_command_says_where_the_stream_stands(tmp_path, capsys):
    "A clinician reading the summary learns whether images can be flagged yet, and if not, what the stream still lacks."
    from proton.cli import main
    stages = []
    for n in (3, 120, N):
        cache = cache_file(tmp_path / "c.npz", n)
        assert main(["score", str(cache), "--out", str(tmp_path / "r.csv"), "--no-progress", "--warmup", "50", "--bank-size", "20"]) == 0
        line = capsys.readouterr().out.splitlines()[1]
        stages.append(line.split(":")[0].strip())
        if n == 3: assert re.search(r"bank filling: class 0 holds \d+, class 1 holds \d+ of the 5 confident images each class needs; no image is flagged yet", line), line
    assert stages[-1] == "monitoring" and stages == sorted(stages, key=["bank filling", "warm-up", "monitoring"].index), stages
    assert re.search(r"monitoring: images scoring above θ = -?\d\.\d+ are flagged \(θ from the warm-up of 50 images\)", line), line


EDITS = {"saved with CRLF line ends": lambda b: b.replace(b"\n", b"\r\n"),
         "last newline removed": lambda b: b[:-1],
         "a score retyped": lambda b: b.replace(b",0.", b",1.", 1),
         "a row deleted": lambda b: b"\n".join(l for i, l in enumerate(b.split(b"\n")) if i != 5)}


@pytest.mark.parametrize("edit", EDITS)
def test_results_edited_by_hand_are_named_and_left_as_they_are(tmp_path, edit):
    "The next run must neither cut the edited file nor glue its rows to new ones: it names the change and writes nothing."
    out = tmp_path / "r.csv"
    run(cache_file(tmp_path / "c.npz", 230), out)
    out.write_bytes(EDITS[edit](out.read_bytes()))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("r")}
    with pytest.raises(ValueError, match="changed by hand"): run(cache_file(tmp_path / "c.npz"), out)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("r")} == before


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_name_with_a_carriage_return_is_one_row_that_the_next_run_reads_back(tmp_path, random_vlm, suffix):
    "POSIX allows any byte but / and NUL in a name; csv quotes a field with a newline but not one with a carriage return."
    if suffix == ".parquet": pytest.importorskip("pyarrow")
    import shutil as sh
    folder = photo_folder(tmp_path / "in", n=4, broken=())
    sh.copy(folder / "0.png", folder / "scan\r1.png")
    out = tmp_path / f"r{suffix}"
    assert run_images(folder, out, random_vlm) == (5, 5)
    (folder / "4.png").write_bytes((folder / "1.png").read_bytes())
    assert run_images(folder, out, random_vlm) == (1, 6)
    paths = [r[0] for r in Results(out).load(columns=["path"])[1]]
    assert str(folder / "scan\r1.png") in paths and len(set(paths)) == 6


def test_an_image_whose_name_is_not_utf8_is_left_out_with_a_warning_naming_it(tmp_path, random_vlm):
    folder = photo_folder(tmp_path / "in", n=3, broken=())
    latin = os.fsencode(folder) + b"/caf\xe9.png"
    shutil.copy(folder / "0.png", latin)
    with pytest.warns(UserWarning, match=r"not UTF-8.*caf\\udce9\.png|caf.*not UTF-8"):
        assert run_images(folder, tmp_path / "r.csv", random_vlm) == (3, 3)
    assert len((tmp_path / "r.csv").read_text(encoding="utf-8").splitlines()) == 4


def test_a_file_list_reaching_a_name_that_is_not_utf8_leaves_it_out_with_a_warning_naming_it(tmp_path, random_vlm):
    "The list names 3.png, a link to the Latin-1 name a Windows share wrote: left out as from a folder, not a stream stopped at every run."
    folder = photo_folder(tmp_path / "in", n=4, broken=())
    os.rename(folder / "3.png", os.fsencode(folder) + b"/scan-\xe9.png")
    os.symlink(b"scan-\xe9.png", folder / "3.png")
    (tmp_path / "list.txt").write_text("in/0.png\nin/1.png\nin/2.png\nin/3.png\n")
    with pytest.warns(UserWarning, match=r"not UTF-8.*scan-\\udce9\.png"):
        assert run_images(tmp_path / "list.txt", tmp_path / "r.csv", random_vlm) == (3, 3)
    odd = os.fsencode(tmp_path) + b"/caf\xe9"  # a list in a folder whose own name is not UTF-8: none of its images can be written
    os.mkdir(odd); shutil.copy(folder / "0.png", odd + b"/0.png"); (Path(os.fsdecode(odd)) / "list.txt").write_text("0.png\n")
    with pytest.raises(ValueError, match=r"not UTF-8 text.*caf\\udce9/0\.png"): run_images(Path(os.fsdecode(odd)) / "list.txt", tmp_path / "s.csv", random_vlm)
    assert not list(tmp_path.glob("s.csv*"))
    (Path(os.fsdecode(odd)) / "list.txt").write_text("../in/1.png\n0.png\n")  # one image outside it: scored, and the warning names the list
    with pytest.warns(UserWarning, match="not UTF-8") as caught: run_images(Path(os.fsdecode(odd)) / "list.txt", tmp_path / "s.csv", random_vlm)
    said = next(str(w.message) for w in caught if "not UTF-8" in str(w.message))
    assert "caf\\udce9/list.txt" in said and said.isprintable(), said  # escaped, as the image's name is: no lone surrogate


@pytest.mark.parametrize("case", ["the list's folder, in the warning", "the results' folder"])
def test_a_name_that_is_not_utf8_is_printed_escaped_once_the_work_is_done(tmp_path, case):
    "Under a strict UTF-8 stdout (PYTHONIOENCODING=utf-8) printing such a name failed after scoring: exit status 1, and no --audit written."
    folder = photo_folder(tmp_path / "in", n=2, broken=())
    odd = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"))
    odd.mkdir(); shutil.copy(folder / "1.png", odd / "1.png"); (odd / "list.txt").write_text("../in/0.png\n1.png\n")  # 1.png: left out
    source, out = (odd / "list.txt", tmp_path / "r.csv") if case.startswith("the list") else (folder, odd / "r.csv")
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    r = subprocess.run([exe, "score", str(source), "--out", str(out), "--model", "open_clip:ViT-S-32/none", "--classes", "a,b", "--no-progress",
                        "--audit", str(tmp_path / "a.csv")], capture_output=True, env=dict(os.environ, PYTHONIOENCODING="utf-8"), timeout=600)
    assert r.returncode == 0, r.stderr.decode(errors="backslashreplace")
    assert (tmp_path / "a.csv").exists() and b"caf\\udce9" in r.stdout, r.stdout


@pytest.mark.parametrize("flag,what", [("--prompts", "the prompt file"), ("--checkpoint", "the model's weights")])
def test_the_command_refuses_an_audit_over_its_prompt_file_or_weights(tmp_path, flag, what):
    folder = photo_folder(tmp_path / "in", n=2, broken=())
    (tmp_path / "given.txt").write_text("a photo of a cat\na photo of a dog\n")
    r = proton_ood("score", str(folder), "--out", str(tmp_path / "r.csv"), "--model", "open_clip:ViT-S-32/none", "--classes", "cat,dog",
                   flag, str(tmp_path / "given.txt"), "--audit", str(tmp_path / "given.txt"), "--no-progress")
    assert one_line_error(r) and f"would overwrite {what}" in r.stderr, r.stderr
    assert (tmp_path / "given.txt").read_text() == "a photo of a cat\na photo of a dog\n"


@pytest.mark.parametrize("text", ["-0,55\n-0,52\n-0,61\n", "0.1,0.2\n0.3,0.4\n"])
def test_reference_scores_with_several_values_a_line_are_refused(tmp_path, text):
    (tmp_path / "ref.txt").write_text(text)
    with pytest.raises(ValueError, match=r"ref\.txt: line 1 holds 2 values"): read_reference_scores(tmp_path / "ref.txt")


@pytest.mark.parametrize("v", [2.0, float("nan"), float("inf"), "3"])
def test_a_chunk_size_that_is_not_a_whole_number_is_refused_before_any_file(tmp_path, v):
    cache = cache_file(tmp_path / "c.npz", 50)
    if v == 2.0: assert score_stream(cache, tmp_path / "r2.csv", chunk_size=v, progress=False) == (50, 50)  # a whole number, as a float
    else:
        with pytest.raises(ValueError, match=re.escape(f"chunk_size must be an integer from 1 to 65536, got {v!r}")):
            score_stream(cache, tmp_path / "r2.csv", chunk_size=v, progress=False)
        assert not list(tmp_path.glob("r2*"))


def test_an_empty_results_name_is_named(tmp_path):
    with pytest.raises(ValueError, match="the results file must end in .csv or .parquet"): Results("")


def test_a_folder_reached_through_a_link_is_the_same_stream(tmp_path, random_vlm):
    "A cron job scores /data/incoming, a colleague the same folder through a link: no image may be scored twice."
    folder = photo_folder(tmp_path / "in", n=3, broken=())
    os.symlink(folder, tmp_path / "today")
    assert run_images(folder, tmp_path / "r.csv", random_vlm) == (3, 3)
    assert run_images(tmp_path / "today", tmp_path / "r.csv", random_vlm) == (0, 3)


def test_a_link_moved_to_the_next_days_folder_scores_its_images(tmp_path, random_vlm):
    "`current` points at today's folder; tomorrow's holds images of the same names, which are new images all the same."
    photo_folder(tmp_path / "day1", n=3, broken=()); photo_folder(tmp_path / "day2", n=3, broken=())
    os.symlink(tmp_path / "day1", tmp_path / "current")
    assert run_images(tmp_path / "current", tmp_path / "r.csv", random_vlm) == (3, 3)
    os.remove(tmp_path / "current"); os.symlink(tmp_path / "day2", tmp_path / "current")
    assert run_images(tmp_path / "current", tmp_path / "r.csv", random_vlm) == (3, 6)


def test_a_link_to_an_image_of_the_folder_is_that_image(tmp_path):
    from proton.models.score import list_images
    folder = photo_folder(tmp_path / "in", n=3, broken=())
    os.symlink(folder / "0.png", folder / "zz.png")
    assert list_images(folder) == [str(folder / f"{i}.png") for i in range(3)]
    (tmp_path / "list.txt").write_text("in/1.png\nin/zz.png\nin/0.png\n")
    with pytest.raises(ValueError, match="names in/0.png twice"): list_images(tmp_path / "list.txt")


PARQUET_EDITS = {"a score retyped": ("score", 5, 99.0), "a path retyped": ("path", 6, "edited")}


def retype(out, column, row, value):
    "Change one value of the Parquet file `out`, as a hand with pandas or a notebook would."
    import pyarrow as pa, pyarrow.parquet as pq
    table = pq.read_table(out)
    values = table.column(column).to_pylist(); values[row] = value
    j = table.schema.get_field_index(column)
    pq.write_table(table.set_column(j, table.schema.field(j), pa.array(values, table.schema.field(j).type)), out)


@pytest.mark.parametrize("edit", PARQUET_EDITS)
def test_a_parquet_file_edited_by_hand_is_named_and_left_as_it_is(tmp_path, edit):
    "Only the CSV or journal bytes were checksummed: a retyped score was carried on, and a retyped path had its image scored twice."
    pytest.importorskip("pyarrow")
    out = tmp_path / "r.parquet"
    run(cache_file(tmp_path / "c.npz", 230), out)
    retype(out, *PARQUET_EDITS[edit])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("r")}
    with pytest.raises(ValueError, match=r"r\.parquet was changed by hand"): run(cache_file(tmp_path / "c.npz"), out)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("r")} == before


def second_run_state_writes(tmp_path):
    "How many states the second run of a Parquet stream (256 images, then all N) saves."
    writes = []
    run(cache_file(tmp_path / "c.npz", 256), tmp_path / "count.parquet")
    score_module.save_state, real = lambda state, path: (writes.append(path), save_state(state, path))[1], score_module.save_state
    try: run(cache_file(tmp_path / "c.npz"), tmp_path / "count.parquet")
    finally: score_module.save_state = real
    return len(writes)


@pytest.mark.parametrize("last", [1, 2])
def test_a_parquet_run_killed_while_it_rewrites_a_file_of_earlier_rows_resumes(tmp_path, monkeypatch, last):
    "Killed at the run's last or second-to-last state write, around the file's rewrite: the file's checksum must not name the file changed by hand."
    pytest.importorskip("pyarrow")
    import pandas as pd
    total = second_run_state_writes(tmp_path)
    run(cache_file(tmp_path / "c.npz"), tmp_path / "once.parquet")
    out, writes = tmp_path / "killed.parquet", []
    run(cache_file(tmp_path / "c.npz", 256), out)
    def dying(state, path):
        if len(writes) == total - last: raise KeyboardInterrupt("killed")
        writes.append(path); return save_state(state, path)
    monkeypatch.setattr(score_module, "save_state", dying)
    with pytest.raises(KeyboardInterrupt): run(cache_file(tmp_path / "c.npz"), out)
    monkeypatch.setattr(score_module, "save_state", save_state)
    assert run(cache_file(tmp_path / "c.npz"), out)[1] == N
    pd.testing.assert_frame_equal(parquet_rows(out), parquet_rows(tmp_path / "once.parquet"))


def test_a_reader_that_loaded_the_state_before_a_later_run_rewrote_the_parquet_file_finds_every_row(tmp_path, monkeypatch):
    "The audit in another process reads the state, then a run rewrites the file (its checksum changes), then the audit reads the file."
    pytest.importorskip("pyarrow")
    from proton.deploy import torch_load_safely
    out, before = tmp_path / "r.parquet", []
    run(cache_file(tmp_path / "c.npz", 230), out)
    finish = Results.finish
    def spy(self, *args):
        before.append(torch_load_safely(self.state_path, "a scoring state")); finish(self, *args)
    monkeypatch.setattr(Results, "finish", spy)
    run(cache_file(tmp_path / "c.npz"), out)
    calls = []
    def stale_first(path, what):  # the first read gives the state from before the rewrite
        calls.append(path); return dict(before[-1]) if len(calls) == 1 else torch_load_safely(path, what)
    monkeypatch.setattr(score_module, "torch_load_safely", stale_first)
    assert len(Results(out).load()[1]) == N


def without(out, *keys):
    "Rewrite the state of the stream in `out` as a version that did not record `keys` (state or settings keys) wrote it."
    from proton.deploy import torch_load_safely
    path = Results(out).state_path
    state = torch_load_safely(path, "a scoring state")
    for k in keys: state.pop(k, None); state["settings"].pop(k, None)
    save_state(state, path)


def test_a_parquet_stream_begun_before_the_files_checksum_continues_and_is_checked_from_then_on(tmp_path):
    pytest.importorskip("pyarrow")
    out = tmp_path / "r.parquet"
    run(cache_file(tmp_path / "c.npz", 256), out)
    without(out, "parquet_sha256")
    assert run(cache_file(tmp_path / "c.npz"), out) == (N - 256, N)
    retype(out, "score", 5, 99.0)  # the stream's state now holds the file's checksum
    with pytest.raises(ValueError, match="changed by hand"): run(cache_file(tmp_path / "c.npz"), out)


def test_another_order_is_refused_once_the_stream_holds_rows(tmp_path, random_vlm):
    "--order was not recorded: a stream begun in name order and continued in mtime order matched neither order's stream."
    folder, out = photo_folder(tmp_path / "in", n=4, broken=()), tmp_path / "r.csv"
    assert run_images(folder, out, random_vlm) == (4, 4)  # a folder: name order
    photo_folder(tmp_path / "in", n=6, broken=())
    before = out.read_bytes()
    with pytest.raises(ValueError, match=r"other settings \(order\): order was 'name', now 'mtime'; choose"): run_images(folder, out, random_vlm, order="mtime")
    (tmp_path / "list.txt").write_text("".join(f"in/{i}.png\n" for i in range(6)))
    with pytest.raises(ValueError, match=r"order was 'name', now 'list'"): run_images(tmp_path / "list.txt", out, random_vlm)
    assert out.read_bytes() == before
    assert run_images(tmp_path / "list.txt", out, random_vlm, order="name") == (2, 6)  # the same images, in the stream's order


def test_a_file_list_that_grows_continues_its_stream(tmp_path, random_vlm):
    "Order 'list' is the list's order of the images not yet scored: entries appended to the list are the new images."
    folder = photo_folder(tmp_path / "in", n=6, broken=())
    (tmp_path / "all.txt").write_text("".join(f"in/{i}.png\n" for i in (5, 0, 3, 1, 4, 2)))
    run_images(tmp_path / "all.txt", tmp_path / "once.csv", random_vlm)
    (tmp_path / "list.txt").write_text("".join(f"in/{i}.png\n" for i in (5, 0, 3, 1)))
    assert run_images(tmp_path / "list.txt", tmp_path / "r.csv", random_vlm) == (4, 4)
    shutil.copy(tmp_path / "all.txt", tmp_path / "list.txt")
    assert run_images(tmp_path / "list.txt", tmp_path / "r.csv", random_vlm) == (2, 6)
    assert (tmp_path / "r.csv").read_bytes() == (tmp_path / "once.csv").read_bytes()


def test_a_stream_begun_before_its_order_was_recorded_continues_and_records_it(tmp_path, random_vlm):
    folder, out = photo_folder(tmp_path / "in", n=4, broken=()), tmp_path / "r.csv"
    run_images(folder, out, random_vlm)
    without(out, "order")
    photo_folder(tmp_path / "in", n=6, broken=())
    assert run_images(folder, out, random_vlm, order="mtime") == (2, 6)  # unknown: accepted, and recorded from now on
    photo_folder(tmp_path / "in", n=8, broken=())
    with pytest.raises(ValueError, match="order was 'mtime', now 'name'"): run_images(folder, out, random_vlm)


@pytest.mark.parametrize("how", ["a link moved on", "the file replaced in place"])
def test_other_weights_at_the_same_checkpoint_path_are_refused(tmp_path, random_vlm, how):
    "Only the checkpoint's path was recorded: a retrained model behind the same --checkpoint continued the stream silently."
    import hashlib
    folder, out = photo_folder(tmp_path / "in", n=4, broken=()), tmp_path / "r.csv"
    (tmp_path / "v1.pt").write_bytes(b"weights of day 1"); (tmp_path / "v2.pt").write_bytes(b"weights of day 2")
    model = tmp_path / "model.pt"
    if how == "a link moved on": os.symlink("v1.pt", model)
    else: shutil.copy(tmp_path / "v1.pt", model)
    assert run_images(folder, out, random_vlm, checkpoint=model) == (4, 4)
    if how == "a link moved on": os.remove(model); os.symlink("v2.pt", model)
    else: shutil.copy(tmp_path / "v2.pt", model)
    photo_folder(tmp_path / "in", n=6, broken=())
    before = out.read_bytes()
    one, two = (hashlib.sha256((tmp_path / f).read_bytes()).hexdigest() for f in ("v1.pt", "v2.pt"))
    with pytest.raises(ValueError, match=rf"other settings \(checkpoint_sha256\): checkpoint_sha256 was '{one}', now '{two}'"):
        run_images(folder, out, random_vlm, checkpoint=model)
    assert out.read_bytes() == before
    if how == "the file replaced in place": shutil.copy(tmp_path / "v1.pt", model)
    else: os.remove(model); os.symlink("v1.pt", model)
    assert run_images(folder, out, random_vlm, checkpoint=model) == (2, 6)  # the day's weights again: the stream continues


@pytest.mark.filterwarnings("ignore:one class")
def test_a_reference_stream_scored_with_other_weights_at_the_same_checkpoint_path_is_refused(tmp_path, random_vlm):
    "Only model, classes, prompts and config were compared: θ was set silently from the scores of the weights the file held before."
    folder, model = photo_folder(tmp_path / "in", n=6, broken=()), tmp_path / "model.pt"
    score = lambda out, **kw: score_stream(folder, tmp_path / out, random_vlm, "a", config=ProtonConfig(bank_size=20, k_min=1), warmup=2,
                                           chunk_size=2, checkpoint=model, progress=False, **kw)  # one class: every image calibrates the bank
    model.write_bytes(b"weights of day 1")
    score("ref.csv")
    assert score("same.csv", reference=tmp_path / "ref.csv") == (6, 6)
    model.write_bytes(b"weights of day 2 (retrained)")
    with pytest.raises(ValueError, match=r"ref\.csv was scored by a detector with other settings \(checkpoint_sha256\)"):
        score("new.csv", reference=tmp_path / "ref.csv")
    assert not (tmp_path / "new.csv").exists()
    without(tmp_path / "ref.csv", "checkpoint_sha256")  # an earlier version's reference: its weights are not known
    assert score("old.csv", reference=tmp_path / "ref.csv") == (6, 6)


def test_a_stream_begun_before_the_weights_sha256_was_recorded_continues_and_records_it(tmp_path, random_vlm):
    folder, out = photo_folder(tmp_path / "in", n=4, broken=()), tmp_path / "r.csv"
    (tmp_path / "model.pt").write_bytes(b"weights of day 1")
    run_images(folder, out, random_vlm, checkpoint=tmp_path / "model.pt")
    without(out, "checkpoint_sha256")
    photo_folder(tmp_path / "in", n=6, broken=())
    assert run_images(folder, out, random_vlm, checkpoint=tmp_path / "model.pt") == (2, 6)
    (tmp_path / "model.pt").write_bytes(b"weights of day 2")
    photo_folder(tmp_path / "in", n=8, broken=())
    with pytest.raises(ValueError, match=r"other settings \(checkpoint_sha256\)"): run_images(folder, out, random_vlm, checkpoint=tmp_path / "model.pt")


def test_a_run_that_stops_with_an_error_still_prints_its_warnings_first(tmp_path):
    "One class, then --strict meets an unreadable 5th image: the one-class warning came before the committed rows, and was lost."
    folder = photo_folder(tmp_path / "in", n=6, broken=(4,))
    r = proton_ood("score", str(folder), "--out", str(tmp_path / "r.csv"), "--model", "open_clip:ViT-S-32/none", "--classes", "a", "--strict",
                   "--no-progress", "--workers", "1", "--chunk-size", "2")
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and len(lines) == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("proton-ood score: warning: one class: ") and lines[1].startswith("proton-ood score: error: cannot read image"), r.stderr
    assert len((tmp_path / "r.csv").read_text().splitlines()) == 5  # the header and 4 committed rows


def test_a_reader_that_left_gets_the_audit_written_and_the_warnings_shown(tmp_path):
    "`proton-ood score ... --audit a.csv | true`: the requested file is written and the warnings are on stderr, whatever became of stdout."
    folder = photo_folder(tmp_path / "in", n=3, broken=())
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    reader, writer = os.pipe()
    os.close(reader)  # the reader is gone before the command writes a line
    r = subprocess.run([exe, "score", str(folder), "--out", str(tmp_path / "r.csv"), "--model", "open_clip:ViT-S-32/none", "--classes", "a",
                        "--no-progress", "--audit", str(tmp_path / "a.csv")], stdout=writer, stderr=subprocess.PIPE, text=True,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=600)
    os.close(writer)
    assert r.returncode == 141 and (tmp_path / "a.csv").exists(), r.stderr
    assert r.stderr.startswith("proton-ood score: warning: one class: ") and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("classes", ["Normal,normal", "normal,NORMAL"])
def test_classes_the_model_cannot_tell_apart_are_refused_before_any_file(tmp_path, classes):
    "open_clip's tokenizer lowercases: two names differing in case gave one text embedding, so every confidence was 1/2, silently."
    folder = photo_folder(tmp_path / "in", broken=())
    with pytest.raises(ValueError, match="point the same way"):
        score_stream(folder, tmp_path / "r.csv", "open_clip:ViT-S-32/none", classes, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


@pytest.mark.parametrize("text", ["", "\n# only a comment\n", "[]"])
def test_a_prompt_file_without_prompts_is_refused_not_replaced_by_the_class_names(tmp_path, text):
    (tmp_path / ("p.json" if text == "[]" else "p.txt")).write_text(text)
    path = tmp_path / ("p.json" if text == "[]" else "p.txt")
    with pytest.raises(ValueError, match=re.escape(f"the prompt file {path} holds no prompts")): class_prompts_from("a,b", path)


@pytest.mark.parametrize("text,message", [('"a photo"', "a list of prompts or an object class -> prompts, not a str"),
                                          ("5", "a list of prompts or an object class -> prompts, not a int"),
                                          ("null", "a list of prompts or an object class -> prompts, not a NoneType"),
                                          ("[[]]", "the prompt of class 0 must be a prompt or a non-empty list of non-empty prompts"),
                                          ("[3, 4]", "the prompt of class 0 must be a prompt or a non-empty list of non-empty prompts")])
@pytest.mark.parametrize("classes", [None, "a,b"])
def test_a_prompt_file_of_the_wrong_shape_is_named_in_one_line(tmp_path, text, message, classes):
    "A JSON prompt file holding a string, a number or a list of non-prompts raised TypeError/IndexError, or took each letter as a class."
    (tmp_path / "p.json").write_text(text)
    with pytest.raises(ValueError) as e: class_prompts_from(classes, tmp_path / "p.json")
    if classes is None or text[0] != "[": assert message in str(e.value), e.value
    assert "\n" not in str(e.value) and str(tmp_path / "p.json") in str(e.value), e.value


@pytest.mark.parametrize("classes,prompts", [("a,b\udcff", None), ("a,b", ["a", "b\udcff"]), (None, {"a": "x", "b\udcff": "y"})])
def test_names_and_prompts_that_are_not_text_are_refused_before_any_file(tmp_path, classes, prompts):
    "A class name in another encoding (a byte that is no UTF-8, from the command line) failed as the results were written, leaving r.csv and its state empty."
    with pytest.raises(ValueError, match="not UTF-8 text"): class_prompts_from(classes, prompts)
    folder = photo_folder(tmp_path / "in", broken=())
    with pytest.raises(ValueError, match="not UTF-8 text"):
        score_stream(folder, tmp_path / "r.csv", "open_clip:ViT-S-32/none", classes, prompts=prompts, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_class_name_that_is_not_utf8_on_the_command_line_is_one_line_and_writes_nothing(tmp_path):
    folder = photo_folder(tmp_path / "in", n=2, broken=())
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    r = subprocess.run([exe, "score", str(folder), "--out", str(tmp_path / "r.csv"), "--model", "open_clip:ViT-S-32/none",
                        "--classes", b"a,b\xff", "--no-progress"], capture_output=True, timeout=600)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 1 and err.count("\n") == 1 and "not UTF-8 text" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


@pytest.mark.parametrize("given", [dict(checkpoint="/does/not/exist"), dict(tokenizer="vocab"), dict(device="cuda:3")])
def test_options_of_a_model_are_refused_for_a_cache_before_any_file(tmp_path, given):
    "A cache was scored with --checkpoint (even a missing one, recorded with the digest of no bytes) or --device accepted and ignored; the next run without it was refused."
    source = cache_file(tmp_path / "c.npz", n=20)
    with pytest.raises(ValueError, match="an embedding cache brings its own embeddings and classes: give no"):
        score_stream(source, tmp_path / "r.csv", progress=False, **given)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]


def test_the_status_says_the_bank_fills_while_a_reference_threshold_waits(tmp_path):
    "With --reference, θ exists from the first image: the summary said 'monitoring: images scoring above θ are flagged' while every row said 'bank filling' and none was flagged."
    from proton.models.score import stream_status
    (tmp_path / "ref.txt").write_text("0.1\n0.2\n")
    run(cache_file(tmp_path / "c.npz", n=6), tmp_path / "r.csv", reference=tmp_path / "ref.txt")
    assert stream_status(tmp_path / "r.csv").startswith("bank filling: "), stream_status(tmp_path / "r.csv")
    run(cache_file(tmp_path / "c.npz"), tmp_path / "r.csv", reference=tmp_path / "ref.txt")
    assert stream_status(tmp_path / "r.csv").startswith("monitoring: images scoring above θ = 0.2 are flagged (θ from the reference scores)")


@pytest.mark.parametrize("name", ["r.csv/", "r.parquet/"])
def test_a_results_name_ending_in_a_slash_names_a_folder_and_is_refused(tmp_path, name):
    "Path() drops a trailing slash: --out results.csv/ (a folder meant) wrote results.csv, its lock and its state, silently."
    source = cache_file(tmp_path / "c.npz", n=20)
    with pytest.raises(ValueError, match="names a folder"): score_stream(source, str(tmp_path) + "/" + name, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]


@pytest.mark.parametrize("name", ["typo.npz", "missing_folder", "list.txt"])
def test_a_source_that_does_not_exist_is_named_not_asked_for_a_model(tmp_path, name):
    "A cache path with a typo was not a cache, so the error asked for --model."
    with pytest.raises(FileNotFoundError, match=re.escape(f"no embedding cache, image folder or file list at {tmp_path / name}")):
        score_stream(tmp_path / name, tmp_path / "r.csv", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_stream_is_not_continued_with_another_tokenizer_vocabulary(tmp_path):
    "The tokenizer was no setting of the stream: a FLAIR stream begun with one vocab.txt continued with another (or with an added_tokens.json beside it), whose text embeddings differ; a reference scored with another was taken."
    from proton.models.flair import random_flair
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "normal", "glaucoma"]
    for name, vocab in (("a", words), ("b", words[:5] + words[:4:-1]), ("moved", words), ("added", words)):
        (tmp_path / name).mkdir(); (tmp_path / name / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (tmp_path / "added" / "added_tokens.json").write_text('{"retina": 7}')  # read by the tokenizer beside vocab.txt: another tokenization
    torch.save(random_flair(0).state_dict(), tmp_path / "flair.pth")
    folder = photo_folder(tmp_path / "in", n=3, broken=())
    run_with = lambda vocab: proton_ood("score", str(folder), "--out", str(tmp_path / "r.csv"), "--model", "flair", "--checkpoint", str(tmp_path / "flair.pth"),
                                        "--tokenizer", str(tmp_path / vocab), "--classes", "normal,glaucoma", "--no-progress")
    assert run_with("a").returncode == 0
    for other in ("b", "added"):
        r = run_with(other)
        assert one_line_error(r) and "other settings (tokenizer)" in r.stderr, (other, r.stderr)
    r = proton_ood("score", str(folder), "--out", str(tmp_path / "s.csv"), "--model", "flair", "--checkpoint", str(tmp_path / "flair.pth"),
                   "--tokenizer", str(tmp_path / "b"), "--classes", "normal,glaucoma", "--no-progress", "--reference", str(tmp_path / "r.csv"))
    assert one_line_error(r) and "scored by a detector with other settings (tokenizer)" in r.stderr, r.stderr  # a reference too
    r = run_with("moved")  # the same vocabulary elsewhere: where the file is is no setting
    assert r.returncode == 0 and "scored 0 new images" in r.stdout, r.stderr
