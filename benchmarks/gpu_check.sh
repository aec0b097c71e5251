#!/usr/bin/env bash
# One-shot check on a lent GPU machine (H100/H200, no internet), run from the repository root:
#   bash benchmarks/gpu_check.sh          (needs .whl/ carried along: open_clip_torch, ftfy, wcwidth wheels)
#   STEPS="a d" bash benchmarks/gpu_check.sh   (only the named steps; default all)
# The wheels, fetched where pip works (the GPU machine has torch, torchvision and the rest):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.2.13
# Everything it measures goes to $OUT: log; bench_cuda.json (c); suite.json (e); extract_vit_amp.json, extract_vit_amp_w12.json,
# extract_vit_amp_shards2048.json, extract_vit_amp_switch.json, probe_amp.json, extract_vit_fp32.json, extract_flair_512.json and decode_parity.json (d).
# Steps, most important first: a) GPU and versions, b) CUDA parity tests, c) stream-engine performance on CUDA,
# e) end-to-end time of `proton-ood evaluate --experiments all`, d) extraction: the device path's tests on CUDA (nvJPEG
# parity with the CPU preprocessing, no host synchronisation while staging), then throughput at steady state, the most
# wanted first: ViT-B/32 on 8,192 JPEG files under float16 autocast on the device path, with a stage breakdown, with 0, 25 %
# and 50 % of the files handed back to the workers (extract's worker_share); the same with shards of 2,048 and with a
# thread switch interval of 0.5 ms; ViT-B/32 in float32, both paths; FLAIR on 4,096 PNG files stored at its input
# resolution without compression, as the data scripts' --resize 512 prepares them; benchmarks/extract_probe.py (each stage
# alone, the resize as matrix products against torch's interpolation kernels, copies of the loop with one change each);
# a worker share with 12 workers; then pixels made floats on the device exactly as on the CPU, and nvJPEG's parity by
# kind of JPEG file. Steps a and d need about 540 s (BUDGET=540); the default budget cuts d's later steps.
# Every step has its own timeout, capped so the whole script ends within BUDGET seconds; a step whose timeout that cap
# cuts below 15 s is skipped (below a BUDGET of 30, the install steps themselves); a step that fails or times out is
# logged and the next one runs.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
LOG="$OUT/log"
BUDGET=${BUDGET:-400}  # seconds for the whole script (the brief allows 7 minutes)
DEV=${DEV:-cuda}
STEPS=${STEPS:-"a b c e d"}
want() { [[ " $STEPS " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1

step() {  # step NAME MAX_SECONDS COMMAND...: run COMMAND with a timeout, log its output, never stop the script
  local name=$1 max=$2; shift 2
  local left=$(( BUDGET - SECONDS - 15 ))  # 15 s: the kill grace of timeout -k, and the summary
  local t=$(( max < left ? max : left ))
  # skipped when the budget cuts its timeout below 15 s; a step whose own maximum is shorter runs in full
  if (( t < max && t < 15 )); then echo "=== $name: SKIPPED, ${left}s of the ${BUDGET}s budget left" | tee -a "$LOG"; return 0; fi
  local cmd="$*"
  echo "=== $name [timeout ${t}s, t=${SECONDS}s, $(date -u +%H:%M:%S)]: ${cmd%%$'\n'*}" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 10 "$t" "$@" 2>&1 | tee -a "$LOG"
  local rc=$?
  local note=""; (( rc == 124 || rc == 137 )) && note=" (TIMED OUT)"
  echo "=== $name: rc=$rc in $(( SECONDS - t0 ))s$note" | tee -a "$LOG"
  return 0
}

# wheels of the dependencies the machine lacks, then the package itself (its metadata gives proton.__version__); --upgrade:
# a rerun on a warm machine replaces the copy an earlier run left in /tmp/site, which the benchmarks would import
step "install wheels" 90 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
step "install proton" 60 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site .
export PYTHONPATH=/tmp/site

if want a; then
# a. the machine
step "a. GPU" 30 nvidia-smi -L
step "a. torch" 60 python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'
step "a. imports" 60 python3 -c '
import importlib, importlib.metadata as md
for d in ("torch", "torchvision", "numpy", "scikit-learn", "pandas", "tqdm", "timm", "transformers", "huggingface_hub",
          "safetensors", "regex", "pillow", "scikit-image", "hypothesis", "pytest", "open_clip_torch", "ftfy", "wcwidth"):
    try: print(f"{d:>16} {md.version(d)}")
    except md.PackageNotFoundError: print(f"{d:>16} MISSING")
for m in ("proton", "proton.cli", "proton.bench.evaluation", "proton.models.extract", "proton.models.vlm", "proton.models.flair", "open_clip"):
    print(f"{m:>16}", importlib.import_module(m).__file__)'

step "a. shared memory" 10 df -h /dev/shm
fi

if want b; then
# b. CUDA parity of the engine: the tests run on the device named by PROTON_TEST_DEVICE
step "b. parity tests" 150 env PROTON_TEST_DEVICE=$DEV python3 -m pytest -q -x -rs -p no:cacheprovider tests/test_engine.py tests/test_reference.py
fi

if want c; then
# c. stream-engine performance
step "c. engine performance" 200 python3 benchmarks/run.py --device $DEV --json "$OUT/bench_cuda.json"

# c2. chunk size on the GPU: the engine's throughput at N=10^7, C=2, for chunks of 2^16 to 2^21 images
step "c2. chunk sizes" 60 python3 -c '
import sys, time, json, torch; sys.path.insert(0, "benchmarks")
import proton.engine as engine
from proton import Proton
from run import stream
T, X = stream(10_000_000, 2, device="'$DEV'")
for size in (1 << 16, 1 << 18, 1 << 20, 1 << 21):
    engine.CUDA_CHUNK_SIZE = size
    best = 1e9
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); start = torch.cuda.memory_allocated()  # the peak of this chunk size alone
    for _ in range(3):
        torch.cuda.synchronize(); t = time.perf_counter(); Proton(T).score(X); torch.cuda.synchronize(); best = min(best, time.perf_counter() - t)
    print(json.dumps(dict(chunk=size, n=len(X), samples_per_s=round(len(X) / best), beyond_input_gib=round((torch.cuda.max_memory_allocated() - start) / 2**30, 2))))'
fi

if want e; then
# e. the whole experiment suite from an embedding cache (5,000 synthetic images, d=512); proton-ood evaluate runs on the CPU
step "e. suite end to end" 120 python3 benchmarks/suite.py --n-id 2000 --n-per-shift 1000 --timeout 105 --json "$OUT/suite.json"
fi

if want d; then
# d. extraction: the device path's parity on CUDA (nvJPEG; prints the measured pixel difference), then throughput at steady state
step "d. decode parity" 120 env PROTON_TEST_DEVICE=$DEV python3 -m pytest -q -s -rs -p no:cacheprovider tests/test_gpu_decode.py
step "d. extract ViT-B/32 amp" 150 python3 benchmarks/extract.py --device $DEV --models vit-b-32 --n 8192 --batch-size 256 --repeats 1 --amp --paths device --worker-shares 0,0.25,0.5 --breakdown --json "$OUT/extract_vit_amp.json"
# the probe's copies of the loop (no shards written) ran at 58-68 % of forward only where extract ran at 38 % (2026-11-27):
# one shard per batch (256, the default) against shards of 2,048 images, to see whether writing shards is what the copies lack
step "d. shards of 2048" 80 python3 benchmarks/extract.py --device $DEV --models vit-b-32 --n 8192 --batch-size 256 --repeats 2 --amp --paths device --shard-size 2048 --breakdown --json "$OUT/extract_vit_amp_shards2048.json"
# if not the shards, the GIL: the thread that launches the forward passes waits up to Python's switch interval (5 ms) for the
# GIL each time the writer or the staging thread holds it; against about 13 ms of GPU work per batch of 256
step "d. switch interval 0.5 ms" 80 python3 benchmarks/extract.py --device $DEV --models vit-b-32 --n 8192 --batch-size 256 --repeats 2 --amp --paths device --switch-interval 0.0005 --json "$OUT/extract_vit_amp_switch.json"
# the table of the README: float32 (both paths) and FLAIR, before the probe and the worker share, so that a budget of 520 s keeps them
step "d. extract ViT-B/32 fp32" 100 python3 benchmarks/extract.py --device $DEV --models vit-b-32 --n 8192 --batch-size 256 --repeats 1 --json "$OUT/extract_vit_fp32.json"
step "d. extract FLAIR 512 PNG" 120 python3 benchmarks/extract.py --device $DEV --models flair --paths workers --n 4096 --batch-size 128 --repeats 1 --fundus-size 512 --png-level 0 --json "$OUT/extract_flair_512.json"
step "d. probe" 120 python3 benchmarks/extract_probe.py --device $DEV --json "$OUT/probe_amp.json"
# a share handed back to the workers was slower with 16 workers (2026-11-27): the same share with fewer workers, leaving cores to the threads that feed the GPU
step "d. worker share, 12 workers" 80 python3 benchmarks/extract.py --device $DEV --models vit-b-32 --n 8192 --batch-size 256 --repeats 1 --amp --paths device --worker-shares 0,0.25 --workers 12 --json "$OUT/extract_vit_amp_w12.json"
step "d. pixels on the device" 60 python3 -c '
import numpy as np, torch
from proton.models.vlm import pixels_to_float
from proton.models.flair import flair_pixels, flair_preprocess
p = torch.arange(256, dtype=torch.uint8, device="'$DEV'")
exact = torch.equal(pixels_to_float(p).cpu(), torch.from_numpy(np.arange(256, dtype=np.float32) / 255))
a = np.random.default_rng(0).integers(0, 256, (512, 384, 3), dtype=np.uint8)
same = torch.equal(pixels_to_float(flair_pixels(a).to("'$DEV'")).cpu(), flair_preprocess(a))
print(f"pixels_to_float on '$DEV' equals numpy float32 p / 255 for all 256 values: {exact}; FLAIR pixels there equal flair_preprocess: {same}")
from PIL import Image
from proton.models import load_vlm
from proton.models.extract import _Preprocess, as_float_batch
vlm = load_vlm("open_clip:ViT-B-32/none"); pre = _Preprocess(vlm); im = Image.fromarray(a)
clip = torch.equal(as_float_batch(pre.pixels(im)[None].to("'$DEV'"), pre.normalise)[0].cpu(), vlm.preprocess(im))
print(f"open_clip pixels normalised on '$DEV' equal the CPU preprocess, bit for bit: {clip}")'
step "d. decode parity by file kind" 60 python3 benchmarks/decode_parity.py --device $DEV --json "$OUT/decode_parity.json"
fi

echo "=== done in ${SECONDS}s; files: $(cd "$OUT" && ls | tr '\n' ' ')" | tee -a "$LOG"
