"""Segmentation metrics shared by training, ``bin/evaluate`` and the tests.

Two families:

* pixel metrics (foreground IoU and Dice), accumulated as dataset-level sums so that a
  validation set split over batches and devices gives the same number as one big array;
* the Data Science Bowl 2018 instance metric: for each IoU threshold t in 0.50..0.95,
  TP / (TP + FP + FN) where a predicted and a true object match when their IoU > t;
  averaged over thresholds, then over images;
* the object-matching scores of StarDist's ``stardist.matching.matching`` and Cellpose's
  ``metrics.average_precision`` at a few IoU thresholds (:func:`matching_scores`):
  TP/FP/FN, precision, recall, F1, AP, mean matched IoU and panoptic quality.
"""
import numpy as np

#: IoU / probability thresholds 0.50, 0.55, ..., 0.95 (rounded so 0.75 is exactly 0.75).
THRESHOLDS = np.round(np.arange(0.5, 1.0, 0.05), 2)


def _numpy(x):
    """Accept numpy arrays, lists and MXNet NDArrays alike."""
    if hasattr(x, 'asnumpy'):
        x = x.asnumpy()
    return np.asarray(x)


def _same_shape(a, b, what):
    if a.shape != b.shape:
        if a.size == b.size and np.squeeze(a).shape == np.squeeze(b).shape:
            return a.reshape(b.shape)
        raise ValueError('%s: shapes differ: %s vs %s' % (what, a.shape, b.shape))
    return a


def _ratio(num, den):
    """num / den with the empty/empty convention: nothing to find and nothing found = 1."""
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    out = np.ones_like(den)
    np.divide(num, den, out=out, where=den > 0)
    return out


class PixelMetrics:
    """Foreground IoU and Dice summed over a whole validation set.

    Sums of intersections and unions are kept per threshold, so the result is the
    dataset-level IoU (not a mean of per-batch IoUs) and does not depend on how the
    data was split into batches or devices.
    """

    def __init__(self, thresholds=THRESHOLDS):
        self.thresholds = np.asarray(thresholds, dtype=np.float64)
        self.reset()

    def reset(self):
        """Forget everything accumulated so far."""
        n = len(self.thresholds)
        self.inter = np.zeros(n, np.int64)
        self.pred = np.zeros(n, np.int64)
        self.true = 0

    def update(self, prob, truth):
        """Add a batch.

        Parameters
        ----------
        prob : array-like, (N, H, W) float in [0, 1]
            Foreground probabilities (NDArray accepted).
        truth : array-like, (N, H, W) bool or 0/1
            Ground-truth foreground.
        """
        prob = _numpy(prob)
        truth = _numpy(truth) > 0
        prob = _same_shape(prob, truth, 'PixelMetrics.update')
        # One pass for all thresholds: bucket = how many thresholds lie strictly below the
        # probability, i.e. for how many t the pixel counts as foreground (prob > t).
        # The thresholds are cast to prob's dtype so this agrees with `prob > t` in numpy.
        th = self.thresholds.astype(prob.dtype) if prob.dtype.kind == 'f' else self.thresholds
        bucket = np.searchsorted(th, prob.ravel(), side='left')
        n = len(self.thresholds)
        t = truth.ravel()
        all_counts = np.bincount(bucket, minlength=n + 1)
        fg_counts = np.bincount(bucket[t], minlength=n + 1)
        # count of pixels with bucket > i, for each threshold i
        self.pred += np.cumsum(all_counts[::-1])[::-1][1:]
        self.inter += np.cumsum(fg_counts[::-1])[::-1][1:]
        self.true += int(t.sum())

    def result(self):
        """Return ``{'iou', 'iou50', 'dice'}``.

        ``iou`` is the foreground IoU averaged over the thresholds, ``iou50`` the IoU at
        0.5 and ``dice`` the Dice coefficient at 0.5. With no foreground in either the
        truth or the prediction a score is 1.0.
        """
        union = self.pred + self.true - self.inter
        iou = _ratio(self.inter, union)
        i50 = int(np.argmin(np.abs(self.thresholds - 0.5)))
        dice = _ratio(2 * self.inter[i50], self.pred[i50] + self.true)
        return {'iou': float(iou.mean()), 'iou50': float(iou[i50]), 'dice': float(dice)}


