"""Object size, as Cellpose handles it: a model is trained on nuclei of a typical
diameter, and an image whose nuclei are much larger or smaller is rescaled so that they
reach the network at that diameter, then the result is mapped back.

A U-Net sees a fixed neighbourhood (its receptive field) at a fixed resolution: nuclei
several times the size it was trained on come out as fragments (no single view holds a
whole nucleus), much smaller ones merge. Training records the median diameter of its
nuclei (:func:`nucleus_sizes`, stored in the export's sidecar as ``diameter``);
``bin/predict --diameter N|auto`` rescales each image by ``model diameter / N``, where
``auto`` measures N from a first prediction at the image's own scale
(:func:`estimate_diameter`).

``--diameter range`` enlarges like ``auto`` but shrinks only the images whose nuclei are
larger than the model was trained on *for that kind of image* (:func:`nucleus_sizes`,
stored in the export as ``diameter_ranges``). Why: a model that has seen large
fluorescence nuclei segments them best at their own resolution (shrinking them to the
median cost 0.01-0.06 DSB score on held-out fluorescence groups), while large nuclei of a
kind it has only seen small - stained tissue, say - come out as fragments or not at all,
and shrinking them is what recovers them; enlarging small nuclei helped wherever it was
tried (experiments/dsb2018, the grouped validation).
"""
import math

import numpy as np

from .errors import UserError

#: Rescaling is limited to this range (a 4x upscale of a 2000 px image is 8000 px).
SCALE_LIMITS = (0.25, 4.0)
#: Images whose nuclei are within this factor of the model's diameter are not rescaled.
SCALE_TOLERANCE = 1.15
#: ``--diameter range``: the sizes a model has seen of a kind of image are the diameters
#: between these percentiles of that kind's training nuclei (recorded both; the rule
#: shrinks only nuclei above the top one times SCALE_TOLERANCE).
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


def estimate_diameter(labels, min_objects=3):
    """The typical nucleus diameter of an image from its (predicted) instance labels: the
    area-weighted median of the objects' equivalent diameters, so a large nucleus broken
    into a few fragments and the specks around it do not outvote the nuclei themselves.
    None when fewer than ``min_objects`` objects were found (too little to go on)."""
    d = object_diameters(labels)
    if len(d) < min_objects:
        return None
    order = np.argsort(d)
    weights = np.cumsum(d[order] ** 2)
    return float(d[order][np.searchsorted(weights, weights[-1] / 2)])


def rescale_factor(model_diameter, image_diameter):
    """By how much to resize an image whose nuclei measure ``image_diameter`` px so they
    reach a model trained on ``model_diameter`` px: 1.0 within :data:`SCALE_TOLERANCE`,
    else ``model / image`` clipped to :data:`SCALE_LIMITS`."""
    if not image_diameter or not model_diameter:
        return 1.0
    factor = float(model_diameter) / float(image_diameter)
    if 1 / SCALE_TOLERANCE <= factor <= SCALE_TOLERANCE:
        return 1.0
    return float(np.clip(factor, *SCALE_LIMITS))


def range_factor(model_diameter, ranges, kind, image_diameter):
    """``--diameter range``: :func:`rescale_factor` when it enlarges; when it would shrink,
    only for nuclei larger than the model saw of the image's ``kind`` (the top of its
    ``ranges`` entry from :func:`nucleus_sizes`, or of ``'all'`` for a kind it saw too
    little of, times :data:`SCALE_TOLERANCE`), else 1.0."""
    factor = rescale_factor(model_diameter, image_diameter)
    if factor >= 1.0:
        # Enlarging costs no pixels: small nuclei drawn larger were separated and outlined
        # better even where the model had seen their size (+0.05 on unseen small fluorescence).
        return factor
    if not ranges:
        return 1.0
    # Shrinking does cost pixels: large fluorescence nuclei of sizes the model had seen
    # scored lower shrunk to its median (-0.024 on a held-out group; -0.04 for 10 images just
    # above the 95th percentile, hence the tolerance), sizes it had never seen far higher.
    high = (ranges.get(kind) or ranges['all'])[1]
    return factor if image_diameter > high * SCALE_TOLERANCE else 1.0


def resolve_diameter(diameter, model):
    """The ``--diameter`` a run uses: the flag's, else the model's own (its training's
    ``--predict-diameter``); None = no rescaling. Refused in one line for a model that
    cannot be rescaled to."""
    chosen = model.predict_diameter if diameter is None else diameter
    if chosen is None or chosen == 'none':
        return None
    flag = '--diameter' if diameter is not None else "--diameter (the model's default, %s)" % chosen
    if model.meta.get('resize_mode') == 'resize':
        raise UserError('%s: this model was trained on images resized to %s px, where nuclei have no one '
                        'size; it needs a model trained at native resolution (bin/train --crop)'
                        % (flag, model.meta.get('train_size')))
    if not model.diameter:
        raise UserError('%s: the model does not record the nucleus size it was trained on (exported before '
                        '--diameter existed, or trained without labelled nuclei); predict without --diameter' % flag)
    if chosen == 'range' and not model.diameter_ranges:
        raise UserError('%s: the model does not record the nucleus sizes it was trained on per kind of image '
                        '(exported before --diameter range existed); use --diameter auto or PIXELS' % flag)
    return chosen
