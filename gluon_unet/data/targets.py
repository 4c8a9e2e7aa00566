"""What the network learns to predict, built from instance labels.

``mask``: one channel, the nucleus (foreground) mask. ``mask-gap``: the same channel with a
background line of at least 1 px wherever two nuclei touch, as the U-Net paper trained
(Ronneberger et al., 2015): the network then learns to leave the contact between touching
nuclei below the threshold, so a thresholded map keeps them apart and the distance
watershed sees a neck to cut. ``mask+border``: a second channel
with the nuclei's borders, as the 2018 Data Science Bowl winners trained: a thresholded
foreground map merges touching nuclei into one blob, while a border channel draws the
line between them, and instances then grow from the confident interiors (nucleus minus
border) by a marker-controlled watershed (:func:`gluon_unet.inference.postprocess.instances_from_prob`).
``mask+centre``: a second channel with each nucleus' distance to its own edge, as a
fraction of its largest (1 at the centre, 0 on the edge and on the contact with a
neighbour: StarDist's object probability, the "energy" of the deep watershed transform).
Where the thin border is hard for a small network to draw exactly, this is a smooth map
over the whole nucleus, and two touching nuclei show two hills with a valley down to 0
between them even where their union has no neck: the hill tops are the watershed's
markers and the nuclei meet in the valley. ``mask+contact``: a second channel with only
the lines where nuclei touch (both sides of every contact, and the narrow background gaps
between nuclei), none of the outlines against the background: the border's one part the
foreground cannot show, learnt with the U-Net paper's gap weights (``--loss wbce_dice``)
on a sparse line the network need not draw around every nucleus; instances grow from the
foreground minus the contacts, so the foreground stays whole (``mask-gap`` cuts it).
``mask+flow``: two more channels, the direction from each nucleus pixel to its nucleus'
centre (Cellpose's idea, Stringer et al., 2021): the direction flips across the line
where two nuclei touch, whatever the shape of their union, and following it from every
pixel gathers each nucleus at one point (:func:`gluon_unet.inference.postprocess.instances_from_flows`).
"""
import numpy as np
from scipy import ndimage as ndi

#: ``--target`` choices, and the output channel each one adds.
TARGETS = ('mask', 'mask-gap', 'mask+border', 'mask+centre', 'mask+contact', 'mask+touching', 'mask+flow')
#: The second map of ``mask+touching`` is a contact map (drawn wider for larger nuclei): the
#: post-processing treats both alike.
OUTPUTS = {'mask': ('foreground',), 'mask-gap': ('foreground',), 'mask+border': ('foreground', 'border'),
           'mask+centre': ('foreground', 'centre'), 'mask+contact': ('foreground', 'contact'),
           'mask+touching': ('foreground', 'contact'), 'mask+flow': ('foreground', 'flow_y', 'flow_x')}
#: ``mask+touching``: how far (pixels) another nucleus may be for a pixel of a nucleus to be
#: on their touching border, by the nucleus' area (px): below 300, below 2,000, above.
TOUCHING_REACH = ((300, 1), (2000, 2), (None, 3))
#: ... and for a background pixel between two nuclei: 3, or 6 where the image's largest
#: nucleus exceeds 4,000 px.
TOUCHING_GAP = ((4000, 3), (None, 6))

_CROSS = ndi.generate_binary_structure(2, 1)


def second_map_of(outputs):
    """What a model's maps after the foreground are, by its ``outputs`` (a value of
    :data:`OUTPUTS`): 'border', 'centre', 'contact', 'flow' (``mask+flow``'s two), or None."""
    rest = tuple(outputs)[1:]
    if not rest:
        return None
    return 'flow' if rest == ('flow_y', 'flow_x') else rest[0]


def _labels(instances, copy=False):
    """``instances`` as 2-D int32 labels (a copy with ``copy``), or a ValueError."""
    labels = np.asarray(instances)
    if labels.ndim != 2:
        raise ValueError('instances must be (H, W), got shape %s' % (labels.shape,))
    return labels.astype(np.int32, copy=copy)


def _contour(labels):
    """Pixels with a 4-neighbour of another label (background included): both sides of
    every nucleus' outline and of every contact between two nuclei."""
    return ndi.maximum_filter(labels, footprint=_CROSS, mode='nearest') != \
        ndi.minimum_filter(labels, footprint=_CROSS, mode='nearest')


