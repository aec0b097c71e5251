"""Extraction from a prepared folder to an embedding cache: labels, prompts, shards, resuming after a kill (simulated and real), corruption, errors.

Every test runs the real code path offline: real image files (photographs bundled with scikit-image) in the data scripts'
layout, decoded by DataLoader workers and encoded by an open_clip ViT-S/32 with random weights.
"""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st
from PIL import Image
from skimage import data as skdata

import proton.models.extract as ex
from proton.bench.cache import EmbeddingCache
from proton.bench.prepared import read_prepared
from proton.models.extract import extract, extract_main, shard_path
from proton.models import load_vlm

MODEL = "open_clip:ViT-S-32/none"  # the smallest open_clip ViT at 224 px, with random weights (seed 0)
CLASSES = ["normal", "diabetic_retinopathy"]
NAMES = ["normal", "diabetic retinopathy"]
IMAGES = {  # relative path -> image; PNG and JPEG, colour, grey and RGBA, one upper-case suffix as Imagenette has
    "id/normal/retina.png": skdata.retina, "id/normal/moon.png": skdata.moon, "id/normal/coins.png": skdata.coins,
    "id/diabetic_retinopathy/microaneurysms.png": skdata.microaneurysms,
    "id/diabetic_retinopathy/ihc.jpg": skdata.immunohistochemistry,
    "semantic/glaucoma/camera.png": skdata.camera, "semantic/glaucoma/logo.png": skdata.logo,
    "covariate/uwf/hubble.jpg": skdata.hubble_deep_field,
    "far/tench/astronaut.jpg": skdata.astronaut, "far/tench/chelsea.jpg": skdata.chelsea,
    "far/church/coffee.jpg": skdata.coffee, "far/church/rocket.JPEG": skdata.rocket,
}
N = len(IMAGES)
RUN = dict(batch_size=2, shard_size=2, num_workers=1, progress=False)  # 6 shards; the same batches in every test
EPOCH = "1767225600"  # SOURCE_DATE_EPOCH: a fixed creation time makes caches of separate runs comparable byte for byte


def make_prepared(root, split=True, classes=True):
    "A prepared folder of the 12 bundled images, at most 64 px, with split.csv and classes.json as the data scripts write them."
    root = Path(root)
    rows = ["file,shift,label,source"]
    for rel, image in IMAGES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        im = Image.fromarray(image())
        im.thumbnail((64, 64))
        im.save(path, format="JPEG" if path.suffix.lower() in (".jpg", ".jpeg") else "PNG")
        rows.append(f"{rel},{rel.split('/')[0]},{rel.split('/')[1]},skimage")
    if split: (root / "split.csv").write_text("\n".join(rows) + "\n")
    if classes:
        (root / "classes.json").write_text(json.dumps(dict(benchmark="toy", classes=CLASSES, class_names=NAMES,
                                                           prompts={c: [n] for c, n in zip(CLASSES, NAMES)})))
    return root


def expected_rows():
    "Sorted files with the shift and label each must get, derived from the paths alone."
    files = sorted(IMAGES)
    shift = [f.split("/")[0] for f in files]
    labels = [CLASSES.index(f.split("/")[1]) if s == "id" else -1 for f, s in zip(files, shift)]
    return files, shift, labels


def same_cache(a, b):
    "Whether two caches hold bitwise identical arrays and the same metadata."
    return (a.image_embeddings.tobytes() == b.image_embeddings.tobytes()
            and a.text_embeddings.tobytes() == b.text_embeddings.tobytes()
            and a.content_hash() == b.content_hash())


@pytest.fixture(scope="module")
def clip():
    return load_vlm(MODEL)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_prepared(tmp_path_factory.mktemp("prepared") / "toy")


@pytest.fixture(scope="module")
def reference(clip, data, tmp_path_factory):
    "The uninterrupted run: (its cache file, the cache)."
    out = tmp_path_factory.mktemp("reference") / "cache.npz"
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SOURCE_DATE_EPOCH", EPOCH)
        cache = extract(clip, data, out=out, **RUN)
    return out, cache


@pytest.fixture
def counted(monkeypatch):
    "Names of the shards written from now on (the real writer still writes them)."
    written, real = [], ex._write_shard
    def write(path, arrays, header):
        real(path, arrays, header)
        written.append(path.name)
    monkeypatch.setattr(ex, "_write_shard", write)
    return written


# --- the cache -------------------------------------------------------------------------------------------------------

def test_cache_has_the_folders_labels_shifts_and_sources(clip, data, reference):
    out, cache = reference
    loaded = EmbeddingCache.load(out)
    files, shift, labels = expected_rows()
    assert loaded.source == tuple(files)
    assert loaded.shift.tolist() == shift and loaded.labels.tolist() == labels
    assert loaded.class_names == tuple(NAMES) and loaded.temperature == clip.temperature
    assert loaded.image_embeddings.shape == (N, clip.dim) and loaded.image_embeddings.dtype == np.float32
    assert loaded.local_embeddings is None
    assert same_cache(loaded, cache)
    assert not Path(f"{out}.shards").exists()


def test_embeddings_are_the_models_own(clip, data, reference):
    "Through files, workers and shards, every row is what encode_images gives for that image."
    _, cache = reference
    direct = clip.encode_images([Image.open(data / f) for f in cache.source])
    np.testing.assert_allclose(cache.image_embeddings, direct.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(cache.text_embeddings, clip.encode_text(NAMES).numpy(), atol=1e-5, rtol=0)
    assert (cache.image_embeddings @ cache.image_embeddings.T - np.eye(N)).max() < 0.9999  # distinct images, distinct rows


def test_metadata_records_provenance(clip, reference):
    from proton import __version__
    m = reference[1].metadata
    assert m["model"] == MODEL and m["checkpoint"] is None and m["n_images"] == N
    assert m["prompts"] == {n: [n] for n in NAMES} and m["prompt_source"] == "classes.json"
    assert m["library_version"] == __version__ and m["created"] == "2026-01-01T00:00:00+00:00"
    assert "Resize(size=224" in m["preprocessing"] and m["image_size"] == [224, 224]
    assert m["images_per_shift"] == {"covariate": 1, "far": 4, "id": 5, "semantic": 2}
    assert m["dataset"] == "toy" and m["device"] == "cpu" and m["amp"] == "none"


def test_the_device_is_recorded_by_its_kind_so_torchrun_and_one_process_agree(data, reference, tmp_path, monkeypatch):
    "The metadata recorded str(device): one process on `cuda` wrote 'cuda', torchrun's rank 0 on `cuda:0` 'cuda:0', so their caches differed (seen here as cpu against cpu:0)."
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    indexed = extract(MODEL, data, out=tmp_path / "c.npz", device="cpu:0", **RUN)
    assert indexed.metadata["device"] == "cpu" and same_cache(indexed, reference[1])

def test_checkpoint_name_and_hash_are_recorded(clip, data, tmp_path):
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"not really weights, but a file with a hash")
    cache = extract(clip, data, checkpoint=weights, **RUN)
    import hashlib
    assert cache.metadata["checkpoint"] == "weights.safetensors"
    assert cache.metadata["checkpoint_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()


def test_weights_named_in_the_model_are_hashed_like_a_checkpoint(clip, data, tmp_path, monkeypatch):
    """A weights file named inside the model (open_clip:<arch>/<file>) is part of the run fingerprint and of the metadata:
    after the file changes, a resumed run recomputes its kept shards instead of mixing old image embeddings with new text ones."""
    from proton.models.extract import file_sha256
    from proton.models.vlm import load_open_clip
    weights = tmp_path / "wdir" / "model.pt"
    weights.parent.mkdir()
    torch.save(clip.model.state_dict(), weights)
    spec, out = f"open_clip:ViT-S-32/{weights}", tmp_path / "c.npz"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    first = extract(spec, data, out=out, keep_shards=True, **RUN)
    first_sha256 = file_sha256(weights)
    torch.save(load_open_clip("ViT-S-32", None, seed=1).model.state_dict(), weights)  # other weights under the same name
    with pytest.warns(UserWarning, match=r"recomputing shard \d+: .* belongs to another run \(differs in \['run'\]\)"):
        resumed = extract(spec, data, out=out, **RUN)
    fresh = extract(spec, data, **RUN)
    assert same_cache(resumed, fresh) and not np.allclose(resumed.image_embeddings, first.image_embeddings)
    assert first.metadata["checkpoint"] == "model.pt" and first.metadata["checkpoint_sha256"] == first_sha256
    assert resumed.metadata["checkpoint_sha256"] == file_sha256(weights) != first_sha256

def test_local_embeddings(clip, data):
    cache = extract(clip, data, local=True, **RUN)
    files = list(cache.source)
    assert cache.local_embeddings.shape == (N, 49, clip.dim)
    direct = clip.encode_local([Image.open(data / f) for f in files[:3]])
    np.testing.assert_allclose(cache.local_embeddings[:3], direct.numpy(), atol=1e-5, rtol=0)


def test_folder_without_split_and_classes(clip, tmp_path):
    root = make_prepared(tmp_path / "bare", split=False, classes=False)
    folder = read_prepared(root)
    assert folder.classes == ("diabetic_retinopathy", "normal") and set(folder.sources) == {""}
    cache = extract(clip, root, **RUN)
    assert cache.class_names == ("diabetic_retinopathy", "normal")
    assert [cache.class_names[y] for y, s in zip(cache.labels, cache.shift) if s == "id"] == \
           [f.split("/")[1] for f in cache.source if f.startswith("id/")]


def test_a_prepared_folder_edited_in_a_spreadsheet_is_read(tmp_path):
    "Excel's 'CSV UTF-8' and Windows editors start the file with a byte order mark; it is not part of the first column's name."
    root = make_prepared(tmp_path / "edited")
    for name in ("split.csv", "classes.json"):
        (root / name).write_bytes("\ufeff".encode() + (root / name).read_bytes().replace(b"\n", b"\r\n"))
    folder = read_prepared(root)
    assert folder.classes == tuple(CLASSES) and set(folder.sources) == {"skimage"} and len(folder.files) == len(IMAGES)


def test_dicom_files_in_a_prepared_folder_are_extracted(clip, tmp_path):
    "A labelled radiology folder of DICOM files is a prepared folder: its .dcm files are images, read as `read_image` reads them."
    pytest.importorskip("pydicom")
    from test_dicom import write_dicom
    from proton.models.vlm import read_image
    root = make_prepared(tmp_path / "dicom", split=False, classes=False)
    scan = write_dicom(root / "id" / "normal" / "scan.dcm", np.linspace(0, 4095, 48 * 40).reshape(48, 40).astype(np.uint16))
    assert "id/normal/scan.dcm" in read_prepared(root).files
    cache = extract(clip, root, **RUN)
    i = list(cache.source).index("id/normal/scan.dcm")
    assert cache.class_names[cache.labels[i]] == "normal"
    np.testing.assert_allclose(cache.image_embeddings[i], clip.encode_images([read_image(scan)])[0].numpy(), atol=1e-5, rtol=0)


# --- prompts ---------------------------------------------------------------------------------------------------------

def test_prompt_ensemble_from_a_json_file(clip, data, tmp_path):
    prompts = {"diabetic retinopathy": ["retinopathy", "a retina with lesions"], "normal": ["a healthy retina"]}
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts))
    cache = extract(clip, data, prompts=path, **RUN)
    E = clip.encode_text(prompts["diabetic retinopathy"])
    mean = torch.nn.functional.normalize(E.mean(0), dim=0)
    np.testing.assert_allclose(cache.text_embeddings[1], mean.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(cache.text_embeddings[0], clip.encode_text(["a healthy retina"])[0].numpy(), atol=1e-5, rtol=0)
    assert cache.metadata["prompt_source"] == "prompts.json"
    assert list(cache.metadata["prompts"]) == NAMES  # label order, whatever the file's order


def test_prompts_on_the_command_line(data, tmp_path, capsys):
    out = tmp_path / "c.npz"
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", str(out), "--prompts", "healthy, diseased",
                         "--workers", "0", "--no-progress"]) == 0
    assert EmbeddingCache.load(out).metadata["prompts"] == {"normal": ["healthy"], "diabetic retinopathy": ["diseased"]}
    lines = tmp_path / "prompts.txt"
    lines.write_text("# a comment\nfirst\nsecond\n")
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", str(out), "--prompts", str(lines),
                         "--workers", "0", "--no-progress"]) == 0
    assert EmbeddingCache.load(out).metadata["prompts"] == {"normal": ["first"], "diabetic retinopathy": ["second"]}
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", str(out), "--prompts", "only one"]) == 1
    assert "got 1 prompts for 2 classes" in capsys.readouterr().err


