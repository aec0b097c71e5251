"""Cross-cutting tests of the synthetic presets and of experiments 6-9 and the regime map, on tiny caches."""
import json
import math
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import f1_score

from proton.bench.evaluation import COLUMNS, evaluate, summarize
from proton.bench.cache import EmbeddingCache
from proton.detector import Proton, ProtonConfig
from proton.bench.experiments import REPORTED
from proton.bench.experiments.cross_domain import DOMAIN_MODELS, cross_domain
from proton.bench.experiments.dynamics import dynamics, prototype_history
from proton.bench.experiments.figure1 import figure1, overlap_coefficient
from proton.bench.experiments.regime import regime
from proton.bench.experiments.robustness import robustness
from proton.bench.experiments.triage import TRIAGE_CLASSIFIERS, triage
from proton.bench.synth import PRESETS, SHIFTS, SyntheticWorld


def tiny_cache(preset="default", seed=0, n_id=60, n_per_shift=30, **knobs):
    return EmbeddingCache.from_world(SyntheticWorld.preset(preset, **knobs), n_id=n_id, n_per_shift=n_per_shift, seed=seed)


# presets

def test_default_preset_is_the_dataclass_defaults():
    assert asdict(SyntheticWorld.preset("default")) == asdict(SyntheticWorld())
    assert asdict(SyntheticWorld.preset("default", seed=4)) == asdict(SyntheticWorld(seed=4))


def test_presets_cover_every_knob_and_the_paper_domains():
    knobs = {k for k in asdict(SyntheticWorld()) if k != "seed"}
    assert set(PRESETS) >= {"default", "ophthalmology", "radiology", "pathology"}
    for name, values in PRESETS.items(): assert set(values) == knobs, name
    assert set(DOMAIN_MODELS) == set(REPORTED["table1b"]) == set(PRESETS) - {"default"}


def test_preset_unknown_name_and_knob():
    with pytest.raises(ValueError, match="unknown preset 'cardiology'"): SyntheticWorld.preset("cardiology")
    with pytest.raises(ValueError, match=r"unknown knobs \['temprature'\]"): SyntheticWorld.preset("radiology", temprature=0.1)


def test_preset_overrides_do_not_leak():
    w = SyntheticWorld.preset("ophthalmology", cov_shift=0.0)
    assert w.cov_shift == 0.0 and PRESETS["ophthalmology"]["cov_shift"] != 0.0
    assert SyntheticWorld.preset("ophthalmology").cov_shift == PRESETS["ophthalmology"]["cov_shift"]


@pytest.mark.parametrize("name", ["ophthalmology", "radiology", "pathology"])
def test_domain_presets_blind_mcm_and_help_proton_on_covariate(name):
    cache = tiny_cache(name, n_id=200, n_per_shift=100)
    s = summarize(evaluate(cache, ["mcm", "proton"], shifts="covariate", n_permutations=2, progress=False)).set_index("method")
    assert s.loc["mcm", "auroc_mean"] < 0.55
    assert s.loc["proton", "delta_auroc"] > 0.05


# experiment 6: cross-domain

def test_cross_domain_columns_rows_and_determinism():
    caches = {"a": tiny_cache("radiology"), "b": tiny_cache("pathology", seed=1)}
    df = cross_domain(caches, n_permutations=2, progress=False)
    assert list(df.columns) == ["domain"] + list(COLUMNS)
    assert len(df) == 2 * 2 * 3 * 2 and set(df.domain) == {"a", "b"}
    assert df.auroc.between(0, 1).all() and df.fpr95.between(0, 1).all()
    pd.testing.assert_frame_equal(df, cross_domain(caches, n_permutations=2, progress=False))
    other = cross_domain(caches, n_permutations=2, seed=7, progress=False)
    assert not np.allclose(df.query("method == 'proton'").auroc, other.query("method == 'proton'").auroc)


def test_cross_domain_rejects_bad_input():
    with pytest.raises(ValueError, match="non-empty dict"): cross_domain([tiny_cache()])
    with pytest.raises(TypeError, match="EmbeddingCache"): cross_domain({"x": "cache.npz"})


# experiment 7: dynamics

