"""The interop adapters with what other OOD libraries hand them: a net's (features, logits) tuple, no input at all, and pickling."""
import io
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import proton
from proton import Proton, ProtonConfig
from reference import clustered_stream

pytest.importorskip("pytorch_ood")
from proton.interop import OpenOODPostprocessor, pytorch_ood_detector

T, E = clustered_stream(3, 16, 300, seed=7)
E = torch.as_tensor(E)
CFG = ProtonConfig(bank_size=10, k_min=2, temperature=0.2)


@pytest.mark.parametrize("x, got", [(None, "NoneType"), ("abc", "str"), (np.array([E[0], None], dtype=object), "ndarray of dtype object")])
def test_input_that_is_no_array_is_named_in_one_line(x, got):
    "None or a string failed with numpy's 'can't convert np.ndarray of type numpy.object_', naming neither the input nor its type."
    ood = pytorch_ood_detector(Proton(T, CFG))
    ood.predict_features(E[:40]); n = ood.detector.welford.n
    with pytest.raises(ValueError, match=rf"^image embeddings must be a numeric array or tensor, got {got}$"): ood.predict_features(x)
    assert ood.detector.welford.n == n


TUPLE = r"^{} a tuple of 2; PROTON needs the \(B, d\) embeddings alone: for a \(features, logits\) pair, pass the features$"


@pytest.mark.parametrize("n", [1, 4])
def test_features_and_logits_are_named_by_both_adapters(n):
    "Networks in OpenOOD and pytorch-ood return (features, logits); numpy's 'inhomogeneous shape' named neither the tuple nor what to pass."
    ood, post = pytorch_ood_detector(Proton(T, CFG), encoder=lambda x: (x, torch.randn(len(x), 5))), OpenOODPostprocessor(Proton(T, CFG))
    with pytest.raises(ValueError, match=TUPLE.format("predict_features got")): ood.predict_features((E[:n], torch.randn(n, 5)))
    with pytest.raises(ValueError, match=TUPLE.format("predict_features got")): ood.predict(E[:n])
    with pytest.raises(ValueError, match=TUPLE.format(re.escape("net(data) returned"))): post.postprocess(lambda x: (x, torch.randn(len(x), 5)), E[:n])
    assert ood.detector.welford.n == post.detector.welford.n == 0
    torch.testing.assert_close(post.postprocess(lambda x: x, E[:n])[1], -Proton(T, CFG).score(E[:n]))


def scored(ood, batches=((40, 100), (100, 163))):
    return torch.cat([ood.predict_features(E[a:b]) for a, b in batches])


@pytest.mark.parametrize("save", ["pickle", "torch.save"])
def test_a_pytorch_ood_detector_pickles_mid_stream(save):
    "pytorch_ood_detector's class was local to the function: `Can't pickle local object 'pytorch_ood_detector.<locals>.ProtonDetector'`."
    ood = pytorch_ood_detector(Proton(T, CFG), encoder=torch.nn.Identity()).to("cpu")
    ood.predict_features(E[:40])  # batches only: the one-image path's cached views are another matter
    if save == "pickle": copy = pickle.loads(pickle.dumps(ood))
    else:
        buf = io.BytesIO(); torch.save(ood, buf); buf.seek(0); copy = torch.load(buf, weights_only=False)
    assert type(copy) is type(ood) and copy.detector is not ood.detector and copy.device == ood.device
    assert isinstance(copy.encoder, torch.nn.Identity)
    got = scored(copy)
    assert torch.equal(got, scored(ood))  # the copy continues the stream on its own: the original's is where it was
    torch.testing.assert_close(got, Proton(T, CFG).score(E[:163])[40:])


def test_a_pytorch_ood_detector_unpickles_in_a_new_process(tmp_path):
    "A DataLoader worker or a later session unpickles it before anything there has called pytorch_ood_detector; pytorch-ood stays a lazy import."
    ood = pytorch_ood_detector(Proton(T, CFG)); ood.predict_features(E[:40])
    (tmp_path / "det.pkl").write_bytes(pickle.dumps(ood)); torch.save([E[40:100], E[100:163]], tmp_path / "E.pt")
    child = f"""import pickle, sys, torch
import proton.interop
assert 'pytorch_ood' not in sys.modules, 'importing proton.interop imported pytorch_ood'
ood = pickle.loads(open({str(tmp_path / 'det.pkl')!r}, 'rb').read())
torch.save(torch.cat([ood.predict_features(x) for x in torch.load({str(tmp_path / 'E.pt')!r})]), {str(tmp_path / 'got.pt')!r})"""
    env = dict(os.environ, PYTHONPATH=str(Path(proton.__file__).parents[1]), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert torch.equal(torch.load(tmp_path / "got.pt"), scored(ood))
