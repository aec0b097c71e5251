"""How far the device path's pixels are from the model's CPU preprocessing, and where the difference comes from.

Run on a GPU machine: `python benchmarks/decode_parity.py --device cuda`. For each kind of JPEG file it prints, per pixel
and in 1/255 units (mean and max over all pixels and channels):
- decode: nvJPEG on the device against libjpeg-turbo on the CPU (`torchvision.io.decode_jpeg`), raw RGB pixels;
- resize: `DevicePreprocess` on the device against the same on the CPU, both from the CPU-decoded pixels;
- total: the device path (device decode, device preprocessing) against the model's own preprocess (PIL), the quantity the
  issue bounds by 1/255 on average and `device_preprocessing`'s self-check tests.
Files: the self-check's pattern (fine detail in brightness, smooth colour); a pattern with fine detail in colour, which
photographs rarely have; both saved with 4:2:0 chroma subsampling (PIL's default) and without (4:4:4); scikit-image's
colour photographs likewise; and random crops as `benchmarks/extract.py` writes them.
"""
import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import proton.models.extract as ex
from proton.models import check_vlm, load_vlm

from _args import usable_device, writable  # benchmarks/_args.py
from extract import photo_crop, photos  # benchmarks/extract.py: the same photographs and crops


def jpeg(rgb, **save):
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgb)).save(buffer, format="JPEG", quality=save.pop("quality", 90), **save)
    return buffer.getvalue()


def kinds(seed=0):
    "{name: [JPEG bytes]}: the self-check's pattern in two chroma layouts, scikit-image's photographs, benchmark-like crops."
    y, x = np.mgrid[0:200, 0:300]
    colour = np.stack([x * 255 / 299, y * 255 / 199, 127.5 + 127.5 * np.sin(x / 3) * np.cos(y / 2)], -1).astype(np.uint8)
    pictures = photos()
    crops = [jpeg(np.asarray(photo_crop(pictures, i, seed=seed))) for i in range(48)]
    return {"self-check pattern 4:2:0": [ex._test_jpeg()], "fine colour detail 4:2:0": [jpeg(colour)],
            "fine colour detail 4:4:4": [jpeg(colour, subsampling=0)],
            "photographs 4:2:0": [jpeg(np.asarray(p)) for p in pictures], "photographs 4:4:4": [jpeg(np.asarray(p), subsampling=0) for p in pictures],
            "500x375 crops 4:2:0 (benchmark)": crops}


def gaps(vlm, files, device):
    "Mean and max per-pixel differences (1/255 units) of decode, resize and total over `files`."
    pre, why = ex._parse_transform(vlm.transform, vlm.image_size)
    std = torch.tensor(pre.std)[:, None, None]
    out = {k: [] for k in ("decode", "resize", "total")}
    for raw in files:
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        on_cpu, on_dev = ex.decode_jpegs([t], "cpu")[0], ex.decode_jpegs([t], device)[0]
        out["decode"].append((on_dev.cpu().float() - on_cpu.float()).abs().flatten() / 255)
        out["resize"].append(((pre([on_cpu.to(device)])[0].cpu() - pre([on_cpu])[0]) * std).abs().flatten())
        out["total"].append(((pre([on_dev])[0].cpu() - vlm.preprocess(Image.open(io.BytesIO(raw)))) * std).abs().flatten())
    return {k: dict(mean=float(torch.cat(v).mean() * 255), max=float(torch.cat(v).max() * 255)) for k, v in out.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", type=usable_device, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="open_clip:ViT-B-32/none")
    p.add_argument("--json", type=writable, default=None)
    args = p.parse_args(argv)
    try: check_vlm(args.model)
    except ValueError as e: p.error(f"argument --model: {e}")
    vlm = load_vlm(args.model, device=args.device)
    rows = {name: gaps(vlm, files, args.device) for name, files in kinds().items()}
    print(f"per-pixel differences in 1/255 (mean / max), {args.model} preprocessing, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    print(f"{'files':<34}{'decode':>14}{'resize':>14}{'total':>14}")
    for name, r in rows.items():
        print(f"{name:<34}" + "".join(f"{r[k]['mean']:>8.3f} /{r[k]['max']:>4.0f}" for k in ("decode", "resize", "total")))
    if args.json: Path(args.json).write_text(json.dumps(dict(device=args.device, model=args.model, rows=rows), indent=2))


if __name__ == "__main__":
    sys.exit(main())