def test_prototype_history_matches_a_step_by_step_replay():
    world = SyntheticWorld(seed=2)
    X = torch.cat([world.sample("id", 50, seed=3)[0], world.sample("far", 20, seed=3)[0]])
    X = X[torch.randperm(len(X), generator=torch.Generator().manual_seed(1))]
    config = ProtonConfig(bank_size=6, k_min=2)
    det, steps = Proton(world.text_embeddings(), config), []
    for x in X:
        det.score(x[None]); steps.append(det.bank.prototypes.clone())
    parts = Proton(world.text_embeddings(), config).score(X, return_parts=True)
    history, received = prototype_history(X, parts.predicted, parts.enqueued, world.n_classes, config.bank_size)
    torch.testing.assert_close(history, torch.stack(steps), atol=1e-5, rtol=0)
    assert received.max() > config.bank_size


def test_dynamics_columns_ranges_and_determinism():
    cache = tiny_cache()
    df = dynamics(cache, seed=3, rho=None)  # every image: the counts below are exact
    assert list(df.columns) == ["shift", "t", "kind", "class", "received", "updated", "cosine_to_final", "drift", "alpha", "calibrated"]
    assert len(df) == 3 * 90 * cache.n_classes and list(df["shift"].unique()) == list(SHIFTS[1:])
    assert df.cosine_to_final.dropna().between(-1 - 1e-6, 1 + 1e-6).all()
    assert np.allclose(df[df.t == df.t.max()].cosine_to_final, 1, atol=1e-5)
    assert df.alpha[df.calibrated].between(0.3, 0.7).all() and (df.alpha[~df.calibrated] == 1).all()
    assert df.drift[~df.updated].isna().all()
    pd.testing.assert_frame_equal(df, dynamics(cache, seed=3, rho=None))
    assert not dynamics(cache, seed=4).t.equals(df.t) or not dynamics(cache, seed=4).alpha.equals(df.alpha)


def test_dynamics_burst_order_puts_the_ood_images_in_the_middle():
    df = dynamics(tiny_cache(), shifts="covariate", order="burst", rho=None).drop_duplicates("t")
    ood_t = df.t[df.kind != "id"]
    assert ood_t.min() == 30 and ood_t.max() == 59  # half of the 60 ID images, then the 30 covariate ones


# experiment 8: triage

def test_triage_is_well_above_chance_on_an_easy_world():
    easy = tiny_cache(cov_shift=4.0, spread=0.3, n_id=90, n_per_shift=45)
    for classifier in TRIAGE_CLASSIFIERS:
        df = triage(easy, classifier, seed=2)
        assert f1_score(df["shift"], df.predicted, average="macro") > 0.6, classifier


def test_triage_columns_determinism_and_ablation():
    cache = tiny_cache("ophthalmology")
    df = triage(cache, seed=1)
    assert list(df.columns) == ["row", "t", "shift", "base", "proto", "predicted"]
    assert set(df["shift"]) == set(SHIFTS[1:]) and set(df.predicted) <= set(SHIFTS[1:])
    assert (cache.shift[df.row] == df["shift"]).all() and df[["base", "proto"]].notna().all().all()
    pd.testing.assert_frame_equal(df, triage(cache, seed=1))
    assert not triage(cache, seed=2).row.equals(df.row)
    base_only = triage(cache, features="base", seed=1)
    assert base_only[["row", "base", "proto"]].equals(df[["row", "base", "proto"]])  # same stream, fewer features


@pytest.mark.parametrize("kwargs, message", [
    (dict(seed=None), "seed must be an integer from 0 to 4294967295, got None"), (dict(seed="a"), "seed must be an integer from 0 to 4294967295, got 'a'"),
    (dict(seed=-1), "seed must be an integer from 0 to 4294967295, got -1"), (dict(seed=2**32), "seed must be an integer from 0 to 4294967295, got 4294967296"),
    (dict(n_splits=None), "n_splits must be an integer of at least 2, got None"), (dict(n_splits="5"), "n_splits must be an integer of at least 2, got '5'"),
    (dict(n_splits=1), "n_splits must be an integer of at least 2, got 1"), (dict(n_splits=2.5), "n_splits must be an integer of at least 2, got 2.5"),
    (dict(features=None), "features must be a non-empty selection of ('base', 'proto'), got None"),
    (dict(classifier=["x"]), "unknown classifier ['x']")])
