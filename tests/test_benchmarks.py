"""The benchmark scripts keep working on a CPU: tiny runs of `benchmarks/extract.py`, `benchmarks/decode_parity.py`, `benchmarks/extract_probe.py`, `benchmarks/score.py` and `benchmarks/score_files.py`.

Their numbers on a CPU describe nothing; what is checked is that every column, path and stage is measured and written,
that a bad argument is refused in one line before any work, and what `benchmarks/gpu_check.sh` runs (with python3 stubbed)."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).parents[1]


def run(script, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_extract_benchmark_measures_every_path_and_stage(tmp_path):
    out = tmp_path / "extract.json"
    printed = run("extract.py", "--quick", "--models", "vit-b-32,flair", "--n", "8", "--batch-size", "4", "--workers", "1",
                  "--fundus-size", "64", "--breakdown", "--worker-shares", "0,0.5", "--switch-interval", "0.001", "--json", str(out))
    rows = {(r["model"].split(",")[0], r["path"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("ViT-B/32", "workers"), ("ViT-B/32", "device"), ("ViT-B/32", "device 0.5w"), ("FLAIR ResNet-50", "workers"),
                         ("FLAIR ResNet-50", "device")}
    assert rows["ViT-B/32", "device 0.5w"]["worker_share"] == 0.5 and rows["ViT-B/32", "device"]["worker_share"] == 0
    assert "FLAIR preprocesses with a function" in rows["FLAIR ResNet-50", "device"]["refused"]
    for key, r in rows.items():
        if "refused" in r: continue
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("forward_only", "loader_only", "end_to_end")), key
        assert r["switch_interval"] == 0.001, key  # the GIL's switch interval the run had, as asked
        assert r["breakdown"]["main"]["encoding"] > 0 and "writing a shard" in r["breakdown"]["writing"]
        main = r["breakdown"]["main"]  # the whole call: the loop, and what comes before and after it
        assert {"listing the folder", "fingerprinting the run", "reading the shards back", "writing the cache"} <= set(main), key
        assert main["the loop over the shards"] >= main["encoding"] + main["waiting for a staged batch"], key
    assert rows["ViT-B/32", "device"]["breakdown"]["staging"]["  of which decoding JPEG files"] > 0  # the device path decodes in the staging thread
    assert rows["ViT-B/32", "device 0.5w"]["breakdown"]["staging"]["  of which decoding JPEG files"] > 0  # half the files still decode there
    assert "no verdict" in printed  # --quick never claims a GPU target


def test_decode_parity_on_the_cpu_is_exact(tmp_path):
    out = tmp_path / "parity.json"
    run("decode_parity.py", "--device", "cpu", "--model", "open_clip:ViT-S-32/none", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6
    for kind, r in rows.items():  # the CPU decodes with libjpeg-turbo on both sides: the same pixels, resized by the same code
        assert r["decode"]["max"] == 0 and r["resize"]["max"] == 0 and r["total"]["mean"] < 0.01, kind


def test_extract_probe_runs_every_variant(tmp_path):
    out = tmp_path / "probe.json"
    run("extract_probe.py", "--device", "cpu", "--n", "16", "--batch-size", "4", "--workers", "0", "--skip", "1", "--fp32",
        "--profile", "--out-dir", str(tmp_path), "--json", str(out))
    result = json.loads(out.read_text())
    assert set(result["stages"]) == {"decode", "preprocess", "preprocess_interpolate", "assemble", "forward"}
    assert all(s["alone_ms"] > 0 and s["host_ms_under_load"] > 0 for s in result["stages"].values())
    rates = result["pipelines"]
    assert {"as_is", "compute_stream", "lag", "async_stage", "one_thread", "main_loop_alone", "shards"} <= set(rates)
    assert all(isinstance(r, float) and math.isfinite(r) and r > 0 for r in rates.values()), rates  # no variant failed
    assert "aten::" in (tmp_path / "probe_profile.txt").read_text() and (tmp_path / "probe_trace.json.gz").stat().st_size > 0


def test_the_steady_state_is_not_charged_with_costs_of_the_first_call_in_a_process(tmp_path, monkeypatch):
    """A process's first `extract` pays once for what later calls reuse (the text encoder's first run, for one):
    charged to the run on all files, it would lower the steady rate that the difference of two runs measures."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import extract as bench
    clock, sizes = [0.0], {tmp_path / "all": 1000, tmp_path / "half": 500}
    def fake_extract(vlm, data, out, **kw):  # 1 ms an image, and half a second more the first time
        clock[0] += (0.5 if clock[0] == 0 else 0) + sizes[Path(data)] * 1e-3
        Path(out).write_bytes(b"")
        return [None] * sizes[Path(data)]
    monkeypatch.setattr(bench, "extract", fake_extract)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    whole, steady = bench.end_to_end(None, tmp_path / "all", tmp_path / "half", 1000, 500, 256, 0, False, False, 1, tmp_path)
    assert steady == pytest.approx(1000, rel=1e-6) and whole == pytest.approx(1000, rel=1e-6)


