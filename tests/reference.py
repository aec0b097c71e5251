"""A slow, obviously-correct float64 PROTON written from the paper's Algorithm 1, independent of the library."""
import math

import numpy as np


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def softmax(z):
    z = z - z.max()
    return np.exp(z) / np.exp(z).sum()


BASE = {
    "mcm": lambda z: -softmax(z).max(),
    "max_logit": lambda z: -z.max(),
    "energy": lambda z: -(z.max() + math.log(np.exp(z - z.max()).sum())),
    "entropy": lambda z: -sum(p * math.log(p) for p in softmax(z) if p > 0),
}


def reference_proton(T, E, gamma=0.7, bank_size=100, k_min=5, alpha_min=0.3, alpha_max=0.7, var_ref=0.02,
                     temperature=0.01, base_score="mcm", slope=100.0, warmup=0):
    "Per-sample (score, base, proto, alpha, calibrated, enqueued) lists for the stream `E`, in float64."
    T, E = unit(np.asarray(T, np.float64)), unit(np.asarray(E, np.float64))
    queues = [[] for _ in T]
    n, mean, m2 = 0, 0.0, 0.0
    reference = var_ref  # sigma^2_0: with a warm-up of W images, their variance from image W + 1 on
    rows = []
    for e in E:
        z = T @ e / temperature
        p = softmax(z)
        base = BASE[base_score](z)
        n += 1
        delta = base - mean
        mean += delta / n
        m2 += delta * (base - mean)
        var = m2 / n
        if warmup and n == warmup + 1: reference = var_before
        var_before = var
        calibrated = all(len(q) >= k_min for q in queues)
        if calibrated:
            protos = [unit(np.mean(q, axis=0)) for q in queues]
            proto = 1 - max(float(e @ mu) for mu in protos)
            alpha = alpha_max - (alpha_max - alpha_min) / (1 + math.exp(-slope * (var - reference)))
            score = alpha * base + (1 - alpha) * proto
        else:
            proto, alpha, score = math.nan, 1.0, base
        enqueued = p.max() >= gamma
        if enqueued:
            q = queues[int(p.argmax())]
            q.append(e)
            if len(q) > bank_size: q.pop(0)
        rows.append((score, base, proto, alpha, calibrated, enqueued))
    return [np.array(col) for col in zip(*rows)]


def clustered_stream(n_classes, dim, n, spread=2.0, seed=0):
    "Random text embeddings and a stream of noisy class-centred image embeddings, a fifth of them off-cluster."
    rng = np.random.default_rng(seed)
    T = unit(rng.normal(size=(n_classes, dim)))
    noise = rng.normal(size=(n, dim)) / np.sqrt(dim)
    E = T[rng.integers(0, n_classes, n)] + spread * noise
    off = rng.random(n) < 0.2
    E[off] = noise[off]
    return T, E