def test_triage_names_a_bad_setting_in_one_line(kwargs, message):
    "seed=None ran with a new order every call; seed 'a', n_splits None or '5', features=None, classifier=['x'] gave raw TypeErrors; -1, 2**32, 1 and 2.5 numpy's or sklearn's messages naming no argument."
    with pytest.raises(ValueError, match=re.escape(message)): triage(tiny_cache(), **kwargs)


def test_triage_refuses_a_cache_without_id_images():
    "Without ID images the prototypes were built from OOD images alone, and triage reported a macro-F1 of them."
    cache = tiny_cache()
    with pytest.raises(ValueError, match="triage needs ID images to seed the prototypes"): triage(cache.subset(cache.shift != "id"))


def test_triage_rejects_bad_input():
    cache = tiny_cache()
    with pytest.raises(ValueError, match="unknown classifier"): triage(cache, "forest")
    with pytest.raises(ValueError, match="features must be"): triage(cache, features=())
    with pytest.raises(ValueError, match="at least two OOD shifts"): triage(cache.subset(np.isin(cache.shift, ["id", "semantic"])))
    few = np.flatnonzero(cache.shift == "semantic")[3:]  # three semantic images left, fewer than the five folds need
    with pytest.raises(ValueError, match=r"5 scored images of every OOD shift.*semantic has 3"): triage(cache.subset(~np.isin(np.arange(len(cache)), few)))


# experiment 9: figure 1

def test_overlap_coefficient_properties():
    rng = np.random.default_rng(0)
    x = rng.normal(size=500)
    assert overlap_coefficient(x, x) == pytest.approx(1.0)
    assert overlap_coefficient(x, x + 100) == 0.0
    assert overlap_coefficient(x, x + 2) < overlap_coefficient(x, x + 1) < overlap_coefficient(x, x + 0.2)
    assert overlap_coefficient(x, rng.normal(size=300)) == pytest.approx(overlap_coefficient(rng.normal(size=300), x), abs=0.2)
    with pytest.raises(ValueError, match="non-empty"): overlap_coefficient([], x)
    with pytest.raises(ValueError, match="bins"): overlap_coefficient(x, x, bins=0)


def test_figure1_tables_ranges_and_determinism():
    cache = tiny_cache("radiology")
    f = figure1(cache, n_tsne=70, perplexity=8, seed=2)
    assert list(f.summary["shift"]) == list(SHIFTS[1:])
    assert f.summary[["overlap", "caught_by_mcm", "caught_by_proto"]].stack().between(0, 1).all()
    assert (f.summary.n_id == 60).all() and (f.summary.n_ood == 30).all()
    assert len(f.tsne) == 70 and set(f.tsne.kind) == {"id", "covariate"} and np.isfinite(f.tsne[["x", "y"]]).all().all()
    g = figure1(cache, n_tsne=70, perplexity=8, seed=2)
    for a, b in zip(f, g): pd.testing.assert_frame_equal(a, b)


def test_figure1_shows_the_blind_spot_on_a_domain_preset():
    f = figure1(tiny_cache("radiology", n_id=150, n_per_shift=75), shifts="covariate", n_tsne=60, perplexity=10)
    cov = f.summary.set_index("shift").loc["covariate"]
    assert cov.overlap > 0.5 and cov.caught_by_proto > cov.caught_by_mcm + 0.3


# the regime map

@pytest.mark.parametrize("run", [figure1, dynamics], ids=["figure1", "dynamics"])
def test_a_cache_without_ood_images_is_named(run):
    only_id = tiny_cache().subset(np.flatnonzero(tiny_cache().shift == "id"))
    with pytest.raises(ValueError, match=r"the cache has no OOD images \(shifts present: \('id',\)\)"): run(only_id)


def test_figure1_on_streams_too_short_to_calibrate_leaves_the_prototype_share_empty():
    out = figure1(tiny_cache(n_id=6, n_per_shift=3), perplexity=2)  # K_min = 5 per class: the bank never calibrates
    assert not out.scores.calibrated.any()
    assert out.summary.caught_by_proto.isna().all() and out.summary.caught_by_mcm.notna().all()