def pixel_scores(pred_mask, true_mask):
    """Foreground IoU and Dice of one image.

    Parameters
    ----------
    pred_mask, true_mask : array-like, (H, W)
        Nonzero = foreground (label images are fine).

    Returns
    -------
    dict
        ``{'iou': float, 'dice': float}``; both 1.0 when both masks are empty.
    """
    p = _numpy(pred_mask) > 0
    t = _numpy(true_mask) > 0
    p = _same_shape(p, t, 'pixel_scores')
    inter = int(np.count_nonzero(p & t))
    sp, st = int(np.count_nonzero(p)), int(np.count_nonzero(t))
    return {'iou': float(_ratio(inter, sp + st - inter)), 'dice': float(_ratio(2 * inter, sp + st))}


def _compact(labels):
    """Map ids to 0..K (0 kept for background) so the joint histogram stays small.

    Returns (indices, K + 1).
    """
    if labels.dtype.kind in 'iub' and labels.size and labels.min() >= 0 \
            and labels.max() <= 4 * labels.size:
        # small non-negative ids: a lookup table avoids the sort in np.unique
        labels = labels.astype(np.int64, copy=False)
        present = np.bincount(labels)
        present[0] = 1
        lut = np.cumsum(present > 0) - 1
        return lut[labels], int(lut[-1]) + 1
    _, idx = np.unique(np.concatenate([[0], labels]), return_inverse=True)
    return idx[1:], int(idx.max()) + 1


def iou_matrix(pred_labels, true_labels):
    """IoU of every (true object, predicted object) pair.

    Uses one joint histogram of the two label images, so the cost is a few passes over
    the pixels whatever the number of objects.

    Parameters
    ----------
    pred_labels, true_labels : (H, W) int
        0 = background; any other value is an object id (need not be consecutive).

    Returns
    -------
    (n_true, n_pred) float64 array
    """
    p = _numpy(pred_labels)
    t = _numpy(true_labels)
    p = _same_shape(p, t, 'iou_matrix')
    p_idx, n_p = _compact(p.ravel())
    t_idx, n_t = _compact(t.ravel())
    joint = np.bincount(t_idx * n_p + p_idx, minlength=n_t * n_p).reshape(n_t, n_p)
    area_t = joint.sum(axis=1)[1:]
    area_p = joint.sum(axis=0)[1:]
    inter = joint[1:, 1:]
    union = area_t[:, None] + area_p[None, :] - inter
    return inter / np.maximum(union, 1)


def dsb_image_score(pred_labels, true_labels, thresholds=THRESHOLDS):
    """Data Science Bowl 2018 score of one image.

    Parameters
    ----------
    pred_labels, true_labels : (H, W) int
        Instance label images, 0 = background.
    thresholds : sequence of float
        IoU thresholds (all >= 0.5, so a match is necessarily one-to-one).

    Returns
    -------
    float
        Mean over thresholds of TP / (TP + FP + FN), a match being IoU > t (strictly).
        1.0 when neither image has an object; 0.0 when only one of them has.
    """
    return dsb_score_from_iou(iou_matrix(pred_labels, true_labels), thresholds)


def dsb_score_from_iou(iou, thresholds=THRESHOLDS):
    """:func:`dsb_image_score` from an image's :func:`iou_matrix` (n_true, n_pred): a
    search that drops predicted objects scores each choice from the columns it keeps."""
    n_true, n_pred = iou.shape
    if n_true == 0 and n_pred == 0:
        return 1.0
    th = np.asarray(thresholds, dtype=np.float64)
    # With IoU > 0.5 an object can overlap at most one partner that much, so the
    # candidate pairs are already a one-to-one matching.
    cand = iou[iou > 0.5]
    tp = (cand[None, :] > th[:, None]).sum(axis=1)
    score = tp / (n_true + n_pred - tp)
    return float(score.mean())


#: The IoU thresholds of :func:`matching_scores` in ``bin/evaluate`` (column suffixes 50, 75, 90).
MATCH_THRESHOLDS = (0.5, 0.75, 0.9)