def test_a_text_prompt_file_is_one_prompt_per_line_even_when_a_prompt_begins_with_a_bracket(tmp_path):
    "Only a .json file is JSON: a .txt file whose first prompt begins with [ or { is still one prompt per line."
    lines = tmp_path / "prompts.txt"
    lines.write_text("[normal] a fundus photograph\n{dr} a fundus photograph with lesions\n")
    assert ex.read_prompt_file(lines) == ["[normal] a fundus photograph", "{dr} a fundus photograph with lesions"]
    as_json = tmp_path / "prompts.json"
    as_json.write_text('["first", "second"]')
    assert ex.read_prompt_file(as_json) == ["first", "second"]
    as_json.write_text("[normal] a fundus photograph\n")
    with pytest.raises(ValueError, match="is not valid JSON"): ex.read_prompt_file(as_json)

# --- resuming --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("killed_after", [1, 4])
def test_resume_after_a_failure_gives_the_identical_cache(clip, data, reference, tmp_path, monkeypatch, killed_after):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    out, written, real = tmp_path / "cache.npz", [], ex._write_shard

    def dying(path, arrays, header):
        if len(written) == killed_after: raise KeyboardInterrupt("simulated kill")
        real(path, arrays, header)
        written.append(path.name)

    monkeypatch.setattr(ex, "_write_shard", dying)
    with pytest.raises(KeyboardInterrupt): extract(clip, data, out=out, **RUN)
    assert not out.exists()
    assert sorted(p.name for p in Path(f"{out}.shards").iterdir()) == [f"shard-{k:05d}.npz" for k in range(killed_after)]
    written.clear()
    monkeypatch.setattr(ex, "_write_shard", lambda *a: (real(*a), written.append(a[0].name)))
    resumed = extract(clip, data, out=out, **RUN)
    assert written == [f"shard-{k:05d}.npz" for k in range(killed_after, N // 2)]  # only the missing shards
    assert same_cache(resumed, reference[1]) and same_cache(EmbeddingCache.load(out), reference[1])


def test_sigkilled_process_resumes_to_the_identical_cache(data, reference, tmp_path):
    "A real `proton-ood extract` process, SIGKILLed once its first shard is on disk, then run again."
    out = tmp_path / "killed.npz"
    shards = Path(f"{out}.shards")
    command = [sys.executable, "-c", "import sys; from proton.cli import main; sys.exit(main())", "extract",
               "--model", MODEL, "--data", str(data), "--out", str(out), "--batch-size", "2", "--shard-size", "2",
               "--workers", "1", "--no-progress", "--keep-shards"]
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not shard_path(shards, 0).exists():
            assert proc.poll() is None, f"the run ended before writing a shard: {proc.communicate()}"
            assert time.monotonic() < deadline, "no shard after 300 s"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)  # the process group we started: the run and its DataLoader worker
    finally:
        proc.wait(timeout=60)
        proc.stdout.close(); proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    done = sorted(shards.glob("shard-*.npz"))
    assert not out.exists() and 1 <= len(done) < N // 2, f"the kill did not land mid-run: {[p.name for p in done]}"
    first = shard_path(shards, 0).stat().st_ino
    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert shard_path(shards, 0).stat().st_ino == first  # reused, not rewritten
    assert not list(shards.glob(".*.tmp"))
    assert same_cache(EmbeddingCache.load(out), reference[1])


def test_the_temporary_cache_file_of_a_killed_run_is_removed_by_the_next(clip, data, reference, tmp_path, monkeypatch):
    "A run killed while it wrote the cache left `.<name>.<hex>.tmp`, as big as the cache, beside it for good: the next run removes it, and nothing else."
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    out, stale, kept = tmp_path / "cache.npz", tmp_path / ".cache.npz.0123456789ab.tmp", tmp_path / ".other.npz.0123456789ab.tmp"
    for p in (stale, kept): p.write_bytes(b"half a cache")
    assert same_cache(extract(clip, data, out=out, **RUN), reference[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["cache.npz", kept.name])


def test_corrupt_and_truncated_shards_are_recomputed(clip, data, reference, tmp_path, monkeypatch, counted):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    out = tmp_path / "cache.npz"
    extract(clip, data, out=out, keep_shards=True, **RUN)
    shards = Path(f"{out}.shards")
    damaged, truncated = shard_path(shards, 1), shard_path(shards, 4)
    raw = bytearray(damaged.read_bytes())
    at = raw.index(np.load(damaged)["image_embeddings"].tobytes()) + 100
    raw[at] ^= 0x01  # a single flipped bit in the stored embeddings
    damaged.write_bytes(raw)
    truncated.write_bytes(truncated.read_bytes()[:-300])
    (shards / ".shard-00005.npz.0123456789ab.tmp").write_bytes(b"half a shard")  # left by a killed write
    counted.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repaired = extract(clip, data, out=out, **RUN)
    assert sorted(counted) == ["shard-00001.npz", "shard-00004.npz"]
    messages = sorted(str(w.message) for w in caught if issubclass(w.category, UserWarning))
    assert len(messages) == 2 and "recomputing shard 1" in messages[0] and "recomputing shard 4" in messages[1]
    assert "checksum mismatch" in messages[0]
    assert same_cache(repaired, reference[1])
    assert not shards.exists()


def test_shards_of_another_run_are_not_reused(clip, data, tmp_path, counted):
    out = tmp_path / "cache.npz"
    extract(clip, data, out=out, keep_shards=True, **RUN)
    counted.clear()
    with pytest.warns(UserWarning, match="belongs to another run"):
        cache = extract(clip, data, out=out, local=True, keep_shards=True, **RUN)  # local features: another fingerprint
    assert len(counted) == N // 2 and cache.local_embeddings is not None
    counted.clear()
    extract(clip, data, out=out, local=True, resume=False, **RUN)
    assert len(counted) == N // 2  # --no-resume recomputes everything


def test_touched_image_invalidates_shards(clip, data, tmp_path, counted):
    out = tmp_path / "cache.npz"
    extract(clip, data, out=out, keep_shards=True, **RUN)
    counted.clear()
    image = data / sorted(IMAGES)[0]
    stat = image.stat()
    try:
        os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        with pytest.warns(UserWarning):
            extract(clip, data, out=out, **RUN)
    finally: os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert len(counted) == N // 2


# --- errors ----------------------------------------------------------------------------------------------------------

def test_missing_class_folder(tmp_path):
    root = make_prepared(tmp_path / "d", split=False)
    info = json.loads((root / "classes.json").read_text())
    (root / "classes.json").write_text(json.dumps({**info, "classes": CLASSES + ["glaucoma"], "class_names": NAMES + ["glaucoma"]}))
    with pytest.raises(ValueError, match="missing class folder: classes.json lists class 'glaucoma'"): read_prepared(root)


def test_two_classes_with_one_name_are_refused_before_any_image_is_read(tmp_path):
    "A cache names each class once: class_names that repeat one are refused when the folder is read, before any image is encoded, and nothing is written."
    root = make_prepared(tmp_path / "d")
    info = json.loads((root / "classes.json").read_text())
    (root / "classes.json").write_text(json.dumps({**info, "class_names": ["retina", "retina"]}))
    with pytest.raises(ValueError, match="classes.json: class 'retina' is named twice"): read_prepared(root)
    with pytest.raises(ValueError, match="named twice"): extract(MODEL, root, out=tmp_path / "c.npz", device="cpu", **{**RUN, "num_workers": 0})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"], "no cache and no shard folder"


def test_empty_and_absent_folders(clip, tmp_path):
    (tmp_path / "empty" / "id").mkdir(parents=True)
    with pytest.raises(ValueError, match="no images in"): extract(clip, tmp_path / "empty", progress=False)
    with pytest.raises(FileNotFoundError, match="no prepared folder"): extract(clip, tmp_path / "absent", progress=False)


def test_only_ood_images(tmp_path):
    root = make_prepared(tmp_path / "d", split=False, classes=False)
    import shutil
    shutil.rmtree(root / "id")
    with pytest.raises(ValueError, match="no ID images"): read_prepared(root)


def test_split_file_must_match_the_disk(tmp_path):
    root = make_prepared(tmp_path / "d")
    (root / "far/tench/astronaut.jpg").rename(root / "far/church/astronaut.jpg")
    with pytest.raises(FileNotFoundError, match="not on disk"): read_prepared(root)
    csv = (root / "split.csv").read_text().replace("far/tench/astronaut.jpg,far,tench", "far/church/astronaut.jpg,far,tench")
    (root / "split.csv").write_text(csv)
    with pytest.raises(ValueError, match="is not in far/tench/"): read_prepared(root)


def test_a_dicom_file_without_a_suffix_is_an_image_of_the_folder(tmp_path):
    "A PACS export names its files IM0001: the DICM marker makes such a file an image, as for `proton-ood score`; a file without it, or DICOMDIR, is not one."
    pytest.importorskip("pydicom")
    from test_dicom import write_dicom
    root = make_prepared(tmp_path / "d", split=False)
    write_dicom(root / "id/normal/IM0001", np.zeros((8, 8), np.uint16)); write_dicom(root / "id/normal/DICOMDIR", np.zeros((8, 8), np.uint16))
    (root / "id/normal/notes").write_text("not an image"); (root / "far/tench/zeros").write_bytes(b"\0" * 200)
    folder = read_prepared(root)
    assert len(folder) == N + 1 and folder.labels[folder.files.index("id/normal/IM0001")] == CLASSES.index("normal")
    make_prepared(root)  # with split.csv, which must then name it
    with pytest.raises(ValueError, match=r"not listed in split.csv, e.g. \['id/normal/IM0001'\]"): read_prepared(root)
    with open(root / "split.csv", "a") as f: f.write("id/normal/IM0001,id,normal,pacs\n")
    assert read_prepared(root).sources[folder.files.index("id/normal/IM0001")] == "pacs"


@pytest.mark.parametrize("resize, warned", [({"short_side": 50, "resampling": "PIL bicubic"}, True), (50, True), (224, False)])
def test_a_folder_stored_below_the_models_input_is_said_and_recorded(tmp_path, capsys, resize, warned):
    """The data scripts' --resize N records N in classes.json; a folder stored below the model's input was upsampled unsaid,
    and the cache did not record the size its images were stored at."""
    data = make_prepared(tmp_path / "data")
    info = json.loads((data / "classes.json").read_text())
    (data / "classes.json").write_text(json.dumps(info | {"resize": resize}))
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", str(tmp_path / "c.npz"), "--workers", "0", "--no-progress"]) == 0
    err = capsys.readouterr().err
    said = re.findall(r"^proton-ood extract: warning: .*$", err, re.M)
    assert bool([w for w in said if "stored at 50 pixels (--resize 50)" in w and "input of 224 pixels" in w]) == warned, err
    assert EmbeddingCache.load(tmp_path / "c.npz").metadata["resize"] == (50 if warned else 224)


def test_unknown_model(data, tmp_path, capsys):
    assert extract_main(["--model", "biomedclip", "--data", str(data), "--out", str(tmp_path / "c.npz")]) == 1
    err = capsys.readouterr().err
    assert "unknown VLM 'biomedclip'" in err and "flair" in err
    with pytest.raises(ValueError, match="unknown VLM"): extract("biomedclip", data, progress=False)
    assert not (tmp_path / "c.npz").exists()


def test_random_unimed_weights_from_the_command_line(data, tmp_path, monkeypatch):
    "--checkpoint none, as load_unimed's own error advises, was refused: 'no checkpoint file or folder at none'."
    import functools
    import proton.models.unimed as unimed
    from test_vlm import SMALL
    monkeypatch.setattr(unimed, "load_unimed", functools.partial(unimed.load_unimed, config=SMALL))  # a small model: the same path, in seconds
    (tmp_path / "vocab").mkdir(); (tmp_path / "vocab" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "normal", "diabetic"]) + "\n")
    out = tmp_path / "c.npz"
    assert extract_main(["--model", "unimed-clip", "--checkpoint", "none", "--tokenizer", str(tmp_path / "vocab"), "--data", str(data),
                         "--out", str(out), "--device", "cpu", "--workers", "0", "--no-progress"]) == 0
    md = EmbeddingCache.load(out).metadata
    assert (md["model"], md["checkpoint"], md["checkpoint_sha256"]) == ("unimed-clip", None, None)


