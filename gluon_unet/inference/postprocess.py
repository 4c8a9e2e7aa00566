"""From probabilities to nuclei: instance labels, and the settings that shape them.

A U-Net predicts a foreground probability per pixel; nuclei that touch form one blob
once thresholded. :func:`instances_from_prob` separates them with a marker-based
watershed: on the distance transform (a convex nucleus has a single distance maximum,
two touching ones have two separated by a saddle at the neck), or - when the network
also predicts boundaries - from the cores left after removing the boundaries, or - when
it predicts each nucleus' distance to its edge (``mask+centre``) - from the tops of
those hills.
"""
import warnings

import numpy as np
from scipy import ndimage as ndi

from .configs import MARKERS, SECOND_MAPS, SPLITS
from .flows import FLOW_STEPS, MIN_GATHER, gather
from .watershed import _distance_watershed, h_maxima_markers

#: The ``marker`` setting of each second map when none is given or chosen: the interior
#: score a marker of a border or contact model exceeds, the depth of a centre model's hill
#: top, the length a flow model's predicted direction needs for a pixel to follow it.
DEFAULT_MARKER = {'border': 0.5, 'centre': 0.1, 'contact': 0.5, 'flow': 0.25}


def instances_from_prob(prob, threshold=0.5, min_size=0, split='watershed', boundary=None,
                        h=0.5, smooth=1.0, marker=None, min_score=0.0, centre=None):
    """Instance labels from a foreground probability map.

    Parameters
    ----------
    prob : (H, W) float
        Foreground probability in [0, 1].
    threshold : float
        Foreground is ``prob > threshold``.
    min_size : int
        Connected components smaller than this many pixels are removed first.
    split : {'watershed', 'randomwalker', 'none'}
        'none' = plain (4-connected) components; 'watershed' separates touching nuclei;
        'randomwalker' separates them from the same markers by a random walker
        (:func:`random_walker_split`) instead of flooding.
    boundary : (H, W) float, optional
        Predicted border probability (a ``mask+border`` model), or contact probability (a
        ``mask+contact`` model). The markers are then the confident interiors, the
        components of ``prob * (1 - boundary) > marker``, and they flood the foreground
        downhill in that interior score, so two touching nuclei meet on the line between
        them. ``h`` and ``smooth`` are not used.
    centre : (H, W) float, optional
        Predicted distance to the edge, as a fraction of the nucleus' largest (a
        ``mask+centre`` model; not with ``boundary``). The markers are its hill tops in
        the foreground that rise at least ``marker`` above the valley to a higher one
        (h-maxima, as for the distance), and they flood it downhill in ``centre``, so two
        touching nuclei meet in the valley between their hills. A depth, not a level:
        a network after a short training draws the hills lower than the target's 1 (a
        small nucleus' hill more so), but still with a valley between touching nuclei.
        ``h`` and ``smooth`` are not used.
    h : float
        Distance watershed: a distance maximum becomes a marker only if it rises at least
        ``h`` pixels above the saddle to a higher one (h-maxima), so pixelation of a single
        round or elongated nucleus never creates a second marker.
    smooth : float
        Gaussian sigma applied to the distance transform before looking for maxima.
    marker : float, optional
        With ``boundary``: the interior score a marker pixel must exceed; with ``centre``,
        how far (in centre score) a hill top must rise above its valley (default:
        :data:`DEFAULT_MARKER`).
    min_score : float
        Objects whose mean foreground probability is below this are dropped last, like a
        detector's confidence cut: debris and out-of-focus blobs pass the pixel threshold
        at moderate probability, real nuclei are confident across their whole area
        (measured on DSB validation images: median 0.96 for matched objects, 0.83 for
        false ones). 0 keeps all.

    Returns
    -------
    (H, W) int32
        0 = background, objects numbered 1..K.
    """
    if split not in SPLITS:
        raise ValueError('split must be one of %s (got %r)' % (', '.join(SPLITS), split))
    prob = np.asarray(prob, dtype=np.float32)
    if prob.ndim != 2:
        raise ValueError('prob must be (H, W), got shape %s' % (prob.shape,))
    mask = prob > threshold
    if min_size > 0 and mask.any():
        comps = np.empty(mask.shape, np.int32)  # skimage's label would be int64
        ndi.label(mask, output=comps)  # 4-connected, numbered in raster order like skimage's
        sizes = np.bincount(comps.ravel())
        small = sizes < min_size
        small[0] = False
        mask &= ~small[comps]
        del comps
    if split == 'none' or not mask.any():
        labels = np.empty(mask.shape, np.int32)
        ndi.label(mask, output=labels)
    elif split == 'randomwalker':
        labels = random_walker_split(*_markers_and_elevation(prob, mask, boundary, h, marker, centre, smooth), mask)
    elif boundary is None and centre is None and smooth > 0:
        labels = _distance_watershed(mask, h, smooth)
    else:
        labels = _marker_watershed(prob, mask, boundary, h, marker, centre)
    return drop_unsure(labels, prob, min_score) if min_score > 0 else labels


