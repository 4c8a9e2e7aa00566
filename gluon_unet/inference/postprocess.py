"""From probabilities to nuclei: instance labels, and the settings that shape them.

A U-Net predicts a foreground probability per pixel; nuclei that touch form one blob
once thresholded. :func:`instances_from_prob` separates them with a marker-based
watershed: on the distance transform (a convex nucleus has a single distance maximum,
two touching ones have two separated by a saddle at the neck), or - when the network
also predicts boundaries - from the cores left after removing the boundaries, or - when
it predicts each nucleus' distance to its edge (``mask+centre``) - from the tops of
those hills.
"""
import numpy as np
from scipy import ndimage as ndi

#: Instance separation choices (``bin/predict --split``): distance watershed, or plain components.
SPLITS = ('watershed', 'none')
#: What a two-map model's second map can be (``OUTPUTS`` of :mod:`gluon_unet.data.targets`).
#: A border or a contact map is a line: the markers are what it leaves of the foreground.
#: A centre map is a hill over each nucleus: the markers are its tops.
SECOND_MAPS = ('border', 'centre', 'contact')
#: Where a two-map model's watershed seeds come from: its second map, or the distance
#: transform of its foreground.
MARKERS = SECOND_MAPS + ('distance',)
#: The ``marker`` setting of each second map when none is given or chosen: the interior
#: score a marker of a border or contact model exceeds, the depth of a centre model's hill top.
DEFAULT_MARKER = {'border': 0.5, 'centre': 0.1, 'contact': 0.5}


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
    split : {'watershed', 'none'}
        'none' = plain (4-connected) components; 'watershed' separates touching nuclei.
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
    elif boundary is None and centre is None and smooth > 0:
        labels = _distance_watershed(mask, h, smooth)
    else:
        labels = _marker_watershed(prob, mask, boundary, h, marker, centre)
    return drop_unsure(labels, prob, min_score) if min_score > 0 else labels


