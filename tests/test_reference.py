"""The detector against the independent float64 reference of tests/reference.py."""
import numpy as np
import pytest
import torch

from proton import Proton, ProtonConfig
from reference import clustered_stream, reference_proton

CASES = {  # name: (config, n_classes, dim, n)
    "defaults-C2": (dict(temperature=0.2), 2, 32, 500),
    "heavy-eviction": (dict(bank_size=3, k_min=2, temperature=0.2), 2, 16, 600),
    "k_min-1": (dict(bank_size=1, k_min=1, temperature=0.2), 2, 16, 300),
    "gate-nothing-passes": (dict(gamma=1.0, temperature=1.0), 3, 16, 200),
    "C10": (dict(bank_size=20, k_min=3, temperature=0.05), 10, 64, 800),
    "paper-temperature": (dict(), 2, 32, 400),
    "energy": (dict(base_score="energy", temperature=0.2, k_min=2), 3, 16, 300),
    "entropy": (dict(base_score="entropy", temperature=0.2, k_min=2), 3, 16, 300),
    "max_logit": (dict(base_score="max_logit", temperature=0.2, k_min=2), 3, 16, 300),
}
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def max_abs_diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.array_equal(np.isnan(a), np.isnan(b)), "NaN positions differ"
    finite = ~np.isnan(a)
    return np.abs(a[finite] - b[finite]).max() if finite.any() else 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, dtype):
    cfg, C, d, n = CASES[case]
    T, E = clustered_stream(C, d, n, seed=len(case))
    T, E = T.astype(np.float32 if dtype == torch.float32 else np.float64), E.astype(T.dtype if dtype == torch.float64 else np.float32)
    parts = Proton(T, ProtonConfig(**cfg)).score(E, return_parts=True)
    ref_score, ref_base, ref_proto, ref_alpha, ref_cal, ref_enq = reference_proton(T, E, **cfg)
    assert np.array_equal(parts.enqueued.numpy(), ref_enq)
    assert np.array_equal(parts.calibrated.numpy(), ref_cal)
    for got, want in [(parts.score, ref_score), (parts.base, ref_base), (parts.proto, ref_proto), (parts.alpha, ref_alpha)]:
        assert max_abs_diff(got, want) <= TOL[dtype]
    if case == "gate-nothing-passes": assert not ref_enq.any() and np.allclose(ref_score, ref_base)
    else: assert ref_cal.any() and ref_enq.any()


def test_reference_is_sensitive():
    "The comparison can fail: a detector with a different gate drifts away from the reference."
    T, E = clustered_stream(2, 32, 400, seed=1)
    ref = reference_proton(T, E, temperature=0.2)[0]
    other = Proton(T, ProtonConfig(temperature=0.2, gamma=0.9)).score(E).numpy()
    assert max_abs_diff(other, ref) > 1e-3


@pytest.mark.parametrize("seed", range(3))
def test_batch_boundaries_do_not_matter(seed):
    "Uneven batches (each taking the step or the vectorised path by size) give the scores and state of one call."
    T, E = clustered_stream(3, 16, 400, seed=seed)
    cfg = ProtonConfig(bank_size=5, k_min=2, temperature=0.2)
    one = Proton(T, cfg)
    whole = one.score(E, return_parts=True)
    cuts = np.unique(np.r_[0, np.random.default_rng(seed).integers(0, 400, 12), 400])
    det = Proton(T, cfg)
    parts = [det.score(E[a:b], return_parts=True) for a, b in zip(cuts[:-1], cuts[1:])]
    assert torch.equal(torch.cat([p.enqueued for p in parts]), whole.enqueued)
    assert max_abs_diff(torch.cat([p.score for p in parts]), whole.score) <= 1e-12
    assert torch.equal(det.bank.entries, one.bank.entries) and torch.equal(det.bank.counts, one.bank.counts)


def tie_stream(n=240, seed=0):
    "Two axis-aligned classes; every third image sits exactly between them, so its confidence is exactly 1/2 on every path."
    rng = np.random.default_rng(seed)
    T = np.eye(2, 8)
    E = T[rng.integers(0, 2, n)] + rng.normal(size=(n, 8)) / 3
    E[::3] = T[0] + T[1]
    return T, E


PATH_CASES = {  # name: (config, stream)
    "confidence-exactly-at-gamma": (dict(gamma=0.5, bank_size=4, k_min=2, temperature=0.1), tie_stream()),
    "calibration-boundary": (dict(gamma=0.6, bank_size=3, k_min=3, temperature=0.1), tie_stream(seed=1)),
    "clustered": (dict(bank_size=5, k_min=2, temperature=0.2), clustered_stream(3, 16, 300, seed=7)),
}
PATHS = {  # how the stream is fed to the detector
    "one image at a time": lambda det, E: [det.score(e) for e in E],
    "small batches": lambda det, E: [det.score(E[a:a + 7]) for a in range(0, len(E), 7)],
    "one call": lambda det, E: [det.score(E)],
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(PATH_CASES))
def test_each_path_matches_reference(case, path):
    "Every scoring path on its own against the reference, so that a mistake made alike in all paths is still caught."
    cfg, (T, E) = PATH_CASES[case]
    ref_score, _, _, _, ref_cal, ref_enq = reference_proton(T, E, **cfg)
    det = Proton(T, ProtonConfig(**cfg))
    got = torch.cat(PATHS[path](det, E))
    assert max_abs_diff(got, ref_score) <= 1e-10
    if case == "confidence-exactly-at-gamma": assert ref_enq[::3].all()  # the inclusive gate admits confidences equal to γ
    if case == "calibration-boundary": assert 0 < ref_cal.mean() < 1


@pytest.mark.parametrize("path", list(PATHS))
def test_warm_up_reference_variance_on_every_path(path):
    "σ²₀ read off the base score's variance over the first W images, then fixed; σ²₀ = var_ref until then."
    cfg = dict(bank_size=5, k_min=2, temperature=0.2, warmup=40, var_ref=0.5)
    T, E = clustered_stream(3, 16, 300, seed=11)
    ref_score = reference_proton(T, E, **cfg)[0]
    det = Proton(T, ProtonConfig(**cfg))
    got = torch.cat(PATHS[path](det, E))
    assert max_abs_diff(got, ref_score) <= 1e-10
    assert max_abs_diff(got, reference_proton(T, E, **(cfg | dict(warmup=0)))[0]) > 1e-3  # the warm-up matters here
    base = reference_proton(T, E, **cfg)[1]
    assert det.var_ref == pytest.approx(np.var(base[:40]), abs=1e-12)
