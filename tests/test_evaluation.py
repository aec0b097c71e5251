"""Cross-cutting tests of the evaluation, the experiments and the `evaluate` command."""
import math
import time
import warnings
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

import proton.bench.evaluation as evaluation
from proton.bench.baselines import noisy_views
from proton.bench.evaluation import COLUMNS, SkippedWarning, evaluate_main, carve_held_out, evaluate, method_scores, summarize
from proton.bench.experiments import EXPERIMENTS
from proton.bench.cache import EmbeddingCache
from proton.detector import Proton, ProtonConfig
from proton.bench.streams import make_stream
from proton.bench.synth import SHIFTS, SyntheticWorld


@pytest.fixture(scope="module")
def cache():
    return EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=100, n_per_shift=50)


def quiet_evaluate(*args, **kwargs):
    "`evaluate` without progress bars, its warnings returned alongside the results."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = evaluate(*args, progress=False, **kwargs)
    return df, [str(w.message) for w in caught if issubclass(w.category, SkippedWarning)]


def test_rows_for_every_method_shift_and_seed(cache):
    methods = ["mcm", "energy", "knn_id", "mahalanobis_id", "proton", "proton[entropy]"]
    df, _ = quiet_evaluate(cache, methods, n_permutations=3, seed=7)
    assert tuple(df.columns) == COLUMNS
    expected = {(m, s, seed) for m in methods for s in SHIFTS[1:] for seed in (7, 8, 9)}
    assert set(zip(df.method, df["shift"], df.seed)) == expected and len(df) == len(expected)
    assert df[list(evaluation.METRICS)].apply(lambda c: c.between(0, 1)).all().all()


def test_results_are_deterministic(cache):
    a, _ = quiet_evaluate(cache, ["mcm", "proton"], n_permutations=2)
    b, _ = quiet_evaluate(cache, ["mcm", "proton"], n_permutations=2)
    pd.testing.assert_frame_equal(a, b)


def test_proton_method_is_the_detector_over_the_stream(cache):
    stream = make_stream(cache, "far", seed=3)
    config = ProtonConfig(gamma=.6, bank_size=15, k_min=3)
    expected = Proton(cache.text_embeddings, config, temperature=cache.temperature).score(cache.image_embeddings[stream.indices])
    np.testing.assert_allclose(method_scores("proton", cache, stream, config), expected.numpy(), atol=1e-5)



@pytest.mark.parametrize("method, config", [("proton", ProtonConfig(temperature=.05)), ("proton", ProtonConfig(temperature=.2, gamma=.3)),
                                            ("proton[energy]", ProtonConfig(temperature=.05, base_score="energy")),
                                            ("proton[energy]", ProtonConfig(base_score="energy"))])
def test_a_configured_temperature_and_base_score_hold_as_in_the_detector(cache, method, config):
    "A τ set in the configuration reached the gate and the classes but not the base score, computed at the cache's τ: PROTON's scores were neither τ's."
    stream = make_stream(cache, "covariate", seed=1)
    expected = Proton(cache.text_embeddings, config, temperature=cache.temperature).score(cache.image_embeddings[stream.indices])
    np.testing.assert_allclose(method_scores(method, cache, stream, config), expected.numpy(), atol=1e-5)


def test_a_base_score_the_method_name_contradicts_is_refused(cache):
    "evaluate took the base score from the method's name and ignored the configuration's: proton with base_score='energy' gave MCM-based PROTON, unsaid."
    energy = ProtonConfig(base_score="energy")
    message = r"^PROTON method 'proton' takes its base score from its name \(mcm\), but its config's base_score is 'energy': name the method proton\[energy\]"
    with pytest.raises(ValueError, match=message): quiet_evaluate(cache, ["mcm", "proton"], config=energy, n_permutations=1)
    with pytest.raises(ValueError, match=message): quiet_evaluate(cache, {"p": ("proton", energy)}, n_permutations=1)
    with pytest.raises(ValueError, match=message): method_scores("proton", cache, make_stream(cache, "far"), energy)
    with pytest.raises(ValueError, match=r"^PROTON method 'proton\[energy\]' takes its base score from its name \(energy\), but its config's base_score is a callable"):
        quiet_evaluate(cache, ["proton[energy]"], config=ProtonConfig(base_score=lambda logits: -logits.max(1).values), n_permutations=1)
    df, _ = quiet_evaluate(cache, ["proton[energy]"], config=energy, n_permutations=1, shifts="far")  # the name agrees
    same, _ = quiet_evaluate(cache, ["proton[energy]"], n_permutations=1, shifts="far")  # the default base_score gives way to the name
    pd.testing.assert_frame_equal(df, same)

