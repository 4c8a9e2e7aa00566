"""bin/evaluate on small generated truth and predictions."""
import csv
import os
import subprocess
import sys

import cv2
import numpy as np
import pytest

from gluon_unet.cli import evaluate_main as main
from gluon_unet.errors import UserError
from gluon_unet.inference.evaluate import evaluate, read_labels
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def squares(shape=(32, 32)):
    labels = np.zeros(shape, np.uint16)
    labels[2:10, 2:10] = 1
    labels[20:28, 20:28] = 2
    return labels


def write_dsb_truth(root, ids):
    """DSB layout: ROOT/<id>/images/<id>.png and one mask file per nucleus."""
    labels = squares()
    for image_id in ids:
        os.makedirs(os.path.join(root, image_id, 'masks'))
        os.makedirs(os.path.join(root, image_id, 'images'))
        cv2.imwrite(os.path.join(root, image_id, 'images', image_id + '.png'),
                    np.full(labels.shape, 80, np.uint8))
        for k in (1, 2):
            cv2.imwrite(os.path.join(root, image_id, 'masks', 'm%d.png' % k),
                        (labels == k).astype(np.uint8) * 255)
    return labels


def read_csv(path):
    with open(path, newline='') as f:
        return {row['image_id']: row for row in csv.DictReader(f)}


@pytest.fixture
def dirs(tmp_path):
    truth, pred = tmp_path / 'truth', tmp_path / 'pred'
    pred.mkdir()
    labels = write_dsb_truth(str(truth), ['a', 'b', 'c', 'd'])
    # a: perfect 16-bit label image with large, non-consecutive ids
    cv2.imwrite(str(pred / 'a.png'), np.where(labels == 1, 1000, np.where(labels == 2, 40000, 0)).astype(np.uint16))
    # b: binary mask with one nucleus missed (named with a _mask suffix)
    cv2.imwrite(str(pred / 'b_mask.png'), (labels == 1).astype(np.uint8) * 255)
    # c: one nucleus shrunk to IoU 48/64 = 0.75 -> not a match at t = 0.75
    c = labels.copy()
    c[20:22, 20:28] = 0
    cv2.imwrite(str(pred / 'c.png'), c)
    # d: no prediction at all; plus a prediction without truth
    cv2.imwrite(str(pred / 'zzz.png'), labels)
    return truth, pred


def test_scores_written_to_csv(dirs, tmp_path, capsys):
    truth, pred = dirs
    out = tmp_path / 'scores.csv'
    assert main(['--pred', str(pred), '--truth', str(truth), '--csv', str(out)]) == 0
    rows = read_csv(out)
    assert list(rows) == ['a', 'b', 'c', 'd']
    assert float(rows['a']['dsb']) == 1.0 and float(rows['a']['iou']) == 1.0
    assert rows['a']['pred_objects'] == '2' and rows['a']['true_objects'] == '2'
    assert float(rows['b']['dsb']) == pytest.approx(0.5)
    assert float(rows['b']['iou']) == pytest.approx(0.5)
    assert float(rows['b']['dice']) == pytest.approx(2 * 64 / (64 + 128), abs=1e-6)
    # c: one exact match + one at IoU 0.75: t < 0.75 -> 2/2, t >= 0.75 -> 1/(1+1+1)
    assert float(rows['c']['dsb']) == pytest.approx((5 * 1 + 5 / 3) / 10, abs=1e-6)
    assert float(rows['c']['iou']) == pytest.approx(112 / 128, abs=1e-6)
    assert rows['d']['status'] == 'missing' and float(rows['d']['dsb']) == 0.0
    printed = capsys.readouterr().out
    mean_line = [line for line in printed.splitlines() if line.startswith('mean')][0]
    expected_mean = (1 + 0.5 + (5 + 5 / 3) / 10 + 0) / 4
    assert float(mean_line.split()[1]) == pytest.approx(expected_mean, abs=1e-4)
    assert '1 of 4 truth images have no prediction and score 0: d' in printed
    assert 'zzz' in printed              # the prediction without truth is reported
    assert not [p for p in os.listdir(tmp_path) if p.startswith('.evaluate-')]  # no temp left


