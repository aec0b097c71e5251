"""Property-based parity: the vectorised engine against the step-by-step path, over random streams and configurations.

PROTON_PARITY_EXAMPLES sets the number of random streams (80 by default; 1,500 for a thorough run)."""
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import proton.engine as engine
from proton.engine import STEP_MAX
from proton import Proton, ProtonConfig, ProtonParts
from proton.scores import as_rows, as_unit_rows
from reference import clustered_stream

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
DEVICE = os.environ.get("PROTON_TEST_DEVICE", "cpu")  # PROTON_TEST_DEVICE=cuda runs the parity tests on a GPU


def stepwise(det, X):
    "The step-by-step path on raw embeddings, normalised and classified exactly as `Proton.score` does it."
    X, norms = as_rows(X, dtype=det.dtype)
    return det._steps(X / norms[:, None], *det._classify(X, norms))


def check_same(fast, slow, det_fast, det_slow, dtype):
    assert torch.equal(fast.enqueued, slow.enqueued) and torch.equal(fast.calibrated, slow.calibrated)
    assert torch.equal(fast.predicted, slow.predicted)
    assert torch.equal(torch.isnan(fast.proto), torch.isnan(slow.proto))
    for name in ("score", "base", "alpha", "proto"):
        a, b = getattr(fast, name).double(), getattr(slow, name).double()
        ok = ~torch.isnan(b)
        assert (a[ok] - b[ok]).abs().max().item() <= TOL[dtype] if ok.any() else True, name
    assert torch.equal(det_fast.bank.entries, det_slow.bank.entries)
    assert torch.equal(det_fast.bank.counts, det_slow.bank.counts)
    assert torch.equal(det_fast.bank.prototypes, det_slow.bank.prototypes)
    wf, ws = det_fast.welford, det_slow.welford
    tol = 1e-9 if dtype == torch.float64 else TOL[dtype]
    assert wf.n == ws.n and abs(wf.mean - ws.mean) <= tol * max(1, abs(ws.mean)) and abs(wf.m2 - ws.m2) <= tol * max(1, ws.m2)


def scan_in_chunks(det, X, chunk):
    "The vectorised path on batches too small for `Proton.score` to choose it."
    X, norms = as_rows(X, dtype=det.dtype, device=det.device)
    parts = []
    for a in range(0, max(len(X), 1), chunk):
        x, n = X[a:a + chunk], norms[a:a + chunk]
        base, confidence, predicted = det._classify(x, n)
        (score, proto, alpha, cal, gated), det.welford = engine.scan_chunk(det.bank, det.welford, det.config, x / n[:, None],
                                                                           base, confidence, predicted)
        parts.append(ProtonParts(score, base, proto, alpha, cal, gated, predicted))
    return ProtonParts(*(torch.cat(x) for x in zip(*parts)))


streams = st.fixed_dictionaries(dict(
    n_classes=st.integers(1, 6), dim=st.integers(2, 24), n=st.integers(0, 400), warmup=st.integers(0, 120),
    seed=st.integers(0, 10_000), bank_size=st.integers(1, 12), k_min_frac=st.floats(0, 1),
    gamma=st.floats(0.3, 1.0), temperature=st.sampled_from([0.05, 0.1, 0.2, 0.5, 1.0]),
    base_score=st.sampled_from(["mcm", "max_logit", "energy", "entropy"]),
    chunk=st.integers(1, 97), tile=st.integers(1, 64), dtype=st.sampled_from([torch.float32, torch.float64])))