def test_command_line_errors(data, tmp_path, capsys):
    out = str(tmp_path / "c.npz")
    assert extract_main(["--model", MODEL, "--data", str(tmp_path / "nowhere"), "--out", out]) == 1
    assert "no prepared folder" in capsys.readouterr().err
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", out, "--tokenizer", str(tmp_path)]) == 1
    assert "a tokenizer is for flair and unimed-clip" in capsys.readouterr().err
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", out, "--prompts", str(tmp_path / "p.json")]) == 1
    assert "no prompt file" in capsys.readouterr().err
    with pytest.raises(SystemExit): extract_main(["--data", str(data), "--out", out])  # --model is required
    if not torch.cuda.is_available():
        assert extract_main(["--model", MODEL, "--data", str(data), "--out", out, "--device", "cuda"]) == 1
        assert "CUDA is not available" in capsys.readouterr().err
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", out, "--device", "tpu"]) == 1
    assert capsys.readouterr().err == "proton-ood extract: error: unknown device 'tpu': use cpu, cuda or cuda:N\n"


def test_unreadable_images_are_skipped_and_reported_or_refused_in_strict_mode(clip, tmp_path):
    from PIL import Image as PILImage
    root = make_prepared(tmp_path / "d", split=False)
    (root / "far/tench/chelsea.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a real jpeg")
    (root / "far/church/coffee.jpg").write_bytes((root / "far/church/coffee.jpg").read_bytes()[:200])  # truncated
    with pytest.warns(UserWarning, match="2 of 12 images could not be read"): cache = extract(clip, root, **RUN)
    skipped = cache.metadata["skipped_files"]
    assert [s["file"] for s in skipped] == ["far/church/coffee.jpg", "far/tench/chelsea.jpg"] and all(s["error"] for s in skipped)
    assert len(cache) == N - 2 and "far/tench/chelsea.jpg" not in cache.source
    with pytest.raises(ValueError, match="cannot read image .*coffee.jpg"): extract(clip, root, strict=True, **RUN)


