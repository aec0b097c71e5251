"Inputs of the synthetic world and of simulated caches: integer knobs and counts as numpy or whole floats, the rest refused in one line; caches in another byte order."
import dataclasses
import hashlib
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from proton.bench.cache import EmbeddingCache, content_digest, write_npz_atomic
from proton.bench.synth import SHIFTS, SyntheticWorld
from proton.scores import as_tensor

SMALL = dict(dim=40, noise_rank=8)  # a world that builds fast

def one_line(e): return "\n" not in str(e)

# an integer given as numpy, as a 0-d tensor or as a whole float
as_kinds = st.sampled_from([int, np.int64, np.int32, np.uint16, float, np.float64, lambda v: torch.tensor(v)])

@settings(max_examples=40, deadline=None)
@given(kind=as_kinds, seed=st.integers(0, 1000), n_classes=st.integers(1, 5), noise_rank=st.integers(1, 12))
def test_integer_knobs_of_any_number_type_give_the_world_of_the_python_int(kind, seed, n_classes, noise_rank):
    knobs = dict(n_classes=n_classes, dim=40, noise_rank=noise_rank, seed=seed)
    w, ref = SyntheticWorld(**{k: kind(v) for k, v in knobs.items()}), SyntheticWorld(**knobs)
    assert dataclasses.asdict(w) == dataclasses.asdict(ref) and all(type(getattr(w, k)) is int for k in knobs)
    for s in SHIFTS: assert torch.equal(w.sample(s, 3, seed=kind(seed))[0], ref.sample(s, 3, seed=seed)[0])

@pytest.mark.parametrize("knob, value", [("n_classes", 0), ("n_classes", -1), ("n_classes", 2.5), ("n_classes", True), ("n_classes", "2"),
                                         ("noise_rank", -3), ("noise_rank", 1.5), ("noise_rank", float("nan")), ("dim", 80.5), ("dim", float("inf")),
                                         ("dim", None), ("seed", 1.5), ("seed", 2**64), ("seed", "0"), ("seed", np.float32(0.5))])
def test_a_bad_integer_knob_is_named_in_one_line(knob, value):
    with pytest.raises(ValueError, match=rf"^{knob} must be (an|a positive|a non-negative) integer") as e: SyntheticWorld(**(SMALL | {knob: value}))
    assert one_line(e.value)

FLOAT_KNOBS = [f.name for f in dataclasses.fields(SyntheticWorld) if f.type is float and f.name != "temperature"]

@pytest.mark.parametrize("knob", FLOAT_KNOBS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), "0.5", None, np.array([0.5, 0.5])])
def test_a_real_knob_that_is_no_finite_number_is_named_in_one_line(knob, value):
    "A NaN or infinite knob drew NaN embeddings (the cache refused them later, naming rows); a string or None a raw TypeError."
    with pytest.raises(ValueError, match=rf"^{knob} must be a finite number, got ") as e: SyntheticWorld(**(SMALL | {knob: value}))
    assert one_line(e.value)

@pytest.mark.parametrize("value, message", [(-1., "temperature must be positive"), (0., "temperature must be positive"), ("0.01", "temperature must be a positive, finite number")])
def test_a_world_refuses_a_temperature_no_cache_could_hold(value, message):
    with pytest.raises(ValueError, match=message): SyntheticWorld(**(SMALL | dict(temperature=value)))

def test_real_knobs_of_any_number_type_give_the_world_of_the_python_float():
    w, ref = SyntheticWorld(**SMALL, spread=np.float64(0.25), temperature=torch.tensor(0.02, dtype=torch.float64)), SyntheticWorld(**SMALL, spread=0.25, temperature=0.02)
    assert dataclasses.asdict(w) == dataclasses.asdict(ref) and type(w.spread) is float and type(w.temperature) is float
    assert torch.equal(w.sample("far", 4)[0], ref.sample("far", 4)[0])

@pytest.mark.parametrize("kind", SHIFTS)
def test_noise_rank_zero_draws_no_noise(kind):
    w = SyntheticWorld(dim=40, noise_rank=0)
    E, _ = w.sample(kind, 5, dtype=torch.float64)
    assert torch.isfinite(E).all() and torch.allclose(E.norm(dim=1), torch.ones(5, dtype=torch.float64))
    EmbeddingCache.from_world(w, n_id=6, n_per_shift=3)

@pytest.mark.parametrize("arg, value", [("n", -1), ("n", 2.5), ("n", float("nan")), ("n", "3"), ("seed", 1.5), ("seed", float("inf")), ("seed", "1")])
def test_a_bad_count_or_seed_of_a_sample_is_named(arg, value):
    args = dict(n=3, seed=0) | {arg: value}
    with pytest.raises(ValueError, match=f"^{arg} must be") as e: SyntheticWorld(**SMALL).sample("id", **args)
    assert one_line(e.value)

def test_a_huge_numpy_sample_seed_does_not_overflow():
    w = SyntheticWorld(**SMALL)
    for s in (1, 2**62, 2**63 - 1): assert torch.equal(w.sample("id", 2, seed=np.int64(s))[0], w.sample("id", 2, seed=s)[0])