def test_score_benchmark_compares_threads_on_the_same_rows(tmp_path):
    out = tmp_path / "score.json"
    printed = run("score.py", "--quick", "--n", "4", "--size", "64", "--workers", "1,2", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["workers"] for r in rows] == [1, 2] and rows[0]["ratio"] == 1.0  # the script asserts that both wrote the same rows
    assert all(math.isfinite(r["images_per_s"]) and r["images_per_s"] > 0 for r in rows) and "no claim" in printed


def test_results_file_benchmark_times_both_formats_on_the_same_rows(tmp_path):
    pytest.importorskip("pyarrow")
    out = tmp_path / "files.json"
    printed = run("score_files.py", "--quick", "--n", "100,300", "--chunk-size", "64", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["n"] for r in rows] == [100, 300] and "no claim" in printed  # the script asserts that both files hold the same rows
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 and r["csv_s"] > 0 for r in rows)
    assert all(r[f"{kind}_{what}"] > 0 for r in rows for kind in ("csv", "parquet") for what in ("one_more_s", "read_all_mib", "read_paths_mib"))


def gpu_check(tmp_path, steps, dev="cpu"):
    "benchmarks/gpu_check.sh run with `python3` and `nvidia-smi` stubbed: its log, and each python3 call's arguments."
    stubs, calls = tmp_path / "bin", tmp_path / "calls"
    stubs.mkdir()
    for name, body in (("python3", 'printf "%s " "$@" | tr "\\n" " " >> "$CALLS"; echo >> "$CALLS"'), ("nvidia-smi", "echo GPU 0: stub")):
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), STEPS=steps, BUDGET="1000", DEV=dev, CALLS=str(calls))
    subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True, timeout=60, check=True)
    return (tmp_path / "out" / "log").read_text(), calls.read_text().splitlines()


def test_gpu_check_runs_its_short_steps(tmp_path):
    "A step whose own timeout is under 15 s (the shared memory's 10 s) runs when the budget allows it."
    log, _ = gpu_check(tmp_path, "a")
    assert "SKIPPED" not in log and "=== a. shared memory [timeout 10s" in log and "/dev/shm" in log


def test_gpu_check_installs_over_a_copy_left_by_an_earlier_run(tmp_path):
    "On a warm machine, /tmp/site holds the previous run's copy of the library: every install must replace it."
    _, calls = gpu_check(tmp_path, "a")
    installs = [c for c in calls if "pip install" in c]
    assert len(installs) == 2 and all("--upgrade" in c for c in installs), installs


def test_gpu_check_passes_its_device_to_every_benchmark(tmp_path):
    _, calls = gpu_check(tmp_path, "c d", dev="cpu")
    scripts = [c for c in calls if c.startswith("benchmarks/")]
    assert len(scripts) == 9 and all("--device cpu" in c for c in scripts), scripts


def test_gpu_check_header_names_every_file_it_writes():
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    header = "".join(line for line in script.splitlines(keepends=True) if line.startswith("#"))
    written = set(re.findall(r'\$OUT/([\w.]+)"', script))
    assert len(written) >= 7 and all(name in header for name in written), written


def test_a_steady_rate_without_a_measurable_difference_is_nan_and_gets_no_verdict(tmp_path, monkeypatch):
    "When the run on all files is not slower than the run on half of them (noise, small --n), there is no steady rate to report: NaN, not 0."
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import extract as bench
    clock, cost = [0.0], {tmp_path / "all": 1.0, tmp_path / "half": 1.2}
    def fake_extract(vlm, data, out, **kw):
        clock[0] += cost[Path(data)]
        Path(out).write_bytes(b"")
        return [None] * (1000 if Path(data).name == "all" else 500)
    monkeypatch.setattr(bench, "extract", fake_extract)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    whole, steady = bench.end_to_end(None, tmp_path / "all", tmp_path / "half", 1000, 500, 256, 0, False, False, 2, tmp_path)
    assert whole == pytest.approx(1000) and math.isnan(steady)
    assert bench.verdict(dict(steady_ratio=steady / 2000, loader_only=1000, forward_only=2000), quick=False).startswith("no verdict")


TINY = ("--quick", "--n", "4", "--batch-size", "2", "--workers", "0")  # should a bad argument be taken, the run is short


