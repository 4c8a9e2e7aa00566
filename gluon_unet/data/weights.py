"""The U-Net paper's per-pixel loss weights (Ronneberger et al., 2015, eq. 2).

``w(x) = w_c(x) + w0 * exp(-(d1(x) + d2(x))^2 / (2 sigma^2))`` on background pixels,
where d1 and d2 are the distances to the nearest and the second-nearest nucleus. The
second term is large only in the thin background gaps between nuclei that almost touch,
so the ``wbce`` loss pays most for merging them - which is what makes them separable.
"""
import math

import numpy as np
from scipy import ndimage as ndi

#: The losses that take this weight map as a third input (``--loss``): their batches carry it.
WEIGHTED = ('wbce', 'wbce_dice')

#: Cap on the class-balancing weight, so an image with a handful of foreground pixels
#: does not get a weight of thousands on them.
MAX_CLASS_WEIGHT = 10.0


def class_weights(foreground):
    """Class-balancing weight per pixel: each class gets the same total weight.

    Parameters
    ----------
    foreground : (H, W) bool

    Returns
    -------
    (H, W) float32
        ``n / (2 * n_class)`` for the pixel's class (so the mean over the image is 1
        when both classes are present), capped at :data:`MAX_CLASS_WEIGHT`; all ones
        when only one class is present.
    """
    fg = np.asarray(foreground, dtype=bool)
    n, n_fg = fg.size, int(np.count_nonzero(fg))
    if n_fg == 0 or n_fg == n:
        return np.ones(fg.shape, np.float32)
    w_fg = min(n / (2.0 * n_fg), MAX_CLASS_WEIGHT)
    w_bg = min(n / (2.0 * (n - n_fg)), MAX_CLASS_WEIGHT)
    return np.where(fg, np.float32(w_fg), np.float32(w_bg))


def unet_weight_map(instances, w0=10.0, sigma=5.0, class_balance=True):
    """Weight map of the U-Net paper from instance labels.

    Parameters
    ----------
    instances : (H, W) int
        0 = background, other values = nucleus ids.
    w0 : float
        Height of the border term.
    sigma : float
        Width (pixels) of the border term.
    class_balance : bool
        Add :func:`class_weights`; otherwise the base weight is 1 everywhere.

    Returns
    -------
    (H, W) float32
        Finite, >= the base weight.

    Notes
    -----
    Each nucleus' distance transform is computed only inside its bounding box grown by
    ``4 * sigma``: a pixel farther than that from the second-nearest nucleus gets a
    border term below ``w0 * exp(-8)`` (< 0.04 % of w0), which is dropped. The cost then
    grows with the number of nuclei times their neighbourhood, not times the image.
    """
    labels = np.asarray(instances)
    if labels.ndim != 2:
        raise ValueError('instances must be (H, W), got shape %s' % (labels.shape,))
    labels = labels.astype(np.int64, copy=False)
    background = labels <= 0
    base = class_weights(~background) if class_balance else np.ones(labels.shape, np.float32)
    if w0 == 0 or background.all():
        return base

    h, w = labels.shape
    margin = int(math.ceil(4 * sigma))
    d1 = np.full(labels.shape, np.inf, np.float32)
    d2 = np.full(labels.shape, np.inf, np.float32)
    for k, box in enumerate(ndi.find_objects(np.maximum(labels, 0)), start=1):
        if box is None:
            continue
        ys, xs = box
        y0, y1 = max(ys.start - margin, 0), min(ys.stop + margin, h)
        x0, x1 = max(xs.start - margin, 0), min(xs.stop + margin, w)
        # The whole nucleus lies inside the window, so distances inside it are exact.
        dk = ndi.distance_transform_edt(labels[y0:y1, x0:x1] != k).astype(np.float32)
        a, b = d1[y0:y1, x0:x1], d2[y0:y1, x0:x1]
        b[...] = np.where(dk < a, a, np.minimum(b, dk))
        np.minimum(a, dk, out=a)

    border = np.zeros(labels.shape, np.float32)
    near = background & np.isfinite(d2)
    s = d1[near] + d2[near]
    border[near] = w0 * np.exp(-(s * s) / (2.0 * sigma * sigma))
    return (base + border).astype(np.float32)
