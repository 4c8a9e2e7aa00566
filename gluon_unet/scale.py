"""Object size, as Cellpose handles it: a model is trained on nuclei of a typical
diameter, and an image whose nuclei are much larger or smaller is rescaled so that they
reach the network at that diameter, then the result is mapped back.

A U-Net sees a fixed neighbourhood (its receptive field) at a fixed resolution: nuclei
several times the size it was trained on come out as fragments (no single view holds a
whole nucleus), much smaller ones merge. Training records the median diameter of its
nuclei (:func:`median_diameter`, stored in the export's sidecar as ``diameter``);
``bin/predict --diameter N|auto`` rescales each image by ``model diameter / N``, where
``auto`` measures N from a first prediction at the image's own scale
(:func:`estimate_diameter`).
"""
import math

import numpy as np

#: Rescaling is limited to this range (a 4x upscale of a 2000 px image is 8000 px).
SCALE_LIMITS = (0.25, 4.0)
#: Images whose nuclei are within this factor of the model's diameter are not rescaled.
SCALE_TOLERANCE = 1.15


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


def median_diameter(label_images):
    """Median equivalent diameter over every object of every label image; None when there
    are none."""
    parts = [object_diameters(labels) for labels in label_images]
    parts = [p for p in parts if len(p)]
    if not parts:
        return None
    return float(np.median(np.concatenate(parts)))


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
