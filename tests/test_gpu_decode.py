"""JPEG files decoded on the device (`decode_on_device`), tested on the CPU: `decode_jpeg(device="cpu")` runs the same tensor ops a GPU runs.

On a GPU machine, `PROTON_TEST_DEVICE=cuda pytest -s tests/test_gpu_decode.py` runs the same tests with the model on CUDA,
nvJPEG decoding, and prints the measured pixel differences.

The device path must give the CPU path's files, order, labels and shard layout, embeddings within rounding, the same report
of unreadable files, and fall back to the workers, saying why, when it cannot reproduce the model's preprocessing.
"""
import copy
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from hypothesis import given, settings, strategies as st
from PIL import Image
from skimage import data as skdata
from torchvision.transforms.functional import _compute_resized_output_size

import proton.models.extract as ex
from proton.bench.cache import EmbeddingCache
from proton.models import load_vlm
from proton.models.extract import extract, shard_path

MODEL = "open_clip:ViT-S-32/none"  # random weights (seed 0): the smallest open_clip ViT at 224 px
DEVICE = os.environ.get("PROTON_TEST_DEVICE", "cpu")
RUN = dict(batch_size=3, shard_size=3, num_workers=2, progress=False)  # batches that mix JPEG and PNG files


def write(path, array, fmt=None, **save):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.ascontiguousarray(array)).save(path, format=fmt, **save)


def mixed_folder(root):
    """A prepared folder (no classes.json: classes from id/) of JPEG files, colour and grey, upper- and lower-case, between PNG files."""
    retina = skdata.retina()
    write(root / "id/normal/a_retina.jpg", retina[::3, ::3], quality=90)
    write(root / "id/normal/b_retina.png", retina[::4, ::4])
    write(root / "id/normal/c_moon.JPG", skdata.moon(), "JPEG", quality=85)  # grey
    write(root / "id/retinopathy/a_micro.png", skdata.microaneurysms())
    write(root / "id/retinopathy/b_crop.jpeg", retina[400:800, 900:1300], quality=95)
    write(root / "far/photo/astronaut.JPEG", skdata.astronaut(), "JPEG")
    write(root / "far/photo/chelsea.jpg", skdata.chelsea())
    write(root / "far/photo/coins.png", skdata.coins())
    write(root / "far/photo/page.jpg", skdata.page())  # grey, smaller than 224 on its short side
    return root


@pytest.fixture(scope="module")
def vlm():
    return load_vlm(MODEL, device=DEVICE)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return mixed_folder(tmp_path_factory.mktemp("mixed"))


@pytest.fixture(scope="module")
def both(vlm, folder, tmp_path_factory):
    """The folder's cache and shards on the workers' path and on the device path."""
    out = tmp_path_factory.mktemp("out")
    cpu = extract(vlm, folder, out=out / "cpu.npz", keep_shards=True, decode_on_device=False, **RUN)
    device = extract(vlm, folder, out=out / "device.npz", keep_shards=True, decode_on_device=True, **RUN)
    return cpu, device, out


def test_device_path_gives_the_same_files_and_embeddings_within_rounding(both):
    cpu, device, _ = both
    assert device.source == cpu.source and list(device.shift) == list(cpu.shift)
    np.testing.assert_array_equal(device.labels, cpu.labels)
    jpeg = np.array([ex.is_jpeg(f) for f in cpu.source])
    assert jpeg.sum() == 6 and (~jpeg).sum() == 3
    cosine = (device.image_embeddings * cpu.image_embeddings).sum(1)
    assert cosine[jpeg].min() > 0.9999
    np.testing.assert_allclose(device.image_embeddings[~jpeg], cpu.image_embeddings[~jpeg], atol=1e-6)  # PNG: decoded by the workers
    np.testing.assert_array_equal(device.text_embeddings, cpu.text_embeddings)


