"""The detector's promises under adversarial input: batch invariance at the boundaries of the configuration, no autograd
history, supported dtypes only, consistent saved states, all-or-nothing calls on every path. Each test was written to
fail on the code before its fix (issue 13)."""
import copy
import io
import math
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import proton.bank
from proton import Proton, ProtonConfig
from proton.engine import STEP_MAX
from reference import clustered_stream

# ---------------------------------------------------------------------------------------------- batch invariance

boundaries = st.fixed_dictionaries(dict(
    gamma=st.sampled_from([1.0, 0.5, 0.7, 0.99]), bank_size=st.sampled_from([1, 2, 5]), k_min=st.sampled_from([1, 2]),
    alpha=st.sampled_from([(0.3, 0.7), (0.5, 0.5), (0.0, 1.0)]), slope=st.sampled_from([0.0, 100.0, 1e6]),
    var_ref=st.sampled_from([0.0, 0.02]), temperature=st.sampled_from([1e-4, 0.01, 0.2, 50.0]),
    dtype=st.sampled_from([torch.float32, torch.float64]), ties=st.booleans(), seed=st.integers(0, 10_000)))


def boundary_stream(p):
    """Two axis-aligned classes and a noisy stream around them; with `ties`, every third image sits exactly between the two:
    its logits are equal in every path (exact arithmetic), so its confidence is exactly 1/2."""
    rng = np.random.default_rng(p["seed"])
    T = np.eye(2, 8)
    E = T[rng.integers(0, 2, 120)] + rng.normal(size=(120, 8)) / 3
    if p["ties"]: E[::3] = T[0] + T[1]
    return T, E


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(boundaries)
def test_every_path_agrees_at_the_boundaries(p):
    T, E = boundary_stream(p)
    k_min = min(p["k_min"], p["bank_size"])
    cfg = ProtonConfig(gamma=p["gamma"], bank_size=p["bank_size"], k_min=k_min, alpha_min=p["alpha"][0], alpha_max=p["alpha"][1],
                       slope=p["slope"], var_ref=p["var_ref"], temperature=p["temperature"])
    E = E.astype(np.float64 if p["dtype"] == torch.float64 else np.float32)
    whole = Proton(T, cfg, dtype=p["dtype"]).score(E, return_parts=True)  # the vectorised engine
    single, steps = Proton(T, cfg, dtype=p["dtype"]), Proton(T, cfg, dtype=p["dtype"])
    one = torch.cat([single.score(e) for e in E])  # the one-image path
    parts = [steps.score(e[None], return_parts=True) for e in E]  # the step path, one image per call
    assert torch.equal(torch.cat([q.enqueued for q in parts]), whole.enqueued)
    assert torch.equal(torch.cat([q.predicted for q in parts]), whole.predicted)
    # the engine's Gram expansion rounds differently from a dot product (the parity tests' tolerance), and a cosine's
    # last-bit rounding reaches the logits multiplied by 1/τ
    tol = (1e-10 if p["dtype"] == torch.float64 else 1e-5) + 4 * torch.finfo(p["dtype"]).eps / p["temperature"]
    for got in (one, torch.cat([q.score for q in parts])):
        assert (got.double() - whole.score.double()).abs().max() <= tol
    assert torch.equal(single.bank.counts, steps.bank.counts)


def test_return_parts_gives_the_same_score_as_the_scores_alone():
    "With γ = 1 the gate hangs on whether 1 + e^(z2 - z1) rounds to 1: both ways of asking for one image must round alike."
    T = np.eye(2, 4)
    cfg = ProtonConfig(gamma=1.0, k_min=1, bank_size=2, temperature=0.01)
    theta = np.linspace(0.5, 0.72, 60)  # logit gaps from about 10 to 40: e^-gap straddles float32's and float64's epsilon
    E = np.stack([np.cos(theta), np.sin(theta), 0 * theta, 0 * theta], 1).astype(np.float32)
    a, b = Proton(T, cfg, dtype=torch.float32), Proton(T, cfg, dtype=torch.float32)
    got, want = torch.cat([a.score(e) for e in E]), torch.cat([b.score(e, return_parts=True).score for e in E])
    assert torch.equal(a.bank.counts, b.bank.counts) and torch.equal(got, want)


# ---------------------------------------------------------------------------------------------- autograd

def test_scoring_never_records_autograd_history():
    T, E = clustered_stream(2, 16, 200, seed=0)
    det = Proton(T, ProtonConfig(k_min=2, temperature=0.2))
    x = torch.tensor(E[:10], requires_grad=True)
    assert not det.score(x).requires_grad
    assert not det.bank.entries.requires_grad and not det.bank.prototypes.requires_grad
    det.score(torch.tensor(E[10:100]))  # more than STEP_MAX rows: the engine copies the bank
    assert not det.score(torch.tensor(E[100:101], requires_grad=True)).requires_grad


