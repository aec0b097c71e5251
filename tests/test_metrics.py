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
    # 20 ID images 0..19, 20 OOD images 10.5..29.5: keeping 19 of 20 ID images (95%) below the threshold accepts
    # the OOD images below 18.5, i.e. 10.5..17.5: 8 of 20
    scores_id, scores_ood = np.arange(20.0), np.arange(20.0) + 10.5
    assert ood_metrics(scores_id, scores_ood)["fpr95"] == pytest.approx(8 / 20)


@pytest.mark.parametrize("bad,message", [([], "non-empty"), ([[0.1]], "1-D"), ([np.nan], "NaN")])
def test_bad_scores_are_refused(bad, message):
    with pytest.raises(ValueError, match=message): ood_metrics(bad, [0.5])