def test_robustness_skips_a_setting_the_cache_cannot_run_and_says_so():
    "A small cache cannot give the id_first order its 50 leading ID images; one class cannot be misrouted: those settings are skipped, the rest run."
    small = tiny_cache(n_id=30)
    with pytest.warns(UserWarning, match=r"robustness: order id_first skipped: .*warmup"):
        r = robustness(small, n_permutations=1, progress=False)
    assert set(r.order[r.factor == "order"]) == {"shuffled", "burst", "drift"} and set(r.factor) == {"rho", "misrouting", "order"}
    one = EmbeddingCache.from_world(SyntheticWorld(seed=0, n_classes=1), n_id=60, n_per_shift=20)
    with pytest.warns(UserWarning, match=r"robustness: misrouting 0\.1 skipped: misrouting needs at least two classes"):
        r = robustness(one, misrouted=(0.1,), orders=("shuffled",), n_permutations=1, progress=False)
    assert set(r.factor) == {"rho", "order"}
    with pytest.raises(ValueError, match="nothing to evaluate: misrouting 0.1 skipped"), pytest.warns(UserWarning):
        robustness(one, rhos=(), misrouted=(0.1,), orders=(), progress=False)


def test_regime_columns_determinism_and_mechanism():
    kw = dict(cov_shifts=(0.0, 4.0), class_strengths=(0.3,), n_id=80, n_per_shift=40, n_permutations=2, progress=False)
    df = regime(**kw)
    assert list(df.columns) == list(COLUMNS) + ["cov_shift", "class_strength"]
    assert len(df) == 2 * 2 * 2 and set(df["shift"]) == {"covariate"}
    pd.testing.assert_frame_equal(df, regime(**kw))
    gain = summarize(df).query("method == 'proton'").set_index("cov_shift").delta_auroc
    assert gain.loc[4.0] > gain.loc[0.0] + 0.1


def test_regime_gain_turns_negative_when_mcm_is_informative_and_nothing_moved():
    df = regime(SyntheticWorld(cov_confidence=0.8), cov_shifts=(0.0,), class_strengths=(0.4,), n_id=150, n_per_shift=75,
                n_permutations=2, progress=False)
    assert summarize(df).query("method == 'proton'").delta_auroc.item() < 0


def test_regime_rejects_bad_input():
    with pytest.raises(ValueError, match="non-empty"): regime(cov_shifts=(), progress=False)
    with pytest.raises(TypeError, match="SyntheticWorld"): regime(world="ophthalmology", progress=False)


def test_the_chapters_read_the_papers_text_numbers_from_reported():
    "The paper's numbers that its text and captions add live in REPORTED, and no chapter's code writes one of them out."
    written = {"31_triage": ("0.70",), "26_sensitivity": ("69.8", "71.2"), "00_intro": ("51%", "88%", "91%")}  # chapter -> the paper's numbers it compares with
    for chapter, numbers in written.items():
        cells = json.loads((Path(__file__).parents[1] / "nbs" / f"{chapter}.ipynb").read_text())["cells"]
        code = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        assert not [n for n in numbers if n in code], chapter
    assert REPORTED["triage_macro_f1"] == 0.70 and REPORTED["var_ref_mean_auroc"] == (69.8, 71.2)
    assert REPORTED["figure1"] == {"mcm_overlap": (51, 88), "caught_by_proto": (51, 91)}


@pytest.mark.parametrize("run", [figure1, dynamics], ids=["figure1", "dynamics"])
def test_a_shift_named_twice_runs_once_and_no_shift_at_all_is_named(run):
    "shifts=['semantic', 'semantic'] doubled every row (figure1: n_id=120 for 60 ID images); shifts=[] raised pandas' 'No objects to concatenate'."
    cache = tiny_cache()
    options = dict(n_tsne=60, perplexity=8) if run is figure1 else dict(rho=None)
    twice, once = run(cache, shifts=["semantic", "semantic"], **options), run(cache, shifts=["semantic"], **options)
    for a, b in zip(*((twice, once) if run is figure1 else ((twice,), (once,)))): pd.testing.assert_frame_equal(a, b)
    with pytest.raises(ValueError, match=r"^shifts is empty: name at least one OOD shift"): run(cache, shifts=[], **options)


def test_an_id_first_order_with_too_few_id_images_says_what_is_missing():
    "robustness skipped id_first with 'warmup must be an integer in [0, 30] ..., got 50', a warmup the user never set."
    with pytest.warns(UserWarning) as caught: robustness(tiny_cache(n_id=30), rhos=(), misrouted=(), n_permutations=1, progress=False)
    said = " ".join(str(w.message) for w in caught)
    assert "order id_first skipped" in said and "the id_first order needs 50 leading ID images (warmup), the stream has 30" in said, said
    assert "warmup must be" not in said


