"""Augmentation applied identically to an image, its mask and its instance labels.

Implemented with OpenCV and numpy only, not albumentations. albumentations 1.3.1 does
resolve beside numpy 1.23 (pip pulls scikit-learn, qudida, joblib along), but:

* the project's determinism rests on ``transform(..., rng)`` drawing every random number
  from the ``np.random.Generator`` the sampler seeds per (epoch, sample); albumentations
  draws from Python's global ``random``/``np.random`` state, which we would have to
  reseed inside every worker around every call;
* the transforms we need are a few lines each on top of ``cv2.resize``/``cv2.remap``,
  which OpenCV (already a dependency) runs on uint8 and int32 alike - so instance labels
  go through the same nearest-neighbour mapping as the mask, with no float round trip;
* it keeps the install to packages we already have (and away from a dependency whose
  2.x line requires a newer numpy).

Geometry uses linear interpolation for the image and nearest for masks and instances,
always, so labels are never blended. Intensity changes touch the image only.

The stain jitter (:func:`hed_jitter`, ``--stain-jitter``) is not part of :class:`Augment`:
it needs the colour of an image as read, which the cached network input (converted to the
model's channels and normalized) no longer has; see :class:`StainJitter`.
"""
import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import cv2
import numpy as np

from .paste import paste_nuclei


def _resize(arr, size, interpolation):
    """cv2.resize that keeps a trailing channel axis of 1."""
    h, w = size
    out = cv2.resize(np.ascontiguousarray(arr), (w, h), interpolation=interpolation)
    if arr.ndim == 3 and out.ndim == 2:
        out = out[..., None]
    return out


def _pad_to_at_least(arr, h, w, top, left, mode):
    """Pad ``arr`` (HW or HWC) to at least (h, w), ``top``/``left`` pixels before it."""
    H, W = arr.shape[:2]
    ph, pw = max(0, h - H), max(0, w - W)
    if not ph and not pw:
        return arr
    pads = [(top, ph - top), (left, pw - left)] + [(0, 0)] * (arr.ndim - 2)
    if mode == 'reflect':
        # numpy's reflect needs 2+ pixels along an axis; 'symmetric' then does the same job
        mode = 'reflect' if min(H, W) > 1 else 'symmetric'
        return np.pad(arr, pads, mode=mode)
    return np.pad(arr, pads, mode='constant')


def _reflect_instances(inst, h, w, top, left):
    """Instance labels reflect-padded like the image, the mirrored nuclei as new ones.

    Each of the up to 8 padded regions (above, below, left, right, corners) offsets its
    ids by its own multiple of the largest id, so a mirror image never shares an id with
    its original or with another mirror (a nucleus cut by the image edge and its mirror
    are two nuclei that touch, as they look).
    """
    H, W = inst.shape
    out = _pad_to_at_least(inst, h, w, top, left, 'reflect').astype(np.int32)
    step = int(inst.max()) if inst.size else 0
    if step == 0 or out.shape == inst.shape:
        return out
    rows = np.digitize(np.arange(out.shape[0]), [top, top + H])  # 0 above, 1 inside, 2 below
    cols = np.digitize(np.arange(out.shape[1]), [left, left + W])
    region = rows[:, None] * 3 + cols[None, :]  # 4 = the image itself
    code = np.where(region < 4, region + 1, np.where(region > 4, region, 0))  # 1..8 outside, 0 inside
    out += ((out > 0) * code * step).astype(np.int32)
    return out


