"""Embedding caches survive the disk exactly or fail loudly, and streams are reproducible, at the requested ID fraction, and corruptible on purpose by an exact amount."""
import json
import os
import pickle
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import proton.bench.cache as cache_module
from proton.bench.cache import CACHE_FORMAT, CorruptCacheError, EmbeddingCache
from proton.bench.streams import ORDERS, make_stream, misroute, stream_permutations
from proton.bench.synth import SHIFTS, SyntheticWorld

WORLD = SyntheticWorld(seed=1)
CACHE = EmbeddingCache.from_world(WORLD, n_id=80, n_per_shift=40, seed=2)
ARRAYS = ("image_embeddings", "text_embeddings", "labels", "shift", "local_embeddings")


def small(**change):
    rng = np.random.default_rng(0)
    fields = dict(image_embeddings=rng.normal(size=(7, 5)).astype(np.float32), text_embeddings=rng.normal(size=(3, 5)),
                  class_names=["a", "b", "c"], labels=[0, 2, 1, 0, -1, -1, -1],
                  shift=["id", "id", "id", "id", "semantic", "covariate", "far"], temperature=0.05,
                  local_embeddings=rng.normal(size=(7, 4, 5)).astype(np.float32),
                  source=[f"scan_{i}.png" for i in range(7)],
                  metadata={"model": "toy", "prompts": {"a": ["a photo of a"]}, "created": "2026-01-01T00:00:00+00:00",
                            "note": "ünïcode ✓", "n": 3, "ratio": 0.1})
    return EmbeddingCache(**{**fields, **change})


def same_content(a, b):
    for k in ARRAYS:
        x, y = getattr(a, k), getattr(b, k)
        if x is None or y is None:
            assert x is None and y is None, k
            continue
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k
    assert (a.class_names, a.source, a.metadata, a.temperature) == (b.class_names, b.source, b.metadata, b.temperature)


# --- round trip -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_round_trip_is_bitwise(tmp_path, dtype):
    c = small(image_embeddings=small().image_embeddings.astype(dtype))
    back = EmbeddingCache.load(c.save(tmp_path / "c.npz"))
    same_content(c, back)
    assert back.content_hash() == c.content_hash()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]


def test_round_trip_of_a_synthetic_cache_and_without_optional_fields(tmp_path):
    back = EmbeddingCache.load(CACHE.save(tmp_path / "world.npz"))
    same_content(CACHE, back)
    assert back.local_embeddings is None and back.source is None and back.metadata["simulated"] is True


def test_saving_again_replaces_the_file(tmp_path):
    path = tmp_path / "c.npz"
    small().save(path)
    CACHE.save(path)
    same_content(EmbeddingCache.load(path), CACHE)


def test_content_hash_sees_every_part():
    h = small().content_hash()
    E = small().image_embeddings.copy(); E[3, 1] = np.nextafter(E[3, 1], np.float32(1))
    assert small(image_embeddings=E).content_hash() != h
    assert small(metadata={"model": "other"}).content_hash() != h
    assert small(class_names=["a", "b", "d"]).content_hash() != h
    assert small(temperature=0.0500001).content_hash() != h
    assert small(source=None).content_hash() != h
    assert small().content_hash() == h


# --- damaged files ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep", [0, 1, 30, 0.5, -22, -1])
def test_truncated_file_is_refused_naming_it(tmp_path, keep):
    raw = small().save(tmp_path / "c.npz").read_bytes()
    n = int(keep * len(raw)) if isinstance(keep, float) else keep % len(raw) if keep < 0 else keep
    bad = tmp_path / "cut.npz"
    bad.write_bytes(raw[:n])
    with pytest.raises(CorruptCacheError, match="cut.npz"):
        EmbeddingCache.load(bad)


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=64).filter(lambda b: not b.startswith((b"PK", b"\x93NUMPY"))))
def test_a_file_that_is_no_archive_is_named_so_without_numpys_pickle_advice(tmp_path_factory, raw):
    bad = tmp_path_factory.mktemp("junk") / "junk.npz"
    bad.write_bytes(raw)
    with pytest.raises(CorruptCacheError, match=r"junk\.npz: not a \.npz archive \(it does not begin as a zip file does\)") as e:
        EmbeddingCache.load(bad)
    assert "pickle" not in str(e.value)