def test_triage_names_a_cache_without_ood_images_as_the_other_experiments_do():
    "Triage blamed calibration ('no OOD image was scored after calibration … K_min … γ') on a cache that had no OOD image at all."
    only_id = tiny_cache().subset(np.flatnonzero(tiny_cache().shift == "id"))
    with pytest.raises(ValueError, match=r"^triage needs at least two OOD shifts: the cache has no OOD images \(shifts present: \('id',\)\)$"): triage(only_id)


def test_sensitivity_names_what_it_cannot_run():
    "Both sweeps empty gave pandas' 'No objects to concatenate'; a cache without covariate images gave evaluate's 'no shift has a stream', not that the γ × M grid needs them."
    from proton.bench.experiments.sensitivity import sensitivity
    cache = tiny_cache()
    with pytest.raises(ValueError, match=r"^nothing to evaluate: gammas or bank_sizes, and var_refs, are empty$"): sensitivity(cache, gammas=(), var_refs=(), progress=False)
    no_cov = cache.subset(np.flatnonzero(cache.shift != "covariate"))
    with pytest.raises(ValueError, match=r"^the γ × M grid runs on \('covariate',\): nothing to evaluate: no shift has a stream: .*; give other grid_shifts, or empty gammas to run the σ²₀ sweep alone$"):
        sensitivity(no_cov, n_permutations=1, progress=False)
    assert set(sensitivity(no_cov, gammas=(), var_refs=(.02,), n_permutations=1, progress=False).sweep) == {"var_ref"}  # the way out works


def test_ablation_and_sensitivity_run_on_the_configured_base_score():
    "Both ran 'proton' (MCM-based) whatever the configuration's base_score; evaluate now refuses a base the method's name contradicts, so they name PROTON by its base."
    from proton.bench.experiments.ablation import ablation
    from proton.bench.experiments.sensitivity import sensitivity
    cache, energy = tiny_cache(), ProtonConfig(base_score="energy")
    a = ablation(cache, n_permutations=1, config=energy, progress=False, shifts="far")
    assert list(dict.fromkeys(a.method))[0] == "energy"
    full = a[a.method == "+ confidence gate (full)"].drop(columns="method").reset_index(drop=True)
    alone = evaluate(cache, ["proton[energy]"], n_permutations=1, progress=False, shifts="far").drop(columns="method")
    pd.testing.assert_frame_equal(full, alone)
    s = sensitivity(cache, gammas=(.7,), bank_sizes=(100,), var_refs=(), n_permutations=1, config=energy, progress=False)
    assert set(s.method) == {"energy", "proton[energy]"}


def test_the_prototype_score_switches_on_with_the_image_after_every_class_reaches_k_min():
    "Chapter 30 read k_min_reached as the index where the prototype score switches on; it switches on one image later, and the chapter says so."
    from proton.bench.experiments.dynamics import k_min_reached
    df = dynamics(tiny_cache())
    for shift, g in df.groupby("shift"):
        assert g[g.calibrated].t.min() == k_min_reached(g) + 1, shift


def test_regime_robustness_and_cross_domain_run_on_the_configured_base_score():
    "All three compared 'mcm' and 'proton' whatever the configuration's base_score, which evaluate now refuses with advice (name the method) regime gives no way to follow."
    from proton.bench.experiments.regime import regime
    energy = ProtonConfig(base_score="energy")
    r = regime(cov_shifts=(1.,), class_strengths=(.1,), n_id=60, n_per_shift=30, n_permutations=1, config=energy, progress=False)
    assert set(r.method) == {"energy", "proton[energy]"}
    cache = tiny_cache()
    rob = robustness(cache, rhos=(.7,), misrouted=(), orders=(), n_permutations=1, config=energy, progress=False)
    assert set(rob.method) == {"energy", "proton[energy]"}
    assert set(cross_domain({"a": cache}, n_permutations=1, config=energy, progress=False).method) == {"energy", "proton[energy]"}
    assert set(cross_domain({"a": cache}, n_permutations=1, progress=False).method) == {"mcm", "proton"}  # the paper's, by default


