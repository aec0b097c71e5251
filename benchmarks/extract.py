"""Throughput of embedding extraction (`proton.models.extract`): images per second, forward only, loader only and end to end.

Run on a GPU machine: `python benchmarks/extract.py --device cuda`. Anywhere: `python benchmarks/extract.py --quick` (small counts;
on a CPU the numbers describe that CPU, not a GPU). Two models, with random weights unless a FLAIR checkpoint is given
(the speed of a network does not depend on the values of its weights):
- FLAIR (ResNet-50) at 512x512, on PNG files shaped like FIVES' 2048x2048 fundus photographs;
- an open_clip ViT-B/32 at 224x224, on JPEG files of 500x375 (Imagenette's typical size), each a random crop of one of
  scikit-image's photographs, encoded again: `--n 20000` makes twenty thousand distinct files in a few tens of seconds.
Two decoding paths, both of `extract`: `workers` (DataLoader workers decode with PIL and run the model's preprocess) and
`device` (`decode_on_device=True`: workers read the JPEG bytes, the model's device decodes them with
torchvision.io.decode_jpeg and preprocesses with tensor ops; FLAIR's preprocessing has no device version, and PNG files
always take the workers' path). `--worker-shares 0,0.25,0.5` times the device path once for each `worker_share` of `extract`:
the share of the files the workers decode all the same, to take work off the GPU. For each model and path, all in this run, on this machine:
- forward only: `encode_images` on one preprocessed batch already on the device, in the precision of the run (float32,
  extraction's default, or float16 autocast with --amp), the encoder's ceiling;
- loader only: the batches of the chosen path, ready on the device, no model, at steady state (after the first
  `--warmup-batches` batches, so that starting the workers is not counted);
- end to end: `extract` from the image files to a written cache (prompts, shards, checksums and the final file), as a
  whole call, and at steady state: the difference between a run on all files and a run on the first half of them,
  which cancels the fixed costs of a call (model copies, prompts, worker start-up). Both come after an untimed run on
  the half: a process's first call also pays once for what later calls reuse (the text encoder's first run, for
  one), which would otherwise be charged to the run on all files and lower the steady rate.
With --breakdown, one more end-to-end run is timed stage by stage, per thread (waiting for the workers, putting a batch on
the device, decoding, preprocessing, waiting for a staged batch, encoding, writing shards), to show which stage the others
wait on, and what the main thread does before and after its loop over the shards (listing the folder, fingerprinting the
run, reading the shards back, writing the cache).
Ratios are against forward only, measured in the same run. The target of the issue is end to end (steady) at least
0.50 of forward only. Image files are read from the page cache (they were just written), so disk speed is not part of
the numbers.
"""
import argparse
import collections
import contextlib
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import proton.models.extract as ex
from proton.models import VLM, load_vlm
from proton.models.extract import (ImageFiles, JpegBytes, _assemble, _at_precision, _Preprocess, as_float_batch, collate_images,
                                   collate_jpeg_bytes, default_workers, device_preprocessing, extract)

from _args import names, non_negative, positive, shares, usable_device, writable  # benchmarks/_args.py

TARGET = 0.50  # the target: end to end (steady) at least half of forward only
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "retina", "immunohistochemistry")  # scikit-image's bundled photographs


def photos():
    "The PHOTOS as RGB PIL images (scikit-image, of the course extra, is imported here: --help needs none of it)."
    from skimage import data
    return [Image.fromarray(getattr(data, name)()).convert("RGB") for name in PHOTOS]


def image_path(folder, i, name):
    "Where file i goes: alternately in the two ID class folders."
    path = Path(folder, "id", "normal" if i % 2 else "diabetic_retinopathy", name)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def fundus_files(folder, n, side, level=1, jobs=1):
    "n PNG fundus photographs of side x side pixels (FIVES' format) at zlib `level`, variations of scikit-image's retina, written by `jobs` processes."
    parallel(_fundus_chunk, folder, n, jobs, side, level)