@settings(max_examples=int(os.environ.get("PROTON_PARITY_EXAMPLES", 80)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams)
def test_vectorised_equals_stepwise(p):
    T, E = clustered_stream(p["n_classes"], p["dim"], p["warmup"] + p["n"], seed=p["seed"])
    k_min = 1 + int(p["k_min_frac"] * (p["bank_size"] - 1))
    cfg = ProtonConfig(gamma=p["gamma"], bank_size=p["bank_size"], k_min=k_min, temperature=p["temperature"],
                       base_score=p["base_score"])
    T, E = torch.tensor(T, dtype=p["dtype"], device=DEVICE), torch.tensor(E, dtype=p["dtype"], device=DEVICE)
    slow, fast = Proton(T, cfg), Proton(T, cfg)
    w = p["warmup"]
    stepwise(slow, E[:w]); stepwise(fast, E[:w])  # a state to continue from, calibrated or not
    want = stepwise(slow, E[w:])
    names = ("CHUNK_SIZE", "TILE", "CUDA_CHUNK_CELLS", "CUDA_TILE_BYTES")
    old = [getattr(engine, n) for n in names]
    per_block = p["n_classes"] * p["dim"] * torch.empty(0, dtype=p["dtype"]).element_size()  # bytes of one block's (C, d) window sums
    try:  # several tiles per chunk on a CPU; on a GPU, chunks of p["chunk"] images in tiles of p["tile"] blocks, by their budgets
        for n, v in zip(names, (p["chunk"], p["tile"], p["chunk"] * p["n_classes"], p["tile"] * per_block)): setattr(engine, n, v)
        got = fast.score(E[w:], return_parts=True) if len(E) - w > engine.STEP_MAX else scan_in_chunks(fast, E[w:], p["chunk"])
    finally:
        for n, v in zip(names, old): setattr(engine, n, v)
    check_same(got, want, fast, slow, p["dtype"])


def test_a_class_that_never_passes_the_gate():
    rng = np.random.default_rng(3)
    T = as_unit_rows(rng.normal(size=(2, 16))).numpy()
    E = T[rng.integers(0, 2, 500)] + 0.5 * rng.normal(size=(500, 16)) / 4
    T = np.vstack([T, -T.sum(0)])  # a third class that every image points away from
    cfg = ProtonConfig(bank_size=4, k_min=2, temperature=0.2)
    slow, fast = Proton(T, cfg), Proton(T, cfg)
    want, got = stepwise(slow, E), scan_in_chunks(fast, E, len(E))
    assert not (want.predicted == 2).any() and want.enqueued.any() and not want.calibrated.any()
    check_same(got, want, fast, slow, torch.float64)


def test_calibration_inside_a_chunk_and_heavy_eviction():
    T, E = clustered_stream(3, 16, 3000, seed=4)
    cfg = ProtonConfig(bank_size=2, k_min=2, temperature=0.2)
    slow, fast = Proton(T, cfg), Proton(T, cfg)
    want, got = stepwise(slow, E), scan_in_chunks(fast, E, len(E))
    first = int(want.calibrated.int().argmax())
    assert 0 < first < 100 and want.enqueued.sum() > 50 * cfg.bank_size  # the queues wrap many times
    check_same(got, want, fast, slow, torch.float64)


def test_parity_check_can_fail():
    "A deliberately wrong engine (queues that never evict) is caught by the same comparison."
    T, E = clustered_stream(2, 16, 400, seed=5)
    cfg = ProtonConfig(bank_size=3, k_min=1, temperature=0.2)
    slow, fast = Proton(T, cfg), Proton(T, cfg)
    want = stepwise(slow, E)
    right = engine.eviction_rows
    try:
        engine.eviction_rows = lambda n_src, base, M, *rest: right(n_src, base, 10**9, *rest)  # nothing is ever evicted
        got = scan_in_chunks(fast, E, len(E))
    finally:
        engine.eviction_rows = right
    with pytest.raises(AssertionError):
        check_same(got, want, fast, slow, torch.float64)


def test_ill_conditioned_similarities_are_recomputed():
    "Entries that nearly cancel make the Gram expansion lose digits: the engine must notice and recompute."
    rng = np.random.default_rng(0)
    e = rng.normal(size=8); e /= np.linalg.norm(e)
    E = np.stack([e, -e + 1e-3 * rng.normal(size=8), e] * 30, dtype=np.float32)  # one class, queues nearly cancelling
    cfg = ProtonConfig(bank_size=2, k_min=1, gamma=0.5)
    slow, fast = Proton(e[None], cfg, dtype=torch.float32), Proton(e[None], cfg, dtype=torch.float32)
    want = stepwise(slow, E)
    calls = []
    right = engine.queue_entries
    try:
        engine.queue_entries = lambda *a: calls.append(len(a[6])) or right(*a)
        got = scan_in_chunks(fast, E, len(E))
    finally:
        engine.queue_entries = right
    assert len(calls) > 1  # the final bank, and at least one recomputation
    check_same(got, want, fast, slow, torch.float32)



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [39, 9, 4, 1])
def test_a_queue_that_cancels_at_a_block_start_is_recomputed(dtype, chunk):
    "Queue [0, 1], [0, -1] before row 8, a block start (M = L = 2): the window sum accumulated from the changes is not exact there."
    X = torch.tensor([[0., -1.], [1., -.5], [4., -2.], [-2., 4.], [-1., 2.], [0., 2.], [0., 4.], [0., -2.], [0., -2.]] + [[1., -.5]] * 30, dtype=dtype)
    cfg = ProtonConfig(bank_size=2, k_min=1, gamma=0.3, temperature=0.01)
    text = torch.tensor([[0.82161814, 0.33043708]], dtype=dtype)
    slow, fast = Proton(text, cfg), Proton(text, cfg)
    want = stepwise(slow, X)
    got = fast.score(X, return_parts=True) if chunk == len(X) else scan_in_chunks(fast, X, chunk)
    check_same(got, want, fast, slow, dtype)


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries(dict(dim=st.integers(2, 12), pairs=st.integers(17, 60), seed=st.integers(0, 10_000),
                                  delta=st.sampled_from([1e-2, 1e-3, 1e-4, 1e-5]), chunk=st.integers(1, 97), tile=st.integers(1, 8),
                                  dtype=st.sampled_from([torch.float32, torch.float64]))))