def instances_from_flows(prob, flow, threshold=0.5, min_size=0, min_score=0.0, min_length=0.25,
                         steps=FLOW_STEPS, min_gather=MIN_GATHER):
    """Instance labels from a flow model's foreground and flow maps: the pixels gathered
    along the flows (:func:`gluon_unet.inference.flows.gather`), a foreground blob no
    gathering reached as an object of its own (a nucleus of a few pixels, as the watershed
    keeps its markerless blobs), then ``min_size`` and ``min_score`` as for
    :func:`instances_from_prob`.

    Parameters
    ----------
    prob : (H, W) float
    flow : (2, H, W) float
        The flow maps (:func:`gluon_unet.data.targets.flow_map`'s encoding).
    threshold, min_size, min_score
        See :func:`instances_from_prob` (``min_size``: objects smaller are dropped).
    min_length, steps, min_gather
        See :func:`~gluon_unet.inference.flows.gather` (``min_length`` is ``bin/predict
        --marker`` of a flow model).

    Returns
    -------
    (H, W) int32
        0 = background, objects numbered 1..K.
    """
    labels = gather(prob, flow, threshold, min_length, steps, min_gather)
    prob = np.asarray(prob, np.float32)
    labels = keep_orphans(labels, prob > threshold)
    if min_size > 0:
        small = np.bincount(labels.ravel()) < min_size
        small[0] = False
        labels[small[labels]] = 0
        labels = keep_orphans(labels, np.zeros(labels.shape, bool))  # renumbered 1..K
    return drop_unsure(labels, prob, min_score) if min_score > 0 else labels


def _marker_watershed(prob, mask, boundary, h, marker, centre=None):
    """The watershed of :func:`instances_from_prob` on the whole image at once: with a
    border or a centre map, or the distance watershed without smoothing."""
    from skimage.segmentation import watershed

    markers, elevation = _markers_and_elevation(prob, mask, boundary, h, marker, centre)
    return keep_orphans(watershed(elevation, markers, mask=mask), mask)


def _markers_and_elevation(prob, mask, boundary, h, marker, centre=None, smooth=0.0):
    """``(markers, elevation)`` of the instance step: the components of a second map's
    confident interior (``boundary``) or the hill tops of ``centre``, else the h-maxima of
    the distance transform (smoothed by ``smooth``); and the surface that falls away from
    them (low inside a nucleus, high where two meet)."""
    if boundary is not None and centre is not None:
        raise ValueError('give a boundary or a centre map, not both')
    if boundary is not None:
        boundary = _same_shape(boundary, prob, 'boundary')
        marker = DEFAULT_MARKER['border'] if marker is None else marker
        markers, elevation = level_markers(prob * (1 - boundary), mask, marker)
    elif centre is not None:
        centre = _same_shape(centre, prob, 'centre')
        marker = DEFAULT_MARKER['centre'] if marker is None else marker
        # x 10: h_maxima_markers works in 1/100 steps of its map, here 1/1000 of the score
        markers, elevation = h_maxima_markers(centre * 10, mask, marker * 10), -centre
    else:
        # Unsmoothed distances tie a lot and the watershed breaks ties by visiting order,
        # which a crop changes: the whole image at once, as before.
        dist = ndi.distance_transform_edt(mask)
        if smooth > 0:
            dist = ndi.gaussian_filter(dist, smooth)
        markers, elevation = h_maxima_markers(dist, mask, h), -dist
    return markers, elevation


