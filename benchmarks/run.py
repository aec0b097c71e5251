"""Benchmarks of the PROTON stream engine: throughput, single-image latency and peak memory.

Run: `.venv/bin/python benchmarks/run.py` (10–20 minutes on a 2-core CPU, most of it in the per-image paths at
N = 10^6; add `--quick` for a short run). Every number is measured in this run, on
this machine, and speed-ups are printed as ratios against baselines measured in the same run:
- `vectorised`: `Proton.score` on the whole stream (the exact vectorised engine), best of 5 runs;
- `step by step`: the detector's per-image path (`Proton._steps`), the literal Algorithm 1;
- `numpy loop`: a plain, straightforward numpy implementation of Algorithm 1 with Python lists as queues;
- many classes and a small bank (C = 1000, M = 4): one call as `score` routes it (on a CPU, the step path: `steps_cheaper`)
  against the same call forced through the engine.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import deque

import numpy as np
import torch

from proton import Proton, ProtonConfig
from proton.detector import DEFAULT_TEMPERATURE
from proton.scores import as_unit_rows

from _args import positive, usable_device, writable  # benchmarks/_args.py


def on_gpu(device):
    "Whether `device` (cuda, cuda:1, cpu, ...) is a GPU."
    return torch.device(device).type == "cuda"


def stream(n, n_classes, dim=512, seed=0, device="cpu"):
    "Text embeddings and a clustered (n, dim) float32 stream on `device`: class centres plus noise, so most images pass the gate."
    g = torch.Generator(device=device).manual_seed(seed)
    T = torch.nn.functional.normalize(torch.randn(n_classes, dim, generator=g, device=device), dim=1)
    X = torch.empty(n, dim, device=device)
    piece = 1 << (22 if on_gpu(device) else 14)  # in pieces, so that building the input adds little to its own size
    for a in range(0, n, piece):
        b = min(n, a + piece)
        cls = torch.randint(n_classes, (b - a,), generator=g, device=device)
        X[a:b] = T[cls] + 0.5 * torch.randn(b - a, dim, generator=g, device=device) / dim ** 0.5
    return T, X


def numpy_loop(T, X, cfg):
    "Algorithm 1 written plainly with numpy: one image at a time, deque queues, prototype recomputed from its queue."
    T, X = T.numpy().astype(np.float64), X.numpy()
    queues = [deque(maxlen=cfg.bank_size) for _ in T]
    protos = np.zeros_like(T)
    n = mean = m2 = 0.0
    out = np.empty(len(X))
    for t, x in enumerate(X):
        e = x / np.linalg.norm(x)
        z = T @ e / cfg.temperature
        p = np.exp(z - z.max()); p /= p.sum()
        base = -p.max()
        n += 1; d = base - mean; mean += d / n; m2 += d * (base - mean)
        s = base
        if min(len(q) for q in queues) >= cfg.k_min:
            alpha = cfg.alpha_max - (cfg.alpha_max - cfg.alpha_min) / (1 + np.exp(-cfg.slope * (m2 / n - cfg.var_ref)))
            s = alpha * base + (1 - alpha) * (1 - (protos @ e).max())
        if p.max() >= cfg.gamma:
            c = int(p.argmax()); queues[c].append(e)
            mu = np.sum(queues[c], axis=0); protos[c] = mu / np.linalg.norm(mu)
        out[t] = s
    return out


def timed(fn, repeat=1):
    "The shortest of `repeat` wall-clock times of `fn()`."
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter(); fn(); best = min(best, time.perf_counter() - start)
    return best


def sync(device):
    if on_gpu(device): torch.cuda.synchronize(device)


def throughput(sizes, classes, slow_max, device, repeat):
    "Rows of samples/s for the three implementations (the slow ones only up to `slow_max` images)."
    rows, cfg = [], ProtonConfig(temperature=DEFAULT_TEMPERATURE)  # τ explicit: the numpy loop reads it from the config
    for C in classes:
        T, X = stream(max(sizes), C, device=device)
        for n in sizes:
            x = X[:n]
            def vectorised():
                Proton(T, cfg).score(x); sync(device)
            rows.append(dict(C=C, n=n, impl="vectorised", seconds=timed(vectorised, repeat)))
            if n <= slow_max:
                def steps():
                    det = Proton(T, cfg); E = as_unit_rows(x); det._steps(E, *det._classify(E)); sync(device)
                rows.append(dict(C=C, n=n, impl="step by step", seconds=timed(steps)))
                if device == "cpu": rows.append(dict(C=C, n=n, impl="numpy loop", seconds=timed(lambda: numpy_loop(T, x, cfg))))
        del X
        if on_gpu(device): torch.cuda.empty_cache()
    for r in rows: r["samples_per_s"] = r["n"] / r["seconds"]
    return rows


def small_blocks(n, device, n_classes=1000, bank_size=4):
    "Seconds of one n-image call with many classes and a small bank, as `score` routes it (`steps_cheaper`) and forced through the engine."
    T, X = stream(n, n_classes, device=device)
    cfg = ProtonConfig(bank_size=bank_size, k_min=1, temperature=DEFAULT_TEMPERATURE)
    def routed():
        Proton(T, cfg).score(X); sync(device)
    def engine():
        Proton(T, cfg)._scan(X, torch.linalg.vector_norm(X, dim=1), None, None, False); sync(device)
    return dict(C=n_classes, M=bank_size, n=n, routed_s=timed(routed, 3), engine_s=timed(engine, 3))


def latency(device, n_warm=300, n_calls=3000):
    "Median and 99th-percentile time of `score` on one image at a time, after a warm-up that calibrates the bank."
    T, X = stream(n_warm + n_calls, 2, device=device)
    det = Proton(T)
    det.score(X[:n_warm])
    times = []
    for x in X[n_warm:]:
        start = time.perf_counter(); det.score(x); sync(device); times.append(time.perf_counter() - start)
    times = np.array(times) * 1e6
    return dict(median_us=float(np.median(times)), p99_us=float(np.percentile(times, 99)))


def peak_rss(n):
    "Peak resident memory of a fresh process scoring an n-image stream, and of one that only builds the input."
    code = ("import sys,torch; sys.path.insert(0, %r); from run import stream; from proton import Proton;"
            "T, X = stream(%d, 2); %s print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")
    here = os.path.dirname(os.path.abspath(__file__))
    def run(body):  # VmHWM, this process's own peak; ru_maxrss would include the parent's memory, inherited at fork
        out = subprocess.run([sys.executable, "-c", code % (here, n, body)], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1]) / 2**20  # KiB
    only_input, scoring = run(""), run("Proton(T).score(X);")
    return dict(n=n, input_gib=n * 512 * 4 / 2**30, peak_gib_input_only=only_input, peak_gib_scoring=scoring,
                beyond_input_gib=scoring - only_input)


def peak_cuda(n, device):
    "Peak GPU memory allocated on `device` while scoring an n-image stream, beyond the input."
    T, X = stream(n, 2, device=device)
    torch.cuda.synchronize(device); torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    Proton(T).score(X); torch.cuda.synchronize(device)
    return dict(n=n, input_gib=X.numel() * 4 / 2**30, beyond_input_gib=(torch.cuda.max_memory_allocated(device) - start) / 2**30)


def table(rows):
    "Samples/s per (C, n) and implementation, with speed-ups of the vectorised engine measured in the same run."
    import pandas as pd
    df = pd.DataFrame(rows).pivot_table(index=["C", "n"], columns="impl", values="samples_per_s")
    for slow in ("step by step", "numpy loop"):
        if slow in df: df[f"vectorised / {slow}"] = df["vectorised"] / df[slow]
    return df


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes only (a minute)")
    p.add_argument("--device", type=usable_device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=writable, help="also write all results to this file")
    p.add_argument("--slow-max", type=positive, help="largest N for the per-image paths (default: 10^6 on a CPU, 10^3 on a GPU)")
    a = p.parse_args(argv)
    sizes = [1_000, 10_000] if a.quick else [1_000, 10_000, 100_000, 1_000_000] + ([10_000_000] if on_gpu(a.device) else [])
    machine = dict(python=platform.python_version(), torch=torch.__version__, cpu=platform.processor() or platform.machine(),
                   cores=os.cpu_count(), threads=torch.get_num_threads(), device=a.device,
                   gpu=torch.cuda.get_device_name(a.device) if on_gpu(a.device) else None)
    print("machine:", json.dumps(machine))
    slow_max = a.slow_max or (1_000 if a.quick or on_gpu(a.device) else 1_000_000)  # per-image paths: minutes at 10^6
    rows = throughput(sizes, [2, 10], slow_max=slow_max, device=a.device, repeat=5)  # best of 5: interference only slows a run down
    import pandas as pd
    with pd.option_context("display.float_format", "{:,.1f}".format, "display.width", 200, "display.max_columns", None):
        print("\nthroughput (samples/s; d=512, M=100) and ratios measured in this run:")
        print(table(rows))
    few = small_blocks(1_000 if a.quick else 4_000, a.device)
    print(f"\nmany classes, small bank (C={few['C']}, M={few['M']}, n={few['n']:,}, one call): as routed {few['routed_s']:.2f} s,"
          f" through the engine {few['engine_s']:.2f} s; engine / routed = {few['engine_s'] / few['routed_s']:.1f}")
    lat = latency(a.device)
    print(f"\nsingle-image latency: median {lat['median_us']:.0f} us, p99 {lat['p99_us']:.0f} us")
    n_mem = 100_000 if a.quick else 1_000_000
    mem = peak_cuda(10 * n_mem, a.device) if on_gpu(a.device) else peak_rss(n_mem)
    if on_gpu(a.device): print(f"\npeak GPU memory scoring {mem['n']:,} images ({mem['input_gib']:.2f} GiB input): {mem['beyond_input_gib']:.2f} GiB beyond the input")
    else: print(f"\npeak RSS scoring {mem['n']:,} images ({mem['input_gib']:.2f} GiB input): {mem['peak_gib_scoring']:.2f} GiB;"
                  f" building the input alone: {mem['peak_gib_input_only']:.2f} GiB; beyond the input: {mem['beyond_input_gib']:.2f} GiB")
    if a.json:
        with open(a.json, "w") as f: json.dump(dict(machine=machine, throughput=rows, small_blocks=few, latency=lat, memory=mem), f, indent=1)


if __name__ == "__main__":
    main()