@example(p=dict(dim=2, pairs=52, seed=905, delta=1e-3, chunk=6, tile=1, dtype=torch.float32))  # the sum shrinks after the block start
def test_near_cancelling_pairs_at_block_starts(p):
    "Pairs x, -x + δ·noise fill a queue of two just before each block start: every window sum there nearly cancels."
    rng = np.random.default_rng(p["seed"])
    x = rng.normal(size=(p["pairs"], p["dim"]))
    X = torch.tensor(np.stack([x, -x + p["delta"] * rng.normal(size=x.shape)], 1).reshape(-1, p["dim"]), dtype=p["dtype"])
    cfg = ProtonConfig(bank_size=2, k_min=1, gamma=0.5)  # one class: every image enters its queue
    slow, fast = Proton(X[:1], cfg), Proton(X[:1], cfg)
    want = stepwise(slow, X)
    old = engine.TILE
    try:
        engine.TILE = 2 * p["tile"]  # tiles of whole blocks, the sums carried from tile to tile
        got = scan_in_chunks(fast, X, p["chunk"])
    finally:
        engine.TILE = old
    check_same(got, want, fast, slow, p["dtype"])

def near_the_gate(gamma, dtype):
    "Images of class 0 of two (τ = 0.01, text np.eye(2, 4)) whose confidences in `dtype` lie within a few units in the last place of γ."
    gap = 0.01 * np.log(gamma / (1 - gamma))  # the cosine gap at which the softmax of two classes gives γ
    z = np.linspace(0, 0.5, 50)[:, None]  # a third coordinate: each length rounds the cosines differently
    theta = np.pi / 4 - np.arcsin(gap * np.sqrt(1 + z * z) / np.sqrt(2)) + np.linspace(-30, 30, 41) * torch.finfo(dtype).eps
    z = np.broadcast_to(z, theta.shape)
    return np.stack([np.cos(theta), np.sin(theta), z, 0 * z], -1).reshape(-1, 4).astype(str(dtype).split(".")[1])


@pytest.mark.parametrize("gamma", [0.7, 0.9, 0.95])
def test_a_confidence_that_rounds_to_gamma_is_gated_alike_on_every_path(gamma):
    "float32 confidences equal to float32(γ): one image at a time gates them as one call (the engine) and chunks (the steps) do."
    T, dt = np.eye(2, 4), torch.float32
    cfg = ProtonConfig(gamma=gamma, k_min=1, bank_size=64, temperature=0.01)
    E = near_the_gate(gamma, dt)
    confidence = Proton(T, cfg, dtype=dt)._classify(*as_rows(E, dtype=dt))[1]
    at = E[(confidence == torch.tensor(gamma, dtype=dt)).numpy()]
    assert len(at) >= 4
    S = np.concatenate([[[0.1, 0.9, 0.3, 0]], np.resize(at, (40, 4)), [[0.5, 0.2, 0.6, 0.3]] * 3]).astype(np.float32)
    one, call, chunks = (Proton(T, cfg, dtype=dt) for _ in range(3))
    scores, enqueued = [], []
    for x in S:  # the one-image path
        n = int(one.bank.counts.sum()); scores.append(one.score(x)); enqueued.append(int(one.bank.counts.sum()) > n)
    whole = call.score(S, return_parts=True)
    parts = [chunks.score(S[a:a + 5], return_parts=True) for a in range(0, len(S), 5)]
    assert torch.equal(torch.tensor(enqueued), whole.enqueued) and torch.equal(torch.cat([p.enqueued for p in parts]), whole.enqueued)
    tol = 1e-5 + 4 * torch.finfo(dt).eps / 0.01  # as the parity of the paths in test_promises
    for got in (torch.cat(scores), torch.cat([p.score for p in parts])): assert (got - whole.score).abs().max() <= tol
    for det in (one, chunks): assert torch.equal(det.bank.counts, call.bank.counts) and torch.equal(det.bank.entries, call.bank.entries)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_routing_each_image_to_its_own_class_changes_nothing_at_the_gate(dtype):
    "Confidences within a few units in the last place of γ: routed to their own zero-shot class, every image scores and gates bit for bit as unrouted."
    T = np.eye(2, 4)
    cfg = ProtonConfig(k_min=1, bank_size=8, temperature=0.01)
    E = near_the_gate(cfg.gamma, dtype)
    for size in (STEP_MAX, len(E)):  # the step path, the engine
        plain, routed = Proton(T, cfg, dtype=dtype), Proton(T, cfg, dtype=dtype)
        for a in range(0, len(E), size):
            want = plain.score(E[a:a + size], return_parts=True)
            got = routed.score(E[a:a + size], return_parts=True, routed=want.predicted)
            for name in ("score", "base", "alpha", "enqueued", "predicted"): assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert torch.equal(routed.bank.entries, plain.bank.entries) and torch.equal(routed.bank.counts, plain.bank.counts)