@dataclass(repr=False, eq=False)
class Augment:
    """The transform: crop/scale, flips, 90-degree rotations, elastic, intensity.

    Parameters
    ----------
    crop : int
        Output side at native resolution (0 = keep the input size). Images smaller than
        the crop window are reflect-padded, the masks and instance labels with them (the
        mirrored nuclei are nuclei, as the network sees them; zeros there would teach
        it that a nucleus is background wherever the padding shows one).
    flip : bool
        Random horizontal and vertical flips (p = 0.5 each).
    rot90 : bool
        Random multiple of 90 degrees (only 0/180 for non-square outputs).
    scale : (float, float) or None
        Zoom factor range (log-uniform); the window of side ``out / factor`` is cropped
        at a random place (padded if larger than the image) and resized to the output.
    intensity : bool
        Brightness (+-``brightness``), contrast and gamma changes on the image.
    elastic : bool
        Elastic deformation: a random displacement field smoothed by a Gaussian of
        ``elastic_sigma`` pixels, scaled to ``elastic_alpha`` pixels.
    paste : float
        Probability that the crop gets 1-5 copies of its own nuclei pasted against others
        (:func:`gluon_unet.data.paste.paste_nuclei`), after the geometry and before the
        intensity changes; 0 = never.

    Call as ``transform(image, mask, instances, rng) -> (image, mask, instances)`` with an
    (H, W, C) uint8 or float32 image, (H, W) uint8 mask, (H, W) int32 instances and a
    ``np.random.Generator``. The same generator state gives the same output. A uint8
    image comes back float32 in [0, 1] when intensity changes are on (no requantizing),
    otherwise with its own dtype.
    """

    crop: int = 0
    flip: bool = True
    rot90: bool = True
    scale: Optional[Tuple[float, float]] = (0.8, 1.25)
    intensity: bool = True
    brightness: float = 0.1
    contrast: Tuple[float, float] = (0.8, 1.25)
    gamma: Tuple[float, float] = (0.8, 1.25)
    elastic: bool = False
    elastic_alpha: float = 8.0
    elastic_sigma: float = 6.0
    paste: float = 0.0

    def __post_init__(self):
        if self.crop < 0:
            raise ValueError('crop must be >= 0')
        self.crop = int(self.crop)

    def __repr__(self):
        return ('Augment(crop=%d, flip=%s, rot90=%s, scale=%s, intensity=%s, elastic=%s, paste=%g)'
                % (self.crop, self.flip, self.rot90, self.scale, self.intensity, self.elastic, self.paste))

    # -- geometry -----------------------------------------------------------------------
    def _crop_scale(self, image, mask, inst, rng):
        H, W = image.shape[:2]
        oh, ow = (self.crop, self.crop) if self.crop else (H, W)
        factor = 1.0
        if self.scale:
            lo, hi = self.scale
            factor = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        wh, ww = max(1, int(round(oh / factor))), max(1, int(round(ow / factor)))
        if H < wh or W < ww:  # window larger than the image: pad, image at a random place
            top = int(rng.integers(0, max(0, wh - H) + 1))
            left = int(rng.integers(0, max(0, ww - W) + 1))
            image = _pad_to_at_least(image, wh, ww, top, left, 'reflect')
            mask = _pad_to_at_least(mask, wh, ww, top, left, 'reflect')
            inst = _reflect_instances(inst, wh, ww, top, left)
            H, W = image.shape[:2]
        y = int(rng.integers(0, H - wh + 1))
        x = int(rng.integers(0, W - ww + 1))
        image, mask, inst = image[y:y + wh, x:x + ww], mask[y:y + wh, x:x + ww], inst[y:y + wh, x:x + ww]
        if (wh, ww) != (oh, ow):
            image = _resize(image, (oh, ow), cv2.INTER_LINEAR)
            mask = _resize(mask, (oh, ow), cv2.INTER_NEAREST)
            inst = _resize(inst, (oh, ow), cv2.INTER_NEAREST)
        return image, mask, inst

    def _flip_rotate(self, image, mask, inst, rng):
        if self.flip:
            if rng.random() < 0.5:
                image, mask, inst = image[:, ::-1], mask[:, ::-1], inst[:, ::-1]
            if rng.random() < 0.5:
                image, mask, inst = image[::-1], mask[::-1], inst[::-1]
        if self.rot90:
            square = image.shape[0] == image.shape[1]
            k = int(rng.integers(0, 4)) if square else 2 * int(rng.integers(0, 2))
            if k:
                image, mask, inst = (np.rot90(a, k, axes=(0, 1)) for a in (image, mask, inst))
        return image, mask, inst

    def _elastic(self, image, mask, inst, rng):
        h, w = mask.shape
        dx = rng.uniform(-1, 1, (h, w)).astype(np.float32)
        dy = rng.uniform(-1, 1, (h, w)).astype(np.float32)
        # Smoothing shrinks the field's amplitude; renormalize so alpha is in pixels.
        dx = cv2.GaussianBlur(dx, (0, 0), self.elastic_sigma)
        dy = cv2.GaussianBlur(dy, (0, 0), self.elastic_sigma)
        norm = self.elastic_alpha / max(1e-6, float(np.abs(np.concatenate([dx, dy])).max()))
        gx, gy = np.meshgrid(np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32))
        map_x, map_y = gx + dx * norm, gy + dy * norm
        c = image.shape[2]
        # One border rule for all three: where the field reaches past the edge the image
        # shows its mirror, so the labels must too (a constant 0 there would call the
        # mirrored nuclei background, up to elastic_alpha pixels in from every edge).
        reflect = cv2.BORDER_REFLECT_101
        image = cv2.remap(np.ascontiguousarray(image), map_x, map_y, cv2.INTER_LINEAR,
                          borderMode=reflect).reshape(h, w, c)
        mask = cv2.remap(np.ascontiguousarray(mask), map_x, map_y, cv2.INTER_NEAREST, borderMode=reflect)
        inst = cv2.remap(np.ascontiguousarray(inst), map_x, map_y, cv2.INTER_NEAREST, borderMode=reflect)
        return image, mask, inst

    # -- intensity ----------------------------------------------------------------------
    def _intensity(self, image, rng):
        was_uint8 = image.dtype == np.uint8
        x = image.astype(np.float32) * (1.0 / 255) if was_uint8 else image.astype(np.float32)
        c = math.exp(rng.uniform(math.log(self.contrast[0]), math.log(self.contrast[1])))
        b = rng.uniform(-self.brightness, self.brightness)
        g = math.exp(rng.uniform(math.log(self.gamma[0]), math.log(self.gamma[1])))
        mean = float(x.mean())
        x = (x - mean) * c + mean + b
        if was_uint8:  # gamma is defined on [0, 1]; float input may be standardized
            np.clip(x, 0, 1, out=x)
            x = np.power(x, g, out=x)
        return x

    def __call__(self, image, mask, instances, rng):
        image = np.asarray(image)
        if image.ndim == 2:
            image = image[..., None]
        mask = np.asarray(mask)
        inst = np.zeros(mask.shape, np.int32) if instances is None else np.asarray(instances)
        if self.crop or self.scale:
            image, mask, inst = self._crop_scale(image, mask, inst, rng)
        image, mask, inst = self._flip_rotate(image, mask, inst, rng)
        if self.elastic:
            image, mask, inst = self._elastic(image, mask, inst, rng)
        # Drawn only when on: runs without it keep the augmentation their seeds gave before.
        if self.paste and rng.random() < self.paste:
            image, inst = paste_nuclei(image, inst, rng)
            mask = (inst > 0).astype(mask.dtype)
        if self.intensity:
            image = self._intensity(image, rng)
        return np.ascontiguousarray(image), np.ascontiguousarray(mask), np.ascontiguousarray(inst)


