"""Bad and degenerate inputs to the deployment tools: the threshold, the drift alarm, the reference file and class indices."""
import warnings

import numpy as np
import pytest
import torch

from proton.deploy import CusumDrift, WarmupThreshold, bank_audit, threshold_for_id_recall
from proton.detector import Proton
from proton.models.score import read_reference_scores


@pytest.mark.parametrize("scores", [[-.4, -.4], [.7] * 50, [1e6] * 3, [.7] * 49 + [np.nextafter(.7, 1)], [.7] * 49 + [float(np.float32(.7))]])
def test_reference_scores_without_spread_are_refused(scores):
    """set_reference floored the spread at 1e-12: a flat reference gave z ≈ 1e11 for any score above it, and the drift alarm fired on half
    of an ID stream; scores equal but for rounding (one image scored in batches of other sizes) the same."""
    with pytest.raises(ValueError, match=r"^the reference scores have no spread \(mean "): WarmupThreshold().set_reference(scores)
    assert WarmupThreshold().set_reference([.7] * 49 + [.71]).std > 1e-3  # a spread that is one


def test_a_warm_up_without_spread_is_said():
    "A warm-up of equal scores (a stream of one image over and over) cannot standardise the drift alarm: it is said, once, and θ is still read off it."
    thr = WarmupThreshold(warmup=3)
    with pytest.warns(UserWarning, match=r"the warm-up's 3 scores have no spread \(mean 0\.5, sd 0\): the drift alarm will fire on any rise above them"):
        theta = thr.update([.5, .5, .5, .6], [True] * 4)
    assert np.isnan(theta[:3]).all() and theta[3] == .5


def test_a_reference_file_with_a_blank_or_short_line(tmp_path):
    "A 'score' CSV with a trailing blank line gave IndexError: list index out of range; a short row the same."
    (tmp_path / "blank.csv").write_text("score\n0.1\n0.2\n0.3\n\n")
    assert read_reference_scores(tmp_path / "blank.csv").tolist() == [.1, .2, .3]
    (tmp_path / "short.csv").write_text("score,calibrated\n0.1,True\n0.2\n0.3,True\n")
    with pytest.raises(ValueError, match=r"short\.csv: line 3 has no calibrated value"): read_reference_scores(tmp_path / "short.csv")
    (tmp_path / "none.csv").write_text("id,score\n1,0.1\n2\n")
    with pytest.raises(ValueError, match=r"none\.csv: line 3 has no score value"): read_reference_scores(tmp_path / "none.csv")
    (tmp_path / "empty.csv").write_text("path,score,calibrated\na.png,0.1,True\nb.png,,True\n")
    with pytest.raises(ValueError, match=r"empty\.csv: line 3 has no score value"): read_reference_scores(tmp_path / "empty.csv")
    (tmp_path / "quoted.csv").write_text('path,score,calibrated\n"multi\nline.png",0.1,True\nb.png,0.2\n')  # a quoted name over two lines
    with pytest.raises(ValueError, match=r"quoted\.csv: line 4 has no calibrated value"): read_reference_scores(tmp_path / "quoted.csv")


@pytest.mark.parametrize("flags", [["False"] * 3, [np.nan] * 3, [.5] * 3, [2, 0, 1], torch.tensor([1., .5, 0.], dtype=torch.bfloat16)])
def test_calibration_flags_that_are_no_flags_are_refused(flags):
    "update read ['False', 'False', 'False'] (a CSV's strings), NaN or 0.5 as True and set θ from scores taken before calibration."
    thr = WarmupThreshold(warmup=2)
    with pytest.raises(ValueError, match=r"^calibrated must be booleans or 0/1"): thr.update([1., 2., 3.], flags)
    assert thr.seen == [] and thr.theta is None  # nothing taken in
    assert np.isnan(thr.update([1., 2., 3.], [1, 0, 0])).all() and thr.seen == [1.]
    for flags in (torch.tensor([0., 0., 0.]), torch.tensor([0, 0, 0], dtype=torch.bfloat16), np.zeros(3)):  # 0/1 as floats: flags all the same
        assert np.isnan(thr.update([1., 2., 3.], flags)).all() and thr.seen == [1.]


def test_string_classes_are_named():
    "A class index given as a string reached torch: 'can't convert np.ndarray of type numpy.str_'."
    with pytest.raises(ValueError, match=r"^predicted classes must be integers, got dtype <U1"): bank_audit(["0", "1"], [True, True], 2, 3)
    det = Proton(torch.nn.functional.normalize(torch.randn(2, 8), dim=1))
    with pytest.raises(ValueError, match=r"^routed classes must be integers, got dtype <U1"): det.score(torch.randn(2, 8), routed=["0", "1"])


def test_a_nan_id_score_is_named_as_such():
    "threshold_for_id_recall([1, nan, 2]) said '... finite scores, got shape (3,)', naming the shape, not the NaN."
    with pytest.raises(ValueError, match=r"^1 of the 3 ID scores is not finite"): threshold_for_id_recall([1., np.nan, 2.])
