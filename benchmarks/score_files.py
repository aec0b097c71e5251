"""What the results file costs `proton-ood score`: a Parquet file against a CSV file, for streams of growing length.

Run: `python benchmarks/score_files.py` (`--quick` for a smoke test; `--json FILE` keeps the results). It scores a simulated
embedding cache of n images (the synthetic world, d = 512, no model) with `score_stream` into a fresh CSV file, the baseline,
and into a fresh Parquet file, in chunks of `--chunk-size`, for each n of `--n`, and prints seconds, microseconds per image
and the Parquet run's time as a multiple of the CSV run's, all measured in this run. A CSV file grows by appending; a Parquet
file cannot be appended to, so how often it is rewritten decides whether its cost per image stays flat as n grows. Both files
must hold the same rows: the script checks it. Then one image is added to each stream, as a daily run adds the day's images
to a long stream, and that run is timed. Last, the peak of memory that Python allocates (tracemalloc) to read the stream's
rows back: every column (`Results.load()`, as the audit reads them, and as a run did until it read the paths alone) against
the paths alone (`load(columns=["path"])`, what a run reads to know which images are new).
"""
import argparse
import json
import os
import platform
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

from proton.bench import EmbeddingCache, SyntheticWorld
from proton.models.score import Results, score_stream

from _args import positive, positives, writable  # benchmarks/_args.py


def timed_run(cache, out, chunk_size):
    "Seconds `score_stream` takes to score the images of `cache` not yet in `out`."
    start = time.perf_counter()
    score_stream(cache, out, chunk_size=chunk_size, progress=False)
    return time.perf_counter() - start


def peak_mib(f, *args, **kwargs):
    "Peak MiB that Python allocates while `f(*args, **kwargs)` runs."
    tracemalloc.start()
    try:
        f(*args, **kwargs)
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally: tracemalloc.stop()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=positives, default=None, help="comma-separated stream lengths (default 10000,30000,100000; --quick 300,600)")
    p.add_argument("--chunk-size", type=positive, default=256, help="images per committed chunk (score's default)")
    p.add_argument("--quick", action="store_true", help="small counts: a smoke test, no claim")
    p.add_argument("--json", type=writable, default=None)
    args = p.parse_args(argv)
    sizes = args.n or ([300, 600] if args.quick else [10_000, 30_000, 100_000])
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"
    print(f"score_stream on a simulated cache (d = 512), chunks of {args.chunk_size}, CSV against Parquet; {machine}")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        cache = Path(scratch, "c.npz")
        EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=10, n_per_shift=10).save(cache)
        timed_run(cache, Path(scratch, "warm.csv"), args.chunk_size); timed_run(cache, Path(scratch, "warm.parquet"), args.chunk_size)  # not counted
        for n in sizes:
            world = EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=n + 1, n_per_shift=1)
            world.subset(np.arange(n)).save(cache)
            row = dict(n=n)
            for kind in ("csv", "parquet"):
                row[f"{kind}_s"] = timed_run(cache, Path(scratch, f"{n}.{kind}"), args.chunk_size)
                row[f"{kind}_us_per_image"] = 1e6 * row[f"{kind}_s"] / n
            assert Results(Path(scratch, f"{n}.csv")).load()[1] == Results(Path(scratch, f"{n}.parquet")).load()[1], f"n={n}: other rows"
            row["ratio"] = row["parquet_s"] / row["csv_s"]
            world.subset(np.arange(n + 1)).save(cache)  # the next day: one image more
            for kind in ("csv", "parquet"):
                out = Path(scratch, f"{n}.{kind}")
                row[f"{kind}_one_more_s"] = timed_run(cache, out, args.chunk_size)
                row[f"{kind}_read_all_mib"] = peak_mib(Results(out).load)
                row[f"{kind}_read_paths_mib"] = peak_mib(Results(out).load, columns=["path"])
            rows.append(row)
    print(f"{'images':>8}{'CSV s':>9}{'Parquet s':>11}{'CSV µs/img':>12}{'Parquet µs/img':>16}{'Parquet / CSV':>15}"
          f"{'one more: CSV s':>17}{'Parquet s':>11}")
    for r in rows:
        print(f"{r['n']:>8}{r['csv_s']:>9.2f}{r['parquet_s']:>11.2f}{r['csv_us_per_image']:>12.1f}{r['parquet_us_per_image']:>16.1f}{r['ratio']:>15.2f}"
              f"{r['csv_one_more_s']:>17.2f}{r['parquet_one_more_s']:>11.2f}")
    print(f"\nMiB that Python allocates to read the rows back\n{'images':>8}{'CSV: all':>10}{'paths':>8}{'paths / all':>13}"
          f"{'Parquet: all':>14}{'paths':>8}{'paths / all':>13}")
    for r in rows:
        print(f"{r['n']:>8}{r['csv_read_all_mib']:>10.1f}{r['csv_read_paths_mib']:>8.1f}{r['csv_read_paths_mib'] / r['csv_read_all_mib']:>13.2f}"
              f"{r['parquet_read_all_mib']:>14.1f}{r['parquet_read_paths_mib']:>8.1f}{r['parquet_read_paths_mib'] / r['parquet_read_all_mib']:>13.2f}")
    if args.quick: print("--quick: small counts, no claim")
    if args.json: Path(args.json).write_text(json.dumps(dict(machine=machine, chunk_size=args.chunk_size, quick=args.quick, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