def _fundus_chunk(folder, indices, side, level):
    from skimage import data
    arr = np.asarray(Image.fromarray(data.retina()).resize((side, side), Image.BICUBIC))
    for i in indices:
        v = np.rot90(arr, i % 4)
        v = v[:, ::-1] if (i // 4) % 2 else v
        v = np.clip(v.astype(np.int16) + (i % 16) - 8, 0, 255).astype(np.uint8)  # every file its own content
        Image.fromarray(np.ascontiguousarray(v)).save(image_path(folder, i, f"fundus_{i:05d}.png"), compress_level=level)


def photo_files(folder, n, size=(500, 375), seed=0, jobs=1):
    "n JPEG files of `size`, each a random crop of one of scikit-image's photographs, resized and encoded at quality 90."
    parallel(_photo_chunk, folder, n, jobs, size, seed)


def photo_crop(photos, i, size=(500, 375), seed=0):
    "File i's picture: a random crop of one of `photos` (PIL images), resized to `size`; the same whichever process draws it."
    rng, photo = np.random.default_rng((seed, i)), photos[i % len(photos)]
    w, h = photo.size
    cw, ch = int(w * rng.uniform(0.5, 1)), int(h * rng.uniform(0.5, 1))
    left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    return photo.crop((left, top, left + cw, top + ch)).resize(size, Image.BILINEAR)


def _photo_chunk(folder, indices, size, seed):
    pictures = photos()
    for i in indices: photo_crop(pictures, i, size, seed).save(image_path(folder, i, f"photo_{i:05d}.jpg"), quality=90)


def parallel(write, folder, n, jobs, *args):
    "Files 0..n-1 written by `write(folder, indices, *args)` in `jobs` processes (in this one when `jobs` is 1)."
    chunks = [range(j, n, jobs) for j in range(jobs)]
    if jobs == 1: return write(folder, chunks[0], *args)
    with ProcessPoolExecutor(jobs) as pool:
        list(pool.map(write, [folder] * jobs, chunks, *[[a] * jobs for a in args]))


def half_folder(folder, scratch):
    "A folder holding the first half of `folder`'s images (hard links, else copies), for the steady-state difference."
    files = sorted(p.relative_to(folder) for p in Path(folder).rglob("*") if p.is_file())
    half = Path(scratch, Path(folder).name + "_half")
    for f in files[: len(files) // 2]:
        (half / f).parent.mkdir(parents=True, exist_ok=True)
        try: os.link(Path(folder, f), half / f)
        except OSError: (half / f).write_bytes(Path(folder, f).read_bytes())
    return half, len(files) // 2


def tiny_vocab(folder):
    "A BERT vocab.txt with the special tokens and the benchmark's prompt words: enough for FLAIR's text side with random weights."
    Path(folder, "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "normal", "diabetic", "retinopathy"]) + "\n")
    return folder


def load_flair_model(args, device, scratch):
    "FLAIR: the released checkpoint if given, else random weights."
    from proton.models.flair import FLAIR, load_flair_tokenizer, random_flair
    if args.flair_checkpoint:
        return load_vlm("flair", args.flair_checkpoint, device=device, tokenizer=args.flair_tokenizer), "released weights"
    return FLAIR(random_flair(0), load_flair_tokenizer(tiny_vocab(scratch)), device), "random weights"


def sync(device):
    if device.type == "cuda": torch.cuda.synchronize(device)


def listing(folder):
    return sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file())


def forward_only(vlm, folder, batch_size, n, warmup, amp):
    "Images per second of `encode_images` (float32, or float16 autocast with `amp`) on one preprocessed batch on the device."
    encoder, files = _at_precision(vlm, amp), listing(folder)[:batch_size]
    x = torch.stack([vlm.preprocess(Image.open(Path(folder, f))) for f in files])
    x = x.repeat(-(-batch_size // len(x)), 1, 1, 1)[:batch_size].to(vlm.device)
    for _ in range(warmup): encoder.encode_images(x, batch_size=batch_size)  # kernels chosen, memory allocated
    iters = max(1, -(-n // batch_size))
    sync(vlm.device)
    t = time.perf_counter()
    for _ in range(iters): encoder.encode_images(x, batch_size=batch_size)  # returns CPU tensors: each call ends synchronised
    return iters * batch_size / (time.perf_counter() - t)


def loader_only(vlm, folder, batch_size, workers, on_device, warmup_batches, share=0):
    "Images per second of the loader alone, batches ready on the device, after the first `warmup_batches` batches."
    files, shape, cuda = listing(folder), (3, *vlm.image_size), vlm.device.type == "cuda"
    pre = _Preprocess(vlm)
    dataset = ImageFiles(folder, files, pre, shape, pixels=pre.pixels) if on_device is None else JpegBytes(folder, files, pre, shape, pixels=pre.pixels, worker_share=share)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers, pin_memory=cuda,
                                         collate_fn=collate_images if on_device is None else collate_jpeg_bytes)
    counted, t = 0, None
    for b, batch in enumerate(loader):
        index = list(range(b * batch_size, min(len(files), (b + 1) * batch_size)))
        if on_device is None: x = as_float_batch(batch[0].to(vlm.device, non_blocking=cuda), pre.normalise)
        else: x, _ = _assemble(batch, index, dataset, on_device, vlm.device)
        if b + 1 == warmup_batches:  # the clock starts once the first batches are in
            sync(vlm.device)
            t = time.perf_counter()
        elif t is not None: counted += len(x)
    sync(vlm.device)
    return counted / (time.perf_counter() - t) if t is not None and counted else float("nan")


def end_to_end(vlm, folder, half, n, n_half, batch_size, workers, amp, on_device, repeats, scratch, share=0, shard_size=256):
    "Images per second of `extract` (best of `repeats`, after an untimed call): the whole call, and at steady state (all files minus the first half; NaN if no run on all files was slower than the one on half)."
    def timed(data, count, r):
        out = Path(scratch, f"cache_{r}.npz")
        t = time.perf_counter()
        cache = extract(vlm, data, out=out, batch_size=batch_size, num_workers=workers, shard_size=max(shard_size, batch_size),
                        amp=amp, decode_on_device=on_device, worker_share=share, resume=False, progress=False)
        elapsed = time.perf_counter() - t
        assert len(cache) == count
        out.unlink()
        return elapsed
    timed(half, n_half, "warm-up")  # not counted: a process's first call pays once for what later calls reuse
    wholes, steadies = [], []
    for r in range(repeats):
        t_all, t_half = timed(folder, n, r), timed(half, n_half, r)
        wholes.append(n / t_all)
        if t_all > t_half: steadies.append((n - n_half) / (t_all - t_half))  # else no difference to measure (noise, small --n)
    return max(wholes), max(steadies, default=float("nan"))


@contextlib.contextmanager
def stages():
    """Within the block, the wall time `extract` spends in each stage, by thread: {(thread, stage): seconds}.

    The wrappers time the module's own functions: in the main thread, listing the folder, fingerprinting the run, the loop
    over the shards (within it, waiting for the next staged batch and encoding it), reading the shards back and writing the
    cache; in the staging thread, waiting for the workers and putting a batch on the device (decoding and preprocessing JPEG files
    there, on the device path); in the writing thread, writing shards."""
    seconds = collections.Counter()
    def add(stage, start): seconds[threading.current_thread().name.split("-")[0], stage] += time.perf_counter() - start
    def timed(f, stage):
        def run(*a, **k):
            start = time.perf_counter()
            try: return f(*a, **k)
            finally: add(stage, start)
        return run
    def timed_iter(items, stage):
        items = iter(items)
        while True:
            start = time.perf_counter()
            try: item = next(items)
            except StopIteration: return
            finally: add(stage, start)
            yield item
    wrapped = [(ex, "decode_jpegs", "  of which decoding JPEG files"), (ex, "_write_shard", "writing a shard"),
               (VLM, "encode_images", "encoding"), (ex.DevicePreprocess, "__call__", "  of which preprocessing"),
               (ex, "read_prepared", "listing the folder"), (ex, "_run_fingerprint", "fingerprinting the run"),
               (ex, "_embed_shards", "the loop over the shards"), (ex, "read_shard", "reading the shards back"),
               (ex.EmbeddingCache, "save", "writing the cache")]
    ahead, saved = ex._ahead, [(owner, name, getattr(owner, name)) for owner, name, _ in wrapped]
    def timed_ahead(items, work, depth=2):
        staged = ahead(timed_iter(items, "waiting for the workers"), timed(work, "putting a batch on the device"), depth)
        try: yield from timed_iter(staged, "waiting for a staged batch")
        finally: staged.close()
    ex._ahead = timed_ahead
    for owner, name, stage in wrapped: setattr(owner, name, timed(getattr(owner, name), stage))
    try: yield seconds
    finally:
        ex._ahead = ahead
        for owner, name, f in saved: setattr(owner, name, f)


def breakdown(vlm, folder, n, batch_size, workers, amp, on_device, scratch, share=0, shard_size=256):
    "One `extract` on all files, timed stage by stage: {thread: {stage: seconds}}, and the whole call's seconds."
    with stages() as seconds:
        start = time.perf_counter()
        extract(vlm, folder, out=Path(scratch, "breakdown.npz"), batch_size=batch_size, num_workers=workers, shard_size=max(shard_size, batch_size),
                amp=amp, decode_on_device=on_device, worker_share=share, resume=False, progress=False)
        total = time.perf_counter() - start
    Path(scratch, "breakdown.npz").unlink()
    out = collections.defaultdict(dict)
    for (thread, stage), t in sorted(seconds.items()): out[{"MainThread": "main", "Thread": "staging", "ThreadPoolExecutor": "writing"}.get(thread, thread)][stage] = t
    return dict(out), total


def verdict(row, # a measured row of the table
            quick): # whether the run had --quick's small counts
    "Whether the row meets the target, or why it cannot say."
    if quick: return "no verdict: with small counts, fixed costs and timing noise dominate"
    if math.isnan(row["steady_ratio"]): return "no verdict: the run on all files was not slower than the run on half of them"
    if row["steady_ratio"] >= TARGET: return "met"
    return "missed: the loader limits it" if row["loader_only"] < row["forward_only"] else "missed"


def machine(device):
    if device.type == "cuda": return f"GPU {torch.cuda.get_device_name(device)}, {os.cpu_count()} CPU cores"
    return f"CPU only: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", type=usable_device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small counts: a smoke test that runs in a few minutes on a CPU")
    p.add_argument("--n", type=positive, default=None, help="images per model (default 2048; --quick 32); thousands for a steady state")
    p.add_argument("--batch-size", type=positive, default=None, help="default 64 (--quick 8)")
    p.add_argument("--workers", type=non_negative, default=None, help=f"DataLoader workers (default {default_workers()} here)")
    p.add_argument("--repeats", type=positive, default=None, help="end-to-end runs, best reported (default 2; --quick 1)")
    p.add_argument("--warmup-batches", type=non_negative, default=None, help="loader batches not timed (default: one per worker; at least 1)")
    p.add_argument("--fundus-size", type=positive, default=None, help="side of the PNG fundus files (default 2048, FIVES; --quick 512)")
    p.add_argument("--png-level", type=int, choices=range(10), default=1, help="zlib level of the PNG files (default 1, quick to write; 0 as the data scripts' --resize stores them)")
    p.add_argument("--models", type=names("flair", "vit-b-32"), default="flair,vit-b-32", help="comma-separated: flair, vit-b-32")
    p.add_argument("--paths", type=names("workers", "device"), default="workers,device", help="comma-separated decoding paths: workers, device")
    p.add_argument("--worker-shares", type=shares, default="0", help="comma-separated worker_share values timed on the device path (default 0)")
    p.add_argument("--shard-size", type=positive, default=256, help="images per shard of the end-to-end runs (default 256, extract's; at least the batch size)")
    p.add_argument("--switch-interval", type=float, default=None, metavar="S",
                   help="Python's thread switch interval for the run, in seconds (sys.setswitchinterval; default Python's, 0.005)")
    p.add_argument("--amp", action="store_true", help="forward passes under float16 autocast (extract's amp=True); default float32")
    p.add_argument("--flair-checkpoint", default=None, help="time the released flair_resnet.pth instead of random weights")
    p.add_argument("--flair-tokenizer", default=None, help="folder with Bio_ClinicalBERT's vocab.txt (with --flair-checkpoint)")
    p.add_argument("--breakdown", action="store_true", help="also time one end-to-end run stage by stage, per thread")
    p.add_argument("--json", type=writable, default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.switch_interval is not None:
        if not args.switch_interval > 0: p.error(f"--switch-interval must be positive, got {args.switch_interval}")
        sys.setswitchinterval(args.switch_interval)  # how long the thread that feeds the GPU may wait for the GIL held by another
    device = torch.device(args.device)
    n = args.n or (32 if args.quick else 2048)
    batch_size = args.batch_size or (8 if args.quick else 64)
    workers = default_workers() if args.workers is None else args.workers
    repeats = args.repeats or (1 if args.quick else 2)
    warmup_batches = max(1, workers if args.warmup_batches is None else args.warmup_batches)
    fundus = args.fundus_size or (512 if args.quick else 2048)
    precision = "float16 autocast" if args.amp else "float32"
    on_cpu = device.type != "cuda"
    print(f"extraction throughput on {machine(device)}; torch {torch.__version__}; {n} images per model, batch {batch_size}, "
          f"{workers} workers, forward passes in {precision} (all columns)")
    if on_cpu: print("CPU numbers" + (" (--quick, small counts)" if args.quick else "") + ": they describe this CPU, not a GPU run")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models:
            folder = Path(scratch, model)
            t = time.perf_counter()
            if model == "flair":
                fundus_files(folder, n, fundus, args.png_level, jobs=os.cpu_count())
                vlm, weights = load_flair_model(args, device, scratch)
                label, files = "FLAIR ResNet-50, 512x512", f"PNG {fundus}x{fundus} z{args.png_level}"
            else:
                photo_files(folder, n, jobs=os.cpu_count())
                vlm, weights = load_vlm("open_clip:ViT-B-32/none", device=device), "random weights"
                label, files = "ViT-B/32, 224x224", "JPEG 500x375"
            print(f"{label}: {n} files written in {time.perf_counter() - t:.1f} s", flush=True)
            half, n_half = half_folder(folder, scratch)
            fwd = forward_only(vlm, folder, batch_size, n, warmup=1 if args.quick else 3, amp=args.amp)
            for path in args.paths:
                on_device, why = (None, "") if path == "workers" else device_preprocessing(vlm)
                row = dict(model=label, weights=weights, files=files, path=path, precision=precision, device=str(device), images=n,
                           batch_size=batch_size, shard_size=max(args.shard_size, batch_size), workers=workers,
                           switch_interval=sys.getswitchinterval(), forward_only=fwd)
                if path == "device" and on_device is None:
                    rows.append(row | dict(refused=why)); continue
                for share in args.worker_shares if path == "device" else [0]:
                    name = path if share == 0 else f"{path} {share:g}w"  # the workers decode a share of the files all the same
                    load = loader_only(vlm, folder, batch_size, workers, on_device, warmup_batches, share)
                    whole, steady = end_to_end(vlm, folder, half, n, n_half, batch_size, workers, args.amp, path == "device", repeats, scratch, share, args.shard_size)
                    rows.append(row | dict(path=name, worker_share=share, loader_only=load, end_to_end=whole, end_to_end_steady=steady,
                                           loader_ratio=load / fwd, ratio=whole / fwd, steady_ratio=steady / fwd))
                    if args.breakdown:
                        rows[-1]["breakdown"], total = breakdown(vlm, folder, n, batch_size, workers, args.amp, path == "device", scratch, share, args.shard_size)
                        print(f"  {name}: where one end-to-end run of {total:.2f} s spends its time, per thread (seconds; threads overlap)")
                        for thread, by_stage in rows[-1]["breakdown"].items():
                            for stage, t in by_stage.items(): print(f"    {thread:<8}{stage:<34}{t:>8.2f}")
                    print(f"  {name}: done", flush=True)
            del vlm
            if device.type == "cuda": torch.cuda.empty_cache()
    print(f"\nimages/s; forward passes in {precision}; ratios against forward only of the same model, in this run")
    print(f"{'model':<26}{'files':<18}{'path':<14}{'forward only':>13}{'loader only':>12}{'e2e whole':>11}{'e2e steady':>12}"
          f"{'loader/fwd':>11}{'e2e/fwd':>9}{'steady/fwd':>11}")
    for r in rows:
        if "refused" in r:
            print(f"{r['model']:<26}{r['files']:<18}{r['path']:<14}{r['forward_only']:>13.1f}   device path refused: {r['refused']}")
            continue
        print(f"{r['model']:<26}{r['files']:<18}{r['path']:<14}{r['forward_only']:>13.1f}{r['loader_only']:>12.1f}{r['end_to_end']:>11.1f}"
              f"{r['end_to_end_steady']:>12.1f}{r['loader_ratio']:>11.2f}{r['ratio']:>9.2f}{r['steady_ratio']:>11.2f}")
    for r in rows:
        if "refused" in r: continue
        print(f"{r['model']}, {r['path']}: end to end (steady) / forward only = {r['steady_ratio']:.0%} "
              f"(target {TARGET:.0%}{', a GPU target' if on_cpu else ''}): {verdict(r, args.quick)}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(machine=machine(device), cpu_only=on_cpu, quick=args.quick, precision=precision, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