def hed_jitter(rgb, rng, sigma):
    """Random stain change of a colour image: each of its hematoxylin, eosin and DAB
    optical densities scaled by U(1 - sigma, 1 + sigma) and shifted by U(-sigma, sigma),
    the HED augmentation of Tellez et al. (2018; 2019 calls sigma 0.05 "light" and 0.2
    "strong").

    Colour deconvolution with scikit-image's matrices (``hed_from_rgb``, Ruifrok &
    Johnston) in optical density -ln(intensity); not with ``rgb2hed``/``hed2rgb``
    themselves: they divide the densities by ln(1e6) (scikit-image 0.24), so a shift of
    sigma would mean 14 times more, and ``rgb2hed`` clips negative densities to 0, so even
    sigma = 0 would change the pixels outside the stains' span. Here sigma = 0 gives the
    image back.

    Parameters
    ----------
    rgb : (H, W, C) uint8
        An image as read; unless it has 3 channels that differ (:func:`~.io.is_colour`)
        it is returned as is and nothing is drawn from ``rng``.
    rng : np.random.Generator
        Six numbers are drawn (3 scales, then 3 shifts).
    sigma : float
        Jitter amount, in [0, 1).

    Returns
    -------
    (H, W, 3) uint8
    """
    from skimage.color import hed_from_rgb, rgb_from_hed

    from .io import is_colour

    if not is_colour(rgb):
        return rgb
    scale = rng.uniform(1 - sigma, 1 + sigma, 3).astype(np.float32)
    shift = rng.uniform(-sigma, sigma, 3).astype(np.float32)
    density = -np.log(np.maximum(rgb[..., :3].astype(np.float32) * (1.0 / 255), 1e-6))
    stains = density @ hed_from_rgb.astype(np.float32)
    stains = stains * scale + shift
    out = np.exp(-(stains @ rgb_from_hed.astype(np.float32)))
    return np.clip(np.rint(out * 255), 0, 255).astype(np.uint8)


