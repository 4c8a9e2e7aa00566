"""Pictures for people: an image with its nuclei's outlines drawn (``bin/predict --overlay``
and the demo's predictions)."""
import numpy as np

def overlay(image, labels, color=(255, 255, 0)):
    """The image with each instance's outline drawn, for a person to look at.

    Parameters
    ----------
    image : (H, W), (H, W, 1) or (H, W, 3) uint8 or float
        Floats in [0, 1] are scaled by 255; other floats are clipped to [0, 255].
    labels : (H, W) int
        Instance labels.
    color : (r, g, b)

    Returns
    -------
    (H, W, 3) uint8
    """
    from skimage.segmentation import find_boundaries

    img = np.asarray(image)
    labels = np.asarray(labels)
    if img.ndim == 3 and img.shape[2] == 1:
        img = img[..., 0]
    if img.shape[:2] != labels.shape:
        raise ValueError('image %s and labels %s differ in size' % (img.shape, labels.shape))
    if img.dtype != np.uint8:
        img = img.astype(np.float32)
        if img.size and img.max() <= 1.0:
            img = img * 255
        img = np.clip(img, 0, 255).astype(np.uint8)
    if img.ndim == 2:
        img = np.stack([img] * 3, axis=-1)
    elif img.shape[2] == 4:
        img = img[..., :3]
    out = img.copy()
    out[find_boundaries(labels, mode='inner')] = color
    return out