def test_one_image_takes_the_tensor_path_only_near_a_decision(monkeypatch):
    "One image at a time: numpy's confidence decides the gate, and the tensor paths' `classify` runs only for one within rounding of γ."
    calls, real = [], engine.classify
    monkeypatch.setattr(engine, "classify", lambda *a: calls.append(1) or real(*a))
    gamma, dt = 0.7, torch.float32
    T, E = clustered_stream(10, 512, 300, seed=6)
    cfg = ProtonConfig(gamma=gamma, k_min=1, bank_size=8, temperature=0.01)
    E = E.astype(np.float32)
    confidence = Proton(T, cfg, dtype=dt)._classify(*as_rows(E, dtype=dt))[1]
    far = E[((confidence - gamma).abs() > 0.1).numpy()]  # ordinary images: their gate is not in doubt
    assert len(far) > 200
    det = Proton(T, cfg, dtype=dt)
    for x in far: det.score(x)
    assert det.bank.counts.sum() > 0 and not calls  # numpy alone, enqueues included
    near = near_the_gate(gamma, dt)[::50]  # within a few units in the last place of γ
    det = Proton(np.eye(2, 4), cfg, dtype=dt)
    for x in near: det.score(x)
    assert len(calls) == len(near)


def crossing(inside, x0, x1, dtype):
    "The nearest points of `dtype` on either side of where `inside` changes on the segment x0 -> x1; none if it does not change."
    at = lambda s: ((1 - s) * x0 + s * x1).astype(dtype)
    a, b = 0., 1.
    if inside(at(a)) == inside(at(b)): return []
    for _ in range(60):
        m = (a + b) / 2
        if inside(at(m)) == inside(at(a)): a = m
        else: b = m
    return [at(a), at(b)]


decisions = st.fixed_dictionaries(dict(
    n_classes=st.integers(2, 5), dim=st.integers(2, 512), gamma=st.sampled_from([0.3, 0.5, 0.7, 0.9, 0.99, 1.0]),
    temperature=st.sampled_from([0.01, 0.1, 1.0]), dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 10_000)))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(decisions)