def test_an_unreadable_images_recorded_error_does_not_depend_on_how_the_folder_was_named(clip, tmp_path, monkeypatch):
    "PIL's error names the file as it was opened: the folder named relatively and absolutely gave two caches, and a resumed run mixed both spellings."
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    monkeypatch.chdir(tmp_path)
    root = make_prepared(tmp_path / "d", split=False)
    (root / "far/tench/chelsea.jpg").write_bytes(b"not an image")
    with pytest.warns(UserWarning, match="1 of 12 images could not be read"): relative = extract(clip, "d", **RUN)
    with pytest.warns(UserWarning, match="1 of 12 images could not be read"): absolute = extract(clip, root, **RUN)
    assert relative.metadata["skipped_files"] == [dict(file="far/tench/chelsea.jpg", error="UnidentifiedImageError: cannot identify image file 'far/tench/chelsea.jpg'")]
    assert relative.content_hash() == absolute.content_hash()


def test_an_unreadable_image_is_named_once_in_the_strict_error(clip, tmp_path):
    "PIL's error names the file itself: 'cannot read image P: cannot identify image file 'P'', read from the image or from a kept shard."
    root = make_prepared(tmp_path / "d", split=False)
    moon = root / "id/normal/moon.png"
    moon.write_bytes(b"\x89PNG\r\n\x1a\n half copied")
    with pytest.raises(ValueError, match="cannot read image") as read: extract(clip, root, strict=True, **dict(RUN, num_workers=0))
    with pytest.warns(UserWarning, match="1 of 12 images could not be read"): extract(clip, root, out=tmp_path / "c.npz", keep_shards=True, **RUN)
    with pytest.raises(ValueError, match="cannot read image") as kept: extract(clip, root, out=tmp_path / "c.npz", strict=True, **RUN)
    for e in (read.value, kept.value): assert str(e).count(str(moon)) == 1, f"the file is named more than once: {e}"


def test_a_decompression_bomb_is_named(clip, tmp_path, monkeypatch):
    from PIL import Image as PILImage
    root = make_prepared(tmp_path / "d", split=False)
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 100)  # every image is now a "bomb" (over twice the limit)
    with pytest.raises(ValueError, match="cannot read image .*: Image size"): extract(clip, root, strict=True, **dict(RUN, num_workers=0))


def test_bad_arguments(clip, data):
    with pytest.raises(ValueError, match="batch_size must be an integer from 1 to 65536, got 0"): extract(clip, data, batch_size=0, progress=False)
    with pytest.raises(ValueError, match="shard_size"): extract(clip, data, shard_size=1.5, progress=False)
    with pytest.raises(ValueError, match="the model runs on cpu"): extract(clip, data, device="cuda", progress=False)


def test_preprocessing_travels_without_the_weights(clip, data):
    import pickle
    pre = ex._Preprocess(clip)
    image = Image.open(data / "far/tench/astronaut.jpg")
    assert torch.equal(pickle.loads(pickle.dumps(pre))(image), clip.preprocess(image))
    assert clip.model is not None  # the original keeps its model
    assert len(pickle.dumps(pre)) < 4 * sum(p.numel() for p in clip.model.parameters()) / 50


def test_open_clip_images_cross_as_pixels_and_are_normalised_where_the_model_runs(clip, data, tmp_path):
    import pickle
    pre, image = ex._Preprocess(clip), Image.open(data / "far/tench/astronaut.jpg")
    p = pickle.loads(pickle.dumps(pre)).pixels(image)  # as a worker computes it
    assert p.dtype == torch.uint8 and p.shape == (3, 224, 224) and pre.normalise[0][0] == pytest.approx(0.48145466)
    assert torch.equal(ex.as_float_batch(p[None], pre.normalise)[0], clip.preprocess(image))  # bit for bit, a quarter of the bytes
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(40))
    files = ex.ImageFiles(data, ["far/tench/astronaut.jpg"], pre, (3, 224, 224), pixels=pre.pixels)
    broken = ex.ImageFiles(tmp_path, ["broken.png"], pre, (3, 224, 224), pixels=pre.pixels)
    batch, errors = ex.collate_images([files[0], broken[0]])
    assert batch.dtype == torch.uint8 and errors[0] == "" and errors[1]  # an unreadable file's zeros keep the batch pixels


@pytest.mark.parametrize("change", ["a step after Normalize", "a preprocess that is not its transform", "FLAIR-like pixels of its own"])
def test_images_cross_as_floats_where_pixels_would_not_give_the_preprocess(clip, data, change):
    import copy, torchvision.transforms as T
    odd, image = copy.copy(clip), Image.open(data / "far/tench/astronaut.jpg")
    if change == "a step after Normalize": odd.transform = T.Compose([*clip.transform.transforms, T.RandomHorizontalFlip(p=1)])
    elif change == "a preprocess that is not its transform": odd.preprocess = lambda im: clip.preprocess(im.transpose(Image.Transpose.FLIP_LEFT_RIGHT))
    else: odd.pixels = lambda im: None  # a backend that defines pixels decides alone
    pre = ex._Preprocess(odd)
    assert pre.normalise is None and pre.pixels(image) is None and torch.equal(pre(image), odd.preprocess(image))


def test_out_of_gpu_memory_advises_a_smaller_batch(data, tmp_path, monkeypatch, capsys):
    def oom(*args, **kwargs): raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(ex, "extract", oom)
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", str(tmp_path / "c.npz"), "--batch-size", "512"]) == 1
    assert "ran out of memory with --batch-size 512" in capsys.readouterr().err


def test_dispatched_by_proton_ood(capsys):
    from proton.cli import main
    with pytest.raises(SystemExit) as e: main(["extract", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: proton-ood extract") and all(o in out for o in ("--prompts", "--checkpoint", "--tokenizer",
                                                                                   "--device", "--batch-size", "--workers", "--keep-shards"))


def test_fit_images_become_the_fit_split_and_prompt_sets_are_read_from_the_folder(clip, tmp_path):
    "fit/<class>/ images go to the cache's fit split, not to its test rows; prompt_sets.json becomes prompt sets, TAG's added."
    from proton.bench.prepared import write_prompt_sets
    root = make_prepared(tmp_path / "toy")
    rows = (root / "split.csv").read_text().splitlines()
    for name, image in (("fit/normal/text.png", skdata.text), ("fit/diabetic_retinopathy/horse.png", skdata.horse)):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray((np.asarray(image()) * (255 if np.asarray(image()).dtype == bool else 1)).astype(np.uint8)).save(path)
        rows.append(f"{name},fit,{name.split('/')[1]},skimage")
    (root / "split.csv").write_text("\n".join(rows) + "\n")
    write_prompt_sets(root, {"L1": {"normal": ["a normal fundus"], "diabetic_retinopathy": ["a fundus with lesions"]}})
    cache = extract(clip, root, **RUN)
    assert len(cache) == N and "fit" not in set(cache.shift)
    assert cache.fit_labels.tolist() == [1, 0]  # sorted paths: fit/diabetic_retinopathy/... first
    assert np.abs(cache.fit_embeddings[1] - clip.encode_images([Image.open(root / "fit/normal/text.png")]).numpy()[0]).max() < 1e-5
    assert cache.prompt_set_names == ("L1", "tag") and cache.prompts[:2] == ("a normal fundus", "a fundus with lesions")


@pytest.mark.parametrize("decoding", [[], ["--decode-on-device", "--worker-share", "0.5"]], ids=["workers", "device-and-workers"])
def test_torchrun_with_two_gloo_processes_gives_the_single_process_cache(data, tmp_path, decoding):
    "Two ranks share the shards (torch.distributed, gloo, on the CPU); the merged cache is the single-process one, bit for bit."
    env = dict(os.environ, SOURCE_DATE_EPOCH=EPOCH, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    common = ["extract", "--model", MODEL, "--data", str(data), "--batch-size", "2", "--shard-size", "2", "--workers", "0",
              "--device", "cpu", "--no-progress", *decoding]  # which files the workers decode depends on their place, not on the rank
    command = Path(sys.executable).with_name("proton-ood")  # the console script, which torchrun runs as a Python file
    single = subprocess.run([sys.executable, str(command), *common, "--out", str(tmp_path / "one.npz")], env=env, capture_output=True, text=True)
    assert single.returncode == 0, single.stderr
    torchrun = Path(sys.executable).with_name("torchrun")
    two = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(command), *common, "--out", str(tmp_path / "two.npz")],
                         env=env, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("wrote ") == 1  # rank 0 reports for both
    a, b = EmbeddingCache.load(tmp_path / "one.npz"), EmbeddingCache.load(tmp_path / "two.npz")
    assert a.content_hash() == b.content_hash() and not (tmp_path / "two.npz.shards").exists()


