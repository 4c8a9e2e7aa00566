"""Nucleus sizes in label images: what a model is trained on, recorded in its export.

Training measures the diameters of its nuclei (:func:`nucleus_sizes`); the export keeps
their median and their range per kind of image, and ``bin/predict --diameter`` rescales
new images to them (:mod:`gluon_unet.inference.scale`). Both sides read this module, and
so does the config, which checks ``--predict-diameter``.
"""
import math

import numpy as np

#: ``--diameter range``: the sizes a model has seen of a kind of image are the diameters
#: between these percentiles of that kind's training nuclei (recorded both; the rule
#: shrinks only nuclei above the top one times the rescaling's tolerance).
RANGE_PERCENTILES = (5.0, 95.0)
#: ... counted only for a kind with at least this many training nuclei; an image of a kind
#: seen less is judged against every training nucleus (the ``'all'`` range).
RANGE_MIN_NUCLEI = 50
#: ``--diameter`` (bin/predict) and ``--predict-diameter`` (bin/train) words; else a number of pixels.
DIAMETER_WORDS = ('none', 'auto', 'range')


def diameter_choice_error(value):
    """None when ``value`` is a valid ``--diameter``: none, auto, range or a finite positive
    number of pixels (as text or a number); else what is wrong, for a one-line error."""
    if value in DIAMETER_WORDS:
        return None
    try:
        pixels = float(value)
    except (TypeError, ValueError):
        pixels = None
    if isinstance(value, bool) or pixels is None or not (math.isfinite(pixels) and pixels > 0):
        return "must be %s or a finite positive number of pixels (got %s)" % (
            ', '.join(repr(w) for w in DIAMETER_WORDS), repr(value))
    return None


def object_diameters(labels):
    """Equivalent diameters (``2 sqrt(area / pi)``, pixels) of the objects of a label image.

    Parameters
    ----------
    labels : (H, W) int
        0 = background.

    Returns
    -------
    (K,) float64
        One per object present (ids without pixels are skipped).
    """
    labels = np.asarray(labels)
    areas = np.bincount(labels[labels > 0].ravel())[1:]
    areas = areas[areas > 0]
    return 2.0 * np.sqrt(areas / math.pi)


def nucleus_sizes(label_images, kinds=None):
    """The nucleus sizes a model is trained on: their median, and their range per kind.

    Parameters
    ----------
    label_images : iterable of (H, W) int
        The training images' instance labels, as the network sees them.
    kinds : sequence of str or None, optional
        Each image's kind (:func:`~gluon_unet.data.io.image_kind`); None: not known.

    Returns
    -------
    median : float or None
        Median equivalent diameter (px) over every nucleus (``bin/predict --diameter``
        rescales to it); None when there are no nuclei.
    ranges : dict or None
        ``{kind: [low, high]}`` (``--diameter range``): the :data:`RANGE_PERCENTILES` of the
        diameters of every kind with at least :data:`RANGE_MIN_NUCLEI` nuclei, and
        ``'all'`` over every nucleus; None when there are no nuclei.
    """
    per_kind = {}
    for k, labels in enumerate(label_images):
        per_kind.setdefault(kinds[k] if kinds is not None else None, []).append(object_diameters(labels))
    every = np.concatenate([d for parts in per_kind.values() for d in parts] or [np.zeros(0)])
    if not len(every):
        return None, None
    seen = {'all': every}
    for kind, parts in per_kind.items():
        d = np.concatenate(parts)
        if kind is not None and len(d) >= RANGE_MIN_NUCLEI:
            seen[kind] = d
    ranges = {kind: [round(float(v), 2) for v in np.percentile(d, RANGE_PERCENTILES)] for kind, d in seen.items()}
    return float(np.median(every)), ranges
