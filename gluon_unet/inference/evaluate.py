"""``bin/evaluate``: score predicted nuclei against ground truth.

Predictions are label images (one id per nucleus, e.g. the 16-bit PNGs of
``bin/predict``), binary masks (split into connected components) or float probability
maps (thresholded, then components), named after the truth ids. Truth is either the
Data Science Bowl layout (``ROOT/<id>/masks/*.png``, one nucleus per file) or a folder of
mask / label images. Per image: the DSB instance score, pixel IoU and Dice - the same
code as the validation metrics in training - and, at IoU 0.5, 0.75 and 0.9, the
object-matching scores of StarDist and Cellpose (:func:`~gluon_unet.metrics.matching_scores`:
TP, FP, FN, precision, recall, F1, AP, mean matched IoU, panoptic quality).
"""
import contextlib
import csv
import os

import numpy as np

from ..data.io import merge_object_masks, read_labels
from ..data.layouts import is_dsb, is_dsb_sample, list_images
from ..errors import UserError
from ..metrics import MATCH_KEYS, MATCH_THRESHOLDS, dsb_score_from_iou, iou_matrix, matching_scores, pixel_scores
from ..outputs import check_apart, check_inputs, check_replaceable, lock_file
from ..utils import atomic_open, check_writable
from .configs import EvaluateConfig

__all__ = ['read_labels', 'find_images', 'load_truth', 'evaluate', 'mean_row', 'write_csv', 'format_table',
           'EvaluateConfig']

#: Name suffixes that still identify the image id. Earlier = preferred when several files
#: share an id (a label image keeps the watershed splits a binary mask has lost).
PRED_SUFFIXES = ('_labels', '_label', '_instances', '', '_mask', '_pred', '_prediction')
TRUTH_SUFFIXES = ('_mask', '_labels', '_label', '_instances', '')
#: Pictures for people (``bin/predict --overlay``), not predictions.
IGNORED_SUFFIXES = ('_overlay',)
def match_column(key, threshold):
    """A matching-score column: ``<key>_<threshold in percent>``, e.g. ``ap_50``, ``pq_75``."""
    return '%s_%d' % (key, round(100 * threshold))


#: The matching-score columns, threshold by threshold.
MATCH_COLUMNS = tuple(match_column(k, t) for t in MATCH_THRESHOLDS for k in MATCH_KEYS)
#: The CSV's columns: the first seven are older and read by other tools; keep them first.
COLUMNS = ('image_id', 'dsb', 'iou', 'dice', 'true_objects', 'pred_objects', 'status') + MATCH_COLUMNS
#: Matching columns summed, not averaged, in :func:`mean_row`.
COUNT_COLUMNS = tuple(c for c in MATCH_COLUMNS if c.split('_')[0] in ('tp', 'fp', 'fn'))


def match_columns(iou):
    """The :data:`MATCH_COLUMNS` of one image from its IoU matrix (n_true, n_pred)."""
    scores = matching_scores(iou, MATCH_THRESHOLDS)
    return {match_column(k, t): scores[t][k] for t in MATCH_THRESHOLDS for k in MATCH_KEYS}


def find_images(folder):
    """Image files directly in ``folder``, sorted (see :func:`~.data.io.is_image_file`)."""
    return [os.path.join(folder, n) for n in list_images(folder)]


def _by_id(paths, suffixes, ignore=()):
    """Map image id -> path, stripping a known suffix; earlier suffixes win ties."""
    named = sorted((s for s in suffixes if s), key=len, reverse=True)
    best = {}
    for path in paths:
        stem = os.path.splitext(os.path.basename(path))[0]
        if any(stem.endswith(s) for s in ignore):
            continue
        suffix = next((s for s in named if stem.endswith(s) and len(stem) > len(s)), '')
        key, rank = stem[:len(stem) - len(suffix)], suffixes.index(suffix)
        if key not in best or rank < best[key][0]:
            best[key] = (rank, path)
    return {k: v[1] for k, v in best.items()}