def test_missing_shift_is_skipped_with_a_message_and_the_rest_runs(cache):
    df, messages = quiet_evaluate(cache.subset(cache.shift != "semantic"), ["mcm", "proton"], n_permutations=2)
    assert set(df["shift"]) == {"covariate", "far"}
    assert any("shift 'semantic'" in m and "no 'semantic' images" in m for m in messages)


@pytest.mark.parametrize("rho", [0, 1, 1.5, -.2])
def test_rho_outside_the_unit_interval_is_an_error(cache, rho):
    with pytest.raises(ValueError, match=r"rho \(the ID fraction\) must be in \(0, 1\)"):
        evaluate(cache, ["mcm"], rho=rho, progress=False)


def test_gl_mcm_is_skipped_without_local_embeddings_and_runs_with_them(cache):
    df, messages = quiet_evaluate(cache, ["mcm", "gl_mcm", "proton[gl_mcm]"], n_permutations=1)
    assert set(df.method) == {"mcm"}
    assert any("gl_mcm (" in m and "local_embeddings" in m for m in messages)
    assert any("proton[gl_mcm] (" in m for m in messages)
    local = replace(cache, local_embeddings=noisy_views(cache.image_embeddings, 4, noise=.5, seed=0).numpy())
    df, messages = quiet_evaluate(local, ["mcm", "gl_mcm", "proton[gl_mcm]"], n_permutations=1)
    assert set(df.method) == {"mcm", "gl_mcm", "proton[gl_mcm]"} and not messages


def test_held_out_images_never_enter_a_stream(cache, monkeypatch):
    seen = []
    def recording(c, shift, **options):
        perms = stream_permutations(c, shift, **options)
        seen.extend(c.image_embeddings[s.indices] for _, s in perms)
        return perms
    stream_permutations = evaluation.stream_permutations
    monkeypatch.setattr(evaluation, "stream_permutations", recording)
    df, _ = quiet_evaluate(cache, ["mcm", "knn_id"], n_permutations=2, held_out_fraction=.3, seed=4)
    held = carve_held_out(cache, .3, seed=4).held_out.embeddings
    assert len(seen) == 3 * 2 and len(held) == 30
    for images in seen: assert not (images[:, None] == held[None]).all(-1).any()
    assert set(df.n_id) == {100 - 30}
    # without a held-out split the privileged methods are skipped, and the streams keep every ID image
    df, messages = quiet_evaluate(cache, ["mcm", "knn_id"], n_permutations=1, held_out_fraction=0)
    assert set(df.method) == {"mcm"} and set(df.n_id) == {100}
    assert any("knn_id (held_out_fraction=0" in m for m in messages)


def test_streams_depend_on_the_methods_only_on_a_cache_without_a_fit_split(cache):
    "The evaluation chapter said the streams never depend on the methods asked for; on a cache without a fit split a privileged method holds ID images out."
    fitted = EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=100, n_per_shift=50, n_fit=20)
    for c, same in ((fitted, True), (cache, False)):
        alone, _ = quiet_evaluate(c, ["mcm"], n_permutations=1)
        beside, _ = quiet_evaluate(c, ["mcm", "knn_id"], n_permutations=1)
        beside = beside[beside.method == "mcm"].reset_index(drop=True)
        assert alone.equals(beside) == same and (set(beside.n_id) == {100 if same else 80})


def test_unknown_method_and_stream_without_id_images(cache):
    with pytest.raises(ValueError, match="unknown method 'msp'"): evaluate(cache, ["msp"], progress=False)
    with pytest.raises(ValueError, match="the cache has no ID images"):
        quiet_evaluate(cache.subset(cache.shift != "id"), ["mcm", "proton"])


def test_summarize_pairs_deltas_on_settings(cache):
    from proton.bench.experiments.robustness import robustness
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedWarning)
        df = robustness(cache, rhos=(.7, .3), misrouted=(0., .1), orders=("shuffled",), n_permutations=2, progress=False)
    s = summarize(df)
    for _, row in s[s.method == "proton"].iterrows():
        same = (s.method == "mcm") & (s["shift"] == row["shift"]) & (s.factor == row.factor) & (s.misrouted == row.misrouted)
        same &= (s.rho == row.rho) if not np.isnan(row.rho) else s.rho.isna()
        assert same.sum() == 1
        assert row.delta_auroc == pytest.approx(row.auroc_mean - s[same].auroc_mean.iloc[0])


def test_command_writes_one_csv_per_experiment(cache, tmp_path, capsys):
    path = cache.save(tmp_path / "small.npz")
    out = tmp_path / "out" / "results.csv"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedWarning)
        assert evaluate_main([str(path), "--out", str(out), "--experiments", "main_table,ablation", "--permutations", "2", "--no-progress"]) == 0
    main = pd.read_csv(out)
    assert tuple(main.columns) == COLUMNS and set(main.seed) == {0, 1}
    ablation = pd.read_csv(tmp_path / "out" / "results_ablation.csv")
    assert tuple(ablation.columns) == COLUMNS and len(ablation) == 5 * 3 * 2
    printed = capsys.readouterr().out
    assert "main_table" in printed and "ablation" in printed and "AUROC" in printed and "simulated" in printed