def test_mask_folder_truth_with_suffix(tmp_path):
    truth, pred = tmp_path / 'masks', tmp_path / 'pred'
    truth.mkdir()
    pred.mkdir()
    labels = squares()
    cv2.imwrite(str(truth / 'x_mask.png'), (labels > 0).astype(np.uint8) * 255)  # binary truth
    cv2.imwrite(str(truth / 'x.png'), np.full(labels.shape, 90, np.uint8))       # the raw image
    cv2.imwrite(str(pred / 'x.png'), labels)
    out = tmp_path / 'out.csv'
    assert main(['--pred', str(pred), '--truth', str(truth), '--csv', str(out)]) == 0
    row = read_csv(out)['x']
    assert float(row['dsb']) == 1.0 and row['true_objects'] == '2'


def test_read_labels_keeps_16_bit_ids_and_labels_binary(tmp_path):
    p16 = str(tmp_path / 'l.png')
    cv2.imwrite(p16, np.array([[0, 300], [65535, 300]], np.uint16))
    assert read_labels(p16).tolist() == [[0, 300], [65535, 300]]
    pbin = str(tmp_path / 'b.png')
    cv2.imwrite(pbin, np.array([[255, 0, 255]], np.uint8))
    assert read_labels(pbin).tolist() == [[1, 0, 2]]


def test_missing_dir_and_no_match_exit_2(dirs, tmp_path, capsys):
    truth, pred = dirs
    assert main(['--pred', str(tmp_path / 'nope'), '--truth', str(truth)]) == 2
    err = capsys.readouterr().err
    assert err.startswith('error: --pred') and err.count('\n') == 1
    empty = tmp_path / 'empty'
    empty.mkdir()
    assert main(['--pred', str(empty), '--truth', str(truth)]) == 2
    assert 'no prediction' in capsys.readouterr().err
    assert main(['--pred', str(pred), '--truth', str(empty)]) == 2
    assert 'holds no masks' in capsys.readouterr().err


def test_shim_runs(dirs):
    truth, pred = dirs
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'evaluate'), '--pred', str(pred),
                           '--truth', str(truth / 'nowhere')], capture_output=True, text=True, timeout=HANG_SECONDS)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith('error: --truth')


def test_read_labels_float_maps_colour_labels_and_jpeg(tmp_path):
    prob = str(tmp_path / 'p.tiff')
    cv2.imwrite(prob, np.array([[0.9, 0.1], [0.2, 0.8]], np.float32))
    assert read_labels(prob).tolist() == [[1, 0], [0, 2]]            # thresholded, 4-connected
    assert read_labels(prob, threshold=0.95).tolist() == [[0, 0], [0, 0]]
    ids = str(tmp_path / 'ids.tiff')
    cv2.imwrite(ids, np.array([[0, 7], [7, 3]], np.float32))          # float holding label ids
    assert read_labels(ids).tolist() == [[0, 7], [7, 3]]
    colour = np.zeros((4, 4, 3), np.uint8)
    colour[0, :2] = (255, 0, 0)
    colour[3, 2:] = (0, 255, 0)
    cv2.imwrite(str(tmp_path / 'c.png'), colour)
    got = read_labels(str(tmp_path / 'c.png'))
    assert got[0, 0] == got[0, 1] != got[3, 2] == got[3, 3] and got[0, 0] > 0 and got[3, 3] > 0
    assert (got[1:3] == 0).all()


def test_dsb_truth_masks_of_different_sizes_name_the_file(tmp_path):
    truth, pred = tmp_path / 'truth', tmp_path / 'pred'
    write_dsb_truth(str(truth), ['a'])
    cv2.imwrite(str(truth / 'a' / 'masks' / 'm3.png'), np.zeros((16, 16), np.uint8))
    pred.mkdir()
    cv2.imwrite(str(pred / 'a.png'), squares())
    with pytest.raises(UserError, match=r'm3.png is 16x16 but the other masks of .* are 32x32'):
        evaluate(str(pred), str(truth))
