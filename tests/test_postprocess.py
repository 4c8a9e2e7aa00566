"""Instances from probabilities, DSB run-length encoding, submission rows, overlays."""
import cv2
import numpy as np
import pytest

from gluon_unet.metrics import iou_matrix
from gluon_unet.inference.overlay import overlay
from gluon_unet.inference.postprocess import instances_from_maps, instances_from_prob
from gluon_unet.inference.submission import rle_decode, rle_encode, submission_rows


def disk(shape, center, radius):
    m = np.zeros(shape, np.uint8)
    cv2.circle(m, center, radius, 1, -1)
    return m.astype(bool)


def ellipse(shape, center, axes, angle):
    m = np.zeros(shape, np.uint8)
    cv2.ellipse(m, center, axes, angle, 0, 360, 1, -1)
    return m.astype(bool)


@pytest.mark.parametrize('radius, distance, angle', [(12, 20, 0), (8, 14, 45), (15, 24, 30)])
def test_watershed_splits_two_touching_disks(radius, distance, angle):
    a = np.deg2rad(angle)
    c1 = (40, 40)
    c2 = (int(round(40 + distance * np.cos(a))), int(round(40 + distance * np.sin(a))))
    d1, d2 = disk((96, 96), c1, radius), disk((96, 96), c2, radius)
    prob = (d1 | d2).astype(np.float32)
    assert instances_from_prob(prob, split='none').max() == 1  # they do touch
    labels = instances_from_prob(prob)
    assert labels.dtype == np.int32
    assert labels.max() == 2
    truth = np.where(d1, 1, 0) + np.where(d2 & ~d1, 2, 0)
    iou = iou_matrix(labels, truth)
    assert iou.max(axis=1).min() > 0.8  # each disk recovered as one object


@pytest.mark.parametrize('radius', [4, 10, 25])
def test_single_disk_stays_whole(radius):
    prob = disk((64, 64), (32, 32), radius).astype(np.float32)
    labels = instances_from_prob(prob)
    assert labels.max() == 1
    assert (labels > 0).sum() == prob.sum()


@pytest.mark.parametrize('minor', [5, 9, 12, 17])
@pytest.mark.parametrize('angle', [0, 30, 45, 60, 90])
def test_ellipse_up_to_aspect_1_7_stays_whole(minor, angle):
    prob = ellipse((80, 80), (40, 40), (int(round(minor * 1.7)), minor), angle).astype(np.float32)
    assert instances_from_prob(prob).max() == 1


def test_noisy_probability_of_one_nucleus_stays_whole():
    rng = np.random.default_rng(0)
    for _ in range(10):
        base = ellipse((64, 64), (32, 32), (int(rng.integers(8, 18)), int(rng.integers(6, 10))),
                       rng.uniform(0, 180)).astype(np.float32)
        prob = cv2.GaussianBlur(base, (0, 0), 1.0) + rng.normal(0, 0.1, base.shape).astype(np.float32)
        assert instances_from_prob(np.clip(prob, 0, 1), min_size=5).max() == 1


def test_min_size_removes_specks_and_labels_are_consecutive():
    prob = np.zeros((40, 40), np.float32)
    prob[5:15, 5:15] = 0.9               # 100 px
    prob[30:32, 30:32] = 0.9             # a 4 px speck
    prob[20:26, 30:36] = 0.8             # 36 px
    labels = instances_from_prob(prob, min_size=10)
    assert sorted(np.unique(labels)) == [0, 1, 2]
    assert labels[31, 31] == 0
    assert instances_from_prob(prob, min_size=0).max() == 3
    assert instances_from_prob(prob, min_size=0, split='none').max() == 3