def test_command_with_two_caches_adds_a_cache_column(cache, tmp_path):
    other = EmbeddingCache.from_world(SyntheticWorld(seed=1), n_id=100, n_per_shift=50)  # a cache given twice is refused
    paths = [str(c.save(tmp_path / f"{name}.npz")) for name, c in (("a", cache), ("b", other))]
    out = tmp_path / "results.csv"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedWarning)
        assert evaluate_main(paths + ["--out", str(out), "--permutations", "1", "--no-progress"]) == 0
    df = pd.read_csv(out)
    assert tuple(df.columns) == ("cache",) + COLUMNS and set(df["cache"]) == set(paths)


def test_command_refuses_bad_arguments(cache, tmp_path, capsys):
    out = str(tmp_path / "r.csv")
    assert evaluate_main([str(tmp_path / "missing.npz"), "--out", out]) == 1
    assert "missing.npz" in capsys.readouterr().err
    assert evaluate_main(["--out", out, "--experiments", "main_table,tables"]) == 1
    assert "unknown experiments ['tables']" in capsys.readouterr().err
    both = [str(cache.save(tmp_path / "c.npz")), "--simulated", "default", "--out", out]
    with pytest.raises(SystemExit): evaluate_main(both)
    with pytest.raises(SystemExit): evaluate_main(["--out", out, "--permutations", "0"])
    assert evaluate_main(["--out", out, "--simulated", "large"]) == 1


def test_all_experiments_on_a_1000_image_cache(tmp_path, capsys):
    "Every experiment through the command on 1,000 simulated images; the time is printed, not asserted."
    path = EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=400, n_per_shift=200).save(tmp_path / "c1000.npz")
    out = tmp_path / "results.csv"
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert evaluate_main([str(path), "--out", str(out), "--experiments", "all", "--no-progress"]) == 0
    seconds = time.perf_counter() - start
    printed = capsys.readouterr().out
    skipped = [str(w.message) for w in caught if issubclass(w.category, SkippedWarning) and "regime" in str(w.message)]
    assert len(skipped) == 1 and skipped[0].startswith("skipped regime: it sweeps synthetic worlds"), skipped  # with `all`, a warning
    for name, e in EXPERIMENTS.items():
        if e.takes == "world":  # regime sweeps synthetic worlds: not run on cache files
            assert name not in printed; continue  # the skip is a warning, on stderr
        written = [out] if name == "main_table" else sorted(tmp_path.glob(f"results_{name}*.csv"))
        assert written, name
        for path in written:
            df = pd.read_csv(path)
            assert len(df) and (e.returns != "metrics" or set(COLUMNS) <= set(df.columns)), path
    with capsys.disabled():
        print(f"\n[timing] all experiments, 1,000-image cache, 5 orders: {seconds:.1f} s")


def test_runs_without_privileged_methods_keep_every_id_image(cache):
    "The held-out split exists for kNN-ID and Mahalanobis-ID; without them no ID image leaves the streams."
    df, _ = quiet_evaluate(cache, ["mcm", "proton"], n_permutations=1, rho=None)
    assert (df.n_id == (cache.shift == "id").sum()).all()
    df, _ = quiet_evaluate(cache, ["mcm", "knn_id"], n_permutations=1, rho=None)
    assert (df.n_id < (cache.shift == "id").sum()).all()


def test_mcm_responds_to_misrouting(cache):
    "Misrouting forces the routed class; MCM scores that class's probability, so its AUROC must move with the level."
    from proton.bench.experiments.robustness import robustness
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedWarning)
        df = robustness(cache, rhos=(), misrouted=(0., .3), orders=(), n_permutations=1, progress=False)
    mcm = df[(df.method == "mcm") & (df["shift"] == "covariate")].set_index("misrouted").auroc
    assert abs(mcm[0.3] - mcm[0.0]) > 0.02


