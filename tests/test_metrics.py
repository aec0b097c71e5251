"""`ood_metrics` against values derived by hand on small score lists (OOD is the positive class, higher = more OOD)."""
import numpy as np
import pytest

from proton import ood_metrics


def test_perfect_separation():
    m = ood_metrics([0.1, 0.2, 0.3], [0.7, 0.8])
    assert m == dict(auroc=1.0, aupr_out=1.0, aupr_in=1.0, fpr95=0.0, fpr95_ood=0.0)


def test_reversed_scores():
    m = ood_metrics([0.7, 0.8], [0.1, 0.2, 0.3])
    assert m["auroc"] == 0.0 and m["fpr95"] == 1.0 and m["fpr95_ood"] == 1.0


def test_one_swapped_pair():
    # ID 0.1, 0.4; OOD 0.3, 0.9: of the 4 (ID, OOD) pairs only (0.4, 0.3) is ordered wrongly -> AUROC 3/4
    m = ood_metrics([0.1, 0.4], [0.3, 0.9])
    assert m["auroc"] == pytest.approx(0.75)
    # ranked by score: 0.9 (OOD), 0.4 (ID), 0.3 (OOD), 0.1 (ID); precision at each OOD hit: 1/1, 2/3 -> AP = (1 + 2/3) / 2
    assert m["aupr_out"] == pytest.approx((1 + 2 / 3) / 2)
    # ID as positive, lower = more ID: 0.1 (ID), 0.3 (OOD), 0.4 (ID), 0.9 -> precision at ID hits: 1/1, 2/3
    assert m["aupr_in"] == pytest.approx((1 + 2 / 3) / 2)
    # catching 95% of OOD needs the threshold at 0.3, which also flags the ID image at 0.4: FPR 1/2
    assert m["fpr95_ood"] == pytest.approx(0.5)


def test_ties_count_half():
    m = ood_metrics([0.5, 0.5], [0.5, 0.5])
    assert m["auroc"] == pytest.approx(0.5)


def test_fpr_at_95_percent_id_recall_on_twenty_images():
    # 20 ID images 0..19, 20 OOD images 10.5..29.5. Accepting scores <= 18 keeps 19 of 20 ID images (95%) and admits
    # OOD 10.5..17.5 (8 of 20); accepting <= 18.5 keeps the same 19 and admits 18.5 too. Of thresholds with equal ID
    # recall the MCM code takes the lowest: 9 of 20. OpenOOD flags from 11.5 up to catch 19 of 20 OOD: ID 12..19, 8 of 20.
    scores_id, scores_ood = np.arange(20.0), np.arange(20.0) + 10.5
    assert ood_metrics(scores_id, scores_ood)["fpr95"] == pytest.approx(9 / 20)
    assert ood_metrics(scores_id, scores_ood)["fpr95_ood"] == pytest.approx(8 / 20)


@pytest.mark.parametrize("bad,message", [([], "non-empty"), ([[0.1]], "1-D"), ([np.nan], "NaN")])
def test_bad_scores_are_refused(bad, message):
    with pytest.raises(ValueError, match=message): ood_metrics(bad, [0.5])


# ---------------------------------------------------------------------------------------------- FPR95 conventions
# Each peer's algorithm restated plainly, as its code computes it, to check `ood_metrics(convention=...)` against.

from hypothesis import given, settings, strategies as st
from sklearn.metrics import roc_curve


def peer_mcm(s_id, s_ood, level=0.95):
    "The MCM repository's fpr_and_fdr_at_recall: ID positive, called with negated scores."
    y = np.r_[np.ones(len(s_id)), np.zeros(len(s_ood))] == 1
    score = -np.r_[s_id, s_ood]
    order = np.argsort(score, kind="mergesort")[::-1]
    score, y = score[order], y[order]
    idx = np.r_[np.where(np.diff(score))[0], y.size - 1]
    tps = np.cumsum(y, dtype=np.float64)[idx]
    fps = 1 + idx - tps
    recall = tps / tps[-1]
    last = tps.searchsorted(tps[-1])
    recall, fps = np.r_[recall[last::-1], 1], np.r_[fps[last::-1], 0]
    return fps[np.argmin(np.abs(recall - level))] / np.sum(~y)


def peer_openood(s_id, s_ood, level=0.95):
    "OpenOOD v1.5's auc_and_fpr_recall: OOD positive, roc_curve's default curve, the first point reaching the recall."
    fpr, tpr, _ = roc_curve(np.r_[np.zeros(len(s_id)), np.ones(len(s_ood))], np.r_[s_id, s_ood])
    return fpr[np.argmax(tpr >= level)]