def test_mixed_folder_keeps_the_shard_layout(both):
    cpu, device, out = both
    for k in range(3):
        a, b = np.load(shard_path(out / "cpu.npz.shards", k)), np.load(shard_path(out / "device.npz.shards", k))
        assert sorted(a.files) == sorted(b.files)
        for name in ("files", "errors"):
            np.testing.assert_array_equal(a[name], b[name])
        assert a["image_embeddings"].shape == b["image_embeddings"].shape and a["image_embeddings"].dtype == b["image_embeddings"].dtype


def test_metadata_and_fingerprint_name_the_path(both, vlm, folder, tmp_path):
    cpu, device, out = both
    assert device.metadata["decode"].startswith(f"JPEG files on {vlm.device.type}: torchvision.io.decode_jpeg") and device.metadata["decode_fallback"] is None
    assert cpu.metadata["decode"].startswith("DataLoader workers") and cpu.metadata["decode_fallback"] == "decode_on_device=False"
    by_default = ex._decoding(vlm, None)  # on CUDA only
    assert by_default[0] is not None if vlm.device.type == "cuda" else by_default[2] == "the model runs on cpu, not CUDA"
    assert EmbeddingCache.load(out / "device.npz").metadata["decode"] == device.metadata["decode"]
    with warnings.catch_warnings(record=True) as caught:  # the device run's shards are not reused by a workers' run
        warnings.simplefilter("always")
        again = extract(vlm, folder, out=out / "device.npz", keep_shards=True, decode_on_device=False, **RUN)
    stale = [w for w in caught if "recomputing shard" in str(w.message)]  # not, say, CPython's warning about forking with CUDA's threads
    assert len(stale) == 3 and all("differs in ['run']" in str(w.message) for w in stale)
    np.testing.assert_array_equal(again.image_embeddings, cpu.image_embeddings)


@pytest.mark.parametrize("share", [0, 0.1, 0.25, 1 / 3, 0.4, 0.5, 0.9, 1])
def test_the_workers_share_of_the_files_is_spread_evenly(share):
    picked = [i for i in range(600) if ex.worker_decodes(i, share)]
    assert len(picked) == round(600 * share)
    gaps = np.diff([-1, *picked])
    assert len(picked) < 2 or gaps.max() - gaps.min() <= 1  # every gap ⌊1/s⌋ or ⌈1/s⌉ files: no run of device-only batches


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan"), "half"])
def test_a_share_outside_0_to_1_is_refused(vlm, folder, share):
    with pytest.raises(ValueError, match="worker_share must be a number from 0 to 1"):
        extract(vlm, folder, decode_on_device=True, worker_share=share, **RUN)


@pytest.fixture(scope="module")
def shared(vlm, folder, tmp_path_factory):
    """The folder's cache on the device path with half, and with all, of its files given to the workers."""
    out = tmp_path_factory.mktemp("shared")
    return {s: extract(vlm, folder, out=out / f"{s}.npz", keep_shards=True, decode_on_device=True, worker_share=s, **RUN) for s in (0.5, 1)}, out


def test_the_workers_share_is_decoded_as_on_the_workers_path_the_rest_on_the_device(both, shared):
    (cpu, device, _), (caches, _) = both, shared
    np.testing.assert_array_equal(caches[1].image_embeddings, cpu.image_embeddings)  # all files to the workers: the workers' cache
    jpeg = np.array([ex.is_jpeg(f) for f in cpu.source])
    assert (np.abs(device.image_embeddings - cpu.image_embeddings).max(1)[jpeg] > 0).all()  # each JPEG row tells who decoded it
    workers = np.array([ex.worker_decodes(i, 0.5) or not j for i, j in enumerate(jpeg)])
    assert (workers & jpeg).sum() == 2 and (~workers).sum() == 4  # JPEG files on both paths
    exact = dict(rtol=0, atol=0 if DEVICE == "cpu" else 1e-6)  # on the CPU a row does not depend on the other rows of its batch
    np.testing.assert_allclose(caches[0.5].image_embeddings[workers], cpu.image_embeddings[workers], **exact)
    np.testing.assert_allclose(caches[0.5].image_embeddings[~workers], device.image_embeddings[~workers], **exact)
    assert caches[0.5].source == cpu.source


