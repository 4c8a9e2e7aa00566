"""Hand-computed cases for the pixel and Data Science Bowl metrics."""
import numpy as np
import pytest

from gluon_unet.metrics import (THRESHOLDS, DSBMetric, PixelMetrics, dsb_image_score, dsb_score,
                                iou_matrix, pixel_scores)


def two_squares():
    t = np.zeros((12, 12), np.int32)
    t[1:5, 1:5] = 1
    t[7:11, 7:11] = 2
    return t


@pytest.mark.parametrize('covered, expected', [
    (100, 1.0), (96, 1.0),   # IoU above every threshold
    (95, 0.9),               # 0.95 is the last threshold, and a match needs IoU > t
    (90, 0.8),               # 0.50 ... 0.85
    (75, 0.5),               # 0.50 ... 0.70 (0.75 itself does not count)
    (51, 0.1), (50, 0.0)])   # only 0.50; none
def test_the_default_thresholds_are_0_50_to_0_95_in_steps_of_0_05(covered, expected):
    # One 10x10 object predicted by a part of it: IoU = covered / 100, and the score is
    # the fraction of the DSB thresholds (0.50, 0.55, ..., 0.95) the IoU exceeds.
    t = np.zeros((12, 12), np.int32)
    t[1:11, 1:11] = 1
    p = np.zeros_like(t)
    p[1:11, 1:11].flat[:covered] = 1
    assert dsb_image_score(p, t) == pytest.approx(expected)
    assert dsb_image_score(p, t, THRESHOLDS) == dsb_image_score(p, t)


def test_perfect_prediction_scores_one():
    t = two_squares()
    assert dsb_image_score(t, t) == 1.0
    # ids need not match, nor be consecutive
    p = np.where(t == 1, 300, np.where(t == 2, 7, 0))
    assert dsb_image_score(p, t) == 1.0


def test_one_missed_object():
    t = two_squares()
    p = np.where(t == 1, 1, 0)
    # TP=1, FN=1 at every threshold
    assert dsb_image_score(p, t) == pytest.approx(0.5)


def test_one_false_object():
    t = np.where(two_squares() == 1, 1, 0)
    p = two_squares()
    # TP=1, FP=1 at every threshold
    assert dsb_image_score(p, t) == pytest.approx(0.5)


def test_empty_images():
    z = np.zeros((8, 8), np.int32)
    t = two_squares()
    assert dsb_image_score(z, z) == 1.0
    assert dsb_image_score(z[:8, :8], t[:8, :8]) == 0.0  # truth but no prediction
    assert dsb_image_score(t, np.zeros_like(t)) == 0.0  # prediction but no truth


def test_iou_exactly_at_threshold_is_not_a_match():
    t = np.zeros((8, 8), np.int32)
    t[2:6, 2:6] = 1                      # 16 pixels
    p = np.zeros_like(t)
    p[2:5, 2:6] = 1                      # 12 pixels inside: IoU = 12/16 = 0.75
    assert iou_matrix(p, t)[0, 0] == 0.75
    # matches for t = 0.50..0.70 (5 thresholds), not at 0.75 and above:
    # score_t = 1 for 5 thresholds, 0/(0+1+1) for the other 5
    assert dsb_image_score(p, t) == pytest.approx(0.5)


def test_partial_overlap_counts_fp_and_fn():
    t = np.zeros((10, 10), np.int32)
    t[0:5, 0:4] = 1                      # 20 pixels
    p = np.zeros_like(t)
    p[0:5, 1:4] = 2                      # 15 pixels inside: IoU 0.75
    p[8:10, 8:10] = 5                    # a false object
    # t < 0.75 (5 thresholds): TP=1, FP=1 -> 1/2 ; t >= 0.75: TP=0, FP=2, FN=1 -> 0
    assert dsb_image_score(p, t) == pytest.approx(0.25)