def random_walker_split(markers, elevation, mask):
    """Instances from ``markers`` by a random walker on ``elevation`` inside ``mask``.

    Where the watershed floods from each marker until two floods meet, the random walker
    gives each pixel the marker a random walk from it most likely reaches first, walks
    being slowed by steep changes of the elevation (Grady 2006, skimage's
    ``random_walker``): the cut between two touching nuclei follows the weakest line
    between them rather than where two floods happen to meet, which the open DSB
    ablation found better on crowded nuclei (0.490 against 0.480). Solved one blob of the
    mask at a time, and only where a blob holds two or more markers (the others are one
    nucleus each), so its cost follows the crowded blobs, not the image.
    """
    from skimage.segmentation import random_walker

    labels = np.zeros(mask.shape, np.int32)
    blobs, _ = ndi.label(mask)
    for index, box in enumerate(ndi.find_objects(blobs), start=1):
        if box is None:
            continue
        blob = blobs[box] == index
        seeds = np.where(blob, markers[box], 0)
        ids = np.unique(seeds[seeds > 0])
        if len(ids) < 2:
            if len(ids) == 1:
                labels[box][blob] = ids[0]
            continue
        data = elevation[box].astype(np.float64)
        span = np.ptp(data[blob])
        data = (data - data[blob].min()) / (span if span > 0 else 1.0)
        walk = np.where(blob, seeds, -1)  # -1: outside the blob, not part of the problem
        try:
            with warnings.catch_warnings():
                # The loose tolerance lets a probability overshoot [0, 1] by a hair, which
                # skimage warns about; only which marker is likeliest is used here.
                warnings.filterwarnings('ignore', message='The probability range is outside')
                found = random_walker(data, walk, beta=130, mode='cg_j', tol=1e-3)
        except Exception:  # noqa: BLE001 - a blob it cannot solve is flooded instead
            from skimage.segmentation import watershed
            found = watershed(data, np.where(blob, seeds, 0), mask=blob)
        labels[box][blob] = _seed_ids(found, seeds)[blob]
    return keep_orphans(labels, mask)


def _seed_ids(found, seeds):
    """``found`` (a solver's labels of one blob) numbered by the ``seeds`` it grew from.

    skimage's ``random_walker`` numbers its output 1..k in each call, whatever the seeds'
    values: solved blob by blob, separate nuclei would share ids. A seed pixel keeps its
    own label, so the seeds say which output number is which nucleus (and the watershed's
    own numbering, already the seeds', passes unchanged).
    """
    lut = np.zeros(max(int(found.max()), 0) + 1, np.int32)
    at = seeds > 0
    lut[found[at]] = seeds[at]
    return np.where(found > 0, lut[np.maximum(found, 0)], 0)


def keep_orphans(labels, mask):
    """A watershed's ``labels`` (changed in place) with every blob of ``mask`` that no
    marker reached added as an object of its own, renumbered 1..K as int32: a blob
    without a marker (a boundary map that swallowed a whole small nucleus) is still a
    nucleus, not to be dropped."""
    from skimage.measure import label
    from skimage.segmentation import relabel_sequential

    orphan = mask & (labels == 0)
    if orphan.any():
        extra = label(orphan, connectivity=1)
        labels[orphan] = extra[orphan] + labels.max()
    return relabel_sequential(labels)[0].astype(np.int32)


def object_scores(labels, prob):
    """Mean probability of each object 1..K of a sequentially numbered label image."""
    n = int(labels.max()) if labels.size else 0
    if n == 0:
        return np.zeros(0)
    return ndi.mean(np.asarray(prob, np.float32), labels, index=np.arange(1, n + 1))


def cut_scores(labels, prob, truth, min_scores):
    """DSB scores of ``labels`` against the true instances ``truth``, one for each of
    ``min_scores``, with the objects whose mean ``prob`` is below it dropped: one IoU
    matrix, of which a min score only drops columns (what the post-processing search
    scores a setting by)."""
    from ..metrics import dsb_score_from_iou, iou_matrix
    iou = iou_matrix(labels, truth)
    mean = object_scores(labels, prob)
    return [dsb_score_from_iou(iou[:, mean >= s]) for s in min_scores]


def drop_unsure(labels, prob, min_score):
    """Remove from ``labels`` (int32, numbered 1..K; changed in place and returned) the
    objects whose mean ``prob`` is below ``min_score``, renumbering the others in their
    order. In place, so a large image's labels are not held twice."""
    keep = np.concatenate([[False], object_scores(labels, prob) >= min_score])
    lut = (np.cumsum(keep) * keep).astype(labels.dtype)
    # mode='clip' is not buffered: each pixel reads its own id, then writes its new one
    return np.take(lut, labels, out=labels, mode='clip')


def _same_shape(level, prob, name):
    level = np.asarray(level, dtype=np.float32)
    if level.shape != prob.shape:
        raise ValueError('%s shape %s differs from prob %s' % (name, level.shape, prob.shape))
    return level


def level_markers(level, mask, marker):
    """Markers (the components of ``level > marker`` in ``mask``: a border map's
    interiors) and the elevation that floods from them: downhill in ``level``."""
    from skimage.measure import label

    return label((level > marker) & mask, connectivity=1), -level


