"""The Data Science Bowl 2018 submission format: run-length encoded objects, one CSV row
each (``ImageId,EncodedPixels``), written by ``bin/predict --rle``."""
import csv
import io

import numpy as np

from ..utils import atomic_open

def rle_encode(mask):
    """Data Science Bowl run-length encoding of one binary mask.

    Pixels are numbered from 1, top to bottom then left to right (column-major), and the
    result is ``'start length start length ...'``; an empty mask gives ``''``.

    Parameters
    ----------
    mask : (H, W) array, nonzero = object
    """
    flat = (np.asarray(mask) > 0).T.ravel()
    padded = np.concatenate([[False], flat, [False]])
    edges = np.flatnonzero(padded[1:] != padded[:-1]) + 1
    starts, ends = edges[0::2], edges[1::2]
    return ' '.join('%d %d' % (s, e - s) for s, e in zip(starts, ends))


def rle_decode(rle, shape):
    """Inverse of :func:`rle_encode`.

    Parameters
    ----------
    rle : str
        ``'start length ...'`` (empty, or NaN as read from a CSV, = no pixel).
    shape : (H, W)

    Returns
    -------
    (H, W) uint8 mask in {0, 1}
    """
    h, w = shape
    flat = np.zeros(h * w, np.uint8)
    if isinstance(rle, str) and rle.strip():
        nums = np.asarray(rle.split(), dtype=np.int64)
        if len(nums) % 2:
            raise ValueError('RLE has an odd number of values')
        starts, lengths = nums[0::2] - 1, nums[1::2]
        if len(starts) and (starts.min() < 0 or (starts + lengths).max() > h * w):
            raise ValueError('RLE runs outside an image of %dx%d pixels' % (h, w))
        for s, n in zip(starts, lengths):
            flat[s:s + n] = 1
    return flat.reshape(w, h).T.copy()


def submission_rows(image_id, labels):
    """Rows ``(image_id, rle)`` of a DSB submission, one per object.

    Objects come from one label image, so they cannot overlap. An image without
    objects still gets one row with an empty ``EncodedPixels``.
    """
    flat = np.asarray(labels).T.ravel()
    # Runs of equal labels in one pass, then grouped by label: avoids one full-image
    # comparison per object, which dominates for images with hundreds of nuclei.
    change = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    starts = np.concatenate([[0], change])
    lengths = np.diff(np.concatenate([starts, [flat.size]]))
    values = flat[starts]
    keep = values != 0
    starts, lengths, values = starts[keep], lengths[keep], values[keep]
    if not len(values):
        return [(image_id, '')]
    order = np.argsort(values, kind='stable')
    starts, lengths, values = starts[order], lengths[order], values[order]
    bounds = np.flatnonzero(np.diff(values)) + 1
    rows = []
    for s, n in zip(np.split(starts, bounds), np.split(lengths, bounds)):
        rows.append((image_id, ' '.join('%d %d' % (a + 1, b) for a, b in zip(s, n))))
    return rows


def write_submission(path, rows):
    """Atomically write DSB submission rows ``(ImageId, EncodedPixels)`` as CSV."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator='\n')
    writer.writerow(('ImageId', 'EncodedPixels'))
    writer.writerows(rows)
    with atomic_open(path, 'wb') as f:
        f.write(text.getvalue().encode())
