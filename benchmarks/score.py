"""Throughput of `proton-ood score` on image files: images per second with one thread reading and preprocessing, and with several.

Run: `python benchmarks/score.py` (`--quick` for a smoke test; `--json FILE` keeps the results). It writes `--n` PNG files shaped
like FIVES' fundus photographs (scikit-image's retina, enlarged to `--size` pixels and turned a little for each file), then
scores the folder with `score_stream` (an open_clip ViT-S/32 with random weights, on the CPU unless `--device` says
otherwise) once with `workers=1`, the baseline, and once for each other `--workers` value, each into fresh results, and
prints images per second and the ratio to the baseline, all measured in this run. Every run's results must be byte for
byte the baseline's: reading in parallel threads may change the speed, never the rows. The files are read from the page
cache (they were just written), so disk speed is not part of the numbers.
"""
import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

from proton.detector import ProtonConfig
from proton.models import load_vlm
from proton.models.extract import default_workers
from proton.models.score import score_stream

from _args import positive, positives, usable_device, writable  # benchmarks/_args.py


def fundus_files(folder, n, size):
    "n PNG files of size x size pixels: the retina, turned by a few degrees more for each file."
    folder.mkdir(parents=True)
    from skimage import data  # the course extra's: imported here, so that --help needs none of it
    retina = Image.fromarray(data.retina()).resize((size, size), Image.BICUBIC)
    for i in range(n): retina.rotate(3 * i).save(folder / f"{i:05d}.png", compress_level=1)


def timed_run(folder, out, vlm, workers, batch_size):
    "Seconds `score_stream` takes to score the whole folder into `out` with `workers` threads."
    start = time.perf_counter()
    score_stream(folder, out, vlm, "normal,lesions", config=ProtonConfig(gamma=0.5), warmup=10, batch_size=batch_size,
                 workers=workers, progress=False)
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=positive, default=None, help="image files (default 128; --quick 8)")
    p.add_argument("--size", type=positive, default=None, help="side of the PNG files in pixels (default 2048, as FIVES; --quick 256)")
    p.add_argument("--workers", type=positives, default=None, help=f"comma-separated thread counts compared with 1 (default: {default_workers()}, this machine's)")
    p.add_argument("--batch-size", type=positive, default=32)
    p.add_argument("--device", type=usable_device, default="cpu")
    p.add_argument("--quick", action="store_true", help="small counts: a smoke test, no claim")
    p.add_argument("--json", type=writable, default=None)
    args = p.parse_args(argv)
    n, size = args.n or (8 if args.quick else 128), args.size or (256 if args.quick else 2048)
    counts = args.workers or [default_workers()]
    vlm = load_vlm("open_clip:ViT-S-32/none", device=args.device)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"
    print(f"score_stream on {n} PNG files of {size}x{size}, open_clip ViT-S/32 (random weights) on {args.device}; {machine}")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch, "in")
        fundus_files(folder, n, size)
        timed_run(folder, Path(scratch, "warm.csv"), vlm, 1, args.batch_size)  # not counted: first calls pay once
        base = Path(scratch, "w1.csv")
        t1 = timed_run(folder, base, vlm, 1, args.batch_size)
        rows.append(dict(workers=1, images_per_s=n / t1, ratio=1.0))
        for w in counts:
            if w == 1: continue
            out = Path(scratch, f"w{w}.csv")
            t = timed_run(folder, out, vlm, w, args.batch_size)
            assert out.read_bytes() == base.read_bytes(), f"{w} threads gave other rows than one"
            rows.append(dict(workers=w, images_per_s=n / t, ratio=t1 / t))
    print(f"{'threads':>8}{'images/s':>11}{'x 1 thread':>12}")
    for r in rows: print(f"{r['workers']:>8}{r['images_per_s']:>11.1f}{r['ratio']:>12.2f}")
    if args.quick: print("--quick: small counts, no claim")
    if args.json: Path(args.json).write_text(json.dumps(dict(machine=machine, n=n, size=size, device=args.device, quick=args.quick, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
