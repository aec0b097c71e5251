"""The OpenOOD post-processor inside OpenOOD's own `Evaluator`, where OpenOOD is importable (it is not on PyPI, so CI skips this).

To run it: put a checkout of https://github.com/Jingkang50/OpenOOD on PYTHONPATH with the modules its package imports
(faiss-cpu, opencv-python-headless, statsmodels, gdown, foolbox, diffdist; imgaug and libmr only need to import) and run pytest on
this file. The evaluator is built without its data loading (which downloads the benchmarks); every call it makes on the
post-processor, and its metrics, are its own.
"""
import numpy as np
import pytest
import torch

evaluation_api = pytest.importorskip("openood.evaluation_api", reason="OpenOOD is not installed")
from openood.postprocessors import BasePostprocessor

from proton import Proton, ood_metrics
from proton.bench.cache import EmbeddingCache
from proton.bench.synth import SyntheticWorld
from proton.interop import OpenOODPostprocessor


class Features(torch.nn.Module):
    "The network: its inputs are already the VLM's embeddings."
    def __init__(self): super().__init__(); self.w = torch.nn.Parameter(torch.zeros(1))
    def forward(self, x): return x


def evaluator(post, loaders:dict):
    "OpenOOD's `Evaluator` on `loaders` ({'id': ..., 'near': {name: ...}, 'far': {name: ...}}), without downloading any data."
    ev = evaluation_api.Evaluator.__new__(evaluation_api.Evaluator)
    ev.id_name, ev.net, ev.postprocessor = "synthetic", Features(), post
    ev.dataloader_dict = dict(id=dict(test=loaders["id"]), csid={}, ood=dict(near=loaders["near"], far=loaders["far"]))
    ev.metrics = dict(id_acc=None, csid_acc=None, ood=None, fsood=None)
    ev.scores = dict(id=dict(train=None, val=None, test=None), csid={}, id_preds=None, id_labels=None, csid_preds={}, csid_labels={},
                     ood=dict(val=None, near=dict.fromkeys(loaders["near"]), far=dict.fromkeys(loaders["far"])))
    return ev


def test_openood_evaluator_gives_our_auroc_and_fpr95():
    cache = EmbeddingCache.from_world(SyntheticWorld.preset("ophthalmology", seed=0), n_id=300, n_per_shift=150)
    E, rows = torch.as_tensor(cache.image_embeddings), {s: np.flatnonzero(cache.shift == s) for s in ("id", "semantic", "covariate", "far")}
    batches = lambda r: [dict(data=E[r[i:i + 64]], label=torch.as_tensor(cache.labels[r[i:i + 64]])) for i in range(0, len(r), 64)]
    post = OpenOODPostprocessor(Proton(cache.text_embeddings, temperature=cache.temperature))
    assert isinstance(post, BasePostprocessor), "OpenOOD's Evaluator refuses any other post-processor"
    ev = evaluator(post, dict(id=batches(rows["id"]), near={s: batches(rows[s]) for s in ("semantic", "covariate")}, far={"far": batches(rows["far"])}))
    assert not (post.APS_mode and not post.hyperparam_search_done)  # the Evaluator would search hyperparameters
    ev.net.eval()
    ev.scores["id"]["test"] = ids = list(post.inference(ev.net, ev.dataloader_dict["id"]["test"], False))
    theirs = dict(zip(("semantic", "covariate", "far"), [*ev._eval_ood(ids, "near", progress=False)[:2], ev._eval_ood(ids, "far", progress=False)[0]]))
    order = np.concatenate([rows[s] for s in ("id", "semantic", "covariate", "far")])  # the stream the Evaluator made: ID, then each OOD set
    s = Proton(cache.text_embeddings, temperature=cache.temperature).score(E[order]).numpy()
    ends = np.cumsum([0] + [len(rows[k]) for k in ("id", "semantic", "covariate", "far")])
    for i, shift in enumerate(("semantic", "covariate", "far"), 1):
        ours = ood_metrics(s[:ends[1]], s[ends[i]:ends[i + 1]])
        fpr, auroc = theirs[shift][:2] / 100
        assert abs(auroc - ours["auroc"]) < 1e-9 and abs(fpr - ours["fpr95_ood"]) < 1e-9, (shift, theirs[shift], ours)