def border_map(instances, gap=2):
    """Border pixels of instance labels: the contour of every nucleus and the gap between
    nuclei that (nearly) touch.

    A pixel is border when its 4-neighbourhood holds another label (the two pixels on
    either side of every contour: one inside the nucleus, one outside), or when it is
    background and two different nuclei lie within ``gap`` pixels of it (the narrow gap
    between touching nuclei is filled, so the separating line is at least 2 px wide
    however small the nuclei). The band has a fixed width instead of a fraction of
    the nucleus: a nucleus 5 px across keeps an interior of 3 px, and blobs without
    one are still kept as objects by the post-processing.

    Parameters
    ----------
    instances : (H, W) int
        0 = background, other values = nucleus ids.
    gap : int
        Background pixels with two different nuclei within this (chessboard) distance are
        border.

    Returns
    -------
    (H, W) bool
    """
    labels = _labels(instances)
    border = _contour(labels)
    if gap > 0:
        border |= (labels == 0) & _two_nuclei_within(labels, gap)
    return border


def _two_nuclei_within(labels, reach):
    """Pixels with two different nuclei within ``reach`` pixels (chessboard distance)."""
    size = 2 * reach + 1
    big = np.iinfo(np.int32).max
    nearest_hi = ndi.maximum_filter(labels, size=size, mode='constant', cval=0)
    nearest_lo = ndi.minimum_filter(np.where(labels > 0, labels, big), size=size, mode='constant', cval=big)
    return (nearest_lo < big) & (nearest_lo != nearest_hi)


def contact_map(instances, gap=2):
    """Where nuclei touch or nearly touch: the border of :func:`border_map` without the
    outlines against the background.

    A nucleus pixel is contact when its 3x3 neighbourhood holds another nucleus (so the
    line is 2 px wide where two touch, one on each side); a background pixel, when two
    different nuclei lie within ``gap`` pixels of it (the gap between them is filled).
    A nucleus that touches nothing has no contact pixel.

    Parameters
    ----------
    instances : (H, W) int
        0 = background, other values = nucleus ids.
    gap : int
        As in :func:`border_map`.

    Returns
    -------
    (H, W) bool
    """
    labels = _labels(instances)
    contact = (labels > 0) & _two_nuclei_within(labels, 1)
    if gap > 0:
        contact |= (labels == 0) & _two_nuclei_within(labels, gap)
    return contact


def touching_map(instances):
    """Where nuclei meet, in a band whose width follows their size: the touching border of
    the 2018 Data Science Bowl winners (selimsef/dsb2018_topcoders, ``create_mask``).

    A pixel of a nucleus is touching when another nucleus lies within its reach
    (:data:`TOUCHING_REACH`: 1 px for nuclei under 300 px, 2 under 2,000, 3 above), a
    background pixel when two nuclei lie within 3 px of it (6 where the image's largest
    nucleus exceeds 4,000 px: :data:`TOUCHING_GAP`). A large nucleus so gets the wider band
    a network needs to draw a cut across it; :func:`contact_map` draws 1 px in every nucleus.

    Parameters
    ----------
    instances : (H, W) int
        0 = background, other values = nucleus ids.

    Returns
    -------
    (H, W) bool
    """
    labels = _labels(instances)
    areas = np.bincount(labels.ravel())
    reach = np.full(len(areas), TOUCHING_REACH[-1][1], np.int32)
    for limit, r in reversed(TOUCHING_REACH[:-1]):
        reach[areas < limit] = r
    largest = areas[1:].max() if len(areas) > 1 else 0
    reach[0] = next(r for limit, r in TOUCHING_GAP if limit is None or largest <= limit)
    per_pixel = reach[labels]
    touching = np.zeros(labels.shape, bool)
    for r in np.unique(per_pixel):
        touching |= (per_pixel == r) & _two_nuclei_within(labels, int(r))
    return touching


def separate_touching(instances):
    """Instance labels with the contact between touching nuclei cleared to background.

    A pixel of nucleus ``a`` is cleared when its 3x3 neighbourhood holds a nucleus with a
    higher id. Only one side of each contact loses pixels, so the line is 1 px wide (a
    nucleus gives up the least area that still separates it), and no pixel of ``a`` is
    left 8-adjacent to the other nucleus: the two are apart under either connectivity.
    Nuclei that touch nothing are unchanged.

    Parameters
    ----------
    instances : (H, W) int
        0 = background, other values = nucleus ids.

    Returns
    -------
    (H, W) int32
        The labels, minus the cleared contact pixels.
    """
    labels = _labels(instances, copy=True)  # a copy: the caller's labels stay as they are
    # The highest id within the 3x3 window; background (0) never clears anything.
    higher = ndi.maximum_filter(labels, size=3, mode='constant', cval=0)
    labels[(labels > 0) & (higher > labels)] = 0
    return labels