def test_flipped_byte_in_the_data_is_a_checksum_mismatch(tmp_path):
    c = small()
    raw = bytearray(c.save(tmp_path / "c.npz").read_bytes())
    at = raw.find(c.image_embeddings.tobytes())
    assert at > 0
    raw[at + 17] ^= 0x01
    (tmp_path / "flipped.npz").write_bytes(bytes(raw))
    with pytest.raises(CorruptCacheError, match=r"flipped\.npz: checksum mismatch"):
        EmbeddingCache.load(tmp_path / "flipped.npz")


def test_any_flipped_byte_is_refused_or_harmless(tmp_path):
    "Flip every byte of a small cache file in turn: the load fails naming the file, or returns identical content."
    c = small(local_embeddings=None)
    raw = c.save(tmp_path / "c.npz").read_bytes()
    arrays, header = c._contents()
    payload = [raw.find(a.tobytes()) for a in arrays.values()] + [raw.find(np.array(header).tobytes())]
    assert min(payload) > 0
    protected = set().union(*(range(at, at + n) for at, n in zip(payload, [a.nbytes for a in arrays.values()] + [np.array(header).nbytes])))
    target, harmless = tmp_path / "x.npz", []
    structural = sorted(set(range(len(raw))) - protected)
    positions = structural[::3] + sorted(protected)[::29]  # the zip layout repeats per entry, so a third of it sees every field
    for i in positions:
        b = bytearray(raw); b[i] ^= 0x04
        target.write_bytes(bytes(b))
        try:
            same_content(EmbeddingCache.load(target), c)
            harmless.append(i)  # zip bookkeeping that does not reach the content: timestamps, flags, spare fields
        except CorruptCacheError as e:
            assert "x.npz" in str(e)
    assert not protected & set(harmless)
    assert len(harmless) < len(structural[::3])  # most structural bytes are checked too


def test_tampered_but_valid_archive_is_a_checksum_mismatch(tmp_path):
    path = CACHE.save(tmp_path / "c.npz")
    with np.load(path, allow_pickle=False) as npz:
        entries = {k: npz[k] for k in npz.files}
    entries["labels"][0] = 1 - entries["labels"][0]  # still a valid cache, but not the one that was hashed
    np.savez(tmp_path / "t.npz", **entries)
    with pytest.raises(CorruptCacheError, match="checksum mismatch"):
        EmbeddingCache.load(tmp_path / "t.npz")


def test_a_tampered_header_alone_is_a_checksum_mismatch(tmp_path):
    "Only the header changes (the arrays are the saved ones), so the mismatch can only come from the header being hashed."
    path = CACHE.save(tmp_path / "c.npz")
    with np.load(path, allow_pickle=False) as npz:
        entries = {k: npz[k] for k in npz.files}
    header = json.loads(str(entries["header"]))
    header["metadata"]["model"] = "something else"
    np.savez(tmp_path / "m.npz", **(entries | {"header": np.array(json.dumps(header))}))
    with pytest.raises(CorruptCacheError, match="checksum mismatch"):
        EmbeddingCache.load(tmp_path / "m.npz")
    np.savez(tmp_path / "same.npz", **entries)
    assert EmbeddingCache.load(tmp_path / "same.npz").metadata == CACHE.metadata  # untouched entries load


def test_not_a_cache(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros(3))
    with pytest.raises(CorruptCacheError, match=r"a\.npy: holds a single \.npy array"):
        EmbeddingCache.load(tmp_path / "a.npy")
    np.savez(tmp_path / "b.npz", x=np.zeros(3))
    with pytest.raises(CorruptCacheError, match=r"b\.npz: missing or malformed 'header'"):
        EmbeddingCache.load(tmp_path / "b.npz")
    (tmp_path / "c.npz").write_text("hello")
    with pytest.raises(CorruptCacheError, match=r"c\.npz: not a \.npz archive \(it does not begin as a zip file does\)"):
        EmbeddingCache.load(tmp_path / "c.npz")
    with pytest.raises(FileNotFoundError):
        EmbeddingCache.load(tmp_path / "missing.npz")
    (tmp_path / "d.npz").mkdir()
    with pytest.raises(CorruptCacheError, match=r"d\.npz is a folder, not a cache file"):
        EmbeddingCache.load(tmp_path / "d.npz")


def write_with_valid_hash(path, arrays, header):
    "An archive whose hash is right, so that only the content checks can refuse it."
    np.savez(path, header=np.array(header), sha256=np.array(cache_module.content_digest(arrays, header)), **arrays)


