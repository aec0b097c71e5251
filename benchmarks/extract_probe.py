"""Where the device path of extraction loses time on a GPU: stage costs alone, stages under a concurrent forward pass, and
the pipeline with one change at a time.

Run on a GPU machine: `python benchmarks/extract_probe.py --json probe.json` (ViT-B/32, random weights, 8,192 JPEG files of
500x375, float16 autocast unless --fp32). Every number is measured in this run; rates are images/s over the batches after the
first --skip ones, so that starting the workers and the first kernels are not counted.
- stages alone: one batch's decoding (nvJPEG), preprocessing (resize, crop, normalise), the same preprocessing with torch's
  antialiased interpolation kernels in place of the library's matrix products (its code before they replaced them, for the
  ratio), decoding and preprocessing as `_assemble` does them, and the forward pass, each timed with the device synchronised,
  median of several;
- stages under load: the same while a forward pass of another batch runs on another stream, started just before;
- pipelines: a copy of `_embed_shards`' loop (workers read bytes, a thread stages batches on a side stream, the main thread
  encodes), first as it was before 7a75f33 (`as_is`: the forward on the legacy default stream), then with one change
  each: the forward on its own stream (`compute_stream`, as the library does since); no host synchronisation per batch
  (features copied back in the background, waited for one batch later); staging without synchronisation (consecutive
  positions as slices, decoded images kept until the side stream is past them); a high-priority side stream; all together;
  on its own stream with the JPEG files' bytes not copied to pinned memory by the DataLoader (nvJPEG reads them on the host);
  staging and encoding in one thread, one after the other; the main loop alone (the first staged batch again and
  again, no decoding), for reference; and the loop as it is with one shard per batch written in a thread, as `extract`
  writes them (the copies write nothing).
- with --profile: torch.profiler tables (and a trace) of a few batches of the pipeline as it is, in --out-dir.
"""
import argparse
import contextlib
import gzip
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _args import non_negative, positive, usable_device, writable  # noqa: E402  (benchmarks/_args.py)
from extract import listing, photo_files, sync  # noqa: E402  (benchmarks/extract.py)

from proton.models import load_vlm  # noqa: E402
from proton.models.extract import (ImageFiles, JpegBytes, _ahead, _assemble, _at_precision, _positions, _Preprocess,  # noqa: E402
                                   _resized_size, _write_shard, collate_jpeg_bytes, decode_jpegs, default_workers, device_preprocessing,
                                   shard_path)


def new_stream(device, priority=0):
    "A CUDA stream on `device`; None on the CPU, where the probe runs as a smoke test."
    return torch.cuda.Stream(device, priority=priority) if device.type == "cuda" else None


def on(stream):
    "Within the block, work goes to `stream` (nothing on the CPU)."
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@contextlib.contextmanager
def precision(device, amp):
    "Inference mode, and float16 autocast on CUDA when `amp`."
    with torch.inference_mode(), torch.autocast(device.type, dtype=torch.float16, enabled=amp and device.type == "cuda"): yield