def test_iou_matrix_values():
    t = two_squares()
    p = np.zeros_like(t)
    p[1:5, 3:7] = 1                      # overlaps object 1 by 8 px; union 24
    m = iou_matrix(p, t)
    assert m.shape == (2, 1)
    assert m[0, 0] == pytest.approx(8 / 24)
    assert m[1, 0] == 0.0


def test_many_objects_at_once():
    # (Its speed - well under a second - is measured by benchmarks/bench_metrics.py.)
    t = np.zeros((200, 200), np.int32)
    k = 0
    for y in range(0, 200, 10):
        for x in range(0, 200, 10):
            k += 1
            t[y:y + 8, x:x + 8] = k      # 400 squares of 64 px
    p = np.roll(t, 1, axis=1)            # shifted: IoU = 56 / 72 = 0.777...
    score = dsb_image_score(p, t)
    # matches for t = 0.50..0.75 (6 of 10 thresholds), all 400 at once
    assert score == pytest.approx(0.6)


def test_dsb_score_and_metric_average_images():
    t = two_squares()
    half = np.where(t == 1, 1, 0)
    assert dsb_score([t, half], [t, t]) == pytest.approx(0.75)
    m = DSBMetric()
    m.update(np.stack([t, half]), np.stack([t, t]))
    m.update(np.zeros((12, 12), np.int32), np.zeros((12, 12), np.int32))
    assert m.result() == pytest.approx((1 + 0.5 + 1) / 3)
    m.reset()
    assert np.isnan(m.result())


def test_pixel_metrics_hand_case():
    prob = np.array([[[0.9, 0.6], [0.2, 0.0]]])
    truth = np.array([[[1, 0], [1, 0]]])
    m = PixelMetrics()
    m.update(prob, truth)
    r = m.result()
    # t=0.50,0.55: pred {0.9,0.6} -> 1/3 ; t=0.60..0.85: pred {0.9} -> 1/2 ; t=0.90,0.95: 0
    assert r['iou50'] == pytest.approx(1 / 3)
    assert r['iou'] == pytest.approx((2 / 3 + 6 / 2) / 10)
    assert r['dice'] == pytest.approx(2 * 1 / (2 + 2))
    # float32 probabilities exactly at a threshold do not count as foreground either
    m32 = PixelMetrics()
    m32.update(prob.astype(np.float32), truth)
    assert m32.result() == pytest.approx(r)


def test_pixel_metrics_sum_over_updates_equals_one_update():
    rng = np.random.default_rng(0)
    prob = rng.random((6, 16, 16)).astype(np.float32)
    truth = rng.random((6, 16, 16)) > 0.7
    truth[4:] = False                    # batches with very different foreground
    a, b = PixelMetrics(), PixelMetrics()
    a.update(prob[:4], truth[:4])
    a.update(prob[4:], truth[4:])
    b.update(prob, truth)
    assert a.result() == b.result()
    # and the dataset-level value, not a mean of per-batch IoUs
    inter = ((prob > 0.5) & truth).sum()
    union = ((prob > 0.5) | truth).sum()
    assert a.result()['iou50'] == pytest.approx(inter / union)


def test_pixel_metrics_empty_is_one():
    m = PixelMetrics()
    m.update(np.zeros((2, 4, 4)), np.zeros((2, 4, 4)))
    assert m.result() == {'iou': 1.0, 'iou50': 1.0, 'dice': 1.0}


def test_pixel_scores():
    t = np.zeros((4, 4), bool)
    t[:2] = True                         # 8 px
    p = np.zeros((4, 4), np.int32)
    p[1:3] = 5                           # 8 px, 4 shared
    s = pixel_scores(p, t)
    assert s['iou'] == pytest.approx(4 / 12)
    assert s['dice'] == pytest.approx(8 / 16)
    assert pixel_scores(np.zeros((3, 3)), np.zeros((3, 3))) == {'iou': 1.0, 'dice': 1.0}