def centre_map(instances):
    """Each nucleus' distance to its own edge, divided by its largest: 1 at its centre,
    falling to 0 on its edge.

    The edge is where a pixel's 4-neighbourhood holds another label: background, or a
    touching nucleus (both sides of a contact are edge, so the valley between two
    nuclei reaches 0 however they touch). An edge pixel scores 0, a pixel next to it
    1 / max. Dividing by each nucleus' own largest distance gives small and large nuclei
    the same hill, so one marker level suits both. A nucleus cut by the image's (or a
    crop's) edge rises towards it, as the nucleus goes on out there.

    Parameters
    ----------
    instances : (H, W) int
        0 = background, other values = nucleus ids.

    Returns
    -------
    (H, W) float32 in [0, 1]
        0 on the background.
    """
    labels = _labels(instances)
    inner = (labels > 0) & ~_contour(labels)
    out = np.zeros(labels.shape, np.float32)
    if not inner.any():
        return out
    dist = ndi.distance_transform_edt(inner).astype(np.float32)
    ids = np.unique(labels[inner])
    top = np.zeros(int(labels.max()) + 1, np.float32)
    top[ids] = ndi.maximum(dist, labels, index=ids)
    np.divide(dist, top[labels], out=out, where=inner)
    return out


def nucleus_centres(labels):
    """Each nucleus' centre: its deepest pixel (farthest from its own edge, as in
    :func:`centre_map`), which lies inside the nucleus whatever its shape, where a centroid
    may fall outside a bent one.

    Returns
    -------
    (cy, cx) : two (labels.max() + 1,) float32 arrays
        Indexed by label; a nucleus with no inner pixel (1-2 px wide) gets one of its pixels.
    """
    labels = _labels(labels)
    n = int(labels.max()) + 1
    cy, cx = np.zeros(n, np.float32), np.zeros(n, np.float32)
    ids = np.unique(labels[labels > 0])
    if not len(ids):
        return cy, cx
    inner = (labels > 0) & ~_contour(labels)
    # +1 on every nucleus pixel: an all-edge nucleus still has a maximum, on one of its pixels
    depth = ndi.distance_transform_edt(inner).astype(np.float32) + (labels > 0)
    pos = np.asarray(ndi.maximum_position(depth, labels, index=ids), np.float32).reshape(-1, 2)
    cy[ids], cx[ids] = pos[:, 0], pos[:, 1]
    return cy, cx


def flow_map(instances):
    """The unit vector from each nucleus pixel towards its nucleus' centre
    (:func:`nucleus_centres`), as two maps in [0, 1]: ``(1 + dy) / 2`` and ``(1 + dx) / 2``.

    Encoded so that a sigmoid output and its BCE learn it as they learn the centre map's
    level, and every map of a model stays a probability-like map (tiling, rescaling and the
    exports treat them alike). The background and each centre pixel are 0.5 (no direction).
    A nucleus cut by the image's (or a crop's) edge points to its deepest visible pixel,
    which lies towards that edge, as the nucleus goes on out there.

    Returns
    -------
    (2, H, W) float32 in [0, 1]
    """
    labels = _labels(instances)
    out = np.full((2,) + labels.shape, 0.5, np.float32)
    yy, xx = np.nonzero(labels)
    if not len(yy):
        return out
    cy, cx = nucleus_centres(labels)
    own = labels[yy, xx]
    dy, dx = cy[own] - yy, cx[own] - xx
    norm = np.hypot(dy, dx)
    norm[norm == 0] = 1  # the centre itself: (0, 0)
    out[0, yy, xx] = 0.5 + 0.5 * dy / norm
    out[1, yy, xx] = 0.5 + 0.5 * dx / norm
    return out


def make_target(mask, instances, target='mask'):
    """The training target of one sample.

    Parameters
    ----------
    mask : (H, W) int
        Class per pixel (binary: 0/1).
    instances : (H, W) int
        Instance labels (used by every target but ``mask``).
    target : {'mask', 'mask-gap', 'mask+border', 'mask+centre', 'mask+contact', 'mask+touching', 'mask+flow'}

    Returns
    -------
    (C, H, W) float32
        ``mask``: the class mask (C = 1); ``mask-gap``: the foreground with the contacts
        between touching nuclei cleared (C = 1); ``mask+border``: foreground and border (C = 2);
        ``mask+centre``: foreground and :func:`centre_map` (C = 2); ``mask+contact``:
        foreground and :func:`contact_map` (C = 2); ``mask+touching``: foreground and
        :func:`touching_map` (C = 2); ``mask+flow``: foreground and :func:`flow_map` (C = 3).
    """
    if target == 'mask':
        return np.asarray(mask).astype(np.float32)[None]
    if target == 'mask-gap':
        return ((np.asarray(mask) > 0) & (separate_touching(instances) > 0)).astype(np.float32)[None]
    if target == 'mask+flow':
        return np.concatenate([(np.asarray(mask) > 0)[None].astype(np.float32), flow_map(instances)])
    if target not in OUTPUTS or len(OUTPUTS[target]) != 2:
        raise ValueError('target must be one of %s (got %r)' % (', '.join(TARGETS), target))
    fg = np.asarray(mask) > 0
    second = {'mask+border': border_map, 'mask+centre': centre_map, 'mask+contact': contact_map,
              'mask+touching': touching_map}[target](instances)
    return np.stack([fg, second]).astype(np.float32)