def test_unknown_format_and_extra_entries_are_refused(tmp_path):
    arrays, header = small()._contents()
    h = json.loads(header); h["format"] = "proton-cache-99"
    write_with_valid_hash(tmp_path / "f.npz", arrays, json.dumps(h))
    with pytest.raises(CorruptCacheError, match="unknown format 'proton-cache-99'"):
        EmbeddingCache.load(tmp_path / "f.npz")
    write_with_valid_hash(tmp_path / "e.npz", arrays | {"extra": np.zeros(2)}, header)
    with pytest.raises(CorruptCacheError, match=r"unexpected entries \['extra'\]"):
        EmbeddingCache.load(tmp_path / "e.npz")
    assert json.loads(header)["format"] == CACHE_FORMAT


def test_invalid_content_with_valid_hash_is_refused_on_load(tmp_path):
    arrays, header = small()._contents()
    arrays = arrays | {"labels": np.array([0, 2, 1, 0, -1, 1, -1])}  # a covariate image with a class
    write_with_valid_hash(tmp_path / "v.npz", arrays, header)
    with pytest.raises(CorruptCacheError, match=r"v\.npz: invalid cache: labels and shift disagree: rows \[5\]"):
        EmbeddingCache.load(tmp_path / "v.npz")
    nan = arrays | {"image_embeddings": np.full((7, 5), np.nan, dtype=np.float32)}
    write_with_valid_hash(tmp_path / "n.npz", nan, header)
    with pytest.raises(CorruptCacheError, match="image_embeddings contains NaN"):
        EmbeddingCache.load(tmp_path / "n.npz")


def test_a_header_missing_a_field_names_the_field(tmp_path):
    "A header without class_names said \"invalid cache: 'class_names'\", the bare text of a KeyError."
    arrays, header = small()._contents()
    h = json.loads(header); del h["class_names"]
    write_with_valid_hash(tmp_path / "k.npz", arrays, json.dumps(h))
    with pytest.raises(CorruptCacheError, match=r"k\.npz: invalid cache: the header lacks the field 'class_names'"):
        EmbeddingCache.load(tmp_path / "k.npz")


# --- no pickle --------------------------------------------------------------------------------------------------

def test_object_array_is_refused(tmp_path):
    path = small().save(tmp_path / "c.npz")
    with np.load(path, allow_pickle=False) as npz:
        entries = {k: npz[k] for k in npz.files}
    np.savez(tmp_path / "o.npz", **(entries | {"source": np.array([object()] * 7, dtype=object)}))
    with pytest.raises(CorruptCacheError, match=r"o\.npz: entry 'source' is an object array"):
        EmbeddingCache.load(tmp_path / "o.npz")


class Payload:
    ran = False

    def __reduce__(self):
        return (setattr, (Payload, "ran", True))


def test_a_pickle_is_never_unpickled(tmp_path):
    (tmp_path / "p.npz").write_bytes(pickle.dumps({"image_embeddings": Payload()}))
    with pytest.raises(CorruptCacheError, match=r"p\.npz"):
        EmbeddingCache.load(tmp_path / "p.npz")
    assert not Payload.ran


def test_save_and_load_never_call_pickle(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("pickle was used")
    for name in ("load", "loads", "dump", "dumps", "Unpickler", "Pickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    same_content(EmbeddingCache.load(small().save(tmp_path / "c.npz")), small())


# --- atomic save ------------------------------------------------------------------------------------------------

def half_write_then(exc):
    def savez(file, **arrays):
        file.write(b"PK\x03\x04" + b"\0" * 1000)  # the start of an archive, as a real write would leave it
        raise exc
    return savez


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_interrupted_save_keeps_the_old_file(tmp_path, monkeypatch, exc):
    path = small().save(tmp_path / "c.npz")
    good = path.read_bytes()
    monkeypatch.setattr(cache_module.np, "savez", half_write_then(exc))
    with pytest.raises(type(exc)):
        CACHE.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]  # no temporary file left behind
    same_content(EmbeddingCache.load(path), small())


def test_interrupted_first_save_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module.np, "savez", half_write_then(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        CACHE.save(tmp_path / "new.npz")
    assert list(tmp_path.iterdir()) == []


def test_failing_rename_keeps_the_old_file(tmp_path, monkeypatch):
    path = small().save(tmp_path / "c.npz")
    good = path.read_bytes()
    def refuse(src, dst): raise PermissionError("rename refused")
    monkeypatch.setattr(cache_module.os, "replace", refuse)
    with pytest.raises(PermissionError):
        CACHE.save(path)
    assert path.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]


def test_data_is_synced_before_the_rename(tmp_path, monkeypatch):
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(cache_module.os, "fsync", lambda fd: (events.append("fsync"), fsync(fd))[1])
    monkeypatch.setattr(cache_module.os, "replace", lambda a, b: (events.append("replace"), replace(a, b))[1])
    small().save(tmp_path / "c.npz")
    assert events.index("fsync") < events.index("replace")


# --- validation -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("labels, shift, message", [
    ([0, 2, 1, 0, 0, -1, -1], None, r"rows \[4\] have shift \['semantic'\] but labels \[0\]"),
    ([0, 2, 1, 0, -1, 2, -1], None, r"rows \[5\] have shift \['covariate'\] but labels \[2\]"),
    ([0, 2, -1, 0, -1, -1, -1], None, r"rows \[2\] have shift 'id' but label -1"),
    ([0, 3, 1, 0, -1, -1, -1], None, r"labels must be in \[-1, 3\), got \[3\]"),
    ([0, -2, 1, 0, -1, -1, -1], None, r"labels must be in \[-1, 3\), got \[-2\]"),
    (None, ["id"] * 4 + ["semantic", "covariate", "unknown"], r"shift has unknown names \['unknown'\]"),
    (None, ["id"] * 4 + ["semantic", "covariate"], "shift must hold 7 strings, got 6"),
])
def test_label_and_shift_inconsistencies_are_refused(labels, shift, message):
    change = {k: v for k, v in (("labels", labels), ("shift", shift)) if v is not None}
    with pytest.raises(ValueError, match=message):
        small(**change)