@dataclass(repr=False, eq=False)
class StainJitter:
    """``--stain-jitter``: a colour training image as read -> :func:`hed_jitter` -> the
    network's input, made the way the cache made the unjittered one (``to_input``, e.g.
    :func:`~.readers.network_input` with the run's channels, ``--normalize`` and size).

    Why here and not in :class:`Augment`: the cache stores the network input, already
    converted to the model's channels and normalized (``--normalize auto`` with
    ``--channels 1``: a grey, inverted, stretched image), so the stain is gone by the time
    the transform sees it. The jitter therefore acts on the image as read (kept aside for
    the colour images, :attr:`~.dataset.SegmentationDataset.colour`), before the
    normalization, as a differently stained slide arrives at bin/predict; and on the
    whole image before the crop, since the percentile stretch is per whole image in
    prediction too.

    Call as ``jitter(rgb, rng) -> image`` (what the cache holds for that sample, jittered).
    """

    sigma: float
    to_input: Callable

    def __call__(self, rgb, rng):
        return self.to_input(hed_jitter(rgb, rng, self.sigma))

    def __repr__(self):
        return 'StainJitter(sigma=%g)' % self.sigma


def make_transform(augment=True, elastic=False, crop=0, flip=True, rot90=True, scale=(0.8, 1.25),
                   intensity=True, paste=0.0):
    """The transform for :class:`~gluon_unet.data.SegmentationDataset`.

    Parameters
    ----------
    augment : bool
        Random flips, rotations, scale and intensity (``--augment``); False keeps only
        the crop (if any).
    elastic : bool
        Add elastic deformation (``--elastic``).
    crop : int
        Random ``crop`` x ``crop`` crops at native resolution (``--crop``); 0 = none.
    scale : (float, float) or None
        Zoom factor range (``--scale-aug``), see :class:`Augment`.
    flip, rot90, intensity
        Switch single augmentations off (see :class:`Augment`).
    paste : float
        ``--paste-rate``: the share of crops with nuclei pasted against others.

    Returns
    -------
    Augment or None
        None when there is nothing to do (no augmentation, no crop).
    """
    if not augment:
        if not crop and not elastic:
            return None
        return Augment(crop=crop, flip=False, rot90=False, scale=None, intensity=False, elastic=elastic)
    return Augment(crop=crop, flip=flip, rot90=rot90, scale=scale, intensity=intensity, elastic=elastic,
                   paste=paste)
