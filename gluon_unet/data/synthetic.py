"""Generated nuclei: the built-in demo data and the test fixture.

Each image holds ellipses of varied size, shape and brightness on a noisy, unevenly lit
background, blurred like an out-of-focus microscope. Masks are the exact ellipses, so
the ground truth is known; some nuclei touch, so instance separation has work to do.
"""
import cv2
import numpy as np

from .dataset import SegmentationDataset


def synthetic_nuclei(count, size=64, channels=1, seed=0, max_nuclei=None):
    """Generate images, masks and instance labels.

    Parameters
    ----------
    count : int
        Number of images.
    size : int
        Side of the square images in pixels.
    channels : int
        1 (grayscale fluorescence) or 3 (the same, tinted).
    seed : int
        Everything is a function of the seed.
    max_nuclei : int, optional
        Upper bound of nuclei per image (default scales with the area).

    Returns
    -------
    images : (count, size, size, channels) uint8
    masks : (count, size, size) uint8 in {0, 1}
    instances : (count, size, size) int32, 0 = background
    """
    rng = np.random.default_rng(seed)
    if max_nuclei is None:
        max_nuclei = max(3, size * size // 400)
    images = np.empty((count, size, size, channels), np.uint8)
    masks = np.empty((count, size, size), np.uint8)
    instances = np.zeros((count, size, size), np.int32)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    for n in range(count):
        signal = np.zeros((size, size), np.float32)
        label = instances[n]
        for k in range(1, rng.integers(1, max_nuclei + 1) + 1):
            r = rng.uniform(0.04, 0.12) * size
            axes = (max(2, int(r * rng.uniform(0.7, 1.3))), max(2, int(r * rng.uniform(0.7, 1.3))))
            center = (int(rng.uniform(0, size)), int(rng.uniform(0, size)))
            blob = np.zeros((size, size), np.uint8)
            cv2.ellipse(blob, center, axes, rng.uniform(0, 180), 0, 360, 1, -1)
            inside = blob > 0
            label[inside] = k  # a later nucleus lies on top of an earlier one
            signal[inside] = rng.uniform(0.35, 1.0)
        # Blur the texture only, not the mask: the boundary stays the exact ellipse.
        signal = cv2.GaussianBlur(signal, (0, 0), rng.uniform(0.5, 1.5))
        light = 0.15 * rng.uniform() * (np.sin(3 * xx + rng.uniform(0, 6)) + 1) * (yy + 0.5)
        img = signal + light + rng.normal(0, rng.uniform(0.02, 0.08), (size, size))
        img = np.clip(img, 0, 1) * 255
        if channels == 3:
            tint = rng.uniform(0.6, 1.0, size=3)
            img = img[..., None] * tint
        images[n] = np.round(img).reshape(size, size, channels).astype(np.uint8)
        # Relabel so ids are consecutive after occlusion removed some nuclei.
        ids = np.unique(label)
        ids = ids[ids > 0]
        remap = np.zeros(label.max() + 1, np.int32)
        remap[ids] = np.arange(1, len(ids) + 1)
        instances[n] = remap[label]
        masks[n] = instances[n] > 0
    return images, masks, instances


def synthetic_dataset(count, size=64, channels=1, seed=0):
    """:func:`synthetic_nuclei` wrapped as a :class:`SegmentationDataset`."""
    images, masks, instances = synthetic_nuclei(count, size, channels, seed)
    return SegmentationDataset(images, masks, instances, names=['synth%05d' % i for i in range(count)])
