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


def loader(*cuts, label=lambda a, b: torch.zeros(b - a, dtype=torch.long)):
    "An OpenOOD-style loader of E: one {'data', 'label'} batch per cut."
    return [{"data": E[a:b], "label": label(a, b)} for a, b in cuts]


CUTS = ((40, 90), (90, 140), (140, 160))


def scalar_last(): L = loader(*CUTS, (160, 161)); L[-1]["label"] = 0; return L
def unlabelled(): L = loader(*CUTS); del L[1]["label"]; return L
def with_nan(): L = loader(*CUTS); L[2]["data"] = L[2]["data"].clone(); L[2]["data"][7, 3] = float("nan"); return L
def interrupted():
    yield from loader(*CUTS[:2]); raise KeyboardInterrupt


@pytest.mark.parametrize("bad, error, message", [
    (scalar_last, ValueError, r"^batch 3 has labels of shape \(\) for 1 image: one label per image is shape \(1,\)$"),
    (unlabelled, ValueError, r"^batch 1 is a dict without 'label'; batches must be dicts with 'data' and 'label', as OpenOOD's loaders yield$"),
    (with_nan, ValueError, r"^batch 2: image embeddings contains NaN or Inf values \(first offending rows: \[7\]\)$"),
    (interrupted, KeyboardInterrupt, None)])
def test_a_failed_inference_leaves_the_stream_where_it_was(bad, error, message):
    "A batch failing after others were scored left them in the stream and returned nothing: a retry scored another stream (AUROC 0.5174 against 0.5130)."
    post = OpenOODPostprocessor(Proton(T, CFG))
    post.inference(lambda x: x, loader((0, 40)), False)
    with pytest.raises(error, match=message): post.inference(lambda x: x, bad(), False)
    assert post.detector.welford.n == 40
    twin = OpenOODPostprocessor(Proton(T, CFG)); twin.inference(lambda x: x, loader((0, 40)), False)
    np.testing.assert_array_equal(post.inference(lambda x: x, loader(*CUTS), False)[1], twin.inference(lambda x: x, loader(*CUTS), False)[1])  # the retry scores the stream a call that never failed scores


@pytest.mark.parametrize("batch, got", [((E[:10], torch.zeros(10)), "a tuple"), ([E[:10], torch.zeros(10)], "a list"),
                                        ({"label": torch.zeros(10)}, "a dict without 'data'"), (E[:10], "a Tensor")])
def test_a_batch_that_is_no_openood_dict_is_named(batch, got):
    "A DataLoader of (x, y) gave 'list indices must be integers or slices, not str'; a dict without 'label', a bare KeyError."
    post = OpenOODPostprocessor(Proton(T, CFG))
    with pytest.raises(ValueError, match=rf"^batch 1 is {got}; batches must be dicts with 'data' and 'label', as OpenOOD's loaders yield$"):
        post.inference(lambda x: x, loader((0, 10)) + [batch], False)
    assert post.detector.welford.n == 0


@pytest.mark.parametrize("label, message", [(torch.zeros(3), "batch 0 has 3 labels for 10 images"),
                                            (torch.zeros(10, 1), r"batch 0 has labels of shape \(10, 1\) for 10 images: one label per image is shape \(10,\)"),
                                            ("abc", "batch 0: 'label' must be a tensor or a numeric array, got str")])
def test_labels_that_do_not_fit_the_images_are_named(label, message):
    "3 labels for 10 images came back as 10 confidences and 3 labels; labels of shape (4, 1) came back (4, 1)."
    post = OpenOODPostprocessor(Proton(T, CFG))
    with pytest.raises(ValueError, match=rf"^{message}$"): post.inference(lambda x: x, [{"data": E[:10], "label": label}], False)
    assert post.detector.welford.n == 0


def test_a_net_that_returns_other_rows_than_images_is_named():
    post = OpenOODPostprocessor(Proton(T, CFG))
    with pytest.raises(ValueError, match=r"^batch 0: net returned 5 embeddings for 10 images$"): post.inference(lambda x: x[:5], loader((0, 10)), False)
    assert post.detector.welford.n == 0


class Net(torch.nn.Module):
    "Embeddings in, embeddings out, with one weight: `inference` sends batches to its device."
    def __init__(self): super().__init__(); self.w = torch.nn.Parameter(torch.zeros(1))
    def forward(self, x): return x


@pytest.mark.parametrize("net", [Net(), lambda x: x], ids=["module", "function"])
@pytest.mark.parametrize("as_", [np.asarray, lambda t: t.tolist()], ids=["numpy", "list"])
def test_numpy_data_and_labels_work_for_every_net(net, as_):
    "numpy data with an nn.Module net failed with \"'numpy.ndarray' object has no attribute 'to'\"."
    y = torch.arange(10) % 3
    got = OpenOODPostprocessor(Proton(T, CFG)).inference(net, [{"data": E[:10].numpy(), "label": as_(y)}], False)
    want = OpenOODPostprocessor(Proton(T, CFG)).inference(net, [{"data": E[:10], "label": y}], False)
    for a, b in zip(got, want): np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_empty_loader_gives_confidences_in_the_detectors_dtype(dtype):
    "An empty loader gave float32 confidences where a float64 detector gives float64."
    post = OpenOODPostprocessor(Proton(torch.as_tensor(T, dtype=dtype), CFG))
    assert post.inference(lambda x: x, [], False)[1].dtype == post.inference(lambda x: x, loader((0, 3)), False)[1].dtype


def test_a_pytorch_ood_detector_moves_to_none_as_proton_does():
    "ProtonDetector.to(None) failed with torch's multi-line TypeError, after its Proton had moved."
    ood = pytorch_ood_detector(Proton(T, CFG))
    assert ood.to(None) is ood and ood.detector.device == Proton(T, CFG).to(None).device


def test_an_encoder_that_cannot_be_called_is_refused_when_the_detector_is_made():
    "encoder='not a model' was accepted, and predict failed with \"'str' object is not callable\"."
    with pytest.raises(TypeError, match=r"^encoder must be callable \(model inputs -> \(B, d\) embeddings\) or None, got str$"):
        pytorch_ood_detector(Proton(T, CFG), encoder="not a model")


@pytest.mark.parametrize("wrap, net", [(lambda a, b: [f"img{i}" for i in range(a, b)], lambda names: E[[int(n[3:]) for n in names]]),
                                       (lambda a, b: {"pixel_values": E[a:b]}, lambda inputs: inputs["pixel_values"])], ids=["file names", "dict of inputs"])
def test_data_that_is_no_array_goes_to_a_net_that_takes_it(wrap, net):
    "The batch checks refused 'data' that is no array ('must be a tensor or a numeric array, got list'), which a net that reads file names or a dict of inputs takes, and which inference passed through before."
    got = OpenOODPostprocessor(Proton(T, CFG)).inference(net, [{"data": wrap(a, b), "label": torch.arange(a, b) % 3} for a, b in CUTS], False)
    want = OpenOODPostprocessor(Proton(T, CFG)).inference(lambda x: x, loader(*CUTS, label=lambda a, b: torch.arange(a, b) % 3), False)
    for a, b in zip(got, want): np.testing.assert_array_equal(a, b)
    post = OpenOODPostprocessor(Proton(T, CFG))
    with pytest.raises(ValueError, match=r"^batch 0 has 3 labels for 10 images$"): post.inference(net, [{"data": wrap(0, 10), "label": torch.zeros(3)}], False)
    assert post.detector.welford.n == 0