def load_truth(root, threshold=0.5):
    """Ground truth as ``{id: loader}``; each loader returns (H, W) int64 labels.

    Loading is deferred so a large truth set is read one image at a time.
    """
    if is_dsb(root, 'masks'):
        return {d: (lambda m=os.path.join(root, d, 'masks'): _read_dsb_masks(m))
                for d in sorted(os.listdir(root)) if is_dsb_sample(os.path.join(root, d), 'masks')}
    return {k: (lambda p=p: read_labels(p, threshold))
            for k, p in _by_id(find_images(root), TRUTH_SUFFIXES).items()}


def _read_dsb_masks(mask_dir):
    """The instance labels of one DSB sample: mask file k -> id k."""
    files = find_images(mask_dir)
    if not files:
        raise UserError('%s holds no mask images' % mask_dir)

    def mismatch(path, shape, expected):
        return UserError('%s is %dx%d but the other masks of %s are %dx%d'
                         % (path, shape[1], shape[0], mask_dir, expected[1], expected[0]))
    return merge_object_masks(files, mismatch=mismatch).astype(np.int64)


def evaluate(pred_dir, truth_dir, threshold=0.5):
    """Score every truth image.

    Returns
    -------
    rows : list of dict
        One per truth id, keys :data:`COLUMNS`; a missing prediction scores 0 with
        ``status='missing'`` (and is scored as an empty prediction: every true object a
        false negative).
    extra : list of str
        Prediction ids without truth (ignored).
    """
    for flag, d in (('--pred', pred_dir), ('--truth', truth_dir)):
        if not os.path.isdir(d):
            raise UserError('%s %s: no such directory' % (flag, d))
    truth = load_truth(truth_dir, threshold)
    if not truth:
        raise UserError('--truth %s holds no masks (expected <id>/masks/*.png or mask images)' % truth_dir)
    preds = _by_id(find_images(pred_dir), PRED_SUFFIXES, IGNORED_SUFFIXES)
    matched = sorted(set(truth) & set(preds))
    if not matched:
        raise UserError('no prediction in %s matches a truth id in %s (e.g. %s)'
                        % (pred_dir, truth_dir, sorted(truth)[0]))
    rows = []
    for image_id in sorted(truth):
        true = truth[image_id]()
        n_true = int(len(np.unique(true[true > 0])))
        if image_id not in preds:
            rows.append(dict(image_id=image_id, dsb=0.0, iou=0.0, dice=0.0, true_objects=n_true,
                             pred_objects=0, status='missing', **match_columns(np.zeros((n_true, 0)))))
            continue
        pred = read_labels(preds[image_id], threshold)
        if pred.shape != true.shape:
            raise UserError('%s is %dx%d but the truth of %s is %dx%d'
                            % (preds[image_id], pred.shape[1], pred.shape[0], image_id,
                               true.shape[1], true.shape[0]))
        px = pixel_scores(pred, true)
        iou = iou_matrix(pred, true)
        rows.append(dict(image_id=image_id, dsb=dsb_score_from_iou(iou), iou=px['iou'],
                         dice=px['dice'], true_objects=n_true,
                         pred_objects=int(len(np.unique(pred[pred > 0]))), status='ok', **match_columns(iou)))
    extra = sorted(set(preds) - set(truth))
    return rows, extra


def mean_row(rows):
    """The column means (missing predictions included as 0); object counts and TP, FP, FN
    are summed instead. Per-image ratios are averaged (StarDist's ``matching_dataset``
    would pool TP, FP and FN over the images first)."""
    means = ('dsb', 'iou', 'dice') + tuple(c for c in MATCH_COLUMNS if c not in COUNT_COLUMNS)
    sums = ('true_objects', 'pred_objects') + COUNT_COLUMNS
    return {'image_id': 'mean', **{k: float(np.mean([r[k] for r in rows])) for k in means},
            **{k: int(sum(r[k] for r in rows)) for k in sums}, 'status': ''}


