"""Bad input is refused with a message naming the problem, and nothing already in the detector is lost."""
import io
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from proton import Proton, ProtonConfig
from reference import clustered_stream

T, E = clustered_stream(3, 16, 300, seed=7)
CFG = ProtonConfig(bank_size=10, k_min=2, temperature=0.2)


def snapshot(det):
    sd = det.state_dict()
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def same_state(a, b):
    "Whether two states are equal, entry by entry (NaN equal to NaN: var_ref is NaN until a warm-up ends)."
    same = lambda x, y: x.shape == y.shape and bool(((x == y) | (x.isnan() & y.isnan()) if x.is_floating_point() else x == y).all())
    return all(same(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def with_nan(x):
    x = x.copy(); x[4, 2] = np.nan; return x


def with_inf(x):
    x = x.copy(); x[0, 0] = np.inf; return x


def with_zero_row(x):
    x = x.copy(); x[6] = 0; return x


BAD_BATCHES = {
    "nan": (with_nan, "NaN or Inf values (first offending rows: [4])"),
    "inf": (with_inf, "NaN or Inf"),
    "zero row": (with_zero_row, "rows [6] have zero length"),
    "wrong dimension": (lambda x: x[:, :10], "dimension 10, expected 16"),
    "3-D": (lambda x: x[:, :, None], "must have shape (N, d) or (d,)"),
}


@pytest.mark.parametrize("name", list(BAD_BATCHES))
def test_bad_batch_is_refused_and_state_kept(name):
    det = Proton(T, CFG)
    det.score(E[:100])
    before = snapshot(det)
    corrupt, message = BAD_BATCHES[name]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        det.score(corrupt(E[100:120]))
    assert same_state(snapshot(det), before)
    # and the stream continues exactly as if the bad call never happened
    clean = Proton(T, CFG); clean.score(E[:100])
    assert torch.equal(det.score(E[100:]), clean.score(E[100:]))


def test_misbehaving_base_score_is_refused():
    det = Proton(T, ProtonConfig(base_score=lambda logits: logits[:, 0] * np.nan))
    with pytest.raises(ValueError, match="base score returned NaN or Inf"): det.score(E[:5])
    det = Proton(T, ProtonConfig(base_score=lambda logits: logits))
    with pytest.raises(ValueError, match=r"base score must return a tensor of shape \(5,\)"): det.score(E[:5])
    assert det.welford.n == 0



@pytest.mark.parametrize("n", [1, 10, 80])  # one image, the step path, the engine
@pytest.mark.parametrize("how", ["callable", "base="])
def test_a_base_score_too_large_for_the_running_variance_is_refused_and_state_kept(n, how):
    "Finite base scores of 1e158 overflowed the running variance: NaN scores from the engine, moments that no longer load."
    scale = [1.]
    cfg = ProtonConfig(bank_size=10, k_min=2, temperature=0.2, base_score=lambda logits: -logits.amax(-1) * scale[0])
    det = Proton(T, cfg)
    det.score(E[:100])
    before = snapshot(det)
    base = np.r_[np.zeros(n - 1), -1e158]  # only the last image's score is too large
    with pytest.raises(ValueError, match=r"base scores must lie within ±1e\+100"):
        if how == "callable": scale[0] = 1e158; det.score(E[100:100 + n])
        else: det.score(E[100:100 + n], base=base)
    assert same_state(snapshot(det), before)


@pytest.mark.parametrize("n", [1, 10, 80])  # one image, the step path, the engine
@pytest.mark.parametrize("how", ["callable", "base="])
def test_a_base_score_past_float32s_range_is_refused_on_a_float32_detector_and_state_kept(n, how):
    "A float64 score of -1e39, finite where it was checked, became -inf in float32: -inf scores, then NaN moments (one image: a RuntimeError; base=: 'NaN or Inf')."
    scale = [1.]
    det = Proton(T.astype(np.float32), ProtonConfig(bank_size=10, k_min=2, temperature=0.2, base_score=lambda logits: -logits.amax(-1).double() * scale[0]))
    det.score(E[:100])
    before = snapshot(det)
    with pytest.raises(ValueError, match=r"^base scores? (returned values|must lie) (beyond|within) ±3\.4e\+38, the range of torch\.float32"):
        if how == "callable": scale[0] = 1e40; det.score(E[100:100 + n])
        else: det.score(E[100:100 + n], base=np.r_[np.zeros(n - 1), -1e39])
    assert same_state(snapshot(det), before)
    det64 = Proton(T, ProtonConfig(bank_size=10, k_min=2, temperature=0.2), dtype=torch.float64)
    assert torch.isfinite(det64.score(E[:n], base=np.r_[np.zeros(n - 1), -1e39])).all()  # float64 holds it


@pytest.mark.parametrize("path", ["one image", "(1, d) parts", "steps", "engine"])
@pytest.mark.parametrize("base_score", ["mcm", "entropy"])
def test_a_tau_too_small_for_the_embeddings_length_is_named_and_state_kept(path, base_score):
    "At τ = 1e-37, long embeddings' logits (cosine × length / τ) overflowed float32 before the length was divided out: 'base score returned NaN or Inf' (mcm) or a NaN confidence that never passes the gate (entropy)."
    cfg = ProtonConfig(bank_size=10, k_min=2, temperature=1e-37, base_score=base_score)
    X = np.tile(np.array([[100., 10.], [20., 100.]], np.float32), (40, 1))
    run = {"one image": lambda d: d.score(X[0]), "(1, d) parts": lambda d: d.score(X[:1], return_parts=True),
           "steps": lambda d: d.score(X[:2]), "engine": lambda d: d.score(X)}[path]
    det = Proton(np.eye(2, dtype=np.float32), cfg)
    det.score(X[:2] / np.linalg.norm(X[:2], axis=1, keepdims=True))  # unit length: the same directions score
    before = snapshot(det)
    with pytest.raises(ValueError, match=r"^temperature 1e-37 is too small for image embeddings of length up to 10[0-9.]+: their logits, cosine × length / τ, overflow torch.float32"):
        run(det)
    assert same_state(snapshot(det), before)


@pytest.mark.parametrize("n", [10, 80])  # the step path, the engine
def test_base_scores_at_the_bound_keep_the_running_variance_finite(n):
    from proton.fusion import MAX_BASE
    det = Proton(T, CFG)
    base = np.where(np.arange(n) % 2, MAX_BASE, -MAX_BASE)
    scores = torch.cat([det.score(E[a:a + n], base=base) for a in range(0, 160, n)])
    assert torch.isfinite(scores).all()
    Proton(T, CFG).load_state_dict(det.state_dict())  # moments a stream could produce

@pytest.mark.parametrize("kwargs, message", [
    (dict(gamma=0.0), "gamma must be in"), (dict(gamma=1.5), "gamma must be in"),
    (dict(bank_size=4, k_min=5), "bank_size must be at least k_min=5, got 4"),
    (dict(k_min=0), "k_min must be an integer from 1 to 1048576, got 0"),
    (dict(temperature=0.0), "temperature must be positive"), (dict(temperature=-1.0), "temperature must be positive"),
    (dict(temperature=float("inf")), "temperature must be positive and finite"),
    (dict(alpha_min=0.9, alpha_max=0.7), "alpha_min <= alpha_max"),
    (dict(var_ref=-0.1), "var_ref must be non-negative"),
    (dict(base_score="odin"), "unknown base score 'odin'"),
    (dict(gamma="0.7"), "gamma must be a number, got '0.7'"), (dict(slope=True), "slope must be a number, got True"),
    (dict(bank_size="10"), "bank_size must be an integer from 1 to 1048576, got '10'"),
    (dict(k_min=2.5), "k_min must be an integer from 1 to 1048576, got 2.5"), (dict(warmup=3.5), "warmup must be an integer from 0 to 16777216, got 3.5"),
    (dict(alpha_max=np.array([0.5, 0.7])), "alpha_max must be a number"),
])
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message): ProtonConfig(**kwargs)


BIG = 10**20  # an integer, but past int64: numpy cannot hold it


def _threshold(w):
    from proton.deploy import WarmupThreshold
    return WarmupThreshold(warmup=w)


def _audit(m):
    from proton.deploy import bank_audit
    return bank_audit([0], [True], 1, m)


@pytest.mark.parametrize("make, name, low, high", [(lambda v: ProtonConfig(k_min=v, bank_size=2**20), "k_min", 1, 2**20),
                                                   (lambda v: ProtonConfig(bank_size=v), "bank_size", 1, 2**20),
                                                   (lambda v: ProtonConfig(warmup=v), "warmup", 0, 2**24),
                                                   (_threshold, "warmup", 2, 2**24), (_audit, "bank_size", 1, 2**20)])
def test_a_size_outside_its_range_is_refused_with_the_range(make, name, low, high):
    "Nothing bounded them: bank_size=10**12 reached the allocator, warmup=10**12 was taken; past int64 the message called an integer no integer."
    for v in (high + 1, BIG, low - 1):
        with pytest.raises(ValueError, match=rf"^{name} must be an integer from {low} to {high}, got {v}$"): make(v)
    make(high)  # the bound itself passes the check (no bank is allocated here)


@settings(max_examples=40, deadline=None)
@given(whole=st.sampled_from([int, float, np.int64, np.int32, np.uint16, np.float64, lambda v: torch.tensor(v)]),
       real=st.sampled_from([float, int, np.float32, np.float64, np.int64, lambda v: torch.tensor(float(v))]))
def test_a_config_of_numpy_or_torch_numbers_holds_plain_numbers_and_its_state_loads_safely(whole, real):
    "A grid of settings from numpy (np.arange, np.linspace) gave a detector whose saved state `weights_only` refused to load."
    cfg = ProtonConfig(gamma=real(1), bank_size=whole(10), k_min=whole(2), alpha_min=real(0), alpha_max=real(1), var_ref=real(0),
                       slope=real(50), warmup=whole(4), temperature=real(1) / 5)
    assert {f: type(getattr(cfg, f)).__name__ for f in ("bank_size", "k_min", "warmup")} == dict.fromkeys(("bank_size", "k_min", "warmup"), "int")
    assert {type(getattr(cfg, f)) for f in ("gamma", "alpha_min", "alpha_max", "var_ref", "slope", "temperature")} == {float}
    det = Proton(T, cfg); scores = det.score(E[:60])
    buf = io.BytesIO(); torch.save(det.state_dict(), buf); buf.seek(0)
    restored = Proton.from_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(restored.score(E[60:90]), det.score(E[60:90]))


@pytest.mark.parametrize("make, message", [
    (dict(warmup="50"), "warmup must be an integer from 2 to 16777216, got '50'"),
    (dict(id_recall="0.9"), "id_recall must be in (0, 1), got '0.9'"),
    (dict(id_recall=np.array([0.9, 0.8])), "id_recall must be in (0, 1), got array"),
    (dict(k="1"), "need k >= 0 and h > 0, finite, got k='1'"),
    (dict(h=None), "need k >= 0 and h > 0, finite, got k=0.5, h=None"),
])
def test_bad_monitor_settings(make, message):
    from proton.deploy import CusumDrift, WarmupThreshold
    with pytest.raises(ValueError, match=re.escape(message)): (CusumDrift if {"k", "h"} & set(make) else WarmupThreshold)(**make)


def test_bad_text_embeddings():
    with pytest.raises(ValueError, match="text embeddings contains NaN"): Proton(with_nan(np.eye(8)))
    with pytest.raises(ValueError, match="text embeddings rows \\[1\\] have zero length"): Proton(np.array([[1.0, 0], [0, 0]]))


@pytest.mark.parametrize("text, got", [(None, "NoneType"), ("abc", "str"), ([[1., 0.], [1.]], "list"),
                                       (np.eye(2, dtype=object), "ndarray of dtype object")])
def test_text_embeddings_that_are_no_numeric_array_are_named_in_one_line(text, got):
    "`Proton(text)` met numpy's IndexError or torch's TypeError in `compute_dtype` before the text embeddings were checked."
    with pytest.raises(ValueError, match=rf"^text embeddings must be a numeric array or tensor, got {got}$"): Proton(text)


@pytest.mark.parametrize("arg, value", [("base", np.zeros((2, 2))), ("routed", np.zeros((2, 2), dtype=int)), ("routed", np.zeros((4, 1), dtype=int))])
def test_base_scores_or_routed_classes_of_more_than_one_dimension_are_refused(arg, value):
    "`base=` and `routed=` of shape (2, 2) for four images were flattened into four values without a word."
    det = Proton(T, CFG)
    name = {"base": "base scores", "routed": "routed classes"}[arg]
    with pytest.raises(ValueError, match=rf"^{name} must have shape \(4,\), got {re.escape(str(value.shape))}$"): det.score(E[:4], **{arg: value})
    assert det.welford.n == 0


def test_one_image_takes_its_base_score_or_routed_class_as_a_number():
    "A single image's base score or class given as a number, as one writes it for one image, is its (1,) array."
    for kw, one in ((dict(base=0.25), dict(base=[0.25])), (dict(base=torch.tensor(0.25)), dict(base=[0.25])), (dict(base=np.float64(0.25)), dict(base=[0.25])),
                    (dict(routed=1), dict(routed=[1])), (dict(routed=torch.tensor(1)), dict(routed=[1]))):
        a, b = Proton(T, CFG), Proton(T, CFG)
        assert torch.equal(a.score(E[0], **kw), b.score(E[:1], **one))
        with pytest.raises(ValueError, match=r"^(base scores|routed classes) must (have shape \(2,\)|hold one class per image \(2\))"): a.score(E[:2], **kw)


@pytest.mark.parametrize("kw, message", [(dict(device="gpu"), "unknown device 'gpu': use cpu, cuda or cuda:N"),
                                         (dict(dtype="float32"), "a detector can compute in float32 or float64, not 'float32' (a str, not a torch.dtype)")]
                         + [(dict(device="cuda"), "the device 'cuda' was asked for, but CUDA is not available here")] * (not torch.cuda.is_available()))
def test_the_constructors_device_and_dtype_are_checked_as_to_checks_them(kw, message):
    "`Proton(T, device=...)` met torch's raw errors, and dtype='float32' was refused as 'not float32'."
    with pytest.raises(ValueError, match="^" + re.escape(message)): Proton(T, **kw)


def test_rows_shorter_than_min_norm_are_not_called_zero_length():
    "Rows of length 1e-13 were refused as having 'zero length'."
    tiny = np.full((2, 16), 2.5e-14)
    for call in (lambda: Proton(T).score(tiny), lambda: Proton(tiny)):
        with pytest.raises(ValueError, match=r"rows \[0, 1\] have zero length or a length below 1e-12 \(MIN_NORM\)"): call()


def test_empty_batch():
    det = Proton(T, CFG)
    for empty in (np.zeros((0, 16)), torch.zeros(0, 16), []):
        out = det.score(empty)
        assert isinstance(out, torch.Tensor) and out.shape == (0,)
    parts = det.score(np.zeros((0, 16)), return_parts=True)
    assert all(len(p) == 0 for p in parts) and det.welford.n == 0


def test_restore_mid_stream_through_a_file(tmp_path):
    det = Proton(T, CFG)
    det.score(E[:137])
    torch.save(det.state_dict(), tmp_path / "state.pt")
    restored = Proton(T, CFG).load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert torch.equal(restored.score(E[137:]), det.score(E[137:]))


@pytest.mark.parametrize("key, value, message", [
    ("format", "proton-state-0", "unknown state format"),
    ("counts", torch.tensor([11, 0, 0]), r"state counts \[11, 0, 0\] must lie in \[0, 10\]"),
    ("bank", torch.zeros(3, 9, 16), r"state bank has shape \(3, 9, 16\)"),
    ("welford", torch.tensor([-1.0, 0, 0], dtype=torch.float64), "welford moments"),
    ("welford", torch.tensor([3.0, np.nan, 0], dtype=torch.float64), "NaN"),
    ("text_embeddings", torch.zeros(2, 16), r"state text embeddings has shape \(2, 16\), expected \(3, 16\)"),
    ("text_embeddings", torch.ones(3, 16) / 4, "state was saved for other text embeddings"),
])
def test_corrupt_state_is_refused(key, value, message):
    det = Proton(T, CFG); det.score(E[:60])
    before = snapshot(det)
    sd = det.state_dict(); sd[key] = value
    target = Proton(T, CFG); target.score(E[:60])
    with pytest.raises(ValueError, match=message): target.load_state_dict(sd)
    assert same_state(snapshot(target), before)


def test_a_one_image_state_whose_queue_nearly_cancels_reloads():
    "The one-image path sums a queue in another order than the load check did: a queue whose mean nearly cancels was refused on reload."
    d, M = 512, 100
    rng = np.random.default_rng(0)
    X = rng.normal(size=(M // 2, d)); X /= np.linalg.norm(X, axis=1, keepdims=True)
    u = rng.normal(size=d); u /= np.linalg.norm(u)
    E = np.concatenate([X + 1e-6 * u, -X + 1e-6 * u])[rng.permutation(M)].astype(np.float32)  # the queue's mean: about 1e-6 u
    det = Proton(rng.normal(size=(1, d)).astype(np.float32), ProtonConfig(bank_size=M, k_min=1))
    for e in E: det.score(e)
    assert torch.equal(Proton.from_state_dict(det.state_dict()).bank.prototypes, det.bank.prototypes)


@pytest.mark.parametrize("change", [lambda p: p.roll(1, 1), lambda p: p * 0.99, lambda p: p.index_fill(0, torch.tensor([0]), 0),
                                    lambda p: torch.nn.functional.normalize(p + 1e-3 * torch.ones_like(p))])
def test_a_prototype_that_is_not_its_queues_normalised_sum_is_refused(change):
    det = Proton(T, CFG); det.score(E[:60])
    sd = det.state_dict(); sd["prototypes"] = change(sd["prototypes"])
    with pytest.raises(ValueError, match="state prototypes are not the normalised sums of their queues"): Proton(T, CFG).load_state_dict(sd)


def test_state_from_another_configuration_is_refused():
    sd = Proton(T, CFG).state_dict()
    with pytest.raises(ValueError, match=r"bank_size=10 \(here 100\)"): Proton(T, ProtonConfig(temperature=0.2, k_min=2)).load_state_dict(sd)


WARM = ProtonConfig(bank_size=10, k_min=2, temperature=0.2, warmup=20)


def hand_edited(key, value):
    "A warm-up detector's state after 60 images, with `sd[key]` replaced by `value`, or changed by it when callable."
    det = Proton(T, WARM); det.score(E[:60])
    sd = det.state_dict(); sd[key] = value(sd[key]) if callable(value) else value
    return sd


@pytest.mark.parametrize("key, value, message", [
    ("var_ref", torch.tensor(np.inf, dtype=torch.float64), "state var_ref inf"),
    ("welford", lambda w: w.index_fill(0, torch.tensor([1]), 1e300), r"state welford moments .* \|mean\| <= 1e\+100"),
    ("welford", lambda w: w.index_fill(0, torch.tensor([2]), 1e205), r"state welford moments .* m2 <= 2 \* n \* 1e\+200"),
    ("bank", lambda b: b.half(), "state bank must be float32 or float64, got torch.float16"),
    ("prototypes", lambda p: p.bfloat16(), "state prototypes must be float32 or float64, got torch.bfloat16"),
])
def test_a_refused_state_leaves_the_detector_as_it_was(key, value, message):
    "A refused load replaced the running moments first (var_ref = inf was refused after); moments no stream reaches and float16 banks were accepted."
    det, twin = Proton(T, WARM), Proton(T, WARM)
    det.score(E[:30]); twin.score(E[:30])
    with pytest.raises(ValueError, match=message): det.load_state_dict(hand_edited(key, value))
    assert same_state(snapshot(det), snapshot(twin))
    assert torch.equal(det.score(E[30:100]), twin.score(E[30:100]))


def test_a_state_of_tensors_that_require_grad_loads_and_scores():
    "torch.load keeps requires_grad: such a bank or text made every later score and deepcopy fail."
    import copy
    det = Proton(T, CFG); det.score(E[:60])
    sd = {k: v.clone().requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in det.state_dict().items()}
    buf = io.BytesIO(); torch.save(sd, buf); buf.seek(0); sd = torch.load(buf, weights_only=True)
    batch, one = copy.deepcopy(det).score(E[60:120]), torch.cat([det.score(e) for e in E[60:120]])
    for restored in (Proton(T, CFG).load_state_dict(sd), Proton.from_state_dict(sd)):
        assert torch.equal(copy.deepcopy(restored).score(E[60:120]), batch)
        assert torch.equal(torch.cat([restored.score(e) for e in E[60:120]]), one)


# the deployment helpers, the metrics and the routed scores: bad input named, state kept

def test_a_warm_up_refuses_scores_that_are_not_finite_and_keeps_its_state():
    from proton.deploy import WarmupThreshold
    thr = WarmupThreshold(warmup=3)
    thr.update([0.1], [True])
    with pytest.raises(ValueError, match="scores must be finite"): thr.update([0.2, np.nan], [True, True])
    assert thr.seen == [0.1] and thr.theta is None
    thr.update([0.2, 0.3], [True, True])
    assert thr.theta == 0.3


@pytest.mark.parametrize("calibrated", [[True, True], [[True, True, True]]])
def test_a_warm_up_refuses_calibration_flags_that_do_not_match_the_scores(calibrated):
    from proton.deploy import WarmupThreshold
    thr = WarmupThreshold(warmup=3)
    with pytest.raises(ValueError, match=r"calibrated must hold one flag per score \(3\)"): thr.update([0.1, 0.2, 0.3], calibrated)
    assert thr.seen == [] and thr.theta is None


@pytest.mark.parametrize("predicted, bank_size, message", [([0, 0, 1], 0, "bank_size must be an integer from 1 to 1048576, got 0"),
                                                          ([0, 0, 1], -1, "bank_size must be an integer from 1 to 1048576, got -1"),
                                                          ([0.9, 1.9, 0.], 5, "predicted classes must be integers"),
                                                          ([True, False, True], 5, "predicted classes must be integers")])
def test_a_bank_audit_refuses_what_no_bank_could_hold(predicted, bank_size, message):
    from proton.deploy import bank_audit
    with pytest.raises(ValueError, match=re.escape(message)): bank_audit(predicted, [True] * 3, 2, bank_size)


@pytest.mark.parametrize("enqueued, got", [(["False", "False"], "dtype <U5"), ([np.nan, 0.], "nan in a float array"), ([.5, 0.], "0.5 in a float array"),
                                           ([2, 0], "values in [0, 2]"), ([-1, 1], "values in [-1, 1]")])
def test_a_bank_audit_refuses_enqueued_flags_that_are_not_booleans(enqueued, got):
    "Any truthy value counted as enqueued: a CSV column of 'False' strings, NaN or 0.5 put images in the bank."
    from proton.deploy import bank_audit
    with pytest.raises(ValueError, match=re.escape(f"enqueued must be booleans or 0/1, got {got}")): bank_audit([0, 1], enqueued, 2, 3)
    assert bank_audit([0, 1], [0, 1], 2, 3) == bank_audit([0, 1], [False, True], 2, 3) == bank_audit([0, 1], [0., 1.], 2, 3) == [(1, 0, 1)]


@pytest.mark.parametrize("n_classes, message", [(v, f"an integer from 1 to {2**63 - 1}") for v in (None, "2", 2.5, True, -1, 0)])
def test_a_bank_audit_refuses_a_number_of_classes_that_is_no_positive_integer(n_classes, message):
    "n_classes went unchecked: 2.0, None and '2' met raw TypeErrors, and -1 gave an empty audit without a word."
    from proton.deploy import bank_audit
    with pytest.raises(ValueError, match=re.escape(f"n_classes must be {message}, got {n_classes!r}")): bank_audit([], [], n_classes, 3)
    assert bank_audit([0, 1], [True, True], 2.0, 3) == bank_audit([0, 1], [True, True], 2, 3) == [(0, 0, 0), (1, 0, 1)]


def test_a_bank_audit_of_very_many_classes_visits_only_those_seen():
    "bank_audit looped over every class up to n_classes: 10^9 classes took minutes for a three-image stream, and 10^20 was 'no positive integer'."
    import signal
    from proton.deploy import bank_audit
    def stuck(*_): raise TimeoutError("bank_audit still looping after 20 s")
    old = signal.signal(signal.SIGALRM, stuck); signal.alarm(20)
    try: assert bank_audit([7, 3, 7], [True, True, True], 10**9, 3) == [(3, 0, 1), (7, 0, 0), (7, 1, 2)]
    finally: signal.alarm(0); signal.signal(signal.SIGALRM, old)
    with pytest.raises(ValueError, match=re.escape(f"n_classes must be an integer from 1 to {2**63 - 1}, got {10**20}")): bank_audit([0], [True], 10**20, 3)


def test_bfloat16_scores_are_scores():
    from proton import ood_metrics
    from proton.deploy import CusumDrift, WarmupThreshold, threshold_for_id_recall
    s = torch.linspace(0, 1, 50)
    assert ood_metrics(s.bfloat16(), (s + .5).bfloat16()) == ood_metrics(s.bfloat16().float(), (s + .5).bfloat16().float())
    assert threshold_for_id_recall(s.bfloat16()) == threshold_for_id_recall(s.bfloat16().float())
    assert CusumDrift().update(s.bfloat16())[0].shape == (50,)
    assert WarmupThreshold(warmup=2).set_reference(s.bfloat16()).theta is not None


@pytest.mark.parametrize("args, message", [(([0., 1.], [2.]), None), ((np.array([]), np.array([1.])), "scores_id must be a non-empty 1-D array"),
                                           ((np.array([np.nan, 1.]), np.array([.5])), "scores_id contains NaN or Inf"),
                                           ((np.array([0., 1.]), np.array([.5]), 1.5), r"recall must be in \(0, 1\], got 1.5"),
                                           ((np.array([0., 1.]), np.array([.5]), float("nan")), r"recall must be in \(0, 1\], got nan"),
                                           ((np.array([0., 1.]), np.array([.5]), "0.9"), r"recall must be in \(0, 1\], got '0.9'")])
def test_fpr_at_recall_checks_its_input_as_ood_metrics_does(args, message):
    from proton.metrics import fpr_at_recall
    if message is None: assert fpr_at_recall(*args) == 0.0  # lists are scores too
    else:
        with pytest.raises(ValueError, match=message): fpr_at_recall(*args)


@pytest.mark.parametrize("routed", [[0.7, 1.2, 0.2], [True, False, True]])
def test_routed_scores_refuse_classes_that_are_not_integers(routed):
    from proton.bench.baselines import routed_score
    with pytest.raises(ValueError, match="routed classes must be integers"): routed_score("mcm", E[:3], T, 0.2, routed)


def test_a_float32_state_restores_a_float64_detector():
    "A state saved by a float32 detector holds rows of unit length to float32's precision, not to float64's."
    det = Proton(torch.as_tensor(T, dtype=torch.float32), CFG); det.score(E[:100])
    wide = Proton(torch.as_tensor(T, dtype=torch.float64), CFG).load_state_dict(det.state_dict())
    assert wide.dtype == torch.float64
    torch.testing.assert_close(wide.score(E[100:]).float(), det.score(E[100:]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("text, message", [(lambda t: t * 2, "text embeddings rows .* unit length"),
                                           (lambda t: "abc", "state text embeddings must be a tensor"),
                                           (lambda t: None, "state text embeddings must be a tensor")])
def test_a_state_whose_text_embeddings_are_not_unit_rows_is_refused(text, message):
    det = Proton(T, CFG); det.score(E[:60])
    sd = det.state_dict(); sd["text_embeddings"] = text(sd["text_embeddings"])
    with pytest.raises(ValueError, match=message): Proton.from_state_dict(sd)


def monitor_state():
    from proton.deploy import Monitor, WarmupThreshold
    m = Monitor(Proton(T, CFG), WarmupThreshold(warmup=20))
    m.score(E[:150])
    return m.state_dict()


@pytest.mark.parametrize("change, message", [
    (lambda sd: {k: v for k, v in sd.items() if k != "drift"}, "monitor state has no 'drift'"),
    (lambda sd: sd | {"threshold": None}, "threshold state must be a dict"),
    (lambda sd: sd | {"threshold": {k: v for k, v in sd["threshold"].items() if k != "warmup"}}, "threshold state has the keys"),
    (lambda sd: sd | {"threshold": sd["threshold"] | {"theta": float("nan")}}, "threshold state: theta must be a finite number"),
    (lambda sd: sd | {"threshold": sd["threshold"] | {"std": -1.}}, "threshold state: std must be a positive"),
    (lambda sd: sd | {"threshold": sd["threshold"] | {"seen": [0.] * 25, "theta": None, "mean": None, "std": None, "source": None}}, "holds 25 warm-up scores of 20"),
    (lambda sd: sd | {"drift": sd["drift"] | {"statistic": -2.}}, r"drift state: statistic must be a number in \[0, h=5.0\]"),
    (lambda sd: sd | {"drift": sd["drift"] | {"statistic": 5.01}}, r"drift state: statistic must be a number in \[0, h=5.0\]"),
    (lambda sd: sd | {"notes": 1}, r"monitor state has the keys \['detector', 'drift', 'format', 'notes', 'threshold'\], expected \['detector', 'drift', 'format', 'threshold'\]"),
])
def test_a_corrupt_monitor_state_is_refused(change, message):
    from proton.deploy import Monitor
    with pytest.raises(ValueError, match=message): Monitor.from_state_dict(change(monitor_state()))


def test_a_cusum_statistic_at_h_loads_and_raises_no_alarm_until_it_grows():
    "C = h is a statistic a CusumDrift holds (the alarm needs C > h), so the bound is inclusive."
    from proton.deploy import Monitor
    sd = monitor_state(); sd["drift"]["statistic"] = 5.
    r = Monitor.from_state_dict(sd)
    assert r.drift.statistic == 5. and not r.drift.update([0.5])[1].any() and r.drift.update([0.6])[1].all()


@pytest.mark.parametrize("key", ["theta", "mean", "std", "seen"])
def test_a_monitor_state_of_0d_tensors_holds_floats_and_scores_as_the_saved_one(key):
    "A threshold held as 0-d tensors was stored as it was; the next score raised a TypeError after the detector had taken in the batch."
    from proton.deploy import Monitor, WarmupThreshold
    warmup = 200 if key == "seen" else 20  # a warm-up still filling, or over
    m = Monitor(Proton(T, CFG), WarmupThreshold(warmup=warmup)); m.score(E[:150])
    sd = m.state_dict(); t = sd["threshold"]
    as_tensor = lambda v: torch.tensor(v, dtype=torch.float64)
    t[key] = [as_tensor(v) for v in t[key]] if key == "seen" else as_tensor(t[key])
    r = Monitor.from_state_dict(sd)
    assert all(type(v) is float for v in r.threshold.seen + [r.threshold.theta, r.threshold.mean, r.threshold.std] if v is not None)
    for a, b in zip(r.score(E[150:]), m.score(E[150:])): np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kw, message", [(dict(rho="0.5"), "rho (the ID fraction) must be in (0, 1), got '0.5'"),
                                         (dict(seed=1.5), "seed must be a non-negative integer, got 1.5"),
                                         (dict(sample_seed=-1), "sample_seed must be a non-negative integer, got -1"),
                                         (dict(order="id_first", warmup=float("nan")), "warmup must be an integer in [0, "),
                                         (dict(order="id_first", warmup="5"), "warmup must be an integer in [0, ")])
def test_a_stream_with_a_setting_that_is_no_number_is_named(kw, message):
    from proton.bench import EmbeddingCache, SyntheticWorld
    from proton.bench.streams import make_stream
    cache = EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=40, n_per_shift=20)
    with pytest.raises(ValueError, match=re.escape(message)): make_stream(cache, "far", **kw)


def test_an_empty_loader_gives_empty_arrays():
    from proton.interop import OpenOODPostprocessor
    pred, conf, label = OpenOODPostprocessor(Proton(T, CFG)).inference(lambda x: x, [], progress=False)
    assert pred.shape == conf.shape == label.shape == (0,)


@pytest.mark.parametrize("size", [10**11, 10**17])
def test_a_bank_too_large_for_memory_is_named_with_its_size(size):
    "--bank-size 100000000000 failed with the allocator's message, which names neither the bank nor the setting; 10**17, with torch's size overflow."
    from proton.bank import PrototypeBank  # ProtonConfig now refuses such an M (past MAX_BANK); a bank within it can still outgrow memory with many classes
    with pytest.raises(ValueError, match=rf"a bank of 3 queues of {size} entries of dimension 16 needs [\d,.]+ GiB.*choose a smaller bank_size"):
        PrototypeBank(3, 16, size)


def test_the_openood_postprocessor_is_one_of_openoods_when_openood_is_installed(monkeypatch):
    "OpenOOD's Evaluator refuses a post-processor that is not an instance of its BasePostprocessor (OpenOOD is not installable here: a stand-in)."
    import importlib, types
    import proton.interop
    base = types.ModuleType("openood.postprocessors"); base.BasePostprocessor = type("BasePostprocessor", (), {})
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "openood", types.ModuleType("openood")); m.setitem(sys.modules, "openood.postprocessors", base)
        post = importlib.reload(proton.interop).OpenOODPostprocessor(Proton(T, CFG))
    importlib.reload(proton.interop)  # back to the module without OpenOOD
    assert isinstance(post, base.BasePostprocessor) and not post.APS_mode and post.hyperparam_search_done
    assert not issubclass(proton.interop.OpenOODPostprocessor, base.BasePostprocessor)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_pytorch_ood_detector_sent_to_cuda_without_cuda_is_refused_in_one_line():
    "ProtonDetector.to('cuda') was accepted on a CPU-only machine, and the next predict_features failed with 'Found no NVIDIA driver'."
    from proton.interop import pytorch_ood_detector
    det = Proton(T, CFG); det.score(E[:40]); before = snapshot(det)
    ood = pytorch_ood_detector(det)
    with pytest.raises(ValueError, match=r"^the device 'cuda' was asked for, but CUDA is not available here$"): ood.to("cuda")
    assert same_state(snapshot(det), before) and det.device.type == "cpu"
    assert torch.equal(ood.predict_features(torch.tensor(E[40:42])), Proton(T, CFG).load_state_dict(before).score(E[40:42]))


@pytest.mark.parametrize("device", ["cpu"] + ["cuda"] * torch.cuda.is_available())
def test_a_pytorch_ood_detector_moves_its_protons_state(device):
    from proton.interop import pytorch_ood_detector
    det, twin = Proton(T, CFG), Proton(T, CFG)
    det.score(E[:40]); twin.score(E[:40])
    ood = pytorch_ood_detector(det)
    assert ood.to(device) is ood and det.device.type == det.bank.entries.device.type == det.bank.counts.device.type == device
    torch.testing.assert_close(ood.predict_features(torch.tensor(E[40:100])).cpu(), twin.score(E[40:100]))
    assert torch.equal(det.bank.counts.cpu(), twin.bank.counts)


def test_a_full_disk_while_saving_a_state_is_named_and_keeps_the_old_file(tmp_path, monkeypatch):
    "A disk that fills mid-save is `No space left on device` (not torch's 'unexpected pos'), and the previous state stays whole."
    import errno
    import os
    from proton import deploy
    path = tmp_path / "state.pt"
    deploy.save_state({"x": torch.zeros(10)}, path)
    before = path.read_bytes()
    class Full(io.FileIO):  # a disk with room for 100 more bytes
        def write(self, b):
            if self.tell() + memoryview(b).nbytes > 100: raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(b)
    monkeypatch.setattr(deploy, "open", lambda p, mode: Full(p, mode.replace("b", "")), raising=False)
    with pytest.raises(OSError, match="No space left on device") as e: deploy.save_state({"x": torch.ones(1000)}, path)
    assert e.value.errno == errno.ENOSPC
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["state.pt"]


@pytest.mark.parametrize("x, got", [((np.ones(16, np.float32), np.ones(3, np.float32)), "tuple"), ([[1.] * 16, [1.] * 3], "list")])
def test_a_ragged_input_to_score_is_named_in_one_line(x, got):
    "A (features, logits) pair or a ragged list given to `Proton.score` met numpy's 'inhomogeneous shape' in the one-image path, naming neither the embeddings nor the input's type."
    T, _ = clustered_stream(3, 16, 10, seed=0)
    det = Proton(T)
    with pytest.raises(ValueError, match=rf"^image embeddings must be a numeric array or tensor, got {got}$"): det.score(x)
    assert det.welford.n == 0


def test_a_ragged_list_of_scores_is_named_in_one_line():
    "A ragged list given to the metrics or the deployment tools met numpy's raw 'inhomogeneous shape', naming no argument."
    from proton import ood_metrics
    from proton.deploy import CusumDrift, WarmupThreshold, threshold_for_id_recall
    r = [.1, [.2, .3]]
    for call, name in ((lambda: ood_metrics([.1, .2], r), "scores_ood"), (lambda: threshold_for_id_recall(r), "scores_id"),
                       (lambda: WarmupThreshold(3).set_reference(r), "scores_id"), (lambda: WarmupThreshold(3).update(r, [True, True]), "scores"),
                       (lambda: CusumDrift().update(r), "z")):
        with pytest.raises(ValueError, match=rf"^{name} must be a numeric array or tensor, got list$"): call()


def test_saving_into_a_missing_folder_names_the_destination_and_the_folder(tmp_path):
    "Saving into a folder that does not exist raised FileNotFoundError naming a hidden temporary file ('.proton.pt.<hex>.tmp')."
    from proton.deploy import replace_atomically, save_detector, save_state
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    for folder, error, why in ((tmp_path / "checkpoints", FileNotFoundError, "folder {} does not exist"),
                               (tmp_path / "notes.txt", NotADirectoryError, "{} is not a folder")):
        dest = folder / "proton.pt"
        for save in (lambda: save_detector(Proton(T, CFG), dest), lambda: save_state({"x": torch.zeros(1)}, dest),
                     lambda: replace_atomically(dest, lambda f: f.write(b"x"))):
            with pytest.raises(error, match=f"^{re.escape(f'cannot write {dest}: ' + why.format(folder.resolve()))}$"): save()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # no folder made, nothing left behind


def test_a_destination_that_is_a_folder_is_named_not_the_temporary_file(tmp_path):
    "Saving onto a folder raised IsADirectoryError naming the hidden temporary file ('.state.pt.<hex>.tmp')."
    from proton.deploy import replace_atomically, save_detector
    dest = tmp_path / "state.pt"; dest.mkdir()
    for save in (lambda: save_detector(Proton(T, CFG), dest), lambda: replace_atomically(dest, lambda f: f.write(b"x"))):
        with pytest.raises(IsADirectoryError, match=f"^{re.escape(f'cannot write {dest}: it is a folder')}$"): save()
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"] and not any(dest.iterdir())


def test_loading_a_folder_passes_the_os_error_through():
    "A folder given as a state was 'not a torch file of tensors (IsADirectoryError)'."
    from proton.deploy import load_detector, load_monitor
    for load in (load_detector, load_monitor):
        with pytest.raises(IsADirectoryError, match=re.escape(f"Is a directory: '{Path(__file__).parent}'")): load(Path(__file__).parent)


def unprivileged(code:str):
    "The output of `code` run in a Python that file permissions bind: as root, through setpriv without the capabilities that override them."
    import shutil, subprocess
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        if not shutil.which("setpriv"): pytest.skip("root without setpriv: file permissions do not bind")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_an_unreadable_state_and_a_read_only_folder_are_named_by_their_os_errors(tmp_path):
    "A state without read permission was 'not a torch file', and saving into a read-only folder named the hidden temporary file."
    from proton.deploy import save_detector
    state, ro = tmp_path / "state.pt", tmp_path / "ro"
    save_detector(Proton(T, CFG), state); state.chmod(0)
    ro.mkdir(); ro.chmod(0o555)
    out = unprivileged(f"""
from proton.deploy import load_detector, save_state
for call in (lambda: load_detector({str(state)!r}), lambda: save_state({{}}, {str(ro / 'state.pt')!r})):
    try: call()
    except Exception as e: print(type(e).__name__, e)
""")
    assert out.splitlines() == [f"PermissionError [Errno 13] Permission denied: '{state}'", f"PermissionError cannot write {ro / 'state.pt'}: Permission denied"]
    assert not any(ro.iterdir())


def test_a_callable_base_score_for_a_state_saved_with_a_named_one_is_refused(tmp_path):
    "load_detector(path, base_score=f) on a state saved with 'mcm' went on scoring with mcm and ignored f without a word."
    from proton.deploy import Monitor, load_detector, load_monitor, save_detector, save_state
    det = Proton(T, CFG); det.score(E[:40])
    save_detector(det, tmp_path / "det.pt"); save_state(Monitor(det).state_dict(), tmp_path / "mon.pt")
    energy = lambda z: -z.logsumexp(1)
    for load in (lambda: Proton.from_state_dict(det.state_dict(), base_score=energy), lambda: load_detector(tmp_path / "det.pt", base_score=energy),
                 lambda: load_monitor(tmp_path / "mon.pt", base_score=energy)):
        with pytest.raises(ValueError, match=r"^state was saved with base score 'mcm', yet a base_score callable was given: pass one only for a state saved with a custom base score$"): load()
    assert load_detector(tmp_path / "det.pt").config.base_score == "mcm"


CALLABLES = """
import functools
class Margin:
    "Minus the gap between the two largest logits."
    def __call__(self, logits):
        top2 = logits.topk(2, -1).values
        return top2[..., 1] - top2[..., 0]
def scaled_mcm(logits, k): return -k * logits.softmax(-1).amax(-1)
def plain(logits): return -logits.amax(-1)
margin, half = Margin(), functools.partial(scaled_mcm, k=0.5)
"""

SAVE_OR_LOAD = """
import sys, numpy as np, torch
import callables
from proton import Proton, ProtonConfig
T = np.eye(3, dtype=np.float32); E = np.random.default_rng(0).normal(size=(20, 3)).astype(np.float32)
for name in ("margin", "half", "plain"):
    path, f = f"{sys.argv[2]}/{name}.pt", getattr(callables, name)
    if sys.argv[1] == "save":
        det = Proton(T, ProtonConfig(base_score=f)); det.score(E); torch.save(det.state_dict(), path)
    else: print(name, Proton.from_state_dict(torch.load(path, weights_only=True), base_score=f).welford.n)
"""


def test_a_state_saved_with_a_callable_object_or_a_partial_restores_in_another_process(tmp_path):
    "A callable object or a partial was recorded by its repr, which holds a memory address: no other process could match it, and the restore was refused."
    import subprocess
    (tmp_path / "callables.py").write_text(CALLABLES); (tmp_path / "run.py").write_text(SAVE_OR_LOAD)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    run = lambda step: subprocess.run([sys.executable, str(tmp_path / "run.py"), step, str(tmp_path)], env=env, capture_output=True, text=True)
    assert run("save").returncode == 0
    load = run("load")
    assert load.stdout.splitlines() == ["margin 20", "half 20", "plain 20"], load.stderr
    names = [torch.load(tmp_path / f"{n}.pt", weights_only=True)["config"]["base_score"] for n in ("margin", "half", "plain")]
    assert names[2] == "callable:plain" and not any(re.search("0x[0-9a-f]", n) for n in names), names  # a function is named as before


READ_ONLY = """
import sys, warnings, numpy as np
from proton import Proton, ProtonConfig
np.save(sys.argv[2], np.random.default_rng(0).normal(size=(80, 3)).astype(np.float32))
E = np.load(sys.argv[2], mmap_mode="r")
np.save(sys.argv[2] + ".int.npy", np.array([0, 1, 2, 0, 1])); np.save(sys.argv[2] + ".bool.npy", np.ones(5, bool))
from proton.deploy import bank_audit
warnings.simplefilter("error")  # torch warns once a process: one path a process
det = Proton(np.eye(3, dtype=np.float32), ProtonConfig(k_min=1))
{"one image": lambda: det.score(E[0]), "steps": lambda: det.score(E[:10]), "engine": lambda: det.score(E),
 "base=": lambda: det.score(E[:5], base=E[:5, 0]),
 "routed": lambda: det.score(np.array(E[:5]), routed=np.load(sys.argv[2] + ".int.npy", mmap_mode="r")),  # writable embeddings: torch warns once a process
 "bank audit": lambda: bank_audit(np.load(sys.argv[2] + ".int.npy", mmap_mode="r"), np.load(sys.argv[2] + ".bool.npy", mmap_mode="r"), 3, 2)}[sys.argv[1]]()
"""


@pytest.mark.parametrize("path", ["one image", "steps", "engine", "base=", "routed", "bank audit"])
def test_a_read_only_array_is_scored_without_torchs_not_writable_warning(tmp_path, path):
    "A memory-mapped cache (np.load(mmap_mode='r')) drew torch's 'The given NumPy array is not writable' UserWarning from every path."
    import subprocess
    r = subprocess.run([sys.executable, "-c", READ_ONLY, path, str(tmp_path / "e.npy")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr.splitlines()[-1:]


class Scaled:
    "A callable object with a parameter and the default repr."
    def __init__(self, k): self.k = k
    def __call__(self, logits): return -self.k * logits.amax(-1)


def test_a_state_saved_with_a_callable_object_is_refused_with_another_of_other_parameters():
    "Names without addresses made every instance of a class one name: a state saved with Scaled(1) restored into Scaled(5), whose scores are on another scale than its moments."
    det = Proton(T, ProtonConfig(bank_size=10, k_min=2, temperature=0.2, base_score=Scaled(1.))); det.score(E[:40])
    with pytest.raises(ValueError, match="state was saved with a different configuration: base_score="):
        Proton.from_state_dict(det.state_dict(), base_score=Scaled(5.))
    assert Proton.from_state_dict(det.state_dict(), base_score=Scaled(1.)).welford.n == det.welford.n


def test_a_base_score_that_is_a_method_of_an_object_holding_a_lock_saves_its_state():
    "state_dict deep-copied the configuration (dataclasses.asdict), and with it a bound method's object: a model holding a lock raised TypeError."
    import threading
    class Model:
        def __init__(self): self.lock = threading.Lock()
        def score(self, logits): return -logits.amax(-1)
    model = Model()
    det = Proton(T, ProtonConfig(bank_size=10, k_min=2, temperature=0.2, base_score=model.score)); det.score(E[:40])
    assert det.state_dict()["config"]["base_score"] == "callable:test_a_base_score_that_is_a_method_of_an_object_holding_a_lock_saves_its_state.<locals>.Model.score"
    assert Proton.from_state_dict(det.state_dict(), base_score=model.score).welford.n == 40


def test_a_long_double_beyond_float64_is_named_too_large_not_nan():
    "numpy's long double holds 1e4000; read as float64 it is Inf, and the error said NaN or Inf where the input holds neither."
    x = np.full((1, T.shape[1]), np.longdouble("1e4000"))
    with pytest.raises(ValueError, match=r"^image embeddings hold values too large for float64"): Proton(T, CFG).score(x)


NO_MEMORY = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                         "you tried to allocate 1024000000 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("where", ["snapshot", "buffers", "second chunk"])
def test_a_bank_that_score_cannot_copy_is_named_in_one_line_and_state_kept(monkeypatch, where):
    "Memory that runs out while scoring (the snapshot, the work arrays, a later chunk) ends in one line naming bank_size and the batch."
    import proton.detector as detector, proton.engine as engine
    det = Proton(T, CFG)
    det.score(E[:100])
    before = snapshot(det)
    def fail(*a, **k): raise NO_MEMORY
    if where == "snapshot": monkeypatch.setattr(Proton, "_snapshot", fail)
    if where == "buffers": monkeypatch.setattr(detector, "ChunkBuffers", fail)
    if where == "second chunk":  # the first chunk has advanced the bank when the second fails
        scan, calls = detector.scan_chunk, []
        monkeypatch.setattr(engine, "CHUNK_SIZE", 64)
        monkeypatch.setattr(detector, "scan_chunk", lambda *a: fail() if calls.append(1) or len(calls) == 2 else scan(*a))
    with pytest.raises(ValueError) as e:
        det.score(E[100:300])
    msg = str(e.value)
    assert "\n" not in msg and "bank_size" in msg and "200 images" in msg and "alloc_cpu" not in msg, msg
    assert same_state(snapshot(det), before)


def test_a_base_scores_own_runtime_error_is_not_called_out_of_memory():
    "Only the allocator's failure is named 'needs more memory': a base score's own RuntimeError (an overflow in its arithmetic) stays its own."
    def overflowing(logits): return torch.empty(len(logits)).fill_(1e39)
    with pytest.raises(RuntimeError, match="cannot be converted to type float without overflow"):
        Proton(T, ProtonConfig(bank_size=10, k_min=1, base_score=overflowing)).score(E[:5])