def test_k_min_reached_refuses_several_streams_and_a_bad_k_min():
    "A table of three streams gave the last stream's index without a word; k_min None said 'never', 0 or -1 gave 0, 2.5 was taken and '5' raised a raw TypeError."
    from proton.bench.experiments.dynamics import k_min_reached
    df = dynamics(tiny_cache())
    with pytest.raises(ValueError, match=r"rows hold 3 streams \(shifts semantic, covariate, far\): pass one"): k_min_reached(df)
    one = df[df["shift"] == "far"]
    for bad in (None, 0, -1, 2.5, "5"):
        with pytest.raises(ValueError, match=re.escape(f"k_min must be a positive integer, got {bad!r}")): k_min_reached(one, bad)
    assert k_min_reached(one, np.int64(5)) == k_min_reached(one, 5)


@pytest.mark.parametrize("shifts", [5, 2.5, True])
def test_shifts_that_are_no_name_nor_list_are_named(shifts):
    "dynamics(cache, shifts=5) gave 'TypeError: 'int' object is not iterable' from the cache's ood_shifts, which every experiment uses."
    with pytest.raises(ValueError, match=re.escape(f"shifts must be a shift name or a list of them, got {shifts!r}")): dynamics(tiny_cache(), shifts=shifts)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(config="x"), TypeError, "config must be a ProtonConfig, got str"),
    (dict(cov_shifts=None), ValueError, "cov_shifts must be a value or a list of values, got None"),
    (dict(class_strengths="0.3"), ValueError, "class_strength must be a finite number, got '0.3'")])
def test_regime_names_a_bad_grid_or_config(kwargs, error, message):
    "config='x' raised AttributeError, cov_shifts=None a TypeError, and class_strengths='0.3' was read a character at a time ('got '0'')."
    with pytest.raises(error, match=re.escape(message)): regime(**kwargs, n_id=20, n_per_shift=10, n_permutations=1, progress=False)


def test_regime_runs_a_repeated_grid_value_once_and_takes_a_single_value():
    r = regime(cov_shifts=(1., 1), class_strengths=.1, n_id=20, n_per_shift=10, n_permutations=1, progress=False)
    assert r.groupby(["cov_shift", "class_strength", "method"]).size().max() == 1 and set(r.class_strength) == {.1}


def test_prototype_history_and_pca_trajectories_name_bad_input():
    "bank_size 0 gave all-zero prototypes, -1 unit-norm nonsense, None/2.5 raw TypeErrors; an empty stream a torch RuntimeError; pca_trajectories' n_components None or '2' raw TypeErrors and 'must be in [1, 0]'."
    from proton.bench.experiments.dynamics import pca_trajectories
    E = torch.nn.functional.normalize(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), dim=1)
    pred, enq = torch.tensor([0, 1, 0, 1, 0, 1]), torch.ones(6, dtype=torch.bool)
    for bad in (0, -1, None, 2.5):
        with pytest.raises(ValueError, match=re.escape(f"bank_size must be an integer from 1 to 1048576, got {bad!r}")): prototype_history(E, pred, enq, 2, bad)
    with pytest.raises(ValueError, match=r"predicted classes .*\[0, 1\)"): prototype_history(E, pred, enq, 1, 3)
    with pytest.raises(ValueError, match=re.escape("n_classes must be a positive integer, got None")): prototype_history(E, pred, enq, None, 3)
    with pytest.raises(ValueError, match=re.escape("enqueued must have shape (6,), got (5,)")): prototype_history(E, pred, enq[:5], 2, 3)
    history, received = prototype_history(E[:0], pred[:0], enq[:0], 2, 3)
    assert history.shape == (0, 2, 4) and received.shape == (0, 2)
    history, received = prototype_history(E, pred, enq, 2, 3)
    for bad in (None, "2", 2.5, True):
        with pytest.raises(ValueError, match=re.escape(f"n_components must be a positive integer, got {bad!r}")): pca_trajectories(history, received, bad)
    with pytest.raises(ValueError, match=re.escape("n_components must be in [1, 4]")): pca_trajectories(history, torch.zeros_like(received), 5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(rhos=(0.7, 1.5)), "rho (the ID fraction) must be in (0, 1), got 1.5"),
    (dict(misrouted=(0, 2.0)), "the misrouted share must be in [0, 1], got 2.0"),
    (dict(misrouted=(0, math.nan)), "the misrouted share must be in [0, 1], got nan"),
    (dict(orders=("shuffled", "bogus")), "unknown order 'bogus'"),
    (dict(rho=1.5), "rho (the ID fraction) must be in (0, 1), got 1.5"),
    (dict(rhos=("0.5",)), "rho (the ID fraction) must be in (0, 1), got '0.5'"),
    (dict(orders=("id_first",), warmup=-5), "warmup must be a non-negative integer, got -5")])
