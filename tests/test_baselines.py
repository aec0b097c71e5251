"""The baselines against direct numpy computations, their special cases, and their refusals of missing inputs."""
import inspect
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from proton.bench.baselines import (BASELINES, PROMPT_POOLINGS, HeldOut, baseline_scores, ensemble_text_embeddings, fit_knn,
                              fit_mahalanobis, gl_mcm_score, prompt_mcm_score, split_held_out, static_score)
from proton.scores import BASE_SCORES, check_temperature


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def mcm_np(E, T, tau):
    return -softmax(unit(E) @ unit(T).T / tau).max(-1)


def sorted_distances(bank, queries):
    "Brute force: all pairwise distances between normalised rows, each query's row sorted."
    B, Q = unit(bank), unit(queries)
    blocks = [np.linalg.norm(Q[i:i + 100, None] - B[None], axis=-1) for i in range(0, len(Q), 100)]  # small (n, B, d) tensors
    return np.sort(np.concatenate(blocks), axis=1)


def knn_np(bank, queries, k):
    return sorted_distances(bank, queries)[:, k - 1]


def mahalanobis_np(bank, labels, queries, ridge):
    "Direct: class means, pooled covariance plus relative ridge, explicit inverse, min quadratic form."
    B, Q = unit(bank), unit(queries)
    classes = np.unique(labels)
    means = np.stack([B[labels == c].mean(0) for c in classes])
    centred = np.concatenate([B[labels == c] - m for c, m in zip(classes, means)])
    S = centred.T @ centred / len(B)
    d = B.shape[1]
    inv = np.linalg.inv(S + ridge * np.trace(S) / d * np.eye(d))
    return np.min([np.einsum("nd,de,ne->n", Q - m, inv, Q - m) for m in means], axis=0)


def data(seed, n=40, d=16, C=3):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(C, d))
    labels = rng.integers(C, size=n)
    return rng, centres[labels] + .7 * rng.normal(size=(n, d)), labels, centres


# --- kNN-ID -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 10, 40])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_knn_matches_brute_force(k, dtype):
    rng, bank, _, _ = data(k)
    queries = rng.normal(size=(25, 16))
    got = fit_knn(bank.astype(dtype), k).score(queries.astype(dtype))
    assert got.dtype == (torch.float64 if dtype == np.float64 else torch.float32)
    np.testing.assert_allclose(got.numpy(), knn_np(bank, queries, k), atol=1e-5 if dtype == np.float32 else 1e-12)


def test_knn_brute_force_distinguishes_neighbours():
    "The comparison can fail: the k-th and (k+1)-th distances differ on this data, so an off-by-one shows."
    rng, bank, _, _ = data(0)
    queries = rng.normal(size=(25, 16))
    got = fit_knn(bank, 5).score(queries).numpy()
    assert np.abs(got - knn_np(bank, queries, 6)).max() > 1e-3
    assert np.abs(got - knn_np(bank, queries, 4)).max() > 1e-3


def test_knn_several_chunks_and_duplicates():
    "A bank large enough that queries are scored in several chunks, holding exact duplicates."
    rng = np.random.default_rng(1)
    bank = rng.normal(size=(5000, 8))
    bank[100:110] = bank[0]  # ties at the top of the ranking
    queries = np.concatenate([rng.normal(size=(995, 8)), bank[:5]])
    brute = sorted_distances(bank, queries)
    for k in (1, 7, 12):
        np.testing.assert_allclose(fit_knn(bank, k).score(queries).numpy(), brute[:, k - 1], atol=1e-12)
    assert fit_knn(bank, 11).score(bank[:1]).item() == pytest.approx(0, abs=1e-12)  # itself + 10 copies


def test_knn_near_neighbours_keep_their_digits():
    "Distances of 1e-6 survive in float32; 2 - 2cos would round them to 0 or to ~3e-4."
    rng = np.random.default_rng(2)
    bank = unit(rng.normal(size=(50, 32))).astype(np.float32)
    queries = unit(bank[:10] + 1e-6 * unit(rng.normal(size=(10, 32))))
    np.testing.assert_allclose(fit_knn(bank, 1).score(queries).numpy(), knn_np(bank, queries, 1), rtol=0.05)