@pytest.mark.parametrize("change, message", [
    (dict(image_embeddings=np.zeros((7, 5), dtype=np.int64)), "image_embeddings must have a floating dtype"),
    (dict(text_embeddings=np.zeros((3, 4))), "text_embeddings have dimension 4, but image_embeddings have 5"),
    (dict(text_embeddings=np.full((3, 5), np.inf)), "text_embeddings contains NaN or Inf"),
    (dict(local_embeddings=np.zeros((6, 4, 5))), r"local_embeddings must have shape \(7, L, 5\)"),
    (dict(local_embeddings=np.zeros((7, 5))), "local_embeddings must have 3 dimensions"),
    (dict(temperature=float("nan")), "temperature must be positive and finite"),
    (dict(metadata={"x": float("nan")}), "metadata must be JSON-serialisable"),
    (dict(class_names=["a", "b", 3]), r"class_names must hold strings, but entries \[2\]"),
    (dict(temperature="0.05"), "temperature must be a positive, finite number, got '0.05'"),
    (dict(temperature=True), "temperature must be a positive, finite number, got True"),
])
def test_bad_fields_are_refused_naming_them(change, message):
    with pytest.raises(ValueError, match=message):
        small(**change)


SETS = dict(prompt_embeddings=np.eye(3, 5), prompts=["a", "b", "c"], prompt_class=[0, 1, 2], prompt_set=["L1"] * 3)


@pytest.mark.parametrize("change, field", [
    (dict(class_names=["a", "b\udce4", "c"]), "class_names[1]"),
    (dict(source=[f"scan_{i}\udce4.png" for i in range(7)]), "source[0]"),
    (dict(metadata={"dataset": "Pr\udce4parat"}), "metadata['dataset']"),
    (dict(metadata={"skipped_files": [{"file": "x\udce4.png"}]}), "metadata['skipped_files'][0]['file']"),
    (dict(metadata={"Pr\udce4parat": 1}), "a key of metadata"),
    (dict(SETS, prompts=["a", "b", "c\udce4"]), "prompts[2]"),
    (dict(SETS, prompt_set=["L\udce4"] * 3), "prompt_set[0]"),
])
def test_text_that_utf8_cannot_encode_is_refused_naming_the_field(change, field):
    "Names with lone surrogates (os.fsdecode of a folder name in latin-1) were accepted, then save and content_hash raised a bare UnicodeEncodeError."
    with pytest.raises(ValueError) as e: small(**change)
    said = str(e.value)
    assert said.startswith(f"{field} holds ") and "\\udce4" in said and "not UTF-8 text" in said and "\n" not in said, said
    said.encode("utf-8")  # the message itself can be printed anywhere


def test_torch_inputs_are_accepted():
    import torch
    c = small(image_embeddings=torch.as_tensor(small().image_embeddings), labels=torch.tensor([0, 2, 1, 0, -1, -1, -1]))
    same_content(c, small())