def test_robustness_refuses_a_bad_setting_instead_of_skipping_it(kwargs, message):
    "A value of the user's own that evaluate refused was caught as a setting the cache cannot run: a warning, and a partial table returned."
    with pytest.raises(ValueError, match=re.escape(message)): robustness(tiny_cache(), n_permutations=1, progress=False, **kwargs)


def test_grids_take_one_value_and_run_a_repeat_once():
    "orders='burst' was read a letter at a time (five skips), rhos=0.5 raised 'not iterable', gammas='0.5' said \"got '0'\", repeats ran twice (summarize then refused the table)."
    from proton.bench.experiments.sensitivity import sensitivity
    r = robustness(tiny_cache(), rhos=0.5, misrouted=(0, 0.), orders="burst", n_permutations=1, progress=False)
    assert r.groupby(["factor", "rho", "misrouted", "order", "method", "shift"], dropna=False).size().max() == 1
    assert set(r.order[r.factor == "order"]) == {"burst"} and set(r.rho[r.factor == "rho"]) == {0.5}
    s = sensitivity(tiny_cache(), gammas=(1, 1.0), bank_sizes=50, var_refs=(), n_permutations=1, progress=False)
    assert len(s[s.method == "proton"]) == len(s[s.method == "mcm"])


def test_a_config_of_another_type_is_named_by_every_experiment():
    "evaluate and the experiments raised AttributeError ('str' object has no attribute 'base_score'), ablation a TypeError from dataclasses.replace."
    from proton.bench.experiments.ablation import ablation
    from proton.bench.experiments.main_table import main_table
    for run in (lambda c: evaluate(c, ["mcm", "proton"], config="x", progress=False), lambda c: main_table(c, config="x", progress=False),
                lambda c: ablation(c, config="x", progress=False), lambda c: robustness(c, config="x", progress=False)):
        with pytest.raises(TypeError, match="^config must be a ProtonConfig, got str$"): run(tiny_cache())


def test_robustness_and_cross_domain_pass_methods_on_as_evaluate_takes_them():
    "methods='proton' was read a letter at a time ('unknown method p'), a dict lost its configs, and [] ran the default methods."
    cfg = ProtonConfig(gamma=.5)
    r = robustness(tiny_cache(), rhos=(.5,), misrouted=(), orders=(), methods={"loose": ("proton", cfg)}, n_permutations=1, progress=False)
    assert set(r.method) == {"loose"}
    x = cross_domain({"a": tiny_cache()}, methods="proton", n_permutations=1, progress=False)
    assert set(x.method) == {"proton"}
    with pytest.raises(ValueError, match="methods is empty"): cross_domain({"a": tiny_cache()}, methods=[], n_permutations=1, progress=False)


def test_cross_domain_refuses_domain_names_that_print_alike():
    with pytest.raises(ValueError, match="domain names must differ as text"): cross_domain({1: tiny_cache(), "1": tiny_cache()}, n_permutations=1, progress=False)


@pytest.mark.parametrize("kwargs, message", [(dict(threads=0), "threads must be a positive integer, got 0"), (dict(threads="2"), "threads must be a positive integer, got '2'"),
                                             (dict(rho="0.5"), "rho (the ID fraction) must be in (0, 1), got '0.5'"),
                                             (dict(warmup="x"), "warmup must be a non-negative integer, got 'x'")])
def test_evaluate_names_a_bad_setting(kwargs, message):
    "threads 0 or '2' reached torch.set_num_threads (a RuntimeError naming no argument), rho '0.5' a raw TypeError, warmup 'x' was taken."
    with pytest.raises(ValueError, match=re.escape(message)): evaluate(tiny_cache(), ["mcm"], n_permutations=1, progress=False, **kwargs)