def test_one_image_gates_and_classes_as_the_tensor_path_near_gamma_and_ties(p):
    """Confidences within a few units in the last place of γ and logits within a few of a tie, among ordinary images: one
    image at a time enqueues the same images into the same classes as the step path given one image per call (the same
    tensor operations; a larger batch may round a logit's last bit differently, as chapter 50 says)."""
    C, d, dt = p["n_classes"], p["dim"], p["dtype"]
    ndt = str(dt).split(".")[1]
    T, E = clustered_stream(C, d, 30, seed=p["seed"])
    cfg = ProtonConfig(gamma=p["gamma"], k_min=1, bank_size=128, temperature=p["temperature"])
    ref = Proton(T, cfg, dtype=dt)
    tensor = lambda x: ref._classify(*as_rows(x[None], dtype=dt))  # the (1, d) row's base score, confidence and class
    rng = np.random.default_rng(p["seed"])
    near = []
    for a in range(C):
        b = (a + 1) % C
        near += crossing(lambda x: bool(tensor(x)[1] >= p["gamma"]), T[a], T.mean(0) + rng.normal(size=d) / d, ndt)  # the gate
        x0 = T[a] + rng.normal(size=d) / d
        first = int(tensor(x0.astype(ndt))[2])
        near += crossing(lambda x: int(tensor(x)[2]) == first, x0, T[b], ndt)  # a tie
    assert near
    nudged = [x.copy() for x in near for _ in range(3)]
    for x in nudged: i = rng.integers(d); x[i] = np.nextafter(x[i], rng.choice([-np.inf, np.inf]), dtype=ndt)  # one unit in the last place
    S = np.vstack([E.astype(ndt), *near, *nudged])
    S = S[rng.permutation(len(S))]
    one, steps = Proton(T, cfg, dtype=dt), Proton(T, cfg, dtype=dt)
    enqueued = []
    for x in S:
        n = int(one.bank.counts.sum()); one.score(x); enqueued.append(int(one.bank.counts.sum()) > n)
    parts = [steps.score(x[None], return_parts=True) for x in S]
    assert enqueued == torch.cat([q.enqueued for q in parts]).tolist()
    assert torch.equal(one.bank.counts, steps.bank.counts) and torch.equal(one.bank.entries, steps.bank.entries)  # the same rows in the same classes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_long_double_rows_are_scored_alike_on_every_path(dtype):
    "np.longdouble rows were scored by the one-image path and refused by every other one: each path now scores them as their float64 values."
    T, E = clustered_stream(3, 16, 80, seed=5)
    wide = E.astype(np.longdouble)
    paths = {"one image": lambda det, X: torch.cat([det.score(x) for x in X]),
             "(1, d)": lambda det, X: torch.cat([det.score(x[None]) for x in X]),
             "steps": lambda det, X: torch.cat([det.score(X[a:a + 20]) for a in range(0, len(X), 20)]),
             "engine": lambda det, X: det.score(X),
             "parts": lambda det, X: det.score(X, return_parts=True).score}
    cfg = ProtonConfig(bank_size=8, k_min=2, temperature=0.2)
    for name, run in paths.items():
        det = Proton(torch.as_tensor(T, dtype=dtype), cfg)
        assert torch.equal(run(det, wide), run(Proton(torch.as_tensor(T, dtype=dtype), cfg), E)), name


MANY_CLASSES = """
import json, resource, sys, torch
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a regression fails here, not on the machine
from proton import Proton, ProtonConfig
C, d, N = 1000, 64, 16384
g = torch.Generator().manual_seed(0)
T = torch.randn(C, d, generator=g)
X = T[torch.randint(0, C, (N,), generator=g)] + 0.3 * torch.randn(N, d, generator=g)
cfg = ProtonConfig(bank_size=16, k_min=1)  # blocks of 16: C = 1000 stays on the engine (`steps_cheaper`)
small = Proton(T, cfg, temperature=0.01)
want = torch.cat([small.score(X[a:a + 32]) for a in range(0, N, 32)])
one = Proton(T, cfg, temperature=0.01)
open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark: ru_maxrss is now the current RSS
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
got = one.score(X)
growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0) * 1024
print(json.dumps(dict(growth=growth, diff=(got - want).abs().max().item(), bank=torch.equal(one.bank.entries, small.bank.entries))))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's resettable peak RSS")
def test_many_classes_in_one_call_stay_within_the_memory_bound():
    "C = 1000 classes in one 16,384-image call: the (N, C) and per-tile (blocks, C, d) arrays stay within their budgets; the 32-image calls' results."
    import json, subprocess, sys
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", MANY_CLASSES], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout)
    assert r["bank"] and r["diff"] <= 1e-5
    bound = engine.CHUNK_CELLS * 48 + 6 * engine.TILE_BYTES  # the engine chapter's stated bound (its `class_mib`); input and bank add 5 MiB
    assert r["growth"] <= 1.5 * bound, f"one call grew the RSS by {r['growth'] / 2**20:.0f} MiB, far more than {bound / 2**20:.0f} MiB"  # RSS varies by ±100 MiB run to run; unbounded, it asked for gigabytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 20, 400])
def test_an_autocast_the_caller_has_open_does_not_change_the_scores(dtype, amp, batch):
    "score ran inside the caller's autocast (`with torch.autocast(...): det.score(model(x))`): the engine's and the step path's matmuls went to bfloat16 or float16, scores moved by 2e-3 and batch sizes disagreed."
    g = torch.Generator().manual_seed(0)
    text, X = torch.randn(10, 64, generator=g, dtype=dtype), torch.randn(400, 64, generator=g, dtype=dtype)
    plain, inside = (Proton(text, ProtonConfig(k_min=2, gamma=.3, bank_size=20), temperature=.05) for _ in range(2))
    expected = torch.cat([plain.score(X[a:a + batch], return_parts=True).proto for a in range(0, 400, batch)])
    with torch.autocast("cpu", dtype=amp):
        got = torch.cat([inside.score(X[a:a + batch], return_parts=True).proto for a in range(0, 400, batch)])
    assert got.dtype == dtype and torch.equal(torch.nan_to_num(got, 9.), torch.nan_to_num(expected, 9.))
