"""The experiment chapters run on real caches: with `PROTON_CACHES` naming a folder of caches, each chapter loads its domain's cache
from there instead of simulating it, and runs to its end even where its sentences about the simulated results do not hold.

The "real" caches here are not simulated by the course's presets: other worlds, other sizes, marked as not simulated, and in one
variant a temperature so high that no image passes the gate (what a model with random weights gives), so no prototype ever forms.
"""
from dataclasses import replace
from pathlib import Path

import pytest
from nbdev.test import test_nb

from proton.bench.cache import EmbeddingCache
from proton.bench.synth import SyntheticWorld

ROOT = Path(__file__).parents[1]
DOMAINS = ("ophthalmology", "radiology", "pathology")
CHAPTERS = ["24_main_table", "25_ablation", "26_sensitivity", "27_robustness", "28_generality", "29_cross_domain", "30_dynamics", "31_triage"]
WORLDS = {  # variant -> changes to each domain's preset
    "hard": dict(seed=7, cov_shift=0.8, sem_novelty=0.2, far_alignment=0.3),
    "never calibrated": dict(seed=7, temperature=1.0),
}


@pytest.fixture(scope="module", params=list(WORLDS))
def caches(request, tmp_path_factory):
    "A folder of three caches named as `proton-ood reproduce` names them."
    folder = tmp_path_factory.mktemp("caches")
    for domain in DOMAINS:
        cache = EmbeddingCache.from_world(replace(SyntheticWorld.preset(domain), **WORLDS[request.param]), n_id=150, n_per_shift=60, n_fit=40, seed=3)
        replace(cache, metadata=cache.metadata | dict(simulated=False, model="a stand-in for a real VLM")).save(folder / f"{domain}_some-model.npz")
    return folder


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_chapter_runs_on_the_real_caches(chapter, caches, monkeypatch):
    monkeypatch.setenv("PROTON_CACHES", str(caches))
    loaded, load = [], EmbeddingCache.load.__func__
    def spied(cls, path, *args, **kwargs):
        loaded.append(Path(path).name)
        return load(cls, path, *args, **kwargs)
    monkeypatch.setattr(EmbeddingCache, "load", classmethod(spied))
    ok, _ = test_nb(ROOT / "nbs" / f"{chapter}.ipynb", skip_flags=["slow"])
    assert ok, f"{chapter} stopped on the caches of {caches}"
    assert {name for name in loaded if name.endswith("_some-model.npz")}, f"{chapter} did not load a cache of {caches}"
