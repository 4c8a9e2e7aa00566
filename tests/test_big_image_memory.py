"""Issue 16 item 3: the group-by-group distance watershed gives the whole-image result."""
import cv2
import numpy as np
import pytest
from scipy import ndimage as ndi

from gluon_unet import postprocess
from gluon_unet.data.synthetic import synthetic_nuclei


def _whole_image(prob, threshold=0.5, min_size=0, h=0.5, smooth=1.0):
    """The computation before this change, on the whole image at once."""
    from skimage.measure import label
    from skimage.segmentation import relabel_sequential, watershed
    mask = prob > threshold
    comps = label(mask, connectivity=1)
    if min_size > 0 and comps.max() > 0:
        sizes = np.bincount(comps.ravel())
        small = sizes < min_size
        small[0] = False
        mask &= ~small[comps]
    dist = ndi.gaussian_filter(ndi.distance_transform_edt(mask), smooth)
    markers = postprocess._h_maxima_markers(dist, mask, h)
    labels = watershed(-dist, markers, mask=mask)
    orphan = mask & (labels == 0)
    if orphan.any():
        extra = label(orphan, connectivity=1)
        labels[orphan] = extra[orphan] + labels.max()
    return relabel_sequential(labels)[0].astype(np.int32)


def _prob(seed, reps=(2, 3)):
    mask = synthetic_nuclei(1, size=128, seed=seed)[1][0] > 0
    noise = np.random.default_rng(seed).normal(0, 0.05, mask.shape).astype(np.float32)
    prob = cv2.GaussianBlur(np.where(mask, 0.9, 0.1).astype(np.float32), (0, 0), 1.5) + noise
    return np.tile(prob, reps)


def _same_partition(a, b):
    """One-to-one mapping between the label ids of a and b."""
    pairs = np.unique(np.stack([a.ravel(), b.ravel()]), axis=1)
    return len(np.unique(pairs[0])) == len(np.unique(pairs[1])) == pairs.shape[1]


@pytest.mark.parametrize('seed', range(4))
@pytest.mark.parametrize('kw', [{}, {'min_size': 16}, {'h': 2.0}, {'h': 40.0}, {'threshold': 0.8},
                                {'smooth': 2.0}])
def test_grouped_watershed_equals_whole_image(seed, kw):
    prob = _prob(seed)
    new = postprocess.instances_from_prob(prob, **kw)
    old = _whole_image(prob, **kw)
    assert _same_partition(old, new)
    assert new.dtype == np.int32 and np.array_equal(old, new)  # label numbers too


def test_objects_at_the_image_border_and_single_pixels():
    prob = np.zeros((40, 50), np.float32)
    prob[0:6, 0:9] = prob[30:40, 44:50] = prob[20, 20] = prob[21, 21] = 0.9
    prob[10:18, 10:30] = 0.9  # two touching squares
    prob[12:16, 18:22] = 0.9
    assert np.array_equal(postprocess.instances_from_prob(prob), _whole_image(prob))