def test_knn_bad_k():
    _, bank, _, _ = data(0)
    for k in (0, 2.5, True):
        with pytest.raises(ValueError, match="k must be a positive integer"):
            fit_knn(bank, k)
    with pytest.raises(ValueError, match=r"^k must be at most the bank size 40 \(held-out ID images\), got 41$"): fit_knn(bank, 41)


# --- Mahalanobis-ID ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n,d", [(40, 16), (12, 30), (300, 8)])  # n > d, n < d (singular Σ), many samples
@pytest.mark.parametrize("ridge", [1e-3, 1e-2, 1.])
def test_mahalanobis_matches_direct(n, d, ridge):
    rng, bank, labels, _ = data(n + d, n=n, d=d)
    labels = np.array([7, 2, 4])[labels]  # arbitrary, non-contiguous class ids
    queries = rng.normal(size=(20, d))
    got = fit_mahalanobis(bank, labels, ridge=ridge).score(queries).numpy()
    want = mahalanobis_np(bank, labels, queries, ridge)
    np.testing.assert_allclose(got, want, rtol=1e-7)


def test_mahalanobis_is_not_euclidean():
    "The comparison can fail: the whitened distance ranks queries differently from the Euclidean one."
    rng, bank, labels, centres = data(3)
    bank[:, 0] *= 10  # one direction with far more variance than the others
    queries = rng.normal(size=(50, 16))
    got = fit_mahalanobis(bank, labels).score(queries).numpy()
    means = np.stack([unit(bank)[labels == c].mean(0) for c in np.unique(labels)])
    euclid = (np.linalg.norm(unit(queries)[:, None] - means[None], axis=-1) ** 2).min(1)
    assert np.corrcoef(np.argsort(np.argsort(got)), np.argsort(np.argsort(euclid)))[0, 1] < .99


def test_mahalanobis_returns_input_dtype_and_refuses_bad_labels():
    rng, bank, labels, _ = data(4)
    assert fit_mahalanobis(bank, labels).score(bank.astype(np.float32)).dtype == torch.float32
    assert fit_mahalanobis(bank, labels).score(bank).dtype == torch.float64
    with pytest.raises(ValueError, match="OOD samples cannot be held-out ID"):
        fit_mahalanobis(bank, np.where(labels == 0, -1, labels))
    with pytest.raises(ValueError, match="integer class indices"):
        fit_mahalanobis(bank, labels.astype(float))
    with pytest.raises(ValueError, match="more held-out samples than classes"):
        fit_mahalanobis(bank[:3], np.arange(3))
    with pytest.raises(ValueError, match="no within-class variance"):
        fit_mahalanobis(np.repeat(bank[:2], 3, axis=0), np.repeat([0, 1], 3))


# --- zero-shot baselines ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(BASE_SCORES))
def test_static_scores_reuse_base_scores(name):
    rng = np.random.default_rng(5)
    E, T = rng.normal(size=(9, 6)), rng.normal(size=(4, 6))
    logits = torch.as_tensor(unit(E) @ unit(T).T / .1)
    np.testing.assert_allclose(static_score(name, E, T, .1).numpy(), BASE_SCORES[name](logits).numpy(), rtol=1e-12)
    np.testing.assert_allclose(baseline_scores(name, E, T, .1).numpy(), BASE_SCORES[name](logits).numpy(), rtol=1e-12)


TINY = 1 / float(np.finfo(np.float32).max)  # below it 1/τ overflows float32, below twice it 2/τ does


@settings(max_examples=300, deadline=None)
@given(tau=st.one_of(*(st.floats(k * TINY, k * TINY * 1.000001) for k in (1, 2)), st.floats(TINY, 1e-36), st.floats(-39, 3).map(lambda e: 10 ** e)),
       seed=st.integers(0, 2 ** 16), dtype=st.sampled_from([np.float16, np.float32, np.float64]))