#: The keys of each threshold's dict in :func:`matching_scores`.
MATCH_KEYS = ('tp', 'fp', 'fn', 'precision', 'recall', 'f1', 'ap', 'matched_iou', 'pq')


def _safe_divide(num, den):
    """num / den, 0.0 when den is 0 - StarDist's ``_safe_divide`` convention (so, unlike
    the DSB score, an image with no object in truth nor prediction scores 0, not 1)."""
    return float(num) / den if den > 0 else 0.0


def matching_scores(iou, thresholds=MATCH_THRESHOLDS):
    """Object-matching scores of one image, as StarDist's ``matching`` defines them.

    Predicted and true objects match one-to-one when their IoU > t (strictly, as in the
    DSB score; StarDist and Cellpose use >=, which differs only for an IoU exactly t).
    With t >= 0.5 an object overlaps at most one partner by more than t, so the pairs
    with IoU > t already are the optimal (Hungarian) matching.

    Parameters
    ----------
    iou : (n_true, n_pred) array
        The image's :func:`iou_matrix`.
    thresholds : sequence of float
        IoU thresholds, each >= 0.5.

    Returns
    -------
    dict
        threshold -> ``{key: value for key in MATCH_KEYS}``: ``tp`` matched pairs,
        ``fp = n_pred - tp``, ``fn = n_true - tp`` (ints); ``precision = tp/(tp+fp)``,
        ``recall = tp/(tp+fn)``, ``f1 = 2tp/(2tp+fp+fn)``, ``ap = tp/(tp+fp+fn)`` (what
        StarDist calls accuracy and StarDist, Cellpose and the DSB the average precision),
        ``matched_iou`` = mean IoU of the matched pairs, ``pq`` = panoptic quality = sum of
        the matched IoUs / (tp + fp/2 + fn/2). Every ratio with a zero denominator is 0,
        as StarDist's ``_safe_divide`` makes it (e.g. all of them when both images are empty).
    """
    iou = np.asarray(iou, dtype=np.float64)
    n_true, n_pred = iou.shape
    out = {}
    for t in thresholds:
        if t < 0.5:
            raise ValueError('matching_scores: threshold %g < 0.5, where a match is not unique' % t)
        matched = iou[iou > t]
        tp = int(matched.size)
        fp, fn = n_pred - tp, n_true - tp
        total = float(matched.sum())
        out[t] = dict(tp=tp, fp=fp, fn=fn, precision=_safe_divide(tp, tp + fp),
                      recall=_safe_divide(tp, tp + fn), f1=_safe_divide(2 * tp, 2 * tp + fp + fn),
                      ap=_safe_divide(tp, tp + fp + fn), matched_iou=_safe_divide(total, tp),
                      pq=_safe_divide(total, tp + fp / 2 + fn / 2))
    return out


def dsb_score(pred_list, true_list):
    """Mean :func:`dsb_image_score` over images (NaN for an empty list)."""
    pred_list, true_list = list(pred_list), list(true_list)
    if len(pred_list) != len(true_list):
        raise ValueError('dsb_score: %d predictions vs %d truths' % (len(pred_list), len(true_list)))
    if not pred_list:
        return float('nan')
    return float(np.mean([dsb_image_score(p, t) for p, t in zip(pred_list, true_list)]))


class DSBMetric:
    """Running mean of the DSB score, for the training loop."""

    def __init__(self):
        self.reset()

    def reset(self):
        """Forget everything accumulated so far."""
        self.total = 0.0
        self.count = 0

    def update(self, pred_labels, true_labels):
        """Add one image (H, W) or a batch (N, H, W) of instance label images."""
        p, t = _numpy(pred_labels), _numpy(true_labels)
        if t.ndim == 2:
            p, t = p[None], t[None]
        p = _same_shape(p, t, 'DSBMetric.update')
        for pi, ti in zip(p, t):
            self.total += dsb_image_score(pi, ti)
            self.count += 1

    def result(self):
        """Mean score over the images seen (NaN before any update)."""
        return self.total / self.count if self.count else float('nan')
