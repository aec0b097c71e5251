"""A copied or pickled detector continues its own stream: the one-image path's numpy views never travel with it."""
import copy
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from proton import Proton, ProtonConfig
from reference import clustered_stream

CFG = ProtonConfig(bank_size=5, k_min=1, gamma=0.3)


def stream():
    "Text embeddings and 120 image embeddings of three classes, float32."
    T, E = clustered_stream(3, 8, 120, seed=1)
    return torch.tensor(T, dtype=torch.float32), torch.tensor(E, dtype=torch.float32)


def one_by_one(det, E): return torch.cat([det.score(e) for e in E])


def state(det):
    "The stream state: bank entries, counts, prototypes, and the Welford moments as a tensor."
    w = det.welford
    return [t.clone() for t in (det.bank.entries, det.bank.counts, det.bank.prototypes)] + [torch.tensor([w.n, w.mean, w.m2])]


def same_state(det, saved): return all(torch.equal(a, b) for a, b in zip(state(det), saved))


def test_a_deepcopy_continues_alone_and_leaves_the_original_untouched():
    T, E = stream()
    a, ref = Proton(T, CFG), Proton(T, CFG)
    one_by_one(a, E[:40]); one_by_one(ref, E[:40])  # the one-image path: `a` holds numpy views of its bank
    saved = state(a)
    b = copy.deepcopy(a)
    got = one_by_one(b, E[40:])
    assert torch.equal(got, one_by_one(ref, E[40:]))
    assert same_state(b, state(ref))  # the copy's tensors, what `state_dict` saves, advanced
    assert same_state(a, saved)  # scoring the copy did not touch the original
    assert torch.equal(one_by_one(a, E[40:]), got)  # which continues as it would have


def test_a_pickled_detector_continues_in_a_fresh_process(tmp_path):
    T, E = stream()
    a, ref = Proton(T, CFG), Proton(T, CFG)
    one_by_one(a, E[:40]); one_by_one(ref, E[:40])
    saved = state(a)
    (tmp_path / "det.pkl").write_bytes(pickle.dumps(a))
    torch.save(E[40:], tmp_path / "rows.pt")
    child = ("import pickle, sys, torch; d = pickle.load(open(sys.argv[1], 'rb'));"
             "torch.save(torch.cat([d.score(e) for e in torch.load(sys.argv[2])]), sys.argv[3])")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", child, tmp_path / "det.pkl", tmp_path / "rows.pt", tmp_path / "out.pt"],
                         cwd=root, env={"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert torch.equal(torch.load(tmp_path / "out.pt"), one_by_one(ref, E[40:]))
    assert same_state(a, saved)


def test_a_deepcopy_of_the_pytorch_ood_detector_continues_alone():
    pytest.importorskip("pytorch_ood")
    from proton.interop import pytorch_ood_detector
    T, E = stream()
    o, ref = pytorch_ood_detector(Proton(T, CFG)), Proton(T, CFG)
    for e in E[:40]: o.predict_features(e)
    one_by_one(ref, E[:40])
    saved = state(o.detector)
    c = copy.deepcopy(o)
    assert torch.equal(torch.cat([c.predict_features(e) for e in E[40:]]), one_by_one(ref, E[40:]))
    assert same_state(c.detector, state(ref))
    assert same_state(o.detector, saved)


def library_classes():
    "Every class the library defines, from every module of the package."
    import importlib, inspect, pkgutil
    import proton
    for m in pkgutil.walk_packages(proton.__path__, "proton."):
        mod = importlib.import_module(m.name)
        yield from (c for c in vars(mod).values() if inspect.isclass(c) and c.__module__ == mod.__name__)


def test_every_method_is_named_as_it_is_reached():
    "A pickled bound method is looked up by its function's name: `Proton.score` defined as `_score` could not be unpickled."
    import inspect
    wrong = [f"{c.__module__}.{c.__qualname__}.{name} is named {f.__name__}" for c in library_classes() for name, a in vars(c).items()
             if inspect.isfunction(f := getattr(a, "__func__", a)) and f.__name__ != name]
    assert not wrong, wrong


def test_bound_methods_and_a_detector_with_a_models_encoder_pickle_and_load_back():
    from proton.interop import pytorch_ood_detector
    from proton.models import load_vlm, prompt_ensemble
    T, E = stream()
    det = Proton(T, CFG)
    score = pickle.loads(pickle.dumps(det.score))
    assert torch.equal(score(E[:10]), Proton(T, CFG).score(E[:10]))
    vlm = load_vlm("open_clip:ViT-S-32/none", device="cpu")
    ood = pytorch_ood_detector(Proton(prompt_ensemble(vlm, {"a": ["a"], "b": ["b"]}), temperature=vlm.temperature), encoder=vlm.encode_images)
    again = pickle.loads(pickle.dumps(ood))
    x = torch.rand(2, 3, *vlm.image_size)
    assert torch.equal(again.predict(x), ood.predict(x))


def test_a_shallow_copy_scores_without_touching_the_original():
    "copy.copy shared the bank: scoring the copy filled the original's queues while its running variance stayed empty."
    T, E = stream()
    det = Proton(T, CFG)
    det.score(E[:30])
    before = state(det)
    other = copy.copy(det)
    other.score(E[30:])
    assert all(torch.equal(a, b) for a, b in zip(state(det), before))
    shallow, deep = copy.copy(other), copy.deepcopy(other)
    assert torch.equal(shallow.score(E[:5]), deep.score(E[:5]))


def test_a_shallow_copy_shares_a_base_score_it_cannot_copy():
    "The copy's own stream state must not mean a copy of what the base score belongs to: a model, or an object holding a lock."
    import threading
    class Scorer:
        def __init__(self): self.lock = threading.Lock()
        def score(self, logits): return -logits.softmax(1).amax(1)
    T, E = stream()
    owner = Scorer()
    det = Proton(T, ProtonConfig(bank_size=5, k_min=1, gamma=0.3, base_score=owner.score))
    other = copy.copy(det)
    assert other.config.base_score.__self__ is owner and torch.equal(other.score(E), Proton(T, det.config).score(E))
