"""Object size, as Cellpose handles it: a model is trained on nuclei of a typical
diameter, and an image whose nuclei are much larger or smaller is rescaled so that they
reach the network at that diameter, then the result is mapped back.

A U-Net sees a fixed neighbourhood (its receptive field) at a fixed resolution: nuclei
several times the size it was trained on come out as fragments (no single view holds a
whole nucleus), much smaller ones merge. Training records the median diameter of its
nuclei (:func:`~gluon_unet.data.sizes.nucleus_sizes`, stored in the export's sidecar as ``diameter``);
``bin/predict --diameter N|auto`` rescales each image by ``model diameter / N``, where
``auto`` measures N from a first prediction at the image's own scale
(:func:`estimate_diameter`).

``--diameter range`` enlarges like ``auto`` but shrinks only the images whose nuclei are
larger than the model was trained on *for that kind of image* (:func:`~gluon_unet.data.sizes.nucleus_sizes`,
stored in the export as ``diameter_ranges``). Why: a model that has seen large
fluorescence nuclei segments them best at their own resolution (shrinking them to the
median cost 0.01-0.06 DSB score on held-out fluorescence groups), while large nuclei of a
kind it has only seen small - stained tissue, say - come out as fragments or not at all,
and shrinking them is what recovers them; enlarging small nuclei helped wherever it was
tried (experiments/dsb2018, the grouped validation).
"""
import numpy as np

from ..data.sizes import object_diameters
from ..errors import UserError

#: Rescaling is limited to this range (a 4x upscale of a 2000 px image is 8000 px).
SCALE_LIMITS = (0.25, 4.0)
#: Images whose nuclei are within this factor of the model's diameter are not rescaled.
SCALE_TOLERANCE = 1.15


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
    ``ranges`` entry from :func:`~gluon_unet.data.sizes.nucleus_sizes`, or of ``'all'`` for a kind it saw too
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