def test_flair_images_at_its_input_size_cross_as_pixels_and_embed_as_the_model_does(tmp_path, monkeypatch):
    from proton.models.flair import FLAIR, load_flair_tokenizer, random_flair
    vocab = tmp_path / "vocab"
    vocab.mkdir()
    (vocab / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "normal", "glaucoma"]) + "\n")
    flair, rng, root = FLAIR(random_flair(0), load_flair_tokenizer(vocab)), np.random.default_rng(0), tmp_path / "prepared"
    for i, shape in enumerate([(512, 512, 3), (512, 400, 3), (300, 200, 3), (512, 512, 3)]):  # the third one needs resizing
        path = root / "id" / ("normal" if i % 2 else "glaucoma") / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)
    dtypes, collate = [], ex.collate_images
    monkeypatch.setattr(ex, "collate_images", lambda items: (dtypes.append((out := collate(items))[0].dtype), out)[1])
    cache = extract(flair, root, batch_size=2, num_workers=0, progress=False)
    assert dtypes == [torch.float32, torch.uint8]  # files 0 and 2 (glaucoma; 2 needs resizing), then 1 and 3 (normal): only pixels
    direct = flair.encode_images([Image.open(root / f) for f in cache.source])
    assert np.abs(cache.image_embeddings - direct.numpy()).max() < 1e-5


def test_an_out_that_is_a_folder_is_refused_before_any_image_is_encoded(clip, data, tmp_path, counted):
    "The cache is written last: a folder as --out would fail there, after every image, with the shards beside a name the next run would not give."
    (tmp_path / "caches").mkdir()
    with pytest.raises(ValueError, match=r"caches is a folder: name the cache file to write, e\.g\. .*caches/\w+\.npz"):
        extract(clip, data, out=tmp_path / "caches", num_workers=0, progress=False)
    assert counted == [] and sorted(p.name for p in tmp_path.iterdir()) == ["caches"]


def test_a_model_with_other_weights_under_the_same_name_does_not_reuse_the_shards(data, tmp_path, monkeypatch):
    "load_vlm('open_clip:<arch>/', checkpoint=...) names no weights; the shards of one checkpoint were reused by another, silently."
    from proton.models.vlm import load_open_clip
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    for seed in (0, 1): torch.save(load_open_clip("ViT-S-32", None, seed=seed).model.state_dict(), tmp_path / f"w{seed}.pt")
    a, b = (load_vlm("open_clip:ViT-S-32/", tmp_path / f"w{seed}.pt") for seed in (0, 1))
    assert a.name == b.name
    extract(a, data, out=tmp_path / "c.npz", keep_shards=True, **RUN)
    with pytest.warns(UserWarning, match="belongs to another run"): resumed = extract(b, data, out=tmp_path / "c.npz", **RUN)
    assert same_cache(resumed, extract(b, data, **RUN))


def test_shards_of_local_features_of_another_kind_are_not_reused(clip, data, tmp_path, monkeypatch):
    """ViT local features changed (final-layer patch tokens, then GL-MCM's value path) with nothing in the run fingerprint: a resumed run
    mixed a killed run's old local features with new ones and recorded the new kind, which reproduce's check then accepted."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    extract(clip, data, out=tmp_path / "c.npz", keep_shards=True, local=True, **RUN)
    monkeypatch.setattr(type(clip), "local_features", "another kind of local features")
    with pytest.warns(UserWarning, match=r"recomputing shard \d+: .* belongs to another run"): extract(clip, data, out=tmp_path / "c.npz", local=True, **RUN)


def test_torchrun_without_an_out_file_gives_every_rank_the_cache(data, tmp_path):
    "out=None: each rank made a scratch folder of its own and could not read the shards the others wrote."
    script = tmp_path / "run.py"
    script.write_text(f"""import torch.distributed as dist, sys