def write_csv(path, rows):
    """Write the per-image rows atomically (temp file + rename: never half a file)."""
    check_csv(path)
    with atomic_open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ('%.6f' % r[k] if isinstance(r[k], float) else r[k]) for k in COLUMNS})


def check_csv(path):
    """One line when ``--csv`` cannot be written: its folder is missing or not writable."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError('--csv %s: folder %s does not exist' % (path, folder))
    check_writable(path, '--csv', is_file=True)


#: Matching columns shown per image in :func:`format_table` (all of them are in the CSV).
TABLE_MATCH = (('ap50', 'ap_50'), ('ap75', 'ap_75'), ('ap90', 'ap_90'), ('f1@.5', 'f1_50'), ('pq@.5', 'pq_50'))


def format_table(rows, mean):
    """A plain-text table, one line per image, then the mean; below it, every matching
    score per IoU threshold, summed (TP, FP, FN) or averaged over the images."""
    width = max([len('image_id')] + [len(r['image_id']) for r in rows])
    head = '%-*s  %6s  %6s  %6s  %5s  %5s' % (width, 'image_id', 'dsb', 'iou', 'dice', 'true', 'pred') \
        + ''.join('  %6s' % name for name, _ in TABLE_MATCH)
    line = '%-*s  %6.4f  %6.4f  %6.4f  %5d  %5d' + '  %6.4f' * len(TABLE_MATCH)

    def fields(label, r):
        return ((width, label, r['dsb'], r['iou'], r['dice'], r['true_objects'], r['pred_objects'])
                + tuple(r[c] for _, c in TABLE_MATCH))
    out = [head, '-' * len(head)]
    for r in rows:
        out.append(line % fields(r['image_id'], r) + ('  (missing)' if r['status'] == 'missing' else ''))
    out.append('-' * len(head))
    out.append(line % fields('mean', mean))
    out.append('')
    sub = '%-9s  %6s  %6s  %6s  %9s  %6s  %6s  %6s  %11s  %6s' % (
        'IoU >', 'tp', 'fp', 'fn', 'precision', 'recall', 'f1', 'ap', 'matched_iou', 'pq')
    out += ['matching scores over the %d images (tp, fp, fn summed; the rest averaged per image)' % len(rows),
            sub, '-' * len(sub)]
    for t in MATCH_THRESHOLDS:
        m = {k: mean[match_column(k, t)] for k in MATCH_KEYS}
        out.append('%-9.2f  %6d  %6d  %6d  %9.4f  %6.4f  %6.4f  %6.4f  %11.4f  %6.4f' % (
            t, m['tp'], m['fp'], m['fn'], m['precision'], m['recall'], m['f1'], m['ap'], m['matched_iou'],
            m['pq']))
    return '\n'.join(out)


def run_evaluate(config):
    """``bin/evaluate``: score ``config.pred`` against ``config.truth`` (an
    :class:`EvaluateConfig`), writing ``config.csv`` if given. The CSV is checked before
    the scoring (not after it): apart from the inputs, one gluon_unet wrote if it exists,
    writable, and locked until written.

    Returns
    -------
    (list of dict, dict, list of str)
        The per-image rows, their mean and the ids of predictions without truth.
    """
    check_inputs([('--pred', config.pred, 'folder'), ('--truth', config.truth, 'folder')])
    check_apart([('--csv', config.csv)], [('--pred', config.pred), ('--truth', config.truth)], 'evaluate')
    check_replaceable(config.csv, COLUMNS[0] + ',', '--csv', 'a table of scores')
    if config.csv:
        check_csv(config.csv)
    with lock_file(config.csv, '--csv') if config.csv else contextlib.nullcontext():
        rows, extra = evaluate(config.pred, config.truth, config.threshold)
        if config.csv:
            write_csv(config.csv, rows)
    return rows, mean_row(rows), extra
