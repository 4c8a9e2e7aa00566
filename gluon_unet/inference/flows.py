"""Nuclei from a flow model's maps (``--target mask+flow``): follow the flows, then gather.

A flow model predicts, besides the foreground, the direction from each nucleus pixel to
its nucleus' centre (:func:`gluon_unet.data.targets.flow_map`). Cellpose's way to
instances (Stringer et al., 2021, its ``dynamics.compute_masks``): every foreground pixel
takes steps along the predicted direction, so the pixels of one nucleus meet at its centre
while those of a neighbour, whose directions point the other way across their contact,
meet at the other's; the points where many pixels end are the nuclei, and each pixel
belongs to the one it reached (:func:`gather`; the objects, sizes and scores:
:func:`gluon_unet.inference.postprocess.instances_from_flows`). Unlike a watershed, no
seed has to be found on the foreground's shape: two touching nuclei with no neck between
them still part where the predicted directions turn.
"""
import numpy as np
from scipy import ndimage as ndi

#: Steps each pixel takes, 1 px each: enough to cross a nucleus of up to twice as many pixels
#: (after ``--diameter`` rescaling, prediction sees nuclei at about the training size).
FLOW_STEPS = 40
#: A point where at least this many pixels end (within a 3 x 3 window) starts a nucleus.
MIN_GATHER = 6


def follow_flows(flow, mask, steps=FLOW_STEPS, min_length=0.25):
    """Where each pixel of ``mask`` ends after ``steps`` unit steps along ``flow``.

    Parameters
    ----------
    flow : (2, H, W) float
        The encoded directions, (1 + dy) / 2 and (1 + dx) / 2, as the model predicts them.
    mask : (H, W) bool
        The pixels to move (the foreground).
    steps : int
    min_length : float
        A pixel whose predicted direction is shorter than this (0..1: the network is
        unsure of it, as on the background and at a centre) takes no step.

    Returns
    -------
    (yy, xx, ey, ex) : int arrays
        The pixels' coordinates and where they ended (rounded, within the image).
    """
    flow = np.asarray(flow, np.float32)
    h, w = mask.shape
    yy, xx = np.nonzero(mask)
    # the predicted vectors, renormalised where long enough: a step is one pixel, so that
    # the steps needed do not depend on how sure the network is of a direction
    vy, vx = 2 * flow[0] - 1, 2 * flow[1] - 1
    norm = np.hypot(vy, vx)
    scale = np.where(norm > min_length, 1 / np.maximum(norm, 1e-6), 0).astype(np.float32)
    vy, vx = vy * scale, vx * scale
    py, px = yy.astype(np.float32), xx.astype(np.float32)
    for _ in range(int(steps)):
        iy = np.clip(np.rint(py), 0, h - 1).astype(np.intp)
        ix = np.clip(np.rint(px), 0, w - 1).astype(np.intp)
        # a point never leaves the foreground: a step into the background is not taken
        ny, nx = py + vy[iy, ix], px + vx[iy, ix]
        jy = np.clip(np.rint(ny), 0, h - 1).astype(np.intp)
        jx = np.clip(np.rint(nx), 0, w - 1).astype(np.intp)
        ok = mask[jy, jx]
        py, px = np.where(ok, ny, py), np.where(ok, nx, px)
    ey = np.clip(np.rint(py), 0, h - 1).astype(np.intp)
    ex = np.clip(np.rint(px), 0, w - 1).astype(np.intp)
    return yy, xx, ey, ex


def gather(prob, flow, threshold=0.5, min_length=0.25, steps=FLOW_STEPS, min_gather=MIN_GATHER):
    """The foreground of ``prob`` labelled by where its pixels end along ``flow``.

    Parameters
    ----------
    prob : (H, W) float
        Foreground probability; the foreground is ``prob > threshold``.
    flow : (2, H, W) float
        The flow maps (:func:`gluon_unet.data.targets.flow_map`'s encoding).
    min_length, steps
        See :func:`follow_flows`.
    min_gather : int
        Pixels that must end within a 3 x 3 window for it to start a nucleus; a foreground
        pixel whose path ends nowhere near one joins the nucleus next to it (within 3 px).

    Returns
    -------
    (H, W) int32
        One label per gathering point (not numbered 1..K; 0 = background, and foreground
        that no nucleus reached: :func:`~gluon_unet.inference.postprocess.instances_from_flows`
        makes those blobs objects of their own).
    """
    from skimage.segmentation import expand_labels

    prob = np.asarray(prob, np.float32)
    flow = np.asarray(flow, np.float32)
    if prob.ndim != 2 or flow.shape != (2,) + prob.shape:
        raise ValueError('prob must be (H, W) and flow (2, H, W), got %s and %s' % (prob.shape, flow.shape))
    mask = prob > threshold
    labels = np.zeros(prob.shape, np.int32)
    if not mask.any():
        return labels
    yy, xx, ey, ex = follow_flows(flow, mask, steps, min_length)
    ends = np.bincount(ey * prob.shape[1] + ex, minlength=prob.size).reshape(prob.shape)
    gathered = ndi.uniform_filter(ends.astype(np.float32), size=3, mode='constant') * 9 >= min_gather - 0.5
    seeds = np.empty(prob.shape, np.int32)
    ndi.label(gathered, output=seeds)
    labels[yy, xx] = seeds[ey, ex]
    # a pixel whose path ended between the gathering points (a stray direction): the
    # nucleus next to it, within the foreground
    return np.where(mask, expand_labels(labels, distance=3), 0).astype(np.int32)