from proton.models import load_vlm
from proton.models.extract import extract
dist.init_process_group("gloo")
cache = extract(load_vlm({MODEL!r}), {str(data)!r}, batch_size=2, shard_size=2, num_workers=0, progress=False)
open(f"{str(tmp_path)}/rank{{dist.get_rank()}}.txt", "w").write(cache.content_hash())  # a file each: two ranks' prints can interleave
""")
    env = dict(os.environ, SOURCE_DATE_EPOCH=EPOCH, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    two = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2", str(script)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-2000:]
    hashes = {r: (tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)}
    assert len(set(hashes.values())) == 1 and len(hashes[0]) == 64


@pytest.mark.parametrize("args, env, message", [
    (["--batch-size", "0"], {}, "error: --batch-size must be an integer from 1 to 65536, got 0"),  # the option typed, not extract's argument
    (["--shard-size", "0"], {}, "error: --shard-size must be an integer from 1 to 1048576, got 0"),
    (["--workers", "-1"], {}, "error: --workers must be an integer from 0 to 1024, got -1"),
    (["--worker-share", "2"], {}, "error: --worker-share must be a number from 0 to 1"),
    (["--prompt-sets", "nope.json"], {}, "no prompt file at nope.json"),
    ([], {"SOURCE_DATE_EPOCH": "abc"}, "SOURCE_DATE_EPOCH must be an integer number of seconds, got 'abc'"),
    ([], {"SOURCE_DATE_EPOCH": "99999999999999999999"}, "SOURCE_DATE_EPOCH=99999999999999999999 is out of range"),
    (["--out", ""], {}, "name the cache file to write"),
])
def test_bad_options_are_named_before_the_model_loads(data, tmp_path, monkeypatch, capsys, args, env, message):
    "Each was named only once the model had loaded; a bad SOURCE_DATE_EPOCH only after every image was embedded."
    import proton.models.extract as module
    monkeypatch.setattr(module, "load_vlm", lambda *a, **k: pytest.fail("the model was loaded before the options were checked"))
    for k, v in env.items(): monkeypatch.setenv(k, v)
    out = [] if "--out" in args else ["--out", str(tmp_path / "c.npz")]
    assert module.extract_main(["--model", MODEL, "--data", str(data), "--device", "cpu", "--no-progress", *out, *args]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag, low, high", [("--batch-size", 1, 2**16), ("--shard-size", 1, 2**20), ("--workers", 0, 1024)])
@pytest.mark.parametrize("past", [False, True])
def test_a_size_past_its_bound_is_refused_in_one_line_before_the_model_loads(data, tmp_path, monkeypatch, capsys, flag, low, high, past):
    "--workers 1000000 went on to start a million DataLoader processes; past int64 the line said 'must be an integer of at least 1' of one."
    monkeypatch.setattr(ex, "load_vlm", lambda *a, **k: pytest.fail("the model was loaded before the options were checked"))
    v = 10**20 if past else high + 1
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", str(tmp_path / "c.npz"), "--device", "cpu", "--no-progress", flag, str(v)]) == 1
    assert capsys.readouterr().err == f"proton-ood extract: error: {flag} must be an integer from {low} to {high}, got {v}\n"  # the option typed
    assert not list(tmp_path.iterdir()), "no cache, shard or lock"


def test_sizes_at_their_bound_pass_the_check(data, tmp_path):
    ex.check_extract(data, out=tmp_path / "c.npz", batch_size=2**16, num_workers=1024, shard_size=2**20)


@pytest.mark.parametrize("rename, to, said", [  # "\udce4": a latin-1 "ä" (byte 0xe4) on disk, as os.fsdecode reads it
    ("", "Pr\udce4parat", "the prepared folder's name 'Pr\\udce4parat'"),
    ("id/normal", "id/norm\udce4l", "a class of the prepared folder 'norm\\udce4l'"),
    ("id/normal/moon.png", "id/normal/m\udce4\udce4n.png", "a file of the prepared folder 'id/normal/m\\udce4\\udce4n.png'"),
])
def test_names_that_are_not_utf8_are_refused_before_the_model_loads(tmp_path, monkeypatch, capsys, rename, to, said):
    "A folder, class or file name in latin-1 bytes: every image was embedded, then the save died with \"'utf-8' codec can't encode character '\\udce4'\"."
    monkeypatch.setattr(ex, "load_vlm", lambda *a, **k: pytest.fail("the model was loaded before the names were checked"))
    root = make_prepared(tmp_path / (to if not rename else "prep"), split=False, classes=False)
    if rename: (root / rename).rename(root / to)
    assert extract_main(["--model", MODEL, "--data", str(root), "--out", str(tmp_path / "c.npz"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"proton-ood extract: error: {said} is not UTF-8 text") and "rename it" in err and err.count("\n") == 1, err
    assert not (tmp_path / "c.npz").exists() and not (tmp_path / "c.npz.shards").exists()


@pytest.mark.parametrize("args, said", [  # what the metadata records besides the folder: "\udce9" a latin-1 "é", "\udce8" an "è"
    (["--prompts", "pr\udce9.txt"], "the prompt file's name 'pr\\udce9.txt'"),
    (["--model", "open_clip:ViT-S-32/", "--checkpoint", "mod\udce8le.pt"], "the weights' name 'mod\\udce8le.pt'"),
    (["--model", "open_clip:ViT-S-32/caf\udce9/w.pt"], "the model's name 'open_clip:ViT-S-32/caf\\udce9/w.pt'"),
    (["--prompts", "caf\udce9,dr"], "a prompt 'caf\\udce9'"),
])
def test_other_texts_of_the_metadata_that_are_not_utf8_are_refused_before_the_model_loads(tmp_path, monkeypatch, capsys, args, said):
    "The prompt file's name, the weights', a weights path in the model's name, a prompt: every image was embedded, then the save refused metadata['prompt_source'], ..."
    monkeypatch.setattr(ex, "load_vlm", lambda *a, **k: pytest.fail("the model was loaded before the names were checked"))
    monkeypatch.chdir(tmp_path)
    root = make_prepared("prep")
    Path("pr\udce9.txt").write_text("normal\ndr\n"); Path("mod\udce8le.pt").write_bytes(b"weights")
    Path("caf\udce9").mkdir(); Path("caf\udce9/w.pt").write_bytes(b"weights")
    assert extract_main(["--model", MODEL, "--data", str(root), "--out", "c.npz", "--no-progress", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"proton-ood extract: error: {said} is not UTF-8 text") and err.count("\n") == 1, err
    assert not Path("c.npz").exists() and not Path("c.npz.shards").exists()


def test_a_cache_in_a_folder_whose_name_is_not_utf8_is_reported_escaped(data, tmp_path):
    "Under a strict UTF-8 stdout (PYTHONIOENCODING=utf-8) the summary line naming --out failed once the cache was written: exit status 1."
    odd = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"))
    odd.mkdir()
    r = subprocess.run([str(Path(sys.executable).with_name("proton-ood")), "extract", "--model", MODEL, "--data", str(data), "--out", str(odd / "c.npz"),
                        "--device", "cpu", "--workers", "0", "--no-progress"], capture_output=True, env=dict(os.environ, PYTHONIOENCODING="utf-8"), timeout=600)
    assert r.returncode == 0 and b"caf\\udce9/c.npz" in r.stdout, r.stderr.decode(errors="backslashreplace")
    assert EmbeddingCache.load(odd / "c.npz").metadata["n_images"] == N


def test_a_folder_whose_test_images_are_all_unreadable_is_named(tmp_path):
    root = tmp_path / "p"
    for rel, content in {"fit/normal/a.png": None, "fit/glaucoma/b.png": None, "id/normal/c.png": b"junk", "id/glaucoma/d.png": b"junk"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if content is None: Image.new("RGB", (8, 8)).save(root / rel)
        else: (root / rel).write_bytes(content)
    with pytest.raises(ValueError, match=r"none of the 2 test images of .* could be read, e.g. .*/id/"):
        extract(load_vlm(MODEL), root, **RUN)


def test_a_second_run_on_the_same_out_is_refused_while_the_first_writes(clip, data, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    import threading
    out, real, started, go = tmp_path / "cache.npz", ex._write_shard, threading.Event(), threading.Event()
    def held(path, arrays, header):  # the first run stops at its first shard until the second one has tried
        if not started.is_set(): started.set(); go.wait(60)
        real(path, arrays, header)
    monkeypatch.setattr(ex, "_write_shard", held)
    first = {}
    thread = threading.Thread(target=lambda: first.update(cache=extract(clip, data, out=out, **RUN)))
    thread.start()
    try:
        assert started.wait(60)
        with pytest.raises(OSError, match=r"^another extract is writing .*cache\.npz"): extract(clip, data, out=out, **RUN)
    finally:
        go.set(); thread.join(120)
    assert same_cache(first["cache"], reference[1]) and same_cache(EmbeddingCache.load(out), reference[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.npz"]  # no lock, no shards left behind
    assert same_cache(extract(clip, data, out=out, **RUN), reference[1])  # the lock is free again


def test_a_link_to_the_cache_and_its_target_share_one_lock_and_one_shard_folder(clip, data, reference, tmp_path, monkeypatch):
    "The lock was named after --out as typed: link.npz and the target.npz it points to took two locks, and two runs could write one cache."
    from proton.deploy import hold_lock
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    link = tmp_path / "link.npz"
    link.symlink_to("target.npz")
    with hold_lock(tmp_path / "target.npz.lock"):  # as a run on target.npz holds it
        with pytest.raises(OSError, match=r"^another extract is writing .*link\.npz \(it holds target\.npz\.lock\)"): extract(clip, data, out=link, **RUN)
    assert same_cache(extract(clip, data, out=link, keep_shards=True, **RUN), reference[1])
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["link.npz", "target.npz", "target.npz.shards"]


@pytest.mark.skipif(sys.platform == "win32", reason="the lock is POSIX's flock")
def test_a_killed_runs_lock_is_free_at_once_while_the_children_it_forked_live(tmp_path):
    "DataLoader workers forked under `hold_lock` shared its flock and kept it about 5 s after a SIGKILLed extract: a rerun was told 'another extract is writing'. A forked child now closes its copy, and the lock stays its holder's alone."
    from proton.deploy import hold_lock
    lock = tmp_path / "c.npz.lock"
    code = ("import os, sys, time\nfrom proton.deploy import hold_lock\nwith hold_lock(sys.argv[1], remove=True):\n"
            "    child = os.fork()\n    if child == 0: time.sleep(120); os._exit(0)\n    print(child, flush=True); time.sleep(120)\n")
    holder, child = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True), None
    try:
        child = int(holder.stdout.readline())
        with pytest.raises(BlockingIOError, match="another process holds"): hold_lock(lock).__enter__()  # the child's close left the holder's lock
        holder.kill(); holder.wait()  # as the OOM killer kills a run: its children live on
        os.kill(child, 0)
        with hold_lock(lock): pass  # free at once
    finally:
        holder.kill(); holder.wait(); holder.stdout.close()
        if child: os.kill(child, signal.SIGKILL)


def test_a_prompts_folder_is_refused_naming_it(data, tmp_path, monkeypatch, capsys):
    "--prompts <folder> was taken for the prompts themselves, one prompt: 'got 1 prompts for 2 classes'."
    monkeypatch.setattr(ex, "load_vlm", lambda *a, **k: pytest.fail("the model was loaded before the prompts were checked"))
    (tmp_path / "prompts").mkdir()
    said = (f"{tmp_path / 'prompts'} is a folder, not a prompt file: give a prompt file, "
            "or the prompts (on the command line, separated by commas)")
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", str(tmp_path / "c.npz"), "--prompts", str(tmp_path / "prompts")]) == 1
    assert capsys.readouterr().err == f"proton-ood extract: error: {said}\n"
    from proton.models.score import class_prompts_from
    for call in (lambda: ex.check_extract(data, prompts=tmp_path / "prompts"), lambda: ex.check_extract(data, prompts=str(tmp_path / "prompts")),
                 lambda: class_prompts_from(None, tmp_path / "prompts")):  # the Python API said 'no prompt file at <folder>'
        with pytest.raises(ValueError) as e: call()
        assert str(e.value) == said


@pytest.mark.parametrize("out, flag, given, what", [
    ("prep/classes.json", None, None, "write inside the prepared folder"),
    ("prep/split.csv", None, None, "write inside the prepared folder"),
    ("prep/id/normal/retina.png", None, None, "write inside the prepared folder"),
    ("prep/new.npz", None, None, "write inside the prepared folder"),
    ("p.txt", "--prompts", "p.txt", "overwrite the prompt file"),
    ("link.npz", "--prompts", "p.txt", "overwrite the prompt file"),  # a hard link to it
    ("sets.json", "--prompt-sets", "sets.json", "overwrite the prompt sets file"),
    ("w.pt", "--checkpoint", "w.pt", "overwrite the model's weights"),
    ("tok/vocab.txt", "--tokenizer", "tok", "overwrite the tokenizer"),
    ("p", "--prompts", "p.lock", "overwrite the prompt file"),  # <out>.lock, removed when the run ends
    ("prep", None, None, "overwrite the prepared folder"),  # --data prep.shards: <out>.shards, removed when the run ends
])
def test_an_out_over_an_input_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys, out, flag, given, what):
    "--out naming a file of the prepared folder, the prompt file, ... wrote the cache over it, exit status 0."
    monkeypatch.setattr(ex, "load_vlm", lambda *a, **k: pytest.fail("the model was loaded before --out was checked"))
    monkeypatch.chdir(tmp_path)
    data = make_prepared("prep.shards" if out == "prep" else "prep")
    Path("p.txt").write_text("a photo of normal\na photo of dr\n"); Path("p.lock").write_text("normal\ndr\n"); os.link("p.txt", "link.npz")
    Path("sets.json").write_text(json.dumps({"mine": {"normal": ["a"], "diabetic_retinopathy": ["b"]}}))
    Path("w.pt").write_bytes(b"weights"); Path("tok").mkdir(); Path("tok/vocab.txt").write_text("[PAD]\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", out, *([flag, given] if flag else []), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("proton-ood extract: error: the cache ") and err.count("\n") == 1 and what in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_an_out_that_cannot_be_written_is_refused_before_the_model_loads(data, tmp_path, monkeypatch, capsys):
    "--out under a file (a folder that cannot be made) failed only once the model had loaded, as evaluate and score's audit do not."
    monkeypatch.setattr(ex, "load_vlm", lambda *a, **k: pytest.fail("the model was loaded before --out was checked"))
    (tmp_path / "a file").write_text("not a folder")
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", str(tmp_path / "a file" / "c.npz"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"proton-ood extract: error: cannot write {tmp_path / 'a file' / 'c.npz'}: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("flag, out, refused", [
    ("--tokenizer", "oph.npz", None),
    ("--checkpoint", "oph.npz", None),
    ("--tokenizer", "vocab.txt", "overwrite the tokenizer"),
    ("--checkpoint", "open_clip_model.safetensors", "overwrite the model's weights"),  # the weights file open_clip picks
    ("--checkpoint", "open_clip_config.json", "overwrite the model's config"),
])
def test_an_out_in_a_folder_input_gets_the_same_answer_on_a_rerun(tmp_path, monkeypatch, capsys, flag, out, refused):
    "An --out inside the --tokenizer or snapshot folder was accepted, then refused once the first run had written it: any existing file of the folder counted as an input."
    def loaded(*a, **k): raise ValueError("checked")  # the model loads once every argument is found fit
    monkeypatch.setattr(ex, "load_vlm", loaded)
    monkeypatch.chdir(tmp_path)
    data = make_prepared(tmp_path / "data" / "toy")
    Path("vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\na\n"); Path("open_clip_config.json").write_text("{}")
    Path("open_clip_model.safetensors").write_bytes(b"weights"); Path("other.bin").write_bytes(b"not read")
    answers = []
    for _ in range(2):  # before the first run wrote the cache, and after
        assert extract_main(["--model", MODEL, "--data", str(data), "--out", out, flag, ".", "--no-progress"]) == 1
        answers.append(capsys.readouterr().err)
        Path(out).write_bytes(Path(out).read_bytes() if Path(out).exists() else b"a cache from the first run")
    assert answers[0] == answers[1], answers
    assert answers[0] == "proton-ood extract: error: checked\n" if refused is None else refused in answers[0], answers[0]


def test_the_command_prints_each_warning_as_one_line_but_the_skipped_images_in_the_summary(tmp_path, capsys):
    "extract_main ignored every warning, the documented 'recomputing shard k' among them, because its summary names the skipped images."
    root = make_prepared(tmp_path / "d", split=False)
    (root / "far/tench/chelsea.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a real jpeg")
    args = ["--model", MODEL, "--data", str(root), "--out", str(tmp_path / "c.npz"), "--batch-size", "2", "--shard-size", "2", "--workers", "0",
            "--no-progress", "--keep-shards"]
    assert extract_main(args) == 0
    assert capsys.readouterr().err == ""
    damaged = shard_path(Path(f"{tmp_path / 'c.npz'}.shards"), 2)
    damaged.write_bytes(damaged.read_bytes()[:-300])
    assert extract_main(args) == 0
    out, err = capsys.readouterr()
    assert err.startswith("proton-ood extract: warning: recomputing shard 2: ") and err.count("\n") == 1, err
    assert "skipped 1 unreadable images" in out, out


def test_strict_with_dataloader_workers_is_a_one_line_error(tmp_path):
    "The strict error was raised in a worker: the DataLoader re-raised it with the worker's traceback in its text."
    root = make_prepared(tmp_path / "d", split=False)
    moon = root / "id/normal/moon.png"
    moon.write_bytes(b"\x89PNG\r\n\x1a\n half copied")
    exe = shutil.which("proton-ood") or str(Path(sys.executable).parent / "proton-ood")
    r = subprocess.run([exe, "extract", "--model", MODEL, "--data", str(root), "--out", str(tmp_path / "c.npz"), "--batch-size", "2",
                        "--workers", "2", "--strict", "--no-progress"], capture_output=True, text=True, timeout=600)
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("proton-ood extract: error: cannot read image") and lines[0].count(str(moon)) == 1, r.stderr


def test_the_cache_records_the_text_pooling_of_a_backend_that_has_one(reference, tmp_path):
    "FLAIR's prompts pool in two ways that give other text embeddings; the cache did not say which, so nothing could tell a cache of the other."
    from proton.models.flair import FLAIR, load_flair_tokenizer, random_flair
    assert reference[1].metadata["text_pooling"] is None  # open_clip has no such option
    vocab = tmp_path / "vocab"
    vocab.mkdir()
    (vocab / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "normal", "glaucoma"]) + "\n")
    root = tmp_path / "prepared"
    for c in ("normal", "glaucoma"):
        (root / "id" / c).mkdir(parents=True)
        Image.fromarray(np.full((16, 16, 3), 9, np.uint8)).save(root / "id" / c / "0.png")
    flair = FLAIR(random_flair(0), load_flair_tokenizer(vocab), text_pooling="padded_batch")
    assert extract(flair, root, prompt_sets=False, num_workers=0, progress=False).metadata["text_pooling"] == "padded_batch"


def test_text_pooling_on_the_command_line_is_refused_for_a_model_without_it(data, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ex, "load_vlm", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "c.npz"
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", str(out), "--text-pooling", "padded_batch"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"proton-ood extract: error: --text-pooling is for flair, not {MODEL}: leave it out", err
    assert not out.exists()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(epoch=st.one_of(st.integers(max_value=-62135596801), st.integers(min_value=253402300800)).map(str))  # before year 1 or after 9999
@example(epoch="1" * 4301)  # more digits than int() reads: was 'must be an integer', on a 4,000-character line
@example(epoch="-" + "9" * 5000)
def test_a_source_date_epoch_out_of_range_is_named_as_such(monkeypatch, epoch):
    "An OverflowError that did not name SOURCE_DATE_EPOCH, or 'must be an integer' for an integer."
    monkeypatch.setenv("SOURCE_DATE_EPOCH", epoch)
    shown = epoch if len(epoch) <= 20 else epoch[:20] + "..."
    with pytest.raises(ValueError, match=rf"^SOURCE_DATE_EPOCH={re.escape(shown)} is out of range: the years 1 to 9999 are ") as e: ex._created()
    assert "\n" not in str(e.value) and len(str(e.value)) < 150
    for edge in (-62135596800, 253402300799): monkeypatch.setenv("SOURCE_DATE_EPOCH", str(edge)); ex._created()  # the first and last seconds are fine
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "x" * 5000)
    with pytest.raises(ValueError, match=r"^SOURCE_DATE_EPOCH must be an integer number of seconds, got 'x{20}\.\.\.'$"): ex._created()


def test_a_model_that_fails_to_load_leaves_no_new_folder(data, tmp_path, monkeypatch, capsys):
    "Checking --out made its folders before the model loaded; a model that then failed to load left new/sub behind, empty."
    def fail(*a, **k): raise OSError("no weights at w.pt")
    monkeypatch.setattr(ex, "load_vlm", fail)
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", str(tmp_path / "new" / "sub" / "c.npz"), "--no-progress"]) == 1
    assert "no weights at w.pt" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


# --- torchrun: failures, thread counts, batch sizes ------------------------------------------------------------------

def torchrun(args, tmp_path, command=None, **env):
    "`proton-ood extract ARGS` (or `command extract ARGS`) under torchrun with two gloo processes on the CPU: the finished process."
    command = command or Path(sys.executable).with_name("proton-ood")  # the console script, which torchrun runs as a Python file
    return subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2", str(command), "extract",
                           "--model", MODEL, "--workers", "0", "--device", "cpu", "--no-progress", *args],
                          env=dict(os.environ, SOURCE_DATE_EPOCH=EPOCH, OMP_NUM_THREADS="1", TQDM_DISABLE="1", **env),
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)


def errors_of(run):
    "The lines `proton-ood extract` printed as errors."
    return [l for l in run.stderr.splitlines() if l.startswith("proton-ood extract: error:")]


def test_an_unreadable_image_on_one_rank_stops_every_rank_with_its_one_line(tmp_path):
    """--strict with the unreadable image in rank 1's shard: rank 0 sat in the barrier, then printed gloo's 'Connection closed by peer'
    and was killed by torchrun, sometimes before it removed <out>.lock. Every rank now raises the failed rank's error."""
    root = make_prepared(tmp_path / "d")
    bad = root / read_prepared(root).files[2]  # shard 1 of 2-image shards: rank 1's
    bad.write_bytes(b"\x89PNG\r\n\x1a\n half copied")
    out = tmp_path / "c.npz"
    run = torchrun(["--data", str(root), "--out", str(out), "--batch-size", "1", "--shard-size", "2", "--strict"], tmp_path)
    assert run.returncode == 1, run.stderr[-2000:]
    lines = errors_of(run)
    assert lines and all(l.startswith("proton-ood extract: error: cannot read image ") and str(bad) in l for l in lines), run.stderr[-3000:]
    assert "Connection closed" not in run.stderr
    assert not Path(f"{out}.lock").exists() and not out.exists()
    assert shard_path(Path(f"{out}.shards"), 0).exists()  # what rank 0 finished is kept for the next run