def test_the_share_is_in_the_metadata_and_the_run_fingerprint(vlm, folder, both, shared):
    (_, device, _), (caches, out) = both, shared
    assert caches[0.5].metadata["decode"] == device.metadata["decode"].replace("; other files", "; 1 in 2 files (spread evenly) and all other files")
    assert caches[0.5].metadata["worker_share"] == 0.5 and device.metadata["worker_share"] == 0
    with warnings.catch_warnings(record=True) as caught:  # another share, other embeddings: no shard of the last run is reused
        warnings.simplefilter("always")
        again = extract(vlm, folder, out=out / "0.5.npz", keep_shards=True, decode_on_device=True, worker_share=1, **RUN)
    assert sum("recomputing shard" in str(w.message) and "differs in ['run']" in str(w.message) for w in caught) == 3
    np.testing.assert_array_equal(again.image_embeddings, caches[1].image_embeddings)
    run = lambda share: ex._run_fingerprint(vlm, ex.read_prepared(folder), None, False, 3, False, True, share)
    assert run(0) == ex._run_fingerprint(vlm, ex.read_prepared(folder), None, False, 3, False, True)  # share 0: the runs of before


def test_device_preprocessing_reproduces_the_transform_on_every_shape(vlm, folder):
    pre, why = ex.device_preprocessing(vlm)
    assert why == "" and pre.geometry == [("resize", 224, None, "bicubic"), ("crop", (224, 224))]
    files = sorted(p for p in folder.rglob("*") if ex.is_jpeg(p))
    images = ex.decode_jpegs([torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in files], vlm.device)
    ours = pre(images).cpu()
    theirs = torch.stack([vlm.preprocess(Image.open(p)) for p in files])
    gap = ((ours - theirs) * torch.tensor(pre.std)[:, None, None]).abs()
    print(f"device path on {vlm.device}: mean |diff| {gap.mean() * 255:.4f}/255, max {gap.max() * 255:.1f}/255 over {len(files)} JPEG files")
    assert gap.mean() < 1 / 255  # the bound
    if vlm.device.type == "cpu": assert gap.max() <= 2 / 255 + 1e-6  # libjpeg-turbo on both sides: at most a rounding step per resize pass (width, then height)


@pytest.mark.parametrize("size,max_size", [(224, None), ([224], None), ([200, 300], None), (224, 300), (100, 101)])
def test_resized_size_is_torchvision_s(size, max_size):
    for h, w in [(375, 500), (500, 375), (224, 224), (100, 1000), (1411, 1411), (7, 3)]:
        expected = _compute_resized_output_size((h, w), [size] if isinstance(size, int) else size, max_size)
        assert list(ex._resized_size(h, w, size, max_size)) == expected


