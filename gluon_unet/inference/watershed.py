"""The distance watershed of :func:`gluon_unet.inference.postprocess.instances_from_prob`,
solved group by group of nuclei within bounded memory, and its h-maxima markers.

A one-map model's nuclei are split where the distance to the background has two maxima
that each rise ``h`` pixels above the saddle between them. On a large dense image (tissue,
a confluent culture) the whole-image temporaries of a watershed take ~110 bytes a pixel,
so the nuclei are solved in groups (each with the margin its smoothing needs), and a group
that grows as large as the image is solved in strips of rows.
"""
import numpy as np
from scipy import ndimage as ndi


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
