"""End-to-end time of the whole experiment suite, `proton-ood evaluate --experiments all`, on an embedding cache.

Run: `python benchmarks/suite.py` (add `--json FILE` to keep the summary). It writes a synthetic embedding cache of
realistic size with the library's own writer (`EmbeddingCache.from_world(SyntheticWorld.preset(...)).save(...)`), then
runs the `proton-ood` console script's entry point (`proton.cli:main`) in a fresh Python process, exactly as
`proton-ood evaluate CACHE --experiments all` would, and times it from process start to exit (imports included).
The time of each experiment is measured inside that process too, by wrapping `proton.bench.evaluation._run_experiment`.

Device: `proton-ood evaluate` has no device option. The evaluation scores numpy caches with CPU torch tensors (one
torch thread per `evaluate`), so the suite runs on the CPU even on a GPU machine; the GPU, if any, is only reported.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _args import positive, writable  # benchmarks/_args.py

ROOT = Path(__file__).resolve().parents[1]

# Runs in the child process: the console script's `main`, with each experiment timed. Prints one tagged JSON line.
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from proton.cli import main
import proton.bench.evaluation as b
imported = time.perf_counter() - t0
times = {}
run = getattr(b, "_run_experiment", None)
if run is not None:
    def timed(name, *a, **k):
        t = time.perf_counter()
        try: return run(name, *a, **k)
        finally:
            times[name] = round(time.perf_counter() - t, 3)
            print(f"SUITE_EXP {name} {times[name]}", flush=True)
    b._run_experiment = timed
rc = main()
print("SUITE_CHILD " + json.dumps(dict(import_s=round(imported, 3), experiments_s=times, rc=rc)), flush=True)
sys.exit(rc)
"""


def machine():
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(cpu=platform.processor() or platform.machine(), cpu_cores=os.cpu_count(), torch=torch.__version__,
                torch_threads=torch.get_num_threads(), gpu_present=gpu, python=platform.python_version())


def main(argv=None):
    from proton import __version__
    from proton.bench.cache import EmbeddingCache
    from proton.bench.synth import PRESETS, SyntheticWorld

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-id", type=positive, default=1200, help="ID images of the synthetic cache")
    p.add_argument("--n-per-shift", type=positive, default=600, help="images of each OOD shift (semantic, covariate, far)")
    p.add_argument("--dim", type=positive, default=512, help="embedding dimension")
    p.add_argument("--preset", choices=PRESETS, default="default", help="SyntheticWorld preset")
    p.add_argument("--experiments", default="all", help="passed to proton-ood evaluate --experiments")
    p.add_argument("--permutations", type=positive, default=5, help="passed to proton-ood evaluate --permutations")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the evaluation process is killed")
    p.add_argument("--json", type=writable, default=None, help="also write the summary to this JSON file")
    p.add_argument("--quick", action="store_true", help="a smoke test: 200 ID + 100 per shift, 1 permutation")
    args = p.parse_args(argv)
    if args.quick: args.n_id, args.n_per_shift, args.permutations = 200, 100, 1

    summary = dict(what="proton-ood evaluate --experiments " + args.experiments, library_version=__version__,
                   device="cpu", device_note="proton-ood evaluate has no device option: it runs on CPU torch tensors",
                   machine=machine(), preset=args.preset, dim=args.dim, n_id=args.n_id, n_per_shift=args.n_per_shift,
                   permutations=args.permutations)
    with tempfile.TemporaryDirectory() as scratch:
        t = time.perf_counter()
        world = SyntheticWorld.preset(args.preset, seed=0, dim=args.dim)
        cache = EmbeddingCache.from_world(world, n_id=args.n_id, n_per_shift=args.n_per_shift)
        path = cache.save(Path(scratch, "synthetic.npz"))
        summary.update(images=len(cache), cache_bytes=path.stat().st_size, build_cache_s=round(time.perf_counter() - t, 3))
        out = Path(scratch, "results", "main.csv")
        cmd = [sys.executable, "-c", CHILD, "evaluate", str(path), "--experiments", args.experiments,
               "--permutations", str(args.permutations), "--out", str(out), "--no-progress"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x),
                   PYTHONWARNINGS="ignore")
        print(f"timing `proton-ood evaluate {path.name} --experiments {args.experiments} --permutations {args.permutations}` "
              f"on {len(cache)} synthetic images (d={args.dim}, {args.n_id} ID + {args.n_per_shift} per OOD shift), device cpu",
              flush=True)
        t = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=scratch, timeout=args.timeout)
            rc, stdout, stderr = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
            stdout, stderr = [s.decode() if isinstance(s, bytes) else s for s in (stdout, stderr)]
        summary["seconds"] = round(time.perf_counter() - t, 3)
        summary["rc"] = rc
        lines = stdout.splitlines()
        child = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("SUITE_CHILD ")]
        if child: summary["import_s"] = child[0]["import_s"]
        summary["experiments_s"] = {w[1]: float(w[2]) for w in (line.split() for line in lines if line.startswith("SUITE_EXP "))}
        summary["csv_rows"] = {f.name: sum(1 for _ in f.open()) - 1 for f in sorted(out.parent.glob("*.csv"))}
        if rc != 0:
            summary["stderr_tail"] = stderr[-2000:]
            print(stderr[-4000:], file=sys.stderr)
    line = json.dumps(summary)
    print(line)
    if args.json: Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
