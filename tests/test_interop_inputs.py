"""The interop adapters with what other OOD libraries hand them: a net's (features, logits) tuple and no input at all."""
import re

import numpy as np
import pytest
import torch

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