def test_an_unrecognised_transform_falls_back_with_its_reason(vlm, folder):
    odd = copy.copy(vlm)
    odd.transform = T.Compose([T.Resize(224), T.CenterCrop(224), T.RandomHorizontalFlip(), T.ToTensor()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = extract(odd, folder, decode_on_device=True, **RUN)
    assert any("decoded in the DataLoader workers" in str(w.message) for w in caught)
    assert "RandomHorizontalFlip" in cache.metadata["decode_fallback"] and "has no device version" in cache.metadata["decode_fallback"]
    assert cache.metadata["decode"].startswith("DataLoader workers")


@pytest.mark.parametrize("transform,reason", [
    (None, "not a torchvision transform (FLAIR's flair_preprocess stays on the CPU path)"),
    (T.Resize(224), "is not a torchvision Compose"),
    (T.Compose([T.Resize(224, interpolation=T.InterpolationMode.NEAREST), T.ToTensor()]), "only bilinear and bicubic"),
    (T.Compose([T.Resize(224), T.CenterCrop(224)]), "has no ToTensor step"),
    (T.Compose([T.ToTensor(), T.Resize(224)]), "has no device version"),  # resizing a float tensor: not PIL's 8-bit rounding
])
def test_what_the_device_path_refuses(vlm, transform, reason):
    odd = copy.copy(vlm)
    odd.transform = transform
    pre, why = ex.device_preprocessing(odd)
    assert pre is None and reason in why


def test_a_preprocess_that_is_not_its_transform_fails_the_self_check(vlm):
    odd = copy.copy(vlm)
    odd.preprocess = lambda image: vlm.preprocess(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT))
    pre, why = ex.device_preprocessing(odd)
    assert pre is None and "differs from the model's preprocess" in why


def corrupt_folder(root):
    """The mixed folder plus three broken JPEG files: truncated, not a JPEG, and a damaged Huffman table behind a valid header."""
    mixed_folder(root)
    raw = (root / "far/photo/chelsea.jpg").read_bytes()
    (root / "far/photo/cut.jpg").write_bytes(raw[: len(raw) // 2])
    (root / "far/photo/junk.jpg").write_bytes(b"not a JPEG at all")
    damaged = bytearray(raw)
    k = damaged.index(b"\xff\xc4")  # a Huffman table: PIL reads the header, no decoder decodes the data
    damaged[k + 5 : k + 21] = bytes([255]) * 16
    (root / "far/photo/huffman.jpg").write_bytes(bytes(damaged))
    return root


def test_a_corrupt_jpeg_is_reported_as_on_the_cpu_path(vlm, tmp_path):
    root = corrupt_folder(tmp_path / "corrupt")
    raw = (root / "far/photo/huffman.jpg").read_bytes()
    assert ex._device_decodable(raw) and isinstance(ex.decode_jpegs([torch.frombuffer(bytearray(raw), dtype=torch.uint8)], vlm.device)[0], str)
    caches = {}
    for on_device in (False, True):
        with pytest.warns(UserWarning, match="3 of 12 images could not be read"):
            caches[on_device] = extract(vlm, root, decode_on_device=on_device, **RUN)
    assert caches[True].metadata["skipped_files"] == caches[False].metadata["skipped_files"]
    assert [s["file"] for s in caches[True].metadata["skipped_files"]] == ["far/photo/cut.jpg", "far/photo/huffman.jpg", "far/photo/junk.jpg"]
    assert caches[True].source == caches[False].source and len(caches[True]) == 9
    for on_device in (False, True):
        with pytest.raises(ValueError, match="cannot read image .*cut.jpg"):
            extract(vlm, root, decode_on_device=on_device, strict=True, **RUN)


def staged(vlm, folder):
    """Every file of the folder as one pinned batch from the workers, its JPEG files decoded, and the device's preprocessing."""
    from proton.bench.prepared import read_prepared
    pre, _ = ex.device_preprocessing(vlm)
    files = ex.JpegBytes(folder, read_prepared(folder).files, ex._Preprocess(vlm), (3, *vlm.image_size))
    index = list(range(len(files)))
    batch = ex.collate_jpeg_bytes([files[i] for i in index])
    if vlm.device.type == "cuda": batch["images"] = batch["images"].pin_memory()  # as the DataLoader pins it
    decoded = ex.decode_jpegs(list(torch.split(batch["jpeg_bytes"], batch["jpeg_sizes"])), vlm.device)
    return pre, files, index, batch, decoded


def test_a_mixed_batch_and_a_jpeg_batch_are_assembled_as_each_image_alone(vlm, folder, monkeypatch):
    pre, files, index, batch, decoded = staged(vlm, folder)
    monkeypatch.setattr(ex, "decode_jpegs", lambda raw, device: decoded)
    x, errors = ex._assemble(batch, index, files, pre, vlm.device)  # PNG files from the workers between JPEG files of several sizes
    assert errors == [""] * len(index) and batch["decoded"] and batch["jpeg_at"]
    for j, at in enumerate(batch["jpeg_at"]): torch.testing.assert_close(x[at], pre([decoded[j]])[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(x[batch["decoded"]].cpu(), batch["images"], rtol=0, atol=0)  # the workers' floats, in their places
    jpegs = {k: v for k, v in batch.items()} | dict(decoded=[], images=torch.zeros(0), jpeg_at=list(range(len(decoded))), errors=[""] * len(decoded))
    y, _ = ex._assemble(jpegs, list(range(len(decoded))), files, pre, vlm.device)  # only JPEG files: the preprocessing's own tensor
    torch.testing.assert_close(y, pre(decoded), rtol=0, atol=0)


@pytest.mark.skipif(DEVICE != "cuda", reason="the host waits for a CUDA device; on the CPU there is nothing to wait for")
def test_staging_a_batch_does_not_make_the_host_wait_for_the_device(vlm, folder, monkeypatch):
    pre, files, index, batch, decoded = staged(vlm, folder)
    monkeypatch.setattr(ex, "decode_jpegs", lambda raw, device: decoded)  # nvJPEG waits for its own work: nothing else may wait
    ex._assemble(batch, index, files, pre, vlm.device)  # first: the resize matrices and normalisation constants go to the device once
    torch.cuda.set_sync_debug_mode("error")  # any operation that makes the host wait for the device now raises
    try:
        ex._assemble(batch, index, files, pre, vlm.device)
        pre(decoded)
    finally: torch.cuda.set_sync_debug_mode(0)


@settings(max_examples=80, deadline=None)
@given(h=st.integers(1, 80), w=st.integers(1, 80), size=st.one_of(st.integers(1, 64), st.tuples(st.integers(1, 64), st.integers(1, 64)).map(list)),
       mode=st.sampled_from(["bilinear", "bicubic"]), crop=st.none() | st.tuples(st.integers(1, 70), st.integers(1, 70)), seed=st.integers(0, 2**16))
def test_the_resize_as_matrix_products_is_pils(h, w, size, mode, crop, seed):
    """Random pixels overshoot most, so the order of the passes and the clipping show; only rounding ties may differ."""
    x = torch.randint(0, 256, (1, 3, h, w), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    steps = [T.Resize(size, interpolation=T.InterpolationMode(mode))] + ([T.CenterCrop(crop)] if crop else [])
    pil = T.Compose([*steps, T.PILToTensor()])(Image.fromarray(x[0].permute(1, 2, 0).numpy())).float()
    ours = ex.DevicePreprocess([("resize", size, None, mode)] + ([("crop", crop)] if crop else []), None, None, (0, 0))._batch(x)[0] * 255
    assert ours.shape == pil.shape
    differ = (ours - pil).abs()
    assert differ.max() < 2 + 1e-3 and differ.mean() < 0.25  # a tie rounded the other way in the first pass moves the second by at most 2


@settings(max_examples=100, deadline=None)
@given(n_in=st.integers(1, 300), n_out=st.integers(1, 300), mode=st.sampled_from(["bilinear", "bicubic"]), cut=st.tuples(st.floats(0, 1), st.floats(0, 1)))
def test_pil_weights_are_the_weights_of_torchs_port_of_pils_filters(n_in, n_out, mode, cut):
    start = int(cut[0] * (n_out - 1))
    stop = start + 1 + int(cut[1] * (n_out - 1 - start))  # at least one output
    first, w = ex.pil_weights(n_in, n_out, mode, start, stop)
    identity = torch.eye(n_in, dtype=torch.float64)[None, None]  # row i resized: input i's weight in every output
    theirs = torch.nn.functional.interpolate(identity, size=(n_in, n_out), mode=mode, antialias=True, align_corners=False)[0, 0, :, start:stop].numpy()
    ours = np.zeros_like(theirs)
    ours[first:first + len(w)] = w
    np.testing.assert_allclose(ours, theirs, atol=1e-12)
    assert w.shape[1] == stop - start