def test_min_score_drops_objects_of_low_mean_probability_and_renumbers():
    prob = np.zeros((40, 40), np.float32)
    prob[2:12, 2:12] = 0.95              # a confident nucleus
    prob[20:30, 2:12] = 0.7              # a faint blob: over the pixel cut, unsure as a whole
    prob[20:30, 25:35] = 0.9
    prob[22:24, 27:29] = 0.55            # a confident nucleus with a dim spot: its mean is still high
    boundary = np.zeros_like(prob)
    for kw in ({}, {'split': 'none'}, {'boundary': boundary}, {'smooth': 0}):
        assert instances_from_prob(prob, **kw).max() == 3
        labels = instances_from_prob(prob, min_score=0.8, **kw)
        assert sorted(np.unique(labels)) == [0, 1, 2], kw
        assert labels[25, 5] == 0 and labels[5, 5] > 0 and labels[25, 30] > 0
    assert instances_from_prob(prob, min_score=0.96).max() == 0
    assert instances_from_maps(np.stack([prob, boundary]), min_score=0.8).max() == 2


def test_threshold_is_strict_and_empty_is_empty():
    prob = np.full((8, 8), 0.5, np.float32)
    assert instances_from_prob(prob, threshold=0.5).max() == 0
    assert instances_from_prob(prob, threshold=0.4).max() == 1


def test_boundary_map_splits_where_it_is_high():
    prob = np.zeros((30, 50), np.float32)
    prob[5:25, 5:45] = 1.0               # one rectangle: two nuclei in contact
    boundary = np.zeros_like(prob)
    boundary[5:25, 24:26] = 1.0          # predicted boundary between them
    labels = instances_from_prob(prob, boundary=boundary)
    assert labels.max() == 2
    assert labels[15, 10] != labels[15, 40]
    assert (labels > 0).sum() == (prob > 0.5).sum()  # nothing lost on the boundary line
    assert instances_from_prob(prob).max() == 1     # the distance alone sees one rectangle


def test_bad_split_raises():
    with pytest.raises(ValueError):
        instances_from_prob(np.zeros((4, 4)), split='magic')


def test_rle_column_major_hand_example():
    mask = np.array([[1, 0, 0],
                     [1, 1, 0],
                     [0, 0, 1]])
    # numbered top to bottom, then left to right: column 0 -> 1,2 ; column 1 -> 5 ; column 2 -> 9
    assert rle_encode(mask) == '1 2 5 1 9 1'
    assert np.array_equal(rle_decode('1 2 5 1 9 1', (3, 3)), mask)
    # a run continuing from the bottom of one column to the top of the next
    m2 = np.array([[0, 1], [1, 0]])
    assert rle_encode(m2) == '2 2'


def test_rle_round_trip_and_empty():
    rng = np.random.default_rng(1)
    mask = rng.random((17, 23)) > 0.6
    assert np.array_equal(rle_decode(rle_encode(mask), mask.shape), mask.astype(np.uint8))
    assert rle_encode(np.zeros((4, 5))) == ''
    assert rle_decode('', (4, 5)).sum() == 0
    assert rle_decode(float('nan'), (4, 5)).shape == (4, 5)  # an empty cell read by pandas
    with pytest.raises(ValueError):
        rle_decode('19 3', (4, 5))


def test_submission_rows():
    labels = np.array([[1, 0, 2],
                       [1, 2, 2],
                       [0, 0, 0]])
    rows = submission_rows('img', labels)
    assert rows == [('img', '1 2'), ('img', '5 1 7 2')]
    for (_, rle), k in zip(rows, (1, 2)):
        assert np.array_equal(rle_decode(rle, labels.shape), (labels == k).astype(np.uint8))
    assert submission_rows('empty', np.zeros((5, 5), np.int32)) == [('empty', '')]


def test_overlay_draws_outlines():
    labels = np.zeros((10, 10), np.int32)
    labels[2:8, 2:8] = 1
    out = overlay(np.full((10, 10), 0.5, np.float32), labels)
    assert out.shape == (10, 10, 3) and out.dtype == np.uint8
    assert tuple(out[2, 4]) == (255, 255, 0)   # on the outline
    assert tuple(out[5, 5]) == (127, 127, 127)  # inside, untouched
    assert tuple(out[0, 0]) == (127, 127, 127)
    rgb = np.zeros((10, 10, 3), np.uint8)
    assert tuple(overlay(rgb, labels, color=(0, 255, 0))[7, 5]) == (0, 255, 0)