def test_shards_of_another_cpu_thread_count_are_not_reused(clip, data, tmp_path, counted):
    """A CPU's float32 embeddings depend on its thread count, and torchrun sets OMP_NUM_THREADS=1: a torchrun run resumed in one
    process (or the other way round) mixed the two silently. The thread count is now part of the run fingerprint and of the metadata."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = extract(clip, data, out=tmp_path / "c.npz", keep_shards=True, **RUN)
        torch.set_num_threads(2)
        counted.clear()
        with pytest.warns(UserWarning, match=r"recomputing shard \d+: .* belongs to another run"):
            two = extract(clip, data, out=tmp_path / "c.npz", **RUN)
    finally: torch.set_num_threads(threads)
    assert len(counted) == N // 2
    assert (one.metadata["cpu_threads"], two.metadata["cpu_threads"]) == (1, 2)


def test_shards_of_another_batch_size_are_not_reused(clip, data, tmp_path, counted, capsys, monkeypatch):
    """Embeddings depend on the batch size in their last bits, and shards of another batch size were reused silently: a run resumed
    with a smaller batch (as the out-of-memory advice said) gave a cache that matched no uninterrupted run. They are recomputed now."""
    one = extract(clip, data, out=tmp_path / "c.npz", keep_shards=True, **RUN)
    counted.clear()
    with pytest.warns(UserWarning, match=r"recomputing shard \d+: .* belongs to another run"):
        two = extract(clip, data, out=tmp_path / "c.npz", **dict(RUN, batch_size=1))
    assert len(counted) == N // 2 and (one.metadata["batch_size"], two.metadata["batch_size"]) == (2, 1)
    def oom(*args, **kwargs): raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(ex, "extract", oom)
    assert extract_main(["--model", MODEL, "--data", str(data), "--out", str(tmp_path / "c.npz"), "--batch-size", "512"]) == 1
    assert "reused" not in capsys.readouterr().err  # the advice no longer promises to keep the finished shards


def test_batch_sizes_at_or_above_the_shard_size_share_their_shards(clip, data, tmp_path, counted, monkeypatch):
    "A batch is cut inside its shard: batch sizes of 2 and 4 with shards of 2 compute the same, yet every shard was recomputed and the cache's hash changed."
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    one = extract(clip, data, out=tmp_path / "c.npz", keep_shards=True, **RUN)
    counted.clear()
    two = extract(clip, data, out=tmp_path / "c.npz", **dict(RUN, batch_size=4))
    assert counted == [] and two.content_hash() == one.content_hash() and two.metadata["batch_size"] == 2


def test_local_features_pass_through_torchrun_under_a_name_of_their_own():
    "torchrun's parser took `--local`, after the script, for an ambiguous prefix of its --local-ranks-filter and --local-addr, and stopped."
    from torch.distributed.run import parse_args
    script = [str(Path(sys.executable).with_name("proton-ood")), "extract", "--model", MODEL, "--data", "d", "--out", "c.npz"]
    with pytest.raises(SystemExit): parse_args(["--standalone", "--nproc-per-node", "2", *script, "--local"])
    assert parse_args(["--standalone", "--nproc-per-node", "2", *script, "--local-features"]).training_script_args[-1] == "--local-features"
    for flag in ("--local", "--local-features"): assert ex._parser().parse_args(script[2:] + [flag]).local


@pytest.mark.parametrize("case", ["another run holds the lock", "an unreadable image on rank 1", "no image readable"])
def test_under_torchrun_an_error_every_rank_shares_is_printed_once(tmp_path, case):
    "Success was reported by rank 0 alone, but every error once per rank; rank 0 alone says one that every rank has, and every rank exits 1."
    from proton.deploy import hold_lock
    root, out = make_prepared(tmp_path / "d"), tmp_path / "c.npz"
    args = ["--data", str(root), "--out", str(out), "--batch-size", "1", "--shard-size", "2"] + ["--strict"] * (case != "no image readable")
    if case == "an unreadable image on rank 1": (root / read_prepared(root).files[2]).write_bytes(b"\x89PNG\r\n\x1a\n half copied")
    if case == "no image readable":  # found by every rank once the shards are read: 'none of the 12 images ... could be read' was printed twice
        for f in read_prepared(root).files: (root / f).write_bytes(b"\x89PNG\r\n\x1a\n half copied")
    with hold_lock(f"{out}.lock") if case == "another run holds the lock" else contextlib.nullcontext():
        run = torchrun(args, tmp_path)
    said = {"another run holds the lock": "another extract is writing", "an unreadable image on rank 1": "cannot read image",
            "no image readable": "could be read"}[case]
    assert run.returncode == 1 and len(errors_of(run)) == 1 and said in errors_of(run)[0], run.stderr[-3000:]  # rank 0 spoke before torchrun stopped it


def test_under_torchrun_an_error_before_the_process_group_is_printed_though_rank_0_is_late(tmp_path):
    """Before the process group exists no rank can wait for another: rank 0 alone printed such an error, and when the other rank
    ended first torchrun stopped rank 0 before it spoke, so a bad argument ended the run with no error line at all."""
    slow = tmp_path / "slow.py"  # proton-ood whose rank 0 checks its arguments 3 s after rank 1, as a slower disk would
    slow.write_text("import os, sys, time\nimport proton.models.extract as ex\nreal = ex.check_extract\n"
                    "def late(*a, **k):\n    if os.environ.get('RANK') == '0': time.sleep(3)\n    return real(*a, **k)\n"
                    "ex.check_extract = late\nfrom proton.cli import main\nsys.exit(main())\n")
    run = torchrun(["--data", str(make_prepared(tmp_path / "d")), "--out", str(tmp_path / "c.npz"), "--prompts", "a,b,c"], tmp_path, command=slow)
    assert run.returncode == 1 and errors_of(run) and all("got 3 prompts for 2 classes" in l for l in errors_of(run)), run.stderr[-3000:]


@pytest.mark.parametrize("device, want", [("cuda", [("set_device", "cuda:1"), ("init", "nccl")]), ("cpu", [("init", "gloo")])])
def test_torchrun_puts_each_rank_on_its_own_gpu_before_it_joins(monkeypatch, device, want):
    "NCCL's object collectives (all_gather_object, broadcast_object_list) run on the current CUDA device: without set_device every rank's was cuda:0, which NCCL refuses for two ranks ('Duplicate GPU detected')."
    import torch.distributed as dist
    from proton.models import extract as ex
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2"); monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", str(torch.device(d)))))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert ex._join_torchrun(device) == ("cuda:1" if device == "cuda" else "cpu")
    assert calls == want


@pytest.mark.parametrize("device, rank, message", [("cuda", "2", r"^LOCAL_RANK is 2, but this machine shows 2 CUDA devices \(cuda:0 to cuda:1\): start at most 2 processes a node"),
                                                   ("cuda:1", "0", r"^under torchrun each rank takes the GPU of its LOCAL_RANK: give --device cuda, not cuda:1")])
def test_torchrun_refuses_a_rank_without_its_gpu_and_a_gpu_named_for_every_rank(monkeypatch, device, rank, message):
    "A LOCAL_RANK past the visible GPUs reached torch.cuda.set_device's AcceleratorError, a traceback from the CLI; --device cuda:1 was silently replaced by cuda:<LOCAL_RANK>."
    import torch.distributed as dist
    from proton.models import extract as ex
    monkeypatch.setenv("WORLD_SIZE", "2"); monkeypatch.setenv("LOCAL_RANK", rank)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: pytest.fail("joined"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set a device"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=message): ex._join_torchrun(device)


def test_a_link_into_a_missing_folder_is_written_there(tmp_path):
    "A link --out pointing into a folder that does not exist failed with '[Errno 2] No such file or directory: .../gone/t.npz.lock': extract made the link's folder, not its target's."
    from proton.models.extract import _writing
    link = tmp_path / "dl.npz"; link.symlink_to("gone/t.npz")
    with _writing(link, 0, lambda x: x, lambda: None): assert (tmp_path / "gone" / "t.npz.lock").exists()


def test_the_images_hash_takes_a_file_it_cannot_read_as_unreadable(clip, tmp_path, monkeypatch):
    "images_sha256 (the metadata's, after every image is embedded) raised on a file it could not open: one unreadable image failed the whole extraction, which skips it."
    data = make_prepared(tmp_path / "toy")
    before = ex.images_sha256(read_prepared(data))
    gone = read_prepared(data).files[3]
    hashed = ex.file_sha256
    def denied(path):
        if str(path).endswith(gone): raise PermissionError(13, "Permission denied", str(path))
        return hashed(path)
    monkeypatch.setattr(ex, "file_sha256", denied)
    after = ex.images_sha256(read_prepared(data))
    assert after != before  # what cannot be read is not what was there
    cache = extract(clip, data, out=tmp_path / "c.npz", **RUN)
    assert cache.metadata["images_sha256"] == after and len(cache) == len(read_prepared(data))
