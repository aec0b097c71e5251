"""The experiment chapters run on real caches: with `PROTON_CACHES` naming a folder of caches, each chapter loads its domain's cache
from there instead of simulating it, and runs to its end even where its sentences about the simulated results do not hold; what it
shows of those results (tables, figures' titles and labels) is not labelled simulated.

The "real" caches here are not simulated by the course's presets: other worlds, other sizes, marked as not simulated, and in one
variant a temperature so high that no image passes the gate (what a model with random weights gives), so no prototype ever forms.
"""
from dataclasses import replace
from pathlib import Path

import matplotlib.figure
import matplotlib.text
import pytest
from execnb.shell import CaptureShell
from fastcore.xtras import working_directory
from nbdev.process import NBProcessor

from proton.bench.cache import EmbeddingCache
from proton.bench.synth import SyntheticWorld

ROOT = Path(__file__).parents[1]
DOMAINS = ("ophthalmology", "radiology", "pathology")
CHAPTERS = ["00_intro", "24_main_table", "25_ablation", "26_sensitivity", "27_robustness", "28_generality", "29_cross_domain", "30_dynamics", "31_triage"]
WORLDS = {  # variant -> changes to each domain's preset
    "hard": dict(seed=7, cov_shift=0.8, sem_novelty=0.2, far_alignment=0.3),
    "never calibrated": dict(seed=7, temperature=1.0),
}


# sentences that must not hold where no prototype ever forms: they speak of what the bank learns
UNLEARNED = {"26_sensitivity": ["A lower σ²₀ helps covariate shift, monotonically", "The smallest bank, M=10, is the weakest column everywhere"],
             "30_dynamics": ["the drift drops below 0.01 within the first ten updates",
                             "the first prototypes start farther from where they end than they ever are once the detector is calibrated"]}


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request): return request.param


@pytest.fixture(scope="module")
def caches(world, tmp_path_factory):
    "A folder of three caches named as `proton-ood reproduce` names them."
    folder = tmp_path_factory.mktemp("caches")
    for domain in DOMAINS:
        cache = EmbeddingCache.from_world(replace(SyntheticWorld.preset(domain), **WORLDS[world]), n_id=150, n_per_shift=60, n_fit=40, seed=3)
        replace(cache, metadata=cache.metadata | dict(simulated=False, model="a stand-in for a real VLM")).save(folder / f"{domain}_some-model.npz")
    return folder


CLAIMED = "On these caches, a sentence of this chapter does not hold:"  # what `claim` prints: the book's sentence may say simulated


def run_chapter(path:Path, monkeypatch):
    "Run the notebook at `path` as nbdev_test does (no `#| slow`, no `#| eval: false` cells): its texts shown, the sentences it says do not hold, and the error that stopped it."
    texts, unheld, draw = [], [], matplotlib.figure.Figure.draw
    def drawn(fig, *args, **kwargs):  # every text of a figure when it is drawn: titles, suptitles, axis and colour-bar labels, ...
        texts.extend(t.get_text() for t in fig.findobj(matplotlib.text.Text))
        return draw(fig, *args, **kwargs)
    monkeypatch.setattr(matplotlib.figure.Figure, "draw", drawn)
    monkeypatch.setenv("IN_TEST", "1")
    nb = NBProcessor(path, process=True).nb
    skip = lambda c: c.cell_type != "code" or c.directives_.get("eval:", [""])[0].lower() == "false" or "slow" in c.directives_
    shell, error = CaptureShell(path), None
    try:
        with working_directory(path.parent): shell.run_all(nb, exc_stop=True, preproc=skip)
    except Exception: error = shell.prettytb(fname=path)
    for out in (o for c in nb.cells for o in c.get("outputs", [])):
        for line in "".join(out.text).splitlines() if out.get("name") == "stdout" else []:
            if line.startswith(CLAIMED): unheld.append(line.removeprefix(CLAIMED).strip())
            else: texts.append(line)
        texts.extend("".join(out.get("data", {}).get(mime, "")) for mime in ("text/plain", "text/html"))
    return texts, unheld, error


@pytest.mark.filterwarnings("ignore::proton.bench.evaluation.SkippedWarning")  # these caches have no local embeddings or prompt sets, as a user's may not
@pytest.mark.filterwarnings("error")  # a warning would show on the reader's page: a cell that warns on real caches fails
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_chapter_runs_on_the_real_caches(chapter, world, caches, monkeypatch):
    monkeypatch.setenv("PROTON_CACHES", str(caches))
    loaded, load = [], EmbeddingCache.load.__func__
    def spied(cls, path, *args, **kwargs):
        loaded.append(Path(path).name)
        return load(cls, path, *args, **kwargs)
    monkeypatch.setattr(EmbeddingCache, "load", classmethod(spied))
    texts, unheld, error = run_chapter(ROOT / "nbs" / f"{chapter}.ipynb", monkeypatch)
    assert error is None, f"{chapter} stopped on the caches of {caches}:\n{error}"
    assert {name for name in loaded if name.endswith("_some-model.npz")}, f"{chapter} did not load a cache of {caches}"
    simulated = list(dict.fromkeys(l.strip() for t in texts for l in t.splitlines() if "simulated" in l.lower()))
    assert not simulated, f"{chapter} labels results of the caches of {caches} simulated: {simulated}"
    if world == "never calibrated":  # a sentence about what the bank learns holds only where it learns something
        held = [s for s in UNLEARNED.get(chapter, []) if s not in unheld]
        assert not held, f"{chapter} says of caches where no prototype forms: {held}"
