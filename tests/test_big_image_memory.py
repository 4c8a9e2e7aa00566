"""Issue 16 item 3: the group-by-group distance watershed gives the whole-image result."""
import cv2
import numpy as np
import pytest
from scipy import ndimage as ndi

from gluon_unet.inference import postprocess, watershed
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
    markers = postprocess.h_maxima_markers(dist, mask, h)
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


@pytest.mark.parametrize('seed', range(3))
@pytest.mark.parametrize('kw', [{}, {'h': 2.0, 'smooth': 2.0}])
def test_a_group_as_large_as_the_image_is_solved_in_strips_with_the_same_labels(seed, kw, monkeypatch):
    """Dense images chain every nucleus into one group; it is cut into strips of rows."""
    prob = _prob(seed, reps=(6, 5))  # 768 x 640, ~60 % foreground in touching clusters
    used = []
    real = watershed._Solver.strips
    monkeypatch.setattr(watershed._Solver, 'strips', lambda self, *a: used.append(1) or real(self, *a))
    monkeypatch.setattr(watershed, 'MAX_GROUP_PIXELS', 64 * 64)
    monkeypatch.setattr(watershed, 'STRIP_ROWS', 96)
    new = postprocess.instances_from_prob(prob, **kw)
    assert used  # the strips did run
    assert np.array_equal(new, _whole_image(prob, **kw))


def test_predicting_a_dense_image_holds_a_few_image_sized_arrays_at_most(tmp_path, monkeypatch):
    """Host memory of bin/predict's numpy side (tiles, blending, post-processing, outputs)
    on a dense 1024 px image, counted by tracemalloc (numpy reports its allocations to
    it; the network's MXNet buffers are not counted: they depend on the batch, not the
    image). The whole-image watershed alone needed ~110 bytes a pixel. Strips are made
    small here so that their fixed cost (~110 bytes x MAX_GROUP_PIXELS, 29 MB by
    default) does not hide what grows with the image."""
    import tracemalloc
    from conftest import export_brightness_model
    from gluon_unet.inference.predict import predict_paths

    monkeypatch.setattr(watershed, 'MAX_GROUP_PIXELS', 64 * 64)
    monkeypatch.setattr(watershed, 'STRIP_ROWS', 32)
    model = export_brightness_model(str(tmp_path / 'model'))
    mask = synthetic_nuclei(1, size=128, channels=1, seed=3)[1][0] > 0
    base = cv2.GaussianBlur(np.where(mask, 210, 40).astype(np.uint8), (0, 0), 1.5)
    image = np.tile(base, (8, 8))
    cv2.imwrite(str(tmp_path / 'big.png'), image)
    predict_paths(model, str(tmp_path / 'big.png'), str(tmp_path / 'warm'), progress=False, mode='whole')
    tracemalloc.start()
    try:
        predict_paths(model, str(tmp_path / 'big.png'), str(tmp_path / 'out'), progress=False, mode='tile')
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    labels = cv2.imread(str(tmp_path / 'out' / 'big_labels.png'), cv2.IMREAD_UNCHANGED)
    assert labels.max() > 500  # a dense image, many nuclei
    assert peak / image.size < 40, '%.1f bytes per pixel' % (peak / image.size)
