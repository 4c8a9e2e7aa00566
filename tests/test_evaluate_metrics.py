"""bin/evaluate's object-matching scores (precision, recall, F1, AP, TP/FP/FN, mean matched
IoU, panoptic quality at IoU 0.5, 0.75, 0.9) against an independent brute-force version.

The reference below shares no code with gluon_unet.metrics: it builds every object's mask,
computes each pair's IoU in a loop over the pairs, matches with the Hungarian algorithm
(scipy's linear_sum_assignment, maximising the IoU of pairs above the threshold) and
applies StarDist's formulas with its x/0 = 0 convention.
"""
import csv
import itertools

import cv2
import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from gluon_unet.cli import evaluate_main
from gluon_unet.inference.evaluate import COLUMNS, MATCH_COLUMNS
from gluon_unet.metrics import MATCH_KEYS, MATCH_THRESHOLDS, iou_matrix, matching_scores

SHAPE = (40, 48)


def reference_scores(pred, true, t):
    """Brute force: masks, loops, Hungarian; StarDist's matching with IoU > t."""
    t_ids = [i for i in np.unique(true) if i != 0]
    p_ids = [j for j in np.unique(pred) if j != 0]
    iou = np.zeros((len(t_ids), len(p_ids)))
    for a, i in enumerate(t_ids):
        for b, j in enumerate(p_ids):
            mt, mp = true == i, pred == j
            iou[a, b] = np.count_nonzero(mt & mp) / np.count_nonzero(mt | mp)
    tp, total = 0, 0.0
    if iou.size:
        ok = iou > t
        # maximise first the number of pairs above t, then their IoU
        rows, cols = linear_sum_assignment(-(ok * (1.0 + iou)))
        for r, c in zip(rows, cols):
            if ok[r, c]:
                tp += 1
                total += iou[r, c]
    fp, fn = len(p_ids) - tp, len(t_ids) - tp

    def div(a, b):
        return a / b if b else 0.0
    return dict(tp=tp, fp=fp, fn=fn, precision=div(tp, tp + fp), recall=div(tp, tp + fn),
                f1=div(2 * tp, 2 * tp + fp + fn), ap=div(tp, tp + fp + fn), matched_iou=div(total, tp),
                pq=div(total, tp + fp / 2 + fn / 2))