def test_every_static_score_is_finite_for_every_accepted_temperature(tau, seed, dtype):
    "τ = 3e-39 passed check_temperature, but logit differences of 2/τ overflowed float32 and entropy computed 0·(-inf) = NaN; a cosine rounded above 1 over τ overflowed too."
    try: check_temperature(tau)
    except ValueError: return  # refused, with a message: nothing to score
    rng = np.random.default_rng(seed)
    t = rng.normal(size=(64, 512))
    T = np.concatenate([t, -t[:1]])  # a class and its opposite: logits 1/τ and -1/τ, two apart
    E = np.concatenate([T, -T, rng.normal(size=(5, 512))]).astype(dtype)  # cosines of ±1 (some rounded above 1) and others
    for name in BASE_SCORES:
        assert torch.isfinite(static_score(name, E, T.astype(dtype), tau)).all(), name


PROMPT_BASELINES = {"prompt_ensemble_mcm": "embedding", "hier_mcm": "logit", "tag_mcm": "score"}


@pytest.mark.parametrize("tau", [.01, .5])
@pytest.mark.parametrize("name", list(PROMPT_BASELINES))
def test_one_prompt_per_class_is_mcm(name, tau):
    rng = np.random.default_rng(6)
    E, T = rng.normal(size=(30, 8)), rng.normal(size=(3, 8))
    want = mcm_np(E, T, tau)
    np.testing.assert_allclose(prompt_mcm_score(E, 4 * T[None], tau, PROMPT_BASELINES[name]).numpy(), want, rtol=1e-10)
    np.testing.assert_allclose(baseline_scores(name, E, None, tau, prompt_text_embeddings=T[None]).numpy(), want, rtol=1e-10)
    ragged = [t[None] for t in T]  # a list of C arrays (1, d)
    np.testing.assert_allclose(baseline_scores(name, E, None, tau, prompt_text_embeddings=ragged).numpy(), want, rtol=1e-10)


def prompts_and_images(seed=7):
    rng = np.random.default_rng(seed)
    P = rng.normal(size=(5, 3, 8)) * rng.uniform(.1, 10, size=(5, 3, 1))  # prompt lengths must not weigh
    return P, rng.normal(size=(20, 8))


def test_prompt_ensemble_averages_normalised_prompts():
    P, E = prompts_and_images()
    np.testing.assert_allclose(ensemble_text_embeddings(P).numpy(), unit(unit(P).mean(0)), rtol=1e-12)
    np.testing.assert_allclose(prompt_mcm_score(E, P, .05).numpy(), mcm_np(E, unit(P).mean(0), .05), rtol=1e-10)
    assert np.abs(prompt_mcm_score(E, P, .05).numpy() - mcm_np(E, P[0], .05)).max() > 1e-3  # not the first prompt


def test_hierarchical_pooling_averages_logits_without_renormalising():
    P, E = prompts_and_images()
    logits = (unit(E) @ unit(P).transpose(0, 2, 1)).mean(0) / .05  # (N, C): mean over prompts of cos / τ
    want = -softmax(logits).max(-1)
    np.testing.assert_allclose(prompt_mcm_score(E, P, .05, "logit").numpy(), want, rtol=1e-10)
    assert np.abs(want - mcm_np(E, unit(P).mean(0), .05)).max() > 1e-3  # renormalising would differ


def test_hierarchical_pooling_with_different_prompt_counts():
    P, E = prompts_and_images()
    ragged = [P[:2, 0], P[:, 1], P[:1, 2]]
    logits = np.stack([(unit(E) @ unit(g).T).mean(1) for g in ragged], 1) / .05
    np.testing.assert_allclose(prompt_mcm_score(E, ragged, .05, "logit").numpy(), -softmax(logits).max(-1), rtol=1e-10)
    np.testing.assert_allclose(prompt_mcm_score(E, ragged, .05).numpy(),
                               mcm_np(E, np.stack([unit(g).mean(0) for g in ragged]), .05), rtol=1e-10)
    with pytest.raises(ValueError, match=r"same number of prompts per class, got \[2, 5, 1\]"):
        prompt_mcm_score(E, ragged, .05, "score")