@settings(max_examples=20, deadline=None)
@given(kind=as_kinds, n_id=st.integers(0, 6), n_fit=st.integers(0, 4), seed=st.integers(0, 50))
def test_from_world_takes_numpy_and_whole_counts_and_records_plain_ints(kind, n_id, n_fit, seed):
    w = SyntheticWorld(**SMALL)
    c = EmbeddingCache.from_world(w, n_id=kind(n_id), n_per_shift=kind(2), seed=kind(seed), n_fit=kind(n_fit))
    ref = EmbeddingCache.from_world(w, n_id=n_id, n_per_shift=2, seed=seed, n_fit=n_fit)
    assert np.array_equal(c.image_embeddings, ref.image_embeddings) and (n_fit == 0 or np.array_equal(c.fit_embeddings, ref.fit_embeddings))
    assert {k: c.metadata[k] for k in ("n_id", "n_per_shift", "seed", "n_fit")} == dict(n_id=n_id, n_per_shift=2, seed=seed, n_fit=n_fit)
    assert all(type(c.metadata[k]) is int for k in ("n_id", "n_per_shift", "seed", "n_fit"))

@pytest.mark.parametrize("arg, value", [("n_id", 3.5), ("n_id", -1), ("n_id", float("nan")), ("n_id", float("inf")), ("n_fit", "2"),
                                        ("n_per_shift", True), ("seed", 1.5), ("seed", float("nan")), ("dtype", torch.float32), ("dtype", np.int32)])
def test_a_bad_argument_of_from_world_is_named_in_one_line(arg, value):
    with pytest.raises(ValueError, match=f"^{arg} must be") as e: EmbeddingCache.from_world(SyntheticWorld(**SMALL), **{"n_id": 4, "n_per_shift": 2, arg: value})
    assert one_line(e.value)

@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_the_metadata_of_a_simulated_cache_rebuilds_it(dtype):
    c = EmbeddingCache.from_world(SyntheticWorld(**SMALL, seed=2), n_id=5, n_per_shift=3, seed=4, n_fit=2, dtype=dtype)
    m = json.loads(json.dumps(c.metadata))
    again = EmbeddingCache.from_world(SyntheticWorld(**m["world"]), m["n_id"], m["n_per_shift"], m["seed"], m["n_fit"], m["dtype"])
    for k in ("image_embeddings", "text_embeddings", "fit_embeddings"):
        a, b = getattr(c, k), getattr(again, k)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), k

@pytest.mark.parametrize("knob", ["seed", "noise_rank", "class_strength", "class_dirs"])
def test_a_world_is_read_only(knob):
    w = SyntheticWorld(**SMALL)
    with pytest.raises(dataclasses.FrozenInstanceError): setattr(w, knob, 4)
    assert dataclasses.replace(w, seed=5).seed == 5 and w.seed == 0

def _swapped(a): return a.astype(a.dtype.newbyteorder(">" if a.dtype.byteorder in "=<" else "<"))

def test_a_cache_built_from_big_endian_arrays_works_and_hashes_as_the_native_one():
    ref = EmbeddingCache.from_world(SyntheticWorld(**SMALL), n_id=6, n_per_shift=3, n_fit=2)
    arrays, _ = ref._contents()
    big = {k: _swapped(v) for k, v in arrays.items()}
    c = EmbeddingCache(**big, class_names=ref.class_names, temperature=ref.temperature, metadata=ref.metadata)
    assert all(getattr(c, k).dtype.isnative for k in ("image_embeddings", "text_embeddings", "labels", "fit_embeddings", "fit_labels"))
    assert np.array_equal(c.predicted(), ref.predicted()) and c.content_hash() == ref.content_hash()

@pytest.mark.parametrize("dtype", ["f2", "f4", "f8"])
def test_a_file_of_big_endian_arrays_loads_and_keeps_its_hash(tmp_path, dtype):
    ref = EmbeddingCache.from_world(SyntheticWorld(**SMALL), n_id=6, n_per_shift=3, n_fit=2, dtype=np.dtype(dtype))
    arrays, header = ref._contents()
    path = tmp_path / "big.npz"
    write_npz_atomic(path, {k: _swapped(v) for k, v in arrays.items()}, header)  # as a big-endian machine writes it
    assert np.load(path)["image_embeddings"].dtype.byteorder == ">" and str(np.load(path)["sha256"]) == ref.content_hash()
    back = EmbeddingCache.load(path)
    assert np.array_equal(back.predicted(), ref.predicted()) and back.content_hash() == ref.content_hash()
    assert back.image_embeddings.tobytes() == ref.image_embeddings.tobytes()

def test_the_digest_of_native_arrays_is_unchanged():
    arrays = dict(b=np.arange(6, dtype=np.float32).reshape(2, 3), a=np.array(["id", "far"]), c=np.array([True, False]))
    h = hashlib.sha256()  # the digest as it was defined: name, dtype, shape and bytes in name order, then the header
    for k in sorted(arrays): h.update(f"{k}|{arrays[k].dtype.str}|{arrays[k].shape}|".encode()); h.update(arrays[k].tobytes())
    h.update(b'{"x": 1}')
    assert content_digest(arrays, '{"x": 1}') == h.hexdigest()

@pytest.mark.parametrize("dtype", [">f2", ">f4", ">f8", ">i8", ">u2"])
def test_as_tensor_reads_either_byte_order(dtype):
    x = np.arange(6).reshape(2, 3).astype(dtype)
    assert torch.equal(as_tensor(x), as_tensor(x.astype(np.dtype(dtype).newbyteorder("="))))