def disc(labels, cy, cx, r, value):
    yy, xx = np.mgrid[:labels.shape[0], :labels.shape[1]]
    labels[(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = value
    return labels


def discs(spec):
    labels = np.zeros(SHAPE, np.int32)
    for k, (cy, cx, r) in enumerate(spec, 1):
        disc(labels, cy, cx, r, k * 7)          # non-consecutive ids
    return labels


TRUTH = [(10, 10, 6), (10, 30, 5), (28, 14, 7), (30, 36, 6)]


def cases():
    true = discs(TRUTH)
    yield 'identical', true.copy(), true
    # shifted by 0..3 pixels: IoUs spread over the thresholds
    yield 'shifted', discs([(cy + k, cx + (k > 1), r) for k, (cy, cx, r) in enumerate(TRUTH)]), true
    # the first truth disc split into two halves, the last two merged into one object
    split = discs(TRUTH[:2])
    split[(split == 7) & (np.arange(SHAPE[1])[None, :] >= 10)] = 99
    merged = disc(disc(split.copy(), 28, 14, 7, 50), 30, 36, 6, 50)
    merged[26:32, 14:36] = 50
    yield 'split_merged', merged, true
    # overlapping discs in the prediction (the later one wins the overlap), a false positive
    yield 'overlap_fp', discs([(10, 11, 6), (12, 30, 6), (28, 16, 7), (30, 34, 7), (3, 44, 2)]), true
    yield 'empty_truth', true, np.zeros(SHAPE, np.int32)
    yield 'empty_prediction', np.zeros(SHAPE, np.int32), true
    yield 'both_empty', np.zeros(SHAPE, np.int32), np.zeros(SHAPE, np.int32)
    rng = np.random.RandomState(0)
    jitter = discs([(cy + rng.randint(-2, 3), cx + rng.randint(-2, 3), r + rng.randint(-1, 2))
                    for cy, cx, r in TRUTH])
    yield 'jitter', jitter, true


CASES = list(cases())


@pytest.mark.parametrize('name,pred,true', CASES, ids=[c[0] for c in CASES])
def test_matching_scores_match_brute_force(name, pred, true):
    got = matching_scores(iou_matrix(pred, true))
    assert sorted(got) == sorted(MATCH_THRESHOLDS)
    for t in MATCH_THRESHOLDS:
        want = reference_scores(pred, true, t)
        assert {k: got[t][k] for k in ('tp', 'fp', 'fn')} == {k: want[k] for k in ('tp', 'fp', 'fn')}, (name, t)
        for k in MATCH_KEYS:
            assert got[t][k] == pytest.approx(want[k], abs=1e-12), (name, t, k)


def test_cases_exercise_the_thresholds():
    # the generated cases are not trivial: TP differs between thresholds somewhere, and
    # there are false positives and false negatives at 0.5
    tps = [[reference_scores(p, t, th)['tp'] for th in MATCH_THRESHOLDS] for _, p, t in CASES]
    assert any(len(set(row)) > 1 for row in tps)
    split = dict((c[0], c) for c in CASES)['split_merged']
    s = reference_scores(split[1], split[2], 0.5)
    assert s['fp'] > 0 and s['fn'] > 0


def test_empty_cases_follow_stardist():
    empty = np.zeros(SHAPE, np.int32)
    both = matching_scores(iou_matrix(empty, empty))[0.5]
    assert both == dict(tp=0, fp=0, fn=0, precision=0.0, recall=0.0, f1=0.0, ap=0.0, matched_iou=0.0, pq=0.0)
    no_pred = matching_scores(iou_matrix(empty, discs(TRUTH)))[0.75]
    assert (no_pred['fn'], no_pred['precision'], no_pred['recall']) == (4, 0.0, 0.0)
    with pytest.raises(ValueError):
        matching_scores(np.zeros((1, 1)), thresholds=(0.3,))


def test_ap_equals_the_dsb_per_threshold_term():
    # the DSB score is the mean over 0.50:0.05:0.95 of the same tp/(tp+fp+fn)
    from gluon_unet.metrics import THRESHOLDS, dsb_image_score
    for _, pred, true in CASES:
        if not pred.any() and not true.any():
            continue                     # DSB: 1 for nothing to find; StarDist: 0
        aps = matching_scores(iou_matrix(pred, true), THRESHOLDS)
        assert np.mean([aps[t]['ap'] for t in THRESHOLDS]) == pytest.approx(dsb_image_score(pred, true))


def test_bin_evaluate_csv_has_the_columns(tmp_path, capsys):
    truth, pred = tmp_path / 'truth', tmp_path / 'pred'
    truth.mkdir()
    pred.mkdir()
    # plain ids: a case name such as empty_prediction would lose a known suffix (_prediction)
    named = {'case%d' % k: (p, t) for k, (_, p, t) in enumerate(CASES)}
    for name, (p, t) in named.items():
        cv2.imwrite(str(truth / ('%s.png' % name)), t.astype(np.uint16))
        cv2.imwrite(str(pred / ('%s.png' % name)), p.astype(np.uint16))
    cv2.imwrite(str(truth / 'lost.png'), discs(TRUTH).astype(np.uint16))   # no prediction
    out = tmp_path / 'scores.csv'
    assert evaluate_main(['--pred', str(pred), '--truth', str(truth), '--csv', str(out)]) == 0
    with open(out, newline='') as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        rows = {r['image_id']: r for r in reader}
    assert COLUMNS[:7] == ('image_id', 'dsb', 'iou', 'dice', 'true_objects', 'pred_objects', 'status')
    assert {'tp_50', 'fp_75', 'fn_90', 'precision_50', 'recall_75', 'f1_90', 'ap_50', 'matched_iou_75',
            'pq_90'} <= set(MATCH_COLUMNS)
    named['lost'] = (np.zeros(SHAPE, np.int32), discs(TRUTH))
    for (name, (p, t)), th in itertools.product(named.items(), MATCH_THRESHOLDS):
        want = reference_scores(p, t, th)
        for k in MATCH_KEYS:
            value = rows[name]['%s_%d' % (k, round(100 * th))]
            if k in ('tp', 'fp', 'fn'):
                assert int(value) == want[k], (name, th, k)
            else:
                assert float(value) == pytest.approx(want[k], abs=1e-6), (name, th, k)
    assert rows['lost']['status'] == 'missing'
    both_empty = 'case%d' % [c[0] for c in CASES].index('both_empty')
    assert float(rows[both_empty]['dsb']) == 1.0 and float(rows[both_empty]['ap_50']) == 0.0
    printed = capsys.readouterr().out
    head = printed.splitlines()[0].split()
    assert head[:6] == ['image_id', 'dsb', 'iou', 'dice', 'true', 'pred'] and 'ap50' in head and 'pq@.5' in head
    block = printed[printed.index('matching scores'):].splitlines()
    mean_ap75 = np.mean([reference_scores(p, t, 0.75)['ap'] for p, t in named.values()])
    line75 = [line for line in block if line.startswith('0.75')][0].split()
    assert int(line75[1]) == sum(reference_scores(p, t, 0.75)['tp'] for p, t in named.values())
    assert float(line75[7]) == pytest.approx(mean_ap75, abs=1e-4)