def test_tag_pooling_averages_scores_over_prompt_sets():
    P, E = prompts_and_images()
    want = np.mean([mcm_np(E, P[p], .05) for p in range(len(P))], axis=0)
    np.testing.assert_allclose(prompt_mcm_score(E, P, .05, "score").numpy(), want, rtol=1e-10)
    assert set(PROMPT_POOLINGS) == set(PROMPT_BASELINES.values())


@pytest.mark.parametrize("lam", [1., .3, 0.])
def test_gl_mcm_one_view_equal_to_global_is_scaled_mcm(lam):
    "With L=1 and the view equal to the image, both terms are MCM: S_GL = (1 + λ) S_MCM, 2 S_MCM at λ=1."
    rng = np.random.default_rng(8)
    E, T = rng.normal(size=(30, 8)), rng.normal(size=(4, 8))
    got = gl_mcm_score(E, 3 * E[:, None], T, .1, lambda_local=lam).numpy()
    np.testing.assert_allclose(got, (1 + lam) * mcm_np(E, T, .1), rtol=1e-10)


def test_gl_mcm_matches_direct():
    rng = np.random.default_rng(9)
    E, X, T = rng.normal(size=(12, 8)), rng.normal(size=(12, 5, 8)), rng.normal(size=(3, 8))
    local = softmax(unit(X) @ unit(T).T / .1).max(axis=(1, 2))
    want = mcm_np(E, T, .1) - .5 * local
    np.testing.assert_allclose(gl_mcm_score(E, X, T, .1, lambda_local=.5).numpy(), want, rtol=1e-10)
    np.testing.assert_allclose(baseline_scores("gl_mcm", E, T, .1, local_embeddings=X, lambda_local=.5).numpy(), want, rtol=1e-10)


# --- registry and missing inputs ----------------------------------------------------------------------

def full_inputs(seed=10):
    rng = np.random.default_rng(seed)
    E, T = rng.normal(size=(6, 8)), rng.normal(size=(3, 8))
    given = dict(text_embeddings=T, temperature=.1, local_embeddings=rng.normal(size=(6, 4, 8)),
                 prompt_text_embeddings=rng.normal(size=(2, 3, 8)),
                 held_out=HeldOut(rng.normal(size=(20, 8)), rng.integers(3, size=20)))
    return E, given


def run(name, E, given):
    kw = {k: v for k, v in given.items() if k not in ("text_embeddings", "temperature")}
    return baseline_scores(name, E, given["text_embeddings"], given["temperature"], **kw)


@pytest.mark.parametrize("name", list(BASELINES))
def test_every_baseline_runs_and_names_each_missing_input(name):
    E, given = full_inputs()
    s = run(name, E, given)
    assert s.shape == (6,) and torch.isfinite(s).all()
    for need in BASELINES[name].needs:
        with pytest.raises(ValueError, match=f"{name} needs .*{need}|GL-MCM needs a VLM with dense features|{name} needs a temperature"):
            run(name, E, given | {need: None})
    unused = set(given) - set(BASELINES[name].needs)
    assert torch.equal(run(name, E, given | {k: None for k in unused}), s)  # what it does not need, it does not read


def test_gl_mcm_missing_local_message():
    E, given = full_inputs()
    with pytest.raises(ValueError, match="the cache has no local_embeddings; GL-MCM needs a VLM with dense features"):
        run("gl_mcm", E, given | {"local_embeddings": None})