def _marker_watershed(prob, mask, boundary, h, marker, centre=None):
    """The watershed of :func:`instances_from_prob` on the whole image at once: with a
    border or a centre map, or the distance watershed without smoothing."""
    from skimage.segmentation import watershed

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
        markers, elevation = h_maxima_markers(dist, mask, h), -dist
    return keep_orphans(watershed(elevation, markers, mask=mask), mask)


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
        one, the contact probability of a ``mask+contact`` one.
    threshold, min_size, split, h, marker, min_score
        See :func:`instances_from_prob` (``h`` is used by the distance watershed,
        ``marker`` by the second map's markers; ``min_score`` applies to the foreground map).
    markers : {None, 'border', 'centre', 'contact', 'distance'}
        Where the watershed's markers come from, and so what a second map is: the
        interiors left by a border map ('border'; the default with two maps, as before
        other second maps existed) or a contact map ('contact'), the hill tops of a
        centre map ('centre'), or the distance
        transform of the foreground (the default with one map; for a two-map model, when
        its second map splits worse than the distance on validation images -
        :func:`~gluon_unet.inference.postprocess_search.tune_on_maps` chooses).

    Returns
    -------
    (H, W) int32
    """
    maps = np.asarray(maps)
    if maps.ndim == 2:
        maps = maps[None]
    if maps.ndim != 3 or maps.shape[0] not in (1, 2):
        raise ValueError('maps must be (H, W), (1, H, W) or (2, H, W), got shape %s' % (maps.shape,))
    if markers is not None and markers not in MARKERS:
        raise ValueError('markers must be one of %s (got %r)' % (', '.join(MARKERS), markers))
    if markers in SECOND_MAPS and len(maps) != 2:
        raise ValueError('%s markers need a second map (a mask+%s model), got %d map(s)'
                         % (markers, markers, len(maps)))
    second = None if len(maps) == 1 or markers == 'distance' else maps[1]
    centre = second if markers == 'centre' else None
    boundary = None if centre is not None else second
    return instances_from_prob(maps[0], threshold=threshold, min_size=min_size, split=split, boundary=boundary,
                               h=h, marker=marker, min_score=min_score, centre=centre)


def _gauss_radius(smooth):
    """Half-width of scipy's gaussian_filter window (truncate=4)."""
    return int(4.0 * float(smooth) + 0.5) if smooth > 0 else 0


_EIGHT = np.ones((3, 3), bool)


def _first_pixels(ids, y0, x0, width):
    """Raster index in the whole image of the first pixel of every label 1..n of ``ids``
    (a crop at ``(y0, x0)`` numbered in raster order), in label order."""
    flat = np.flatnonzero(ids)
    _, first = np.unique(ids.ravel()[flat], return_index=True)
    cy, cx = np.divmod(flat[first], ids.shape[1])
    return (cy + y0).astype(np.int64) * width + (cx + x0)


#: Groups of nuclei larger than this many pixels (bounding box with its margin) are solved
#: in strips of about as many pixels (at least :data:`STRIP_ROWS` rows): on a dense image
#: (tissue, a confluent culture) the nuclei's neighbourhoods chain into one group as large
#: as the image, and the whole-image temporaries (~110 bytes a pixel) would be back.
MAX_GROUP_PIXELS = 1 << 18
STRIP_ROWS = 128


def _distance_watershed(mask, h, smooth, max_group=None):
    """The distance watershed of :func:`instances_from_prob`, group by group.

    Whole-image temporaries (float64 distances, their smoothed copy, int64 h-maxima,
    skimage's reconstruction ranks, watershed internals) cost ~100 bytes a pixel. But a
    pixel's result depends only on the nuclei within the smoothing radius ``r`` of it:
    the distance transform inside a 4-connected blob only sees that blob's pixels and the
    background (every pixel outside the blob is at least as far as the nearest
    background pixel, and a background pixel outside a crop with a background rim maps
    to a rim pixel no farther away); the smoothed distance is 0 farther than ``r`` (the
    filter's window) from the foreground, so the h-maxima reconstruction and the local
    maxima cannot cross a gap of that width; the watershed floods only inside a blob. So
    blobs whose ``r``-neighbourhoods touch form a group, and each group is solved in its
    own crop (its bounding box + ``2r + 1``, clipped to the image, other groups' pixels
    cleared). The result is bit-identical to the whole-image computation, label numbers
    included (markers numbered by their first pixel in raster order, then blobs without a
    marker), and the temporaries scale with the largest group.

    A group larger than ``max_group`` pixels (default :data:`MAX_GROUP_PIXELS`) is solved
    in strips (:meth:`_Solver.strips`); the temporaries then scale with a strip.
    """
    height, width = mask.shape
    r = max(1, _gauss_radius(smooth))
    near = mask.view(np.uint8)
    if r:  # the mask dilated by a (2r+1)-square, as two 1-D passes
        near = ndi.maximum_filter1d(near, 2 * r + 1, axis=0, mode='constant')
        near = ndi.maximum_filter1d(near, 2 * r + 1, axis=1, mode='constant')
    groups = np.empty(mask.shape, np.int32)
    ndi.label(near, structure=_EIGHT, output=groups)
    del near
    margin = 2 * r + 1
    solver = _Solver(mask.shape, h, smooth, margin)
    max_group = MAX_GROUP_PIXELS if max_group is None else max_group
    for g, box in enumerate(ndi.find_objects(groups), start=1):
        if box is None:
            continue
        y0, y1 = max(0, box[0].start - margin), min(height, box[0].stop + margin)
        x0, x1 = max(0, box[1].start - margin), min(width, box[1].stop + margin)
        if (y1 - y0) * (x1 - x0) > max_group:
            solver.strips(mask, groups, g, (y0, y1, x0, x1))
            continue
        sub = groups[y0:y1, x0:x1] == g
        sub &= mask[y0:y1, x0:x1]
        solver.solve(sub, y0, x0)
    del groups
    return _renumber(solver.out, solver.marker_keys, solver.orphan_keys)


class _Solver:
    """The distance watershed of one crop at a time, written into one label image.

    Local ids are offset per crop (markers positive, blobs without a marker negative)
    and the raster index of each object's first pixel is kept, so :func:`_renumber` can
    number them as the whole-image computation would.
    """

    def __init__(self, shape, h, smooth, margin):
        self.h, self.smooth, self.margin = h, smooth, margin
        self.out = np.zeros(shape, np.int32)
        self.marker_keys, self.orphan_keys = [], []
        self.offset = self.n_orphans = 0

    def solve(self, sub, y0, x0, keep=None):
        """Solve the foreground ``sub`` of the crop at ``(y0, x0)``; with ``keep`` (a
        bool mask of whole blobs of ``sub``), only those blobs' objects are written."""
        from skimage.morphology import local_maxima
        from skimage.segmentation import watershed

        width = self.out.shape[1]
        dist = ndi.distance_transform_edt(sub)
        if self.smooth > 0:
            dist = ndi.gaussian_filter(dist, self.smooth)
        hmax = _h_maxima(dist, self.h)
        own = sub if keep is None else keep
        view = self.out[y0:y0 + sub.shape[0], x0:x0 + sub.shape[1]]
        left = own.copy()  # owned pixels no marker reached
        if hmax.any():
            peaks = local_maxima(hmax, connectivity=2, allow_borders=True) & sub
            del hmax
            markers, n = ndi.label(peaks, structure=_EIGHT)
            if n:
                labels = watershed(-dist, markers, mask=sub)
                if keep is not None:  # markers of other strips' blobs: dropped, numbers closed up
                    ids = np.unique(markers[keep & (markers > 0)])
                    lut = np.zeros(n + 1, np.int32)
                    lut[ids] = np.arange(1, len(ids) + 1, dtype=np.int32)
                    markers, labels, n = lut[markers], lut[labels], len(ids)
                if n:
                    self.marker_keys.append(_first_pixels(markers, y0, x0, width))
                    view[own] = labels[own] + self.offset
                    self.offset += n
                left &= labels == 0
                del markers, labels
        del dist
        # Blobs without a marker (under h everywhere): each its own object, numbered after
        # every marker (skimage finds no maximum on a constant image either).
        orphans, n = ndi.label(left)
        if n:
            self.orphan_keys.append(_first_pixels(orphans, y0, x0, width))
            view[left] = -(orphans[left] + self.n_orphans)  # negative: told apart from markers
            self.n_orphans += n

    def strips(self, mask, groups, g, box):
        """Solve a large group in strips of rows (``MAX_GROUP_PIXELS / width`` of them, at
        least :data:`STRIP_ROWS`).

        Each blob (4-connected nucleus cluster) of the group belongs to the strip where
        it starts; a strip's crop spans its blobs' rows plus the margin, with every
        blob of the group that reaches into the crop present (they shape the smoothed
        distances near the strip's own blobs) but only its own blobs written. A blob
        cut by the crop's edge lies at least the margin (``2r + 1``) from every own blob,
        beyond the smoothing window's reach.
        """
        y0, y1, x0, x1 = box
        sub = groups[y0:y1, x0:x1] == g
        sub &= mask[y0:y1, x0:x1]
        blobs, n = ndi.label(sub)
        del sub
        boxes = ndi.find_objects(blobs)
        tops = np.array([b[0].start for b in boxes])
        bottoms = np.array([b[0].stop for b in boxes])
        rows = max(STRIP_ROWS, MAX_GROUP_PIXELS // (x1 - x0))
        for start in range(0, y1 - y0, rows):
            ids = np.flatnonzero((tops >= start) & (tops < start + rows)) + 1
            if not len(ids):
                continue
            # The group's box already has the margin of background around its blobs.
            c0 = max(y0, y0 + start - self.margin)
            c1 = min(y1, y0 + int(bottoms[ids - 1].max()) + self.margin)
            crop = blobs[c0 - y0:c1 - y0]
            keep = np.zeros(int(n) + 1, bool)
            keep[ids] = True
            self.solve(crop > 0, c0, x0, keep[crop])


def _h_maxima(dist, h):
    """The h-maxima reconstruction of :func:`h_maxima_markers`, on 1/100-pixel integers."""
    from skimage.morphology import reconstruction

    scaled = np.round(dist * 100).astype(np.int64)
    step = max(1, int(round(h * 100)))
    return reconstruction(np.maximum(scaled - step, 0), scaled, method='dilation')


def _renumber(out, marker_keys, orphan_keys, rows=256):
    """Markers (ids > 0) numbered by their first pixel in raster order, then the orphans
    (ids < 0) likewise - the numbering of the whole-image computation - in place."""
    markers = np.concatenate(marker_keys) if marker_keys else np.zeros(0, np.int64)
    orphans = np.concatenate(orphan_keys) if orphan_keys else np.zeros(0, np.int64)
    m, o = len(markers), len(orphans)
    lut = np.zeros(m + o + 1, np.int32)  # index = id + o
    lut[o + 1:][np.argsort(markers, kind='stable')] = np.arange(1, m + 1, dtype=np.int32)
    lut[:o][::-1][np.argsort(orphans, kind='stable')] = np.arange(m + 1, m + o + 1, dtype=np.int32)
    for y in range(0, out.shape[0], rows):  # row blocks: no whole-image temporary
        block = out[y:y + rows]
        block[...] = lut[block + o]
    return out


def h_maxima_markers(dist, mask, h):
    """Markers = the tops of the h-maxima transform of ``dist``, inside ``mask``.

    The reconstruction ``HMAX_h(dist)`` lowers every peak by h and flattens peaks joined
    by a saddle less than h deep into one connected plateau; its regional maxima are the
    markers. (``skimage.morphology.h_maxima`` instead marks each of two equally high
    pixel peaks separately, which split elongated nuclei along their ridge.)
    """
    from skimage.measure import label
    from skimage.morphology import local_maxima, reconstruction

    # Integer 1/100-pixel steps make plateaus exactly flat, whatever the float noise.
    scaled = np.round(dist * 100).astype(np.int64)
    step = max(1, int(round(h * 100)))
    hmax = reconstruction(np.maximum(scaled - step, 0), scaled, method='dilation')
    peaks = local_maxima(hmax, connectivity=2, allow_borders=True) & mask
    return label(peaks, connectivity=2)


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
    how = (['--mode %s' % tuned['mode']] if tuned.get('mode', 'auto') != 'auto' else []) \
        + (['--tta'] if tuned.get('tta') else [])
    return text + (' (chosen on maps predicted with %s)' % ' '.join(how) if how else '')