# ---------------------------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_a_detector_computes_in_float32_or_float64_only(dtype):
    with pytest.raises(ValueError, match="compute in float32 or float64"): Proton(np.eye(2), dtype=dtype)


def test_half_precision_inputs_are_upcast():
    T, E = clustered_stream(2, 16, 50, seed=0)
    want = Proton(T, dtype=torch.float32).score(torch.tensor(E, dtype=torch.float16).float())
    got = Proton(T, dtype=torch.float32).score(torch.tensor(E, dtype=torch.float16))
    assert torch.equal(got, want)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
       n=st.integers(0, 2 * STEP_MAX), flat=st.booleans(), parts=st.booleans())
def test_every_floating_dtype_scores_as_its_float32_copy(dtype, n, flat, parts):
    "Any batch size on any path (one image, steps, engine; scores or parts): the same as the input upcast by hand."
    T, E = clustered_stream(2, 16, 2 * STEP_MAX, seed=0)
    x = torch.tensor(E[:n]).to(dtype)
    if flat and n == 1: x = x[0]  # a (d,) vector
    a, b = Proton(T, dtype=torch.float32), Proton(T, dtype=torch.float32)
    got, want = a.score(x, return_parts=parts), b.score(x.float(), return_parts=parts)
    for g, w in zip(got, want) if parts else [(got, want)]: torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(a.bank.entries, b.bank.entries) and torch.equal(a.bank.counts, b.bank.counts)


@pytest.mark.parametrize("bad", [np.ones((3, 2), dtype=bool), np.ones((3, 2), dtype=np.complex64)])
def test_bool_and_complex_embeddings_are_refused(bad):
    det = Proton(np.eye(2))
    with pytest.raises(ValueError, match="image embeddings must be real numbers"): det.score(bad)
    with pytest.raises(ValueError, match="text embeddings must be real numbers"): Proton(bad)


# ---------------------------------------------------------------------------------------------- saved states

def trained(dtype=torch.float64, n=150):
    T, E = clustered_stream(2, 16, 400, seed=3)
    T = T * np.array([[3.7], [0.31]])  # text embeddings as a model returns them: not unit length
    det = Proton(T, ProtonConfig(bank_size=8, k_min=2, temperature=0.2), dtype=dtype)
    det.score(E[:n])
    return det, T, E


def bad_states():
    det, T, _ = trained()
    sd = det.state_dict()
    def changed(**kw): return {**sd, **kw}
    beyond = sd["bank"].clone(); beyond[0, -1] = 1.0  # counts < M for class 0? make sure below
    yield "entries beyond counts", changed(counts=torch.tensor([3, 3]), bank=beyond), "beyond"
    long = sd["bank"].clone(); long[0, 0] *= 2
    yield "non-unit rows", changed(bank=long), "unit length"
    yield "fractional counts", changed(counts=torch.tensor([2.5, 3.0])), "integer"
    yield "bool counts", changed(counts=torch.tensor([True, True])), "integer"
    yield "n=0 with m2>0", changed(welford=torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)), "n = 0"
    yield "n=1e300", changed(welford=torch.tensor([1e300, 0.0, 1.0], dtype=torch.float64)), "welford"
    yield "a list", [1, 2, 3], "state dict must be a dict"
    yield "missing config key", changed(config={k: v for k, v in sd["config"].items() if k != "gamma"}), "config"
    yield "extra config key", changed(config={**sd["config"], "beta": 1}), "config"
    yield "integer text embeddings", changed(text_embeddings=torch.eye(2, 16, dtype=torch.int64)), "text embeddings"