# --- streams ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shift", SHIFTS[1:])
def test_stream_holds_exactly_id_and_its_shift_and_is_reproducible(shift, order):
    s = make_stream(CACHE, shift, order=order, seed=3, warmup=10)
    assert np.array_equal(np.sort(s.indices), np.flatnonzero(np.isin(CACHE.shift, ["id", shift])))
    assert np.array_equal(s.is_ood, CACHE.shift[s.indices] == shift)
    again = make_stream(CACHE, shift, order=order, seed=3, warmup=10)
    assert np.array_equal(s.indices, again.indices)
    other = make_stream(CACHE, shift, order=order, seed=4, warmup=10)
    assert not np.array_equal(s.indices, other.indices)


@settings(max_examples=60, deadline=None)
@given(rho=st.floats(0.02, 0.98), n_id=st.integers(1, 80), n_ood=st.integers(1, 40))
def test_rho_is_respected(rho, n_id, n_ood):
    c = CACHE.subset(np.r_[np.flatnonzero(CACHE.shift == "id")[:n_id], np.flatnonzero(CACHE.shift == "far")[:n_ood]])
    try:
        s = make_stream(c, "far", rho=rho, sample_seed=n_id)
    except ValueError as e:  # allowed only when rounding leaves one side empty
        assert f"rho={rho} leaves 0 ID" in str(e) or "and 0 OOD images" in str(e)
        return
    n = len(s.indices)
    assert abs((~s.is_ood).mean() - rho) <= 1 / (2 * n) + 1e-12
    assert (~s.is_ood).sum() == n_id or s.is_ood.sum() == n_ood  # only the side in excess is subsampled
    assert len(np.unique(s.indices)) == n


def test_rho_outside_the_open_interval_is_refused():
    for rho in (0, 1, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"rho \(the ID fraction\) must be in \(0, 1\)"):
            make_stream(CACHE, "covariate", rho=rho)


def test_missing_pieces_are_refused():
    with pytest.raises(ValueError, match="the cache has no 'semantic' images"):
        make_stream(CACHE.subset(CACHE.shift != "semantic"), "semantic")
    with pytest.raises(ValueError, match="the cache has no ID images"):
        make_stream(CACHE.subset(CACHE.shift != "id"), "semantic")


def test_permutations_reorder_the_same_images():
    perms = stream_permutations(CACHE, "covariate", n_permutations=5, seed=10, rho=0.5, order="drift")
    assert [s for s, _ in perms] == list(range(10, 15))
    members = {np.sort(p.indices).tobytes() for _, p in perms}
    orders = {p.indices.tobytes() for _, p in perms}
    assert len(members) == 1 and len(orders) == 5
    assert np.array_equal(perms[3][1].indices, make_stream(CACHE, "covariate", rho=0.5, order="drift", seed=13).indices)


def test_drift_and_burst_put_ood_where_promised():
    drift = [make_stream(CACHE, "far", order="drift", seed=s).is_ood for s in range(20)]
    thirds = np.array([[part.mean() for part in np.array_split(d, 3)] for d in drift]).mean(0)
    assert thirds[0] < thirds[1] < thirds[2]
    burst = make_stream(CACHE, "far", order="burst").is_ood
    ood = np.flatnonzero(burst)
    assert np.array_equal(ood, np.arange(ood[0], ood[0] + 40)) and ood[0] == 40


@pytest.mark.parametrize("fraction, seed", [(0.0, 0), (0.05, 1), (0.25, 2), (0.5, 3), (1.0, 4)])
def test_misrouting_fraction_is_exact(fraction, seed):
    routed = misroute(CACHE, fraction, seed=seed)
    own = CACHE.predicted()
    assert routed.shape == (len(CACHE),) and routed.dtype == np.int64
    assert (routed != own).sum() == round(fraction * len(CACHE))
    assert ((routed >= 0) & (routed < CACHE.n_classes)).all()


def test_misrouting_with_three_classes_reaches_both_other_classes():
    world = SyntheticWorld(n_classes=3, seed=5)
    c = EmbeddingCache.from_world(world, n_id=90, n_per_shift=30, seed=0)
    routed, own = misroute(c, 0.5, seed=0), c.predicted()
    shift = (routed - own) % 3
    assert set(shift[routed != own].tolist()) == {1, 2}


def test_misrouting_refuses_impossible_requests():
    with pytest.raises(ValueError, match=r"the misrouted share must be in \[0, 1\]"):
        misroute(CACHE, -0.1)