def peer_ju2025(s_id, s_ood, level=0.95):
    "Ju et al.'s notebooks: OOD positive, roc_curve's default curve, the point whose recall is nearest."
    fpr, tpr, _ = roc_curve(np.r_[np.zeros(len(s_id)), np.ones(len(s_ood))], np.r_[s_id, s_ood])
    return fpr[np.argmin(np.abs(tpr - level))]


PEERS = dict(mcm=peer_mcm, openood=peer_openood, ju2025=peer_ju2025)
tie_heavy = st.lists(st.integers(0, 4), min_size=1, max_size=60).map(lambda v: np.array(v, dtype=np.float64) / 4)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tie_heavy, tie_heavy, st.sampled_from(list(PEERS)), st.sampled_from([0.95, 0.9, 0.5]))
def test_each_convention_is_the_peers_own(s_id, s_ood, convention, level):
    "Tie-heavy scores (five values) and sparse recall (a handful of images of one kind)."
    got = ood_metrics(s_id, s_ood, recall=level, convention=convention)["fpr95"]
    assert abs(got - PEERS[convention](s_id, s_ood, level)) <= 1e-12


def test_the_conventions_differ_where_recall_moves_in_coarse_steps():
    s_id = np.array([0.0, 0.0, 0.1, 0.2, 0.3, 0.5, 0.5, 0.6, 0.6, 0.9])
    s_ood = np.array([0.3, 0.4, 0.5, 0.6, 0.7, 0.7, 0.8, 0.9, 1.0, 1.0, 1.0])
    values = {c: ood_metrics(s_id, s_ood, convention=c)["fpr95"] for c in PEERS}
    assert len(set(values.values())) == 3, values
    with pytest.raises(ValueError, match="unknown FPR95 convention 'sklearn'"): ood_metrics(s_id, s_ood, convention="sklearn")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 40), st.integers(1, 40), st.booleans())
def test_every_metric_lies_in_0_1(n_id, n_ood, reversed_):
    "scikit-learn's average precision of perfectly separated scores can round to 1.0000000000000002 (1 ID and 20 OOD scores)."
    s_id, s_ood = np.arange(n_id) - n_id, np.arange(n_ood) + 1.
    m = ood_metrics(*((s_ood, s_id) if reversed_ else (s_id, s_ood)))
    assert all(0 <= v <= 1 for v in m.values()), m


def test_scores_float64_cannot_keep_apart_are_refused_by_name():
    "Integers beyond 2**53 and long doubles were cast to float64 silently: ood_metrics([2**60, 2**60+1], [2**60+2, 2**60+3]) gave AUROC 0.5, not 1."
    import torch
    big = [2**60, 2**60 + 1], [2**60 + 2, 2**60 + 3]
    with pytest.raises(ValueError, match=r"^scores_id holds integers beyond 2\*\*53"): ood_metrics(np.array(big[0]), np.array(big[1]))
    with pytest.raises(ValueError, match=r"^scores_id holds integers beyond 2\*\*53"): ood_metrics(torch.tensor(big[0]), torch.tensor(big[1]))
    assert ood_metrics(np.array(big[0]) - 2**60, np.array(big[1]) - 2**60)["auroc"] == 1.0  # the offset the message asks for
    assert ood_metrics(torch.tensor([1, 2]), torch.tensor([3, 4]))["auroc"] == 1.0
    if np.finfo(np.longdouble).eps < np.finfo(np.float64).eps:  # a wider long double on this platform
        one = np.longdouble(1)
        with pytest.raises(ValueError, match=rf"^scores_ood holds {np.dtype(np.longdouble)} values that float64 cannot hold exactly"):
            ood_metrics(np.array([one], np.longdouble), np.array([one + np.finfo(np.longdouble).eps], np.longdouble))
        assert ood_metrics(np.array([0.1, 0.2], np.longdouble), np.array([0.3], np.longdouble))["auroc"] == 1.0  # float64 values: kept


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.integers(54, 62), st.sampled_from([0.5, np.float32(0.5), np.float64(0.5)]), st.booleans())
def test_a_list_mixing_floats_and_huge_integers_is_refused(bits, small, numpy_int):
    "A list of floats and integers beyond 2**53 went to float64 as one array and was rounded: ood_metrics([0.5, 2**60], [2**60+1, 0.]) gave AUROC 0.375, not 0.5."
    big = (np.int64 if numpy_int else int)(2**bits)
    with pytest.raises(ValueError, match=r"^scores_id holds integers beyond 2\*\*53"): ood_metrics([small, big], [big + 1, 0.])
    with pytest.raises(ValueError, match=r"^scores_ood holds integers beyond 2\*\*53"): ood_metrics([small, 0.], [[big + 1, 0.]][0])
    assert ood_metrics([small, 2**53], [2**53 + 0., 3.])["auroc"] == 0.625  # 2**53 itself is exact in float64