@pytest.mark.parametrize("name,state,message", list(bad_states()), ids=[b[0] for b in bad_states()])
def test_impossible_states_are_refused_and_change_nothing(name, state, message):
    det, _, _ = trained()
    before = det.state_dict()
    with pytest.raises(ValueError, match=message): det.load_state_dict(state)
    after = det.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in ("bank", "counts", "welford"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_save_load_continue_is_bitwise(dtype):
    det, T, E = trained(dtype)
    buffer = io.BytesIO(); torch.save(det.state_dict(), buffer); buffer.seek(0)
    restored = Proton.from_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(restored.score(E[150:]), det.score(E[150:]))
    for e in E[200:260]: assert torch.equal(restored.score(e), det.score(e))  # and one image at a time


# ---------------------------------------------------------------------------------------------- all or nothing

def test_an_interrupted_step_path_call_leaves_no_trace(monkeypatch):
    det, T, E = trained(n=100)
    before = det.state_dict()
    add, calls = proton.bank.PrototypeBank.add, []
    def interrupting(self, c, e):
        calls.append(c)
        if len(calls) == 3: raise KeyboardInterrupt
        return add(self, c, e)
    monkeypatch.setattr(proton.bank.PrototypeBank, "add", interrupting)
    with pytest.raises(KeyboardInterrupt): det.score(E[100:120])
    monkeypatch.setattr(proton.bank.PrototypeBank, "add", add)
    after = det.state_dict()
    assert len(calls) == 3 and det.welford.n == 100
    assert all(torch.equal(after[k], before[k]) for k in ("bank", "counts", "welford"))


class Interrupting(np.ndarray):
    "The one-image path's vector of ones, read right after the queue and its count are written: a Ctrl-C arrives there."
    def __getitem__(self, i): raise KeyboardInterrupt


def entering(det, E, full:bool):
    "The first image of `E` that enters a full queue (`full`) or one not yet full, found on copies of `det`."
    for j in range(len(E)):
        c = copy.copy(det); c.score(E[j])
        changed = (c.bank.entries != det.bank.entries).any((1, 2)) | (c.bank.counts != det.bank.counts)
        if changed.any() and bool((det.bank.counts[changed] == det.config.bank_size).all()) == full: return j


def assert_untouched(det, before, T):
    "`det`'s state is `before`, and it saves and loads."
    after = det.state_dict()
    for k in ("bank", "counts", "prototypes", "welford", "var_ref"): torch.testing.assert_close(after[k], before[k], rtol=0, atol=0, equal_nan=True)
    loaded = Proton(T, det.config, dtype=det.dtype).load_state_dict(after).state_dict()
    for k in ("bank", "counts", "prototypes", "welford", "var_ref"): torch.testing.assert_close(loaded[k], after[k], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("where, n", [("shift", 100), ("write", 100), ("write", 4), ("dtype", 100), ("full", 4)])
def test_an_interrupted_one_image_call_leaves_no_trace(monkeypatch, where, n):
    det, T, E = trained(n=n)
    det.score(E[n])  # one image: the detector makes the views that path works on
    j = n + 1 + entering(det, E[n + 1:], full=n == 100)
    before, shift, real = det.state_dict(), proton.engine._shift_up, dict(dtype=Proton.dtype.fget, full=torch.full).get(where)
    if where == "shift":  # right after the full queue moved up a row
        def interrupting(*a): shift(*a); raise KeyboardInterrupt
        monkeypatch.setattr(proton.engine, "_shift_up", interrupting)
    elif real is not None:  # while the one-image path builds its return value
        def interrupting(*a, **kw):
            if sys._getframe(1).f_code.co_name == "_score_one": raise KeyboardInterrupt
            return real(*a, **kw)
        monkeypatch.setattr(*((Proton, "dtype", property(interrupting)) if where == "dtype" else (torch, "full", interrupting)))
    else: det._views.ones = det._views.ones.view(Interrupting)
    with pytest.raises(KeyboardInterrupt): det.score(E[j])
    assert_untouched(det, before, T)


def test_an_interrupt_at_the_end_of_the_warm_up_leaves_no_trace(monkeypatch):
    T, E = clustered_stream(2, 16, 300, seed=5)
    cfg = ProtonConfig(bank_size=8, k_min=2, temperature=0.2, warmup=40)
    det, ref = Proton(T, cfg), Proton(T, cfg)
    det.score(E[:39]); ref.score(E[:40])
    before = det.state_dict()
    def interrupting(self): raise KeyboardInterrupt  # arrives just before σ²_0 is read off the warm-up
    monkeypatch.setattr(Proton, "_learn_var_ref", interrupting)
    with pytest.raises(KeyboardInterrupt): det.score(E[39])
    monkeypatch.undo()
    assert_untouched(det, before, T)
    det.score(E[39])
    assert det.var_ref == ref.var_ref != cfg.var_ref and torch.equal(det.state_dict()["welford"], ref.state_dict()["welford"])


# ---------------------------------------------------------------------------------------------- messages

class Evil:
    def __reduce__(self): return (print, ("this must never run",))


@pytest.mark.parametrize("loader", ["load_detector", "load_weights"])
def test_a_refused_pickle_says_why_without_advising_to_unpickle(loader, tmp_path):
    from proton.deploy import load_detector
    from proton.models.vlm import load_weights
    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError) as e: dict(load_detector=load_detector, load_weights=load_weights)[loader](tmp_path / "evil.pt")
    message = str(e.value)
    assert "it holds a pickled print object" in message and "\n" not in message
    assert "weights_only` set to `False`" not in message and "add_safe_globals" not in message and "weights_only=False" not in message


@pytest.mark.filterwarnings("error::RuntimeWarning")
@settings(max_examples=40, deadline=None, derandomize=True)
@given(dtype=st.sampled_from([torch.float32, torch.float64]), scale=st.floats(0.2, 1.0), size=st.sampled_from([(4,), (1, 4), (3, 4)]),
       sign=st.sampled_from([1.0, -1.0]))
def test_a_length_too_long_to_normalise_is_refused_without_a_warning(dtype, scale, size, sign):
    "Finite rows whose squared length overflows the detector's dtype, on the one-image and batch paths: the error, no warning."
    big = sign * scale * float(torch.finfo(dtype).max)
    det = Proton(np.eye(2, 4), dtype=dtype)
    x = np.full(size, big, dtype=np.float32 if dtype == torch.float32 else np.float64)
    with pytest.raises(ValueError, match="too long to normalise"): det.score(x)
    assert det.welford.n == 0


def test_an_overflowing_length_is_not_called_nan():
    det = Proton(np.eye(2, 4), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"rows \[0\] are too long to normalise in torch.float32"): det.score(np.full((1, 4), 1e30))
    with pytest.raises(ValueError, match=r"rows \[1\] hold values too large for torch.float32"): det.score(np.array([[1.0, 0, 0, 0], [1e39, 0, 0, 0]]))
    with pytest.raises(ValueError, match="contains NaN or Inf"): det.score(np.array([[np.inf, 0, 0, 0]]))


# ---------------------------------------------------------------------------------------------- models

def config_only_folder(tmp_path):
    "A folder shaped like a Hugging Face open_clip snapshot, but without its weights file."
    import json
    import open_clip
    folder = tmp_path / "snapshot"; folder.mkdir()
    (folder / "open_clip_config.json").write_text(json.dumps(dict(model_cfg=open_clip.get_model_config("ViT-S-32"), preprocess_cfg={})))
    return folder


def test_missing_weights_are_an_error(tmp_path):
    from proton.models import load_vlm
    folder = config_only_folder(tmp_path)
    with pytest.raises(FileNotFoundError, match="no weights file"): load_vlm("quiltnet", folder)
    with pytest.raises(FileNotFoundError, match="no weights file"): load_vlm(f"open_clip:ViT-S-32/{folder}")


def test_random_weights_only_when_asked_for():
    from proton.models import load_vlm
    with pytest.raises(ValueError, match="name the weights"): load_vlm("open_clip:ViT-S-32")
    a, b = load_vlm("open_clip:ViT-S-32/none", seed=3), load_vlm("open_clip:ViT-S-32/none", seed=3)
    assert torch.equal(a.encode_text(["a cat"]), b.encode_text(["a cat"]))  # seeded


# ---------------------------------------------------------------------------------------------- images

@pytest.mark.parametrize("top", [4095, 65535])
def test_wide_grey_images_keep_their_gradation(top, tmp_path):
    from PIL import Image
    from proton.models.vlm import as_rgb_image
    ramp = np.linspace(0, top, 256 * 64).reshape(64, 256).astype(np.uint16)  # 12-bit data in a 16-bit PNG, and full 16-bit
    Image.fromarray(ramp).save(tmp_path / "ramp.png")
    with Image.open(tmp_path / "ramp.png") as im: grey = np.asarray(as_rgb_image(im))[..., 0]
    assert len(np.unique(grey)) >= 250 and grey.min() == 0 and grey.max() == 255
    assert np.array_equal(np.asarray(as_rgb_image(ramp))[..., 0], grey)  # the array itself, too


def test_a_broken_link_in_a_prepared_folder_is_reported(tmp_path):
    from PIL import Image
    from proton.bench.prepared import read_prepared
    (tmp_path / "id" / "a").mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(tmp_path / "id" / "a" / "x.png")
    (tmp_path / "id" / "a" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    with pytest.raises(ValueError, match=r"id/a/gone.png is a broken link"): read_prepared(tmp_path)


@pytest.mark.parametrize("n", [30, 80])
def test_save_load_continue_is_bitwise_around_a_warm_up(n):
    T, E = clustered_stream(2, 16, 300, seed=5)
    cfg = ProtonConfig(bank_size=8, k_min=2, temperature=0.2, warmup=40)
    det = Proton(T, cfg); det.score(E[:n])
    restored = Proton.from_state_dict(det.state_dict())
    assert (restored.var_ref == det.var_ref) and (n < 40) == (det.var_ref == cfg.var_ref)
    assert torch.equal(restored.score(E[n:]), det.score(E[n:]))
    with pytest.raises(ValueError, match="does not fit a warm-up of 40 images"):
        Proton(T, cfg).load_state_dict(det.state_dict() | {"var_ref": torch.tensor(math.nan, dtype=torch.float64)})