@pytest.mark.parametrize("out", ["c.npz", "./sub/../c.npz"])
def test_command_refuses_an_out_that_is_one_of_its_caches(cache, tmp_path, capsys, out):
    "`evaluate c.npz --out c.npz` would write the table over the cache it read: refused before anything is written."
    path = cache.save(tmp_path / "c.npz")
    (tmp_path / "sub").mkdir()
    before = path.read_bytes()
    assert evaluate_main([str(path), "--out", str(tmp_path / out), "--permutations", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "would overwrite the cache" in err and err.count("\n") == 1, err
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["c.npz", "sub"]


@pytest.mark.parametrize("value", [1.5, -0.1, float("nan")])
def test_a_misrouted_share_outside_0_1_is_named_as_such(cache, value):
    "evaluate(misrouted=1.5) said 'fraction must be in [0, 1]', a name the caller never gave."
    with pytest.raises(ValueError, match=r"the misrouted share must be in \[0, 1\], got"):
        evaluate(cache, ["mcm"], misrouted=value, n_permutations=1, progress=False)


def test_the_protocol_file_describes_the_results_beside_it_after_a_failed_run(cache, tmp_path, monkeypatch):
    """A run that fails before it writes any results leaves the old results and the old protocol file; one that fails after
    writing some lists only those in the protocol file."""
    import json
    from proton.cli import main
    path, id_only = cache.save(tmp_path / "c.npz"), cache.subset(cache.shift == "id").save(tmp_path / "id_only.npz")
    out, protocol = tmp_path / "r.csv", tmp_path / "r_protocol.json"
    run = lambda cache_file, *options: main(["evaluate", str(cache_file), "--out", str(out), "--permutations", "1", "--no-progress", *options])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedWarning)
        assert run(path, "--rho", "0.7") == 0
        results, written = out.read_bytes(), protocol.read_bytes()
        assert json.loads(written)["main_table"]["rho"] == 0.7
        assert run(id_only, "--rho", "0.5") == 1  # no OOD images: fails in the computation
        assert out.read_bytes() == results and protocol.read_bytes() == written
        real = evaluation._run_experiment
        def failing(name, caches, args):
            if name == "ablation": raise ValueError("the ablation failed")
            return real(name, caches, args)
        monkeypatch.setattr(evaluation, "_run_experiment", failing)
        assert run(path, "--rho", "0.6", "--experiments", "main_table,ablation") == 1
    written = json.loads(protocol.read_text())
    assert written["main_table"]["rho"] == 0.6 and list(written) == ["main_table"] and out.read_bytes() != results


@pytest.mark.parametrize("experiments, derived", [("ablation", "r_ablation.csv"), ("figure1", "r_figure1_tsne.csv"),
                                                  ("main_table", "r_protocol.json")])
def test_command_refuses_a_derived_path_that_is_one_of_its_caches(cache, tmp_path, capsys, experiments, derived):
    "Only --out was checked: `evaluate r_ablation.csv --out r.csv --experiments ablation` wrote the table over the cache it read."
    path = cache.save(tmp_path / "c.npz").rename(tmp_path / derived)
    before = path.read_bytes()
    assert evaluate_main([str(path), "--out", str(tmp_path / "r.csv"), "--experiments", experiments, "--permutations", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "would overwrite the cache" in err and derived in err and err.count("\n") == 1, err
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [derived]


def test_command_checks_every_output_path_before_computing(cache, tmp_path, capsys):
    "A derived file that cannot be written (here a folder) was found after main_table had been computed and written."
    path = cache.save(tmp_path / "c.npz")
    (tmp_path / "r_ablation.csv").mkdir()
    assert evaluate_main([str(path), "--out", str(tmp_path / "r.csv"), "--experiments", "main_table,ablation", "--permutations", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "r_ablation.csv" in err and "is a folder" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r.csv").exists()


def test_command_refuses_an_out_that_ends_in_a_slash(cache, tmp_path, capsys):
    "`--out res/` was taken as the stem of a file and wrote `res`, without suffix."
    path = cache.save(tmp_path / "c.npz")
    assert evaluate_main([str(path), "--out", str(tmp_path / "res") + "/", "--permutations", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "folder" in err and err.count("\n") == 1, err
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]


def test_a_simulated_cache_mixed_with_a_real_one_keeps_its_label(cache, tmp_path, capsys):
    "With one simulated and one real cache the '(simulated)' label vanished (it required every cache to be simulated)."
    import json
    sim = cache.save(tmp_path / "sim.npz")
    real = replace(cache, metadata={"model": "real"}).save(tmp_path / "real.npz")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedWarning)
        assert evaluate_main([str(sim), str(real), "--out", str(tmp_path / "r.csv"), "--experiments", "ablation", "--permutations", "1", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"ablation (simulated: {sim})" in printed, printed
    caches = json.loads((tmp_path / "r_protocol.json").read_text())["ablation"]["caches"]
    assert caches[str(sim)]["simulated"] is True and caches[str(real)]["simulated"] is False


def test_an_option_an_experiment_does_not_take_is_named_and_recorded(cache, tmp_path):
    "figure1 ignored --rho and --fpr95 silently while the protocol file recorded them as if applied."
    import json
    path = cache.save(tmp_path / "c.npz")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert evaluate_main([str(path), "--out", str(tmp_path / "r.csv"), "--experiments", "main_table,figure1", "--rho", "0.5",
                              "--fpr95", "mcm", "--permutations", "1", "--no-progress"]) == 0
    notes = [str(w.message) for w in caught if "does not use" in str(w.message)]
    assert len(notes) == 1 and "figure1" in notes[0] and "--rho" in notes[0] and "--fpr95" in notes[0] and "\n" not in notes[0], notes
    protocol = json.loads((tmp_path / "r_protocol.json").read_text())
    assert protocol["main_table"]["ignored"] == [] and {"--rho", "--fpr95", "--permutations"} <= set(protocol["figure1"]["ignored"]), protocol
    with warnings.catch_warnings(record=True) as caught:  # options left at their defaults are not warned about
        warnings.simplefilter("always")
        assert evaluate_main([str(path), "--out", str(tmp_path / "d.csv"), "--experiments", "figure1", "--no-progress"]) == 0
    assert not [w for w in caught if "does not use" in str(w.message)]


def test_command_refuses_a_cache_given_twice(cache, tmp_path, capsys):
    "The same cache twice gave duplicate rows and a fake spread (cross_domain kept one): refused, by path or by content."
    path = cache.save(tmp_path / "c.npz")
    copy = tmp_path / "copy.npz"; copy.write_bytes(path.read_bytes())
    for second in (str(path), str(tmp_path / "sub" / ".." / "c.npz"), str(copy)):
        assert evaluate_main([str(path), second, "--out", str(tmp_path / "r.csv"), "--permutations", "1", "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert "twice" in err and second in err and err.count("\n") == 1, err
    assert not (tmp_path / "r.csv").exists()


def test_a_second_run_into_the_same_out_keeps_the_protocol_of_the_first(cache, tmp_path):
    "A second run replaced <stem>_protocol.json, so the CSV files of the first lost their description; entries are per experiment."
    import json
    path = cache.save(tmp_path / "c.npz")
    run = lambda *options: evaluate_main([str(path), "--out", str(tmp_path / "r.csv"), "--permutations", "1", "--no-progress", *options])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedWarning)
        assert run("--experiments", "main_table,ablation") == 0
        assert run("--experiments", "ablation", "--seed", "7") == 0
    protocol = json.loads((tmp_path / "r_protocol.json").read_text())
    assert list(protocol) == ["main_table", "ablation"], protocol
    assert protocol["main_table"]["seed"] == 0 and protocol["ablation"]["seed"] == 7


@pytest.mark.parametrize("experiments", ["regime", "main_table,regime"])
def test_regime_named_with_cache_files_is_an_error(cache, tmp_path, capsys, experiments):
    "`evaluate c.npz --experiments regime` warned 'skipped regime', wrote nothing and exited 0; named, it fails, before any computation."
    path = cache.save(tmp_path / "c.npz")
    assert evaluate_main([str(path), "--out", str(tmp_path / "r.csv"), "--experiments", experiments, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "regime sweeps synthetic worlds, so it runs only without cache files" in err and err.count("\n") == 1, err
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]


@pytest.mark.parametrize("caches", [[], ["c.npz"]])
def test_an_empty_simulated_preset_is_refused(cache, tmp_path, capsys, caches):
    "`--simulated ''` ran the default world silently, and `c.npz --simulated ''` was not refused as caches and --simulated both."
    paths = [str(cache.save(tmp_path / c)) for c in caches]
    argv = [*paths, "--simulated", "", "--out", str(tmp_path / "r.csv"), "--permutations", "1", "--no-progress"]
    if caches:
        with pytest.raises(SystemExit): evaluate_main(argv)
        assert "give cache files or --simulated, not both" in capsys.readouterr().err
    else:
        assert evaluate_main(argv) == 1
        err = capsys.readouterr().err
        assert "--simulated" in err and "''" in err and "default" in err and err.count("\n") == 1, err
    assert [p.name for p in tmp_path.iterdir()] == caches


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_command_refuses_a_seed_outside_the_range_up_front(cache, tmp_path, capsys, seed):
    "--seed 2**32 passed the check and failed in scikit-learn after earlier experiments had run."
    path = cache.save(tmp_path / "c.npz")
    assert evaluate_main([str(path), "--out", str(tmp_path / "r.csv"), "--experiments", "main_table,triage", "--seed", seed, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"--seed must be an integer in [0, 2**32 - 1], got {seed}" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r.csv").exists()


def test_figure1_without_the_mapped_shift_says_its_map_holds_id_images_only(cache):
    "On a cache without covariate images the t-SNE panel silently held only ID images."
    from proton.bench.experiments.figure1 import figure1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = figure1(cache.subset(cache.shift != "covariate"), n_tsne=80)
    notes = [str(w.message) for w in caught if "t-SNE" in str(w.message)]
    assert set(fig.tsne.kind) == {"id"} and len(notes) == 1 and "'covariate'" in notes[0] and "\n" not in notes[0], notes


def test_evaluate_takes_a_numpy_integer_seed(cache):
    "seed=np.int64(3) reached torch.Generator.manual_seed, which refused it with a TypeError."
    df, _ = quiet_evaluate(cache, ["mcm", "knn_id"], n_permutations=1, seed=np.int64(3))
    ref, _ = quiet_evaluate(cache, ["mcm", "knn_id"], n_permutations=1, seed=3)
    pd.testing.assert_frame_equal(df, ref)


def test_summarize_names_a_reference_that_is_not_in_the_results(cache):
    df, _ = quiet_evaluate(cache, ["mcm", "proton"], shifts="far", n_permutations=1)
    with pytest.raises(ValueError, match="reference 'max_logit' is not among the methods of the results"): summarize(df, reference="max_logit")


def test_summarize_refuses_results_it_would_pool_wrongly(cache):
    "Two runs concatenated: their rows counted as seeds of one, and FPR95 values of two conventions averaged."
    a, _ = quiet_evaluate(cache, ["mcm", "proton"], shifts="far", n_permutations=1, fpr95_convention="ju2025")
    b, _ = quiet_evaluate(cache, ["mcm", "proton"], shifts="far", n_permutations=1, fpr95_convention="mcm")
    with pytest.raises(ValueError, match="FPR95 conventions"): summarize(pd.concat([a, b]))
    with pytest.raises(ValueError, match=r"several rows for one method, shift and seed"): summarize(pd.concat([a, a]))


def test_method_labels_that_print_alike_are_refused(cache):
    with pytest.raises(ValueError, match="method labels 1 and '1' are both '1'"):
        evaluate(cache, {1: ("mcm", None), "1": ("proton", None)}, shifts="far", n_permutations=1)


def test_command_refuses_an_out_that_is_a_hard_link_to_one_of_its_caches(cache, tmp_path, capsys):
    "A hard link to the cache as --out passed the check (it compared resolved paths) and the table was written over the cache."
    import os
    path = cache.save(tmp_path / "c.npz")
    os.link(path, tmp_path / "r.csv")
    before = path.read_bytes()
    assert evaluate_main([str(path), "--out", str(tmp_path / "r.csv"), "--permutations", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "would overwrite the cache" in err and err.count("\n") == 1, err
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["c.npz", "r.csv"]


def test_a_failed_write_of_a_table_keeps_the_old_one_whole(cache, tmp_path, monkeypatch):
    "The tables were written in place: a write that failed half-way (a full disk) left a truncated CSV instead of the old results."
    path, out = cache.save(tmp_path / "c.npz"), tmp_path / "r.csv"
    run = lambda: evaluate_main([str(path), "--out", str(out), "--permutations", "1", "--no-progress"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedWarning)
        assert run() == 0
        results = out.read_bytes()
        def half(df, target, **kwargs):
            (target if hasattr(target, "write") else open(target, "wb")).write(b"method,")
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(pd.DataFrame, "to_csv", half)
        with pytest.raises(OSError, match="No space left"): run()
    assert out.read_bytes() == results and sorted(p.name for p in tmp_path.iterdir()) == ["c.npz", "r.csv", "r_protocol.json"]


def test_command_refuses_an_empty_out(cache, tmp_path, capsys):
    "`--out ''` failed with \"PosixPath('.') has an empty name\"."
    path = cache.save(tmp_path / "c.npz")
    assert evaluate_main([str(path), "--out", "", "--permutations", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "--out is empty" in err and err.count("\n") == 1, err


def test_nothing_to_evaluate_names_the_real_cause(cache):
    "With no stream to run, the error listed every method lacking prompts first and the real cause (rho too far from 0.5) last."
    with pytest.raises(ValueError) as e: evaluate(cache, rho=0.001, n_permutations=1, progress=False)
    message = str(e.value)
    assert message.startswith("nothing to evaluate: no shift has a stream: shift 'semantic' (rho=0.001 leaves"), message
    assert "prompt_text_embeddings" not in message and "\n" not in message, message
    with pytest.raises(ValueError, match=r"^nothing to evaluate: no method can run: gl_mcm \(the cache has no local_embeddings"):
        evaluate(cache.subset(cache.shift != "far"), ["gl_mcm"], shifts=["semantic", "far"], n_permutations=1, progress=False)


def test_the_command_a_partial_course_cache_is_sent_to_runs_as_written(tmp_path, monkeypatch):
    "course_cache refuses a cache without every shift and names a command for it: that command, run as printed, must work."
    import re, shlex, subprocess, sys
    from pathlib import Path
    partial = evaluation.simulated_cache("pathology")
    partial.subset(np.array(partial.shift) != "covariate").save(tmp_path / "pathology.npz")
    monkeypatch.setenv(evaluation.COURSE_CACHES, str(tmp_path))
    with pytest.raises(ValueError) as e: evaluation.course_cache("pathology")
    command = shlex.split(re.search(r"run `proton-ood (.+?)`", str(e.value))[1])
    r = subprocess.run([str(Path(sys.executable).parent / "proton-ood"), *command, "--permutations", "1", "--no-progress"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr


def test_a_row_is_recreated_by_the_streams_chapter_instruction(cache):
    "21_streams: a row of `evaluate(seed=S)` is `make_stream(..., seed=<its seed>, sample_seed=S)`; at rho < 1 the subsample is drawn with S too."
    from proton.metrics import ood_metrics
    df, _ = quiet_evaluate(cache, ["proton"], shifts=["covariate"], n_permutations=2, seed=2, rho=0.7)
    row = df[df.seed == 3].iloc[0]
    stream = make_stream(cache, "covariate", rho=0.7, seed=int(row.seed), sample_seed=2)
    s = method_scores("proton", cache, stream, None)
    assert ood_metrics(s[~stream.is_ood], s[stream.is_ood])["auroc"] == row.auroc


@pytest.mark.parametrize("out", ["r.parquet", "r", "r.txt", "r.csv.gz"])
def test_command_refuses_an_out_that_is_no_csv_file(cache, tmp_path, capsys, out):
    "`--out r.parquet` wrote CSV text into r.parquet, which `pd.read_parquet` then failed on: evaluate writes only CSV."
    path = cache.save(tmp_path / "c.npz")
    assert evaluate_main([str(path), "--out", str(tmp_path / out), "--permutations", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"--out {tmp_path / out} must end in .csv" in err and err.count("\n") == 1, err
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]


def test_command_takes_a_csv_suffix_in_capitals(cache, tmp_path):
    path = cache.save(tmp_path / "c.npz")
    assert evaluate_main([str(path), "--out", str(tmp_path / "R.CSV"), "--permutations", "1", "--no-progress"]) == 0
    assert len(pd.read_csv(tmp_path / "R.CSV")) > 0


@pytest.mark.parametrize("out", [".", "..", "sub", "sub/.", "sub/..", "sub.csv", "new/"])
def test_command_refuses_an_out_that_names_a_folder(cache, tmp_path, monkeypatch, capsys, out):
    "`--out .` failed with Python's \"PosixPath('.') has an empty name\" instead of the refusal of a folder."
    path = cache.save(tmp_path / "c.npz")
    (tmp_path / "sub").mkdir(); (tmp_path / "sub.csv").mkdir()
    monkeypatch.chdir(tmp_path)
    assert evaluate_main([str(path), "--out", out, "--permutations", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"--out {out} names a folder" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["c.npz", "sub", "sub.csv"]


def test_a_refused_run_leaves_no_new_folder(cache, tmp_path, capsys):
    "The check of the outputs made --out's folders before the caches loaded; a cache that then failed left new/sub behind, empty."
    (tmp_path / "bad.npz").write_text("hi")
    assert evaluate_main([str(tmp_path / "bad.npz"), "--out", str(tmp_path / "new" / "sub" / "r.csv"), "--no-progress"]) == 1
    assert "not a .npz archive" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    path = cache.save(tmp_path / "c.npz")  # a run that goes ahead makes them
    assert evaluate_main([str(path), "--out", str(tmp_path / "new" / "sub" / "r.csv"), "--permutations", "1", "--no-progress"]) == 0
    assert sorted(p.name for p in (tmp_path / "new" / "sub").iterdir()) == ["r.csv", "r_protocol.json"]


def test_a_privileged_method_that_cannot_be_fitted_holds_no_id_image_out(cache):
    "kNN-ID asked for on 30 ID images holds 6 out, too few for k = 10: it was skipped, yet every stream had lost those 6 images."
    few = cache.subset((cache.shift != "id") | (np.cumsum(cache.shift == "id") <= 30))
    alone, _ = quiet_evaluate(few, ["mcm"], shifts="semantic", n_permutations=1, rho=None)
    with evaluation._fits() as fits:
        beside, messages = quiet_evaluate(few, ["mcm", "knn_id"], shifts="semantic", n_permutations=1, rho=None)
    assert any(m.startswith("skipped knn_id") for m in messages), messages
    pd.testing.assert_frame_equal(alone, beside)
    assert set(beside.n_id) == {30}
    assert fits[id(few)] == {(0, "none: no ID image held out, the streams keep them all")}, fits


def test_a_cache_with_a_fit_split_records_no_fit_where_no_privileged_method_ran():
    "A run of MCM and PROTON alone recorded that the privileged methods were fitted on the fit split."
    fitted = EmbeddingCache.from_world(SyntheticWorld(seed=0), n_id=100, n_per_shift=50, n_fit=20)
    with evaluation._fits() as fits: quiet_evaluate(fitted, ["mcm", "proton"], shifts="far", n_permutations=1)
    assert fits[id(fitted)] == {(0, "none: no ID image held out, the streams keep them all")}, fits
    with evaluation._fits() as fits: quiet_evaluate(fitted, ["mcm", "knn_id"], shifts="far", n_permutations=1)
    assert fits[id(fitted)] == {(0, "fit split, 20 images")}, fits


def test_a_privileged_method_skipped_for_too_few_images_says_so_in_the_users_terms(cache):
    "'k must be an integer between 1 and the bank size 2, got 10' named a k the user never set; the reason now says what is missing."
    first = lambda n: cache.subset((cache.shift != "id") | (np.cumsum(cache.shift == "id") <= n))  # n ID images
    _, messages = quiet_evaluate(first(10), ["mcm", "knn_id"], shifts="far", n_permutations=1)
    assert any("knn_id (the held-out split (20% of the cache's 10 ID images) holds 2 images; kNN-ID needs at least k = 10)" in m for m in messages), messages
    _, messages = quiet_evaluate(first(5), ["mcm", "mahalanobis_id"], shifts="far", n_permutations=1)
    assert any("mahalanobis_id (the held-out split (20% of the cache's 5 ID images) holds 1 image of 1 class; "
               "Mahalanobis-ID needs more images than classes)" in m for m in messages), messages
    fitted = replace(cache, fit_embeddings=cache.image_embeddings[:4], fit_labels=np.maximum(cache.labels[:4], 0))
    _, messages = quiet_evaluate(fitted, ["mcm", "knn_id"], shifts="far", n_permutations=1)
    assert any("knn_id (the cache's fit split holds 4 images; kNN-ID needs at least k = 10)" in m for m in messages), messages


@pytest.mark.parametrize("method", ["hier_mcm", "proton[hier_mcm]", "prompt_ensemble_mcm"])
def test_prompts_for_another_number_of_classes_are_refused(cache, method):
    "Prompts of shape (C, P, d), read as P classes against the cache's C, gave AUROCs without a word."
    P = noisy_views(cache.text_embeddings, 5, .5).numpy()  # (C, P, d): the axes swapped
    with pytest.raises(ValueError, match=rf"prompt_text_embeddings hold 5 classes, the cache has {cache.n_classes}"):
        evaluate(cache, [method, "mcm"], n_permutations=1, prompt_text_embeddings=P, progress=False)
    with pytest.raises(ValueError, match="hold 5 classes, the cache has"):
        method_scores(method, cache, make_stream(cache, "semantic", seed=0), prompt_text_embeddings=P)
    df, _ = quiet_evaluate(cache, [method, "mcm"], n_permutations=1, prompt_text_embeddings=P.transpose(1, 0, 2))
    assert set(df.method) == {method, "mcm"}


def test_given_prompts_stand_for_the_deepest_level_only(cache):
    "With prompt_text_embeddings=, hier_mcm_l1 and TAG pooled them too: hier_mcm_l1 equalled hier_mcm exactly, under another name."
    P = noisy_views(cache.text_embeddings, 5, .5).numpy().transpose(1, 0, 2)  # (P, C, d)
    names = ["hier_mcm", "prompt_ensemble_mcm", "hier_mcm_l1", "tag_mcm", "proton[hier_mcm_l1]"]
    df, messages = quiet_evaluate(cache, names, n_permutations=1, prompt_text_embeddings=P)
    assert set(df.method) == {"hier_mcm", "prompt_ensemble_mcm"}
    for name, want in [("hier_mcm_l1", "'L1'"), ("tag_mcm", "'tag'"), ("proton[hier_mcm_l1]", "'L1'")]:
        assert any(f"{name} ({name.removeprefix('proton[').removesuffix(']')} pools the prompt set {want}" in m for m in messages), (name, messages)
    with pytest.raises(ValueError, match="hier_mcm_l1 pools the prompt set 'L1'"):
        method_scores("hier_mcm_l1", cache, make_stream(cache, "semantic", seed=0), prompt_text_embeddings=P)


@pytest.mark.parametrize("fraction", ["0.5", True, 1., math.nan])
def test_a_held_out_fraction_that_is_no_number_in_0_1_is_named(cache, fraction):
    "held_out_fraction='0.5' reached '<' (TypeError) in carve_held_out and a format code in evaluate ('Unknown format code 'g'')."
    with pytest.raises(ValueError, match=r"held_out_fraction must be a number in \[0, 1\), got "):
        carve_held_out(cache, fraction)
    with pytest.raises(ValueError, match=r"held_out_fraction must be a number in \[0, 1\), got "):
        evaluate(cache, ["knn_id"], held_out_fraction=fraction, n_permutations=1, progress=False)
