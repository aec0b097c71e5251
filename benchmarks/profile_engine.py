"""Where the stream engine spends its time: a per-operator profile of `Proton.score` on one stream.

Run: `.venv/bin/python benchmarks/profile_engine.py --device cuda --n 10000000` (defaults: the CPU, 10^6 images, C=2).
Prints the throughput of a plain run, then the operators sorted by their own time on the device (CUDA kernels on a
GPU, CPU time otherwise), measured with `torch.profiler` on a second run.
"""
import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _args import positive, usable_device  # benchmarks/_args.py
from run import on_gpu, stream, sync
from proton import Proton


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", type=usable_device, default="cpu")
    p.add_argument("--n", type=positive, default=1_000_000, help="stream length")
    p.add_argument("--classes", type=positive, default=2)
    p.add_argument("--rows", type=positive, default=30, help="operators to list")
    a = p.parse_args(argv)
    T, X = stream(a.n, a.classes, device=a.device)
    Proton(T).score(X[:100_000]); sync(a.device)  # warm-up
    start = time.perf_counter(); Proton(T).score(X); sync(a.device)
    print(f"{a.n:,} images, C={a.classes}, {a.device}: {a.n / (time.perf_counter() - start):,.0f} samples/s")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu(a.device) else [])
    with profile(activities=activities) as prof:
        Proton(T).score(X); sync(a.device)
    key = "self_cuda_time_total" if on_gpu(a.device) else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=a.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