def test_mahalanobis_needs_labels_knn_does_not():
    E, given = full_inputs()
    emb = given["held_out"].embeddings
    assert run("knn_id", E, given | {"held_out": HeldOut(emb)}).shape == (6,)
    with pytest.raises(ValueError, match="mahalanobis_id needs held_out.labels"):
        run("mahalanobis_id", E, given | {"held_out": HeldOut(emb)})
    with pytest.raises(ValueError, match="held_out must be HeldOut"):
        run("knn_id", E, given | {"held_out": emb})


def test_registry_flags_and_needs():
    assert {n for n, b in BASELINES.items() if b.privileged} == {"knn_id", "mahalanobis_id"}
    params = set(inspect.signature(baseline_scores).parameters)
    assert all(set(b.needs) <= params for b in BASELINES.values())
    assert all(b.description for b in BASELINES.values())
    with pytest.raises(ValueError, match="unknown baseline 'odin'"):
        baseline_scores("odin", np.eye(2), np.eye(2), .1)


# --- held-out split -----------------------------------------------------------------------------------

def test_split_takes_a_negative_seed_as_torch_does():
    "A negative seed (torch's generators take -2**63 to 2**64 - 1) was refused: 'seed must be an integer from 0 to ...'."
    held, rest = split_held_out(np.arange(10), .3, seed=-1)
    assert len(held) == 3 and sorted(held.tolist() + rest.tolist()) == list(range(10))
    assert torch.equal(split_held_out(np.arange(10), .3, seed=-1)[0], held)


@pytest.mark.parametrize("fraction", [.05, .2, .5, .95])
def test_split_is_a_seeded_partition(fraction):
    ids = np.random.default_rng(11).choice(1000, size=200, replace=False)
    held, rest = split_held_out(ids, fraction, seed=3)
    assert len(held) == round(fraction * 200) and len(held) + len(rest) == 200
    assert set(held.tolist()).isdisjoint(rest.tolist()) and set(held.tolist()) | set(rest.tolist()) == set(ids.tolist())
    assert torch.equal(split_held_out(ids, fraction, seed=3)[0], held)
    assert not torch.equal(split_held_out(ids, fraction, seed=4)[0], held)


def test_split_from_mask_indexes_numpy_arrays():
    mask = np.arange(50) % 3 == 0
    held, rest = split_held_out(mask, .3, seed=0)
    assert mask[held.numpy()].all() and mask[rest.numpy()].all() and len(held) + len(rest) == mask.sum()
    values = np.arange(50) * 10
    assert np.array_equal(values[held.numpy()], 10 * held.numpy())


@pytest.mark.parametrize("bad,msg", [(np.arange(1), "at least 2 ID samples"), (np.zeros(0, int), "at least 2 ID samples"),
                                     (np.array([2, 2, 3]), "duplicates"), (np.array([-1, 3]), "non-negative"),
                                     (np.ones((2, 2), int), "must be 1-D"), (np.array([.5, 1.5]), "boolean mask or integer")])
def test_split_refuses_bad_input(bad, msg):
    with pytest.raises(ValueError, match=msg):
        split_held_out(bad, .5)


@pytest.mark.parametrize("fraction", [0, 1, -.1, math.nan])
def test_split_refuses_bad_fraction(fraction):
    with pytest.raises(ValueError, match=r"fraction must be a number in \(0, 1\)"):
        split_held_out(np.arange(10), fraction)


@pytest.mark.parametrize("name", list(PROMPT_BASELINES) + ["hier_mcm_l1"])
def test_prompts_for_another_number_of_classes_are_refused(name):
    "A (C, P, d) array, prompts and classes swapped, was read as P classes and scored against C text embeddings without a word."
    rng = np.random.default_rng(11)
    E, T = rng.normal(size=(6, 8)), rng.normal(size=(2, 8))
    swapped = rng.normal(size=(2, 5, 8))  # (C, P, d)
    with pytest.raises(ValueError, match=r"prompt_text_embeddings hold 5 classes, the text embeddings hold 2"):
        baseline_scores(name, E, T, .5, prompt_text_embeddings=swapped)
    with pytest.raises(ValueError, match=r"hold 3 classes, the text embeddings hold 2"):
        baseline_scores(name, E, T, .5, prompt_text_embeddings=[g for g in rng.normal(size=(3, 4, 8))])
    assert baseline_scores(name, E, T, .5, prompt_text_embeddings=swapped.transpose(1, 0, 2)).shape == (6,)