def instances_from_maps(maps, threshold=0.5, min_size=0, split='watershed', h=0.5, marker=None, markers=None,
                        min_score=0.0):
    """Instance labels from a model's probability maps.

    Parameters
    ----------
    maps : (H, W) or (K, H, W) float
        The foreground probability, and for a two-map model (K = 2) its second map: the
        border probability of a ``mask+border`` model, the centre map of a ``mask+centre``
        one, the contact probability of a ``mask+contact`` one; for a ``mask+flow`` model
        (K = 3) its two flow maps (:func:`instances_from_flows`:
        ``marker`` is the direction's length a pixel needs to follow it, ``split`` and
        ``h`` are not used).
    threshold, min_size, split, h, marker, min_score
        See :func:`instances_from_prob` (``h`` is used by the distance watershed,
        ``marker`` by the second map's markers; ``min_score`` applies to the foreground map).
    markers : {None, 'border', 'centre', 'contact', 'flow', 'distance'}
        Where the watershed's markers come from, and so what a second map is: the
        interiors left by a border map ('border'; the default with two maps, as before
        other second maps existed) or a contact map ('contact'), the hill tops of a
        centre map ('centre'), or the distance
        transform of the foreground (the default with one map; for a two-map model, when
        its second map splits worse than the distance on validation images -
        :func:`~gluon_unet.inference.postprocess_search.tune_on_maps` chooses); with three
        maps, 'flow' (the default) gathers the pixels along the flows instead.

    Returns
    -------
    (H, W) int32
    """
    maps = np.asarray(maps)
    if maps.ndim == 2:
        maps = maps[None]
    if maps.ndim != 3 or maps.shape[0] not in (1, 2, 3):
        raise ValueError('maps must be (H, W), (1, H, W), (2, H, W) or (3, H, W), got shape %s' % (maps.shape,))
    if markers is not None and markers not in MARKERS:
        raise ValueError('markers must be one of %s (got %r)' % (', '.join(MARKERS), markers))
    if markers in SECOND_MAPS and len(maps) != (3 if markers == 'flow' else 2):
        raise ValueError('%s markers need %s (a mask+%s model), got %d map(s)'
                         % (markers, 'two flow maps' if markers == 'flow' else 'a second map', markers, len(maps)))
    if len(maps) == 3 and markers in (None, 'flow') and split != 'none':  # 'none': plain components, as ever
        if split == 'randomwalker':
            raise ValueError("a flow model's nuclei are gathered along its flows: split must be "
                             "'watershed' or 'none' with flow markers (got 'randomwalker')")
        return instances_from_flows(maps[0], maps[1:], threshold=threshold, min_size=min_size, min_score=min_score,
                                    min_length=DEFAULT_MARKER['flow'] if marker is None else marker)
    second = None if len(maps) != 2 or markers == 'distance' else maps[1]
    centre = second if markers == 'centre' else None
    boundary = None if centre is not None else second
    return instances_from_prob(maps[0], threshold=threshold, min_size=min_size, split=split, boundary=boundary,
                               h=h, marker=marker, min_score=min_score, centre=centre)


def tuned_markers(tuned):
    """The markers a searched setting (the sidecar's ``postprocess``) grows instances from:
    its ``markers``; settings from before that key had a ``marker`` only for border models,
    and an ``h`` for the distance watershed."""
    return tuned.get('markers') or ('border' if 'marker' in tuned else 'distance')


def settings_text(tuned):
    """``'threshold 0.60, h 0.5, min size 0'``: a :func:`~gluon_unet.inference.postprocess_search.tune_on_maps` result (or the
    sidecar's ``postprocess``) for a log line; two-map models name their markers."""
    if 'marker' in tuned:
        markers = '%s markers %.1f' % (tuned_markers(tuned), tuned['marker'])
    else:
        markers = '%sh %.1f' % ('distance watershed, ' if 'markers' in tuned else '', tuned['h'])
    text = 'threshold %.2f, %s, min size %d' % (tuned['threshold'], markers, tuned['min_size'])
    text += ', min score %.2f' % tuned['min_score'] if tuned.get('min_score') else ''
    text += ', random walker' if tuned.get('split') == 'randomwalker' else ''
    how = (['--mode %s' % tuned['mode']] if tuned.get('mode', 'auto') != 'auto' else []) \
        + (['--tta'] if tuned.get('tta') else [])
    return text + (' (chosen on maps predicted with %s)' % ' '.join(how) if how else '')