def timed(f, device, reps=5):
    "Median seconds of f() with the device synchronised before and after."
    out = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        f()
        sync(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def one_batch(dataset, batch_size):
    "The first batch of the dataset as the workers hand it over."
    return collate_jpeg_bytes([dataset[i] for i in range(batch_size)]), list(range(batch_size))


def by_interpolate(pre, images):
    "`pre(images)` for images of one size, resized by torch's antialiased interpolation kernels, width first: the baseline of its matrix products."
    from torchvision.transforms.functional import center_crop
    x = torch.stack(images).float()
    for step, *args in pre.geometry:
        if step == "crop": x = center_crop(x, list(args[0]))
        else:
            size, max_size, mode = args
            h, w = _resized_size(*x.shape[-2:], size, max_size)
            for shape in ((x.shape[-2], w), (h, w)):  # width first, then height, rounded after each, as PIL does
                x = torch.nn.functional.interpolate(x, size=shape, mode=mode, antialias=True, align_corners=False).clamp_(0, 255).round_()
    mean, std = (torch.tensor(v, device=x.device)[:, None, None] for v in (pre.mean, pre.std))
    return (x / 255 - mean) / std


def stage_costs(vlm, dataset, pre, batch_size, amp):
    "Seconds per batch of each stage alone, and while a forward pass runs on another stream."
    device, encoder = vlm.device, _at_precision(vlm, amp)
    batch, index = one_batch(dataset, batch_size)
    raw = list(torch.split(batch["jpeg_bytes"], batch["jpeg_sizes"]))
    decoded = decode_jpegs(raw, device)
    x = pre(decoded)
    def forward(): return encoder.encode_images(x, batch_size=batch_size)
    def forward_async():  # launched on its own stream, not waited for
        with on(busy), precision(device, amp):
            for _ in range(3): vlm._image_features(x)
    busy, side = new_stream(device), new_stream(device)
    gap = ((by_interpolate(pre, decoded) - x) * torch.tensor(pre.std, device=device)[:, None, None]).abs().amax().item() * 255
    print(f"  the two preprocessings differ by at most {gap:.3f}/255", flush=True)
    assert gap < 2.01, gap  # ties: PIL's halves up against torch's halves to even, at most 2 after the second pass
    stages = dict(decode=lambda: decode_jpegs(raw, device), preprocess=lambda: pre(decoded),
                  preprocess_interpolate=lambda: by_interpolate(pre, decoded),
                  assemble=lambda: _assemble(batch, index, dataset, pre, device), forward=forward)
    out = {}
    for name, f in stages.items():
        alone = timed(f, device)
        def loaded():
            forward_async()
            with on(side):
                t = time.perf_counter()
                f()
                return time.perf_counter() - t  # host time of the call while the other stream computes
        loaded_host = []
        for _ in range(5):
            sync(device)
            loaded_host.append(loaded())
            sync(device)
        busy_alone = timed(forward_async, device)
        out[name] = dict(alone_ms=alone * 1e3, host_ms_under_load=statistics.median(loaded_host) * 1e3, load_ms=busy_alone * 1e3)
        print(f"  {name:<22} alone {alone * 1e3:7.2f} ms; its call's host time while 3 forward passes ({busy_alone * 1e3:.1f} ms) run "
              f"on another stream: {statistics.median(loaded_host) * 1e3:7.2f} ms", flush=True)
    return out


def assemble_async(batch, index, files, pre, device, decode_stream, side):
    "`_assemble` for batches whose files the device decodes, without waiting for the device: the staging thread runs ahead."
    assert not batch["decoded"], "the probe's files are all JPEG"
    with on(decode_stream):
        decoded = decode_jpegs(list(torch.split(batch["jpeg_bytes"], batch["jpeg_sizes"])), device)
    images = torch.stack(decoded) if side is None else None
    if side is not None:
        side.wait_stream(decode_stream)
        images = torch.stack(decoded)
        for d in decoded: d.record_stream(side)  # their memory is not reused before the side stream is past this batch
    x = torch.empty((len(index), *files.shape), device=device)
    x[_positions(batch["jpeg_at"], device)] = pre._batch(images)
    return x


def pipeline(vlm, dataset, pre, batch_size, workers, amp, skip, *, compute_stream=False, lag=False, async_stage=False,
             high_priority=False, threaded=True, fixed=False, pin=True, shards=None):
    "Images/s of a copy of `_embed_shards`' loop over the dataset, after `skip` batches; each keyword is one change."
    device, encoder, n = vlm.device, _at_precision(vlm, amp), len(dataset)
    batches = [list(range(i, min(n, i + batch_size))) for i in range(0, n, batch_size)]
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, num_workers=workers, pin_memory=pin and device.type == "cuda",
                                         collate_fn=collate_jpeg_bytes)
    cuda = device.type == "cuda"
    side, decode_stream = new_stream(device, -1 if high_priority else 0), new_stream(device)
    compute = new_stream(device) if compute_stream else torch.cuda.current_stream(device) if cuda else None
    first = {}
    def stage(item):
        batch, index = item
        if fixed and first: return first["x"].clone(), None  # the staged batch of the first step again: the main loop alone
        with on(side):
            x = assemble_async(batch, index, dataset, pre, device, decode_stream, side) if async_stage else _assemble(batch, index, dataset, pre, device)[0]
            if fixed:
                sync(device)
                first["x"] = x
            return x, side.record_event() if cuda else None
    loaded = iter(loader)
    staged = _ahead(zip(loaded, batches), stage) if threaded else map(stage, zip(loaded, batches))
    ticks, features, pending, written = [], [], None, []
    with contextlib.closing(staged) if threaded else contextlib.nullcontext(), on(compute), ThreadPoolExecutor(1) as writer:
        for x, there in staged:
            if cuda and there is not None:
                compute.wait_event(there)
                x.record_stream(compute)
            if lag:
                with precision(device, amp): f = vlm._image_features(x).float()
                host = torch.empty(f.shape, pin_memory=cuda)
                host.copy_(f, non_blocking=cuda)
                done = compute.record_event() if cuda else None
                if pending is not None:
                    if cuda: pending[1].synchronize()
                    features.append(pending[0])
                pending = (host, done)
            else: features.append(encoder.encode_images(x, batch_size=len(x)))
            if shards is not None:  # one shard per batch, written in a thread as `_embed_shards` writes them
                k = len(ticks)
                arrays = dict(image_embeddings=features[-1].numpy(), files=np.array(dataset.files[k * batch_size:(k + 1) * batch_size], dtype=str))
                written.append(writer.submit(_write_shard, shard_path(shards, k), arrays, dict(shard=k)))
            ticks.append(time.perf_counter())
        if pending is not None:
            if cuda: pending[1].synchronize()
            features.append(pending[0])
            ticks[-1] = time.perf_counter()
        for w in written: w.result()
        if written: ticks[-1] = time.perf_counter()
    counted = sum(len(b) for b in batches[skip + 1:])
    assert sum(len(f) for f in features) == n
    return counted / (ticks[-1] - ticks[skip])