@pytest.mark.parametrize("lam", [math.nan, math.inf, -math.inf, -.5, None, "1", True, np.ones(2)])
def test_gl_mcm_refuses_a_lambda_that_is_no_non_negative_finite_number(lam):
    "λ = NaN gave all-NaN scores, ∞ gave -∞ for every image, and None or '1' a raw TypeError."
    rng = np.random.default_rng(12)
    E, X, T = rng.normal(size=(6, 4)), rng.normal(size=(6, 5, 4)), rng.normal(size=(3, 4))
    with pytest.raises(ValueError, match=r"lambda_local must be a non-negative, finite number, got "):
        gl_mcm_score(E, X, T, .5, lambda_local=lam)
    with pytest.raises(ValueError, match=r"lambda_local must be"):
        baseline_scores("gl_mcm", E, T, .5, local_embeddings=X, lambda_local=lam)


@pytest.mark.parametrize("call,msg", [
    (lambda B, y: fit_knn(B, None), "k must be a positive integer, got None"),
    (lambda B, y: fit_knn(B, math.nan), "k must be a positive integer, got nan"),
    (lambda B, y: fit_knn(B, math.inf), "k must be a positive integer, got inf"),
    (lambda B, y: fit_knn(B, "3"), "k must be a positive integer, got '3'"),
    (lambda B, y: fit_knn(B[:0], 1), "held-out ID embeddings hold no image"),
    (lambda B, y: fit_mahalanobis(B, y, "0.01"), "ridge must be a positive, finite number, got '0.01'"),
    (lambda B, y: fit_mahalanobis(B, y, None), "ridge must be a positive, finite number, got None"),
    (lambda B, y: fit_mahalanobis(B, np.array(list("aaaabbbbcccc"))), "id_labels must be integer class indices, got dtype <U1"),
    (lambda B, y: fit_mahalanobis(B, None), "id_labels must be integer class indices, got None"),
    (lambda B, y: split_held_out(np.arange(10), "0.5"), "fraction must be a number in (0, 1), got '0.5'"),
    (lambda B, y: split_held_out(np.arange(10), None), "fraction must be a number in (0, 1), got None"),
    (lambda B, y: split_held_out(np.arange(10), .5, seed=1.5), "seed must be an integer from -9223372036854775808 to"),
    (lambda B, y: split_held_out(np.arange(10), .5, seed=None), "seed must be an integer from -9223372036854775808 to"),
])
def test_privileged_settings_are_refused_in_one_line_naming_them(call, msg):
    "None, NaN, ∞ or a string for k, ridge, id_labels, fraction or seed reached int(), '<' or torch: TypeError, OverflowError, RuntimeError or an unnamed message."
    rng = np.random.default_rng(13)
    with pytest.raises(ValueError, match=re.escape(msg)):
        call(rng.normal(size=(12, 4)), np.repeat([0, 1, 2], 4))


def test_prompt_and_patch_faults_name_what_is_wrong():
    "The prompt ensemble blamed 'text embeddings' for prompts of the wrong dimension; a zero patch was named by its flattened row."
    rng = np.random.default_rng(14)
    E, T, X = rng.normal(size=(6, 4)), rng.normal(size=(3, 4)), rng.normal(size=(6, 5, 4))
    for pool in PROMPT_POOLINGS:
        with pytest.raises(ValueError, match="prompt text embeddings of class 0 have dimension 3, expected 4"):
            prompt_mcm_score(E, rng.normal(size=(2, 3, 3)), .5, pool)
    X[2, 3] = 0
    with pytest.raises(ValueError, match=r"local embeddings of image 2, patch 3 have zero length"):
        gl_mcm_score(E, X, T, .5)