def test_what_the_detector_would_refuse_is_refused_at_construction():
    "Zero-length rows, two classes with the same text embedding, or no images at all fail later; they fail here instead."
    E = small().image_embeddings.copy(); E[4] = 0
    with pytest.raises(ValueError, match=r"image_embeddings rows \[4\] have zero length"): small(image_embeddings=E)
    E[5] = 1e-14
    with pytest.raises(ValueError, match=r"image_embeddings rows \[4, 5\] have zero length or a length below 1e-12 \(MIN_NORM\)"): small(image_embeddings=E)
    T = small().text_embeddings.copy(); T[2] = 0
    with pytest.raises(ValueError, match=r"text_embeddings rows \[2\] have zero length"): small(text_embeddings=T)
    T = small().text_embeddings.copy(); T[2] = 3 * T[0]
    with pytest.raises(ValueError, match=r"text_embeddings rows 0 and 2 point the same way"): small(text_embeddings=T)
    L = small().local_embeddings.copy(); L[1, 2] = 0; L[5] = 0  # one zero patch of image 1, every patch of image 5
    with pytest.raises(ValueError, match=r"local_embeddings of images \[1, 5\] have zero-length patches .*image 1: patches \[2\]; image 5: patches \[0, 1, 2, 3\]"):
        small(local_embeddings=L)
    c = small()
    with pytest.raises(ValueError, match="a cache needs at least one image"):
        small(image_embeddings=c.image_embeddings[:0], labels=c.labels[:0], shift=c.shift[:0], source=None, local_embeddings=None)


def test_a_fit_split_or_patches_the_detectors_would_refuse_are_refused_at_construction():
    "Zero-length fit rows, an empty fit split or L=0 patches were accepted; kNN-ID, Mahalanobis and GL-MCM were then skipped with a warning."
    F = np.random.default_rng(1).normal(size=(3, 5)).astype(np.float32); F[1] = 0
    with pytest.raises(ValueError, match=r"fit_embeddings rows \[1\] have zero length"): small(fit_embeddings=F, fit_labels=[0, 1, 2])
    with pytest.raises(ValueError, match=r"fit_embeddings hold no image.*leave the fit split out"):
        small(fit_embeddings=np.zeros((0, 5), np.float32), fit_labels=np.zeros(0, np.int64))
    with pytest.raises(ValueError, match=r"local_embeddings hold no patch.*leave local_embeddings out"):
        small(local_embeddings=np.zeros((7, 0, 5), np.float32))


def test_many_classes_are_checked_for_shared_directions_in_little_memory():
    "The check built all C(C-1)/2 pairs of d-vectors in float64: 1.9 GiB for C = 1,000 and d = 512, 191 GiB for C = 10,000."
    import subprocess, sys
    code = ("import resource, numpy as np\n"
            "resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"  # less than the pairs would take (9 GiB)
            "from proton.bench.cache import EmbeddingCache\n"
            "T = np.random.default_rng(0).standard_normal((3000, 256)).astype(np.float32); T[2999] = 2 * T[7]\n"
            "kw = dict(image_embeddings=T[:10], labels=np.arange(10), shift=['id'] * 10, temperature=0.01)\n"
            "EmbeddingCache(text_embeddings=T[:2999], class_names=[f'c{i}' for i in range(2999)], **kw)\n"
            "try: EmbeddingCache(text_embeddings=T, class_names=[f'c{i}' for i in range(3000)], **kw)\n"
            "except ValueError as e: print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == ("text_embeddings rows 7 and 2999 point the same way: "
                                                      "two classes with one text embedding cannot be told apart"), r.stderr[-500:]


@pytest.mark.parametrize("dtype, scale", [(np.float64, 1e160), (np.float32, 1e20)])
def test_rows_whose_length_overflows_their_dtype_are_refused_at_construction(dtype, scale):
    "float64 rows of 1e160 and float32 rows of 1e20 were accepted (numpy's overflow warning only) and failed later in evaluate."
    import warnings
    E = small().image_embeddings.astype(dtype); E[[2, 5]] *= dtype(scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refusal, not numpy's RuntimeWarning
        with pytest.raises(ValueError, match=rf"image_embeddings rows \[2, 5\] are too long to normalise in {np.dtype(dtype)}"):
            small(image_embeddings=E)
        F = small().image_embeddings[:3].astype(dtype); F[1] *= dtype(scale)
        with pytest.raises(ValueError, match=rf"fit_embeddings rows \[1\] are too long"): small(fit_embeddings=F, fit_labels=[0, 1, 2])
    assert small(image_embeddings=small().image_embeddings * np.float32(1e15)).image_embeddings.dtype == np.float32  # long, but within float32
