"""The paper's protocol from a cache: the fit split of the privileged detectors, and prompt sets that the prompt baselines pool."""
import warnings

import numpy as np
import pytest

from proton.bench.cache import EmbeddingCache
from proton.bench.evaluation import PAPER_PROTOCOL, SkippedWarning, _Prepared, evaluate
from proton.bench.experiments.main_table import main_table
from proton.bench.streams import stream_permutations
from proton.bench.synth import SHIFTS, SyntheticWorld


@pytest.fixture(scope="module")
def cache():
    return EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=120, n_per_shift=40, n_fit=30)


def test_fit_split_is_disjoint_from_every_stream_and_streams_keep_every_test_image(cache):
    "With a fit split, no ID test image is held out: every stream holds all the ID images the cache has, none of them a fit image."
    df = evaluate(cache, ["knn_id", "mcm"], rho=None, n_permutations=1, progress=False)
    assert (df.n_id == (cache.shift == "id").sum()).all()
    for shift in SHIFTS[1:]:
        for _, stream in stream_permutations(cache, shift, n_permutations=2, rho=PAPER_PROTOCOL.rho):
            rows = cache.image_embeddings[stream.indices]
            assert not (rows[:, None, :] == cache.fit_embeddings[None]).all(-1).any()


def test_privileged_scores_come_from_the_fit_split(cache):
    "kNN-ID fitted on the fit split, not on carved test images: scores computed directly from the fit split agree."
    from proton.bench.baselines import HeldOut, baseline_scores
    df = evaluate(cache, ["knn_id"], shifts="far", rho=None, n_permutations=1, progress=False)
    direct = baseline_scores("knn_id", cache.image_embeddings, None, None, held_out=HeldOut(cache.fit_embeddings, cache.fit_labels))
    far = (cache.shift == "id") | (cache.shift == "far")
    from proton.metrics import ood_metrics
    s = direct.numpy()[far]; ood = cache.shift[far] == "far"
    assert df.auroc.iloc[0] == pytest.approx(ood_metrics(s[~ood], s[ood])["auroc"], abs=1e-12)


def _with_prompt_sets(cache, seed=0):
    "The cache with prompt sets L1 (one prompt per class), L5 (five) and tag (three), near the class text embeddings."
    rng = np.random.default_rng(seed)
    T = cache.text_embeddings.astype(np.float64)
    sets = {"L1": 1, "L5": 5, "tag": 3}
    emb, texts, cls, names = [], [], [], []
    for name, k in sets.items():
        for c in range(cache.n_classes):
            for j in range(k):
                emb.append(T[c] + 0.3 * rng.normal(size=T.shape[1]) / np.sqrt(T.shape[1]))
                texts.append(f"{name} prompt {j} of {cache.class_names[c]}"); cls.append(c); names.append(name)
    from dataclasses import replace
    return replace(cache, prompt_embeddings=np.array(emb, np.float32), prompts=texts, prompt_class=cls, prompt_set=names)


def test_prompt_baselines_run_from_the_cache_and_appear_in_the_main_table(cache):
    rich = _with_prompt_sets(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedWarning)  # nothing may be skipped but GL-MCM (no local embeddings)
        warnings.filterwarnings("ignore", message=".*gl_mcm.*", category=SkippedWarning)
        df = main_table(rich, n_permutations=1, progress=False)
    for m in ("hier_mcm", "hier_mcm_l1", "tag_mcm", "prompt_ensemble_mcm", "proton[hier_mcm]"):
        assert m in set(df.method), m
    prepared = _Prepared(rich)
    assert not np.allclose(prepared.scores("hier_mcm").numpy(), prepared.scores("hier_mcm_l1").numpy())


def test_prompt_baselines_without_prompt_sets_are_skipped_by_name(cache):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluate(cache, ["mcm", "hier_mcm"], shifts="far", n_permutations=1, progress=False)
    assert any("hier_mcm" in str(w.message) and "prompt sets" in str(w.message) for w in caught)


def test_the_recorded_protocol_says_what_each_experiment_held_out_on_a_cache_without_a_fit_split(tmp_path):
    "Without a fit split, only an experiment with a privileged method holds ID images out: each entry of the protocol file says so, and its streams match."
    import json
    import pandas as pd
    from proton.bench.evaluation import carve_held_out, evaluate_main
    c = EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=100, n_per_shift=40, seed=1)
    c.save(tmp_path / "nofit.npz")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert evaluate_main([str(tmp_path / "nofit.npz"), "--out", str(tmp_path / "r.csv"), "--experiments", "ablation,main_table",
                              "--permutations", "1", "--no-progress"]) == 0
    protocol = json.loads((tmp_path / "r_protocol.json").read_text())
    said = {}
    for name, f in (("ablation", "r_ablation.csv"), ("main_table", "r.csv")):
        entry = protocol[name]
        said[name] = entry["caches"][str(tmp_path / "nofit.npz")]["privileged_fit_on"]
        test = carve_held_out(c, entry["held_out_fraction"]).test  # the images the recorded protocol leaves to the streams
        (_, stream), = stream_permutations(test, "covariate", n_permutations=1, rho=entry["rho"])
        df = pd.read_csv(tmp_path / f)
        assert set(df[df["shift"] == "covariate"].n_id) == {int((~stream.is_ood).sum())}, name
    assert said["main_table"] == "20% of the ID images held out"
    assert said["ablation"].startswith("none")