@pytest.mark.parametrize("script, args, named", [
    ("extract.py", (*TINY, "--models", "vit-b-32,flar", "--paths", "workers"), "'flar'"),
    ("extract.py", (*TINY, "--models", "vit-b-32", "--paths", "workers,devcie"), "'devcie'"),
    ("extract.py", (*TINY, "--models", "vit-b-32", "--paths", "device", "--worker-shares", "0,1.5"), "1.5"),
    ("extract.py", (*TINY, "--worker-shares", "x"), "'x'"),
    ("extract.py", (*TINY, "--models", "vit-b-32", "--paths", "workers", "--json", "/nonexistent/x.json"), "/nonexistent"),
    ("extract.py", (*TINY, "--device", "bogus"), "bogus"),
    ("extract.py", ("--quick", "--n", "0", "--models", "vit-b-32", "--paths", "workers", "--workers", "0"), "--n"),
    ("run.py", ("--quick", "--device", "bogus"), "bogus"),
    ("run.py", ("--quick", "--slow-max", "10", "--json", "/nonexistent/x.json"), "/nonexistent"),
    ("score.py", ("--quick", "--workers", "x"), "'x'"),
    ("score.py", ("--quick", "--n", "0"), "--n"),
    ("score.py", ("--quick", "--device", "bogus"), "bogus"),
    ("score_files.py", ("--quick", "--n", "x"), "'x'"),
    ("score_files.py", ("--quick", "--n", "0"), "--n"),
    ("score_files.py", ("--quick", "--chunk-size", "0"), "--chunk-size"),
    ("suite.py", ("--quick", "--preset", "bogus"), "bogus"),
    ("suite.py", ("--quick", "--json", "/nonexistent/x.json"), "/nonexistent"),
    ("decode_parity.py", ("--device", "bogus"), "bogus"),
    ("decode_parity.py", ("--device", "cpu", "--model", "bogus"), "bogus"),
    ("extract_probe.py", ("--device", "bogus"), "bogus"),
    ("extract_probe.py", ("--device", "cpu", "--n", "0"), "--n"),
    ("extract_probe.py", ("--n", "16", "--batch-size", "4", "--workers", "0"), "CUDA"),  # its default device, cuda
    ("profile_engine.py", ("--device", "bogus"), "bogus"),
    ("profile_engine.py", ("--n", "0"), "--n"),
])
def test_bad_arguments_are_refused_in_one_line_before_any_work(script, args, named):
    if named == "CUDA":
        torch = pytest.importorskip("torch")
        if torch.cuda.is_available(): pytest.skip("a GPU is there: cuda is a good device")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    assert "Traceback" not in done.stderr and done.returncode == 2, done.stderr[-1500:]
    assert last.startswith(f"{script}: error: ") and named in last, last
    assert done.stdout == "", done.stdout[-500:]  # refused before it printed, measured or wrote anything


def test_extract_probe_help_describes_it_whole():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "extract_probe.py"), "--help"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert "and the pipeline with one change at a time." in " ".join(done.stdout.split())


@pytest.mark.parametrize("script", ["extract.py", "extract_probe.py", "decode_parity.py", "score.py", "run.py", "suite.py", "score_files.py"])
def test_a_benchmark_shows_its_help_without_scikit_image(script):
    "scikit-image's photographs are only drawn when a benchmark writes its image files, not to print --help."
    code = (f"import runpy, sys; sys.modules['skimage'] = None; sys.path.insert(0, 'benchmarks'); sys.argv = ['{script}', '--help']\n"
            f"runpy.run_path('benchmarks/{script}', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr.strip().splitlines()[-1:]


@pytest.mark.parametrize("device,gpu", [("cuda", True), ("cuda:0", True), ("cuda:1", True), ("cpu", False)])
def test_the_engine_benchmark_takes_any_cuda_device_for_a_gpu(monkeypatch, device, gpu):
    "run.py tested device == 'cuda': with --device cuda:0 it never synchronised (timing kernel launches), chose the CPU's sizes and died on the CPU's memory keys."
    import torch
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import run
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a))
    run.sync(device)
    assert run.on_gpu(device) == gpu and len(calls) == gpu


def test_the_engine_benchmark_times_a_small_bank_both_ways(monkeypatch):
    "run.py's many-classes row scores the same call as routed and forced through the engine; both give the same scores."
    import torch
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import run
    from proton import Proton, ProtonConfig
    seen = []
    monkeypatch.setattr(Proton, "score", lambda self, X, _s=Proton.score: seen.append(("routed", _s(self, X))))
    monkeypatch.setattr(Proton, "_scan", lambda self, *a, _s=Proton._scan: seen.append(("engine", _s(self, *a))))
    r = run.small_blocks(64, "cpu", n_classes=200, bank_size=2)
    assert {k for k, _ in seen} == {"routed", "engine"} and r["routed_s"] > 0 and r["engine_s"] > 0
    routed, engine = (next(v for k, v in seen if k == name) for name in ("routed", "engine"))
    torch.testing.assert_close(routed, engine)