def profile(vlm, dataset, pre, batch_size, workers, amp, out_dir):
    "A torch.profiler table (CPU and CUDA time by operator) of the pipeline as it is, over 12 batches."
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof
    small = torch.utils.data.Subset(dataset, range(min(len(dataset), 12 * batch_size)))
    small.shape = dataset.shape
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        pipeline(vlm, small, pre, batch_size, workers, amp, skip=2)
    table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    cuda_table = p.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, "probe_profile.txt").write_text(table + "\n\n" + cuda_table)
        trace = Path(out_dir, "probe_trace.json")
        p.export_chrome_trace(str(trace))
        trace.with_suffix(".json.gz").write_bytes(gzip.compress(trace.read_bytes()))
        trace.unlink()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # the first sentence runs over two lines
    p.add_argument("--n", type=positive, default=8192)
    p.add_argument("--batch-size", type=positive, default=256)
    p.add_argument("--workers", type=non_negative, default=default_workers())
    p.add_argument("--skip", type=non_negative, default=4, help="batches not counted at the start of each pipeline")
    p.add_argument("--fp32", action="store_true", help="float32 forward passes (default float16 autocast)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out-dir", default=None, help="where the profile's table and trace go")
    p.add_argument("--json", type=writable, default=None)
    p.add_argument("--device", type=usable_device, default="cuda", help="cuda; cpu runs it as a smoke test of the code, not a measurement")
    args = p.parse_args(argv)
    if args.skip + 2 > (batches := -(-args.n // args.batch_size)): p.error(f"argument --skip: {args.skip} leaves fewer than 2 of the {batches} batches to time")
    amp, device = not args.fp32, torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke test)"
    print(f"{name}; torch {torch.__version__}; {args.n} JPEG 500x375, batch {args.batch_size}, "
          f"{args.workers} workers, {'float16 autocast' if amp else 'float32'}", flush=True)
    result = dict(device=name, n=args.n, batch_size=args.batch_size, workers=args.workers, amp=amp)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch, "vit")
        photo_files(folder, args.n, jobs=max(1, args.workers))
        vlm = load_vlm("open_clip:ViT-B-32/none", device=device)
        pre, why = device_preprocessing(vlm)
        assert pre is not None, why
        dataset = JpegBytes(folder, listing(folder), _Preprocess(vlm), (3, *vlm.image_size))
        print("stage costs, per batch:", flush=True)
        result["stages"] = stage_costs(vlm, dataset, pre, args.batch_size, amp)
        variants = dict(as_is={}, compute_stream=dict(compute_stream=True), lag=dict(lag=True), async_stage=dict(async_stage=True),
                        high_priority=dict(high_priority=True),
                        all=dict(compute_stream=True, lag=True, async_stage=True, high_priority=True),
                        all_but_priority=dict(compute_stream=True, lag=True, async_stage=True),
                        one_thread=dict(threaded=False), own_stream_unpinned=dict(compute_stream=True, pin=False), main_loop_alone=dict(fixed=True),
                        main_loop_alone_lag=dict(fixed=True, lag=True, compute_stream=True), as_is_again={},
                        shards=dict(shards=Path(scratch, "shards")))
        Path(scratch, "shards").mkdir()
        result["pipelines"] = {}
        print("pipelines, images/s at steady state:", flush=True)
        for name, kw in variants.items():
            try: rate = pipeline(vlm, dataset, pre, args.batch_size, args.workers, amp, args.skip, **kw)
            except Exception as e:
                print(f"  {name:<17} FAILED: {type(e).__name__}: {e}", flush=True)
                result["pipelines"][name] = f"{type(e).__name__}: {e}"
                continue
            result["pipelines"][name] = rate
            print(f"  {name:<17} {rate:9.0f}", flush=True)
        if args.profile: profile(vlm, dataset, pre, args.batch_size, args.workers, amp, args.out_dir)
    if args.json: Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
