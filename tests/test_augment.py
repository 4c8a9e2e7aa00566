"""Augmentation keeps image, mask and instances aligned, and is seeded."""
import numpy as np
import pytest

from gluon_unet.data import Augment, make_transform, synthetic_nuclei


@pytest.fixture(scope='module')
def sample():
    images, masks, instances = synthetic_nuclei(1, size=48, channels=1, seed=11)
    return images[0], masks[0], instances[0]


def _as_image(mask):
    """An image that *is* the mask (0/255), to check alignment after the transform."""
    return (mask * 255).astype(np.uint8)[..., None]


@pytest.mark.parametrize('seed', range(6))
def test_exact_alignment_without_resampling(sample, seed):
    _, mask, inst = sample
    t = Augment(crop=32, scale=None, intensity=False)  # flips, rot90, native crop: exact
    img, m, i = t(_as_image(mask), mask, inst, np.random.default_rng(seed))
    assert img.shape == (32, 32, 1) and m.shape == (32, 32) and i.dtype == np.int32
    np.testing.assert_array_equal(img[..., 0] > 127, m > 0)
    np.testing.assert_array_equal(i > 0, m > 0)


@pytest.mark.parametrize('seed', range(4))
def test_alignment_with_scale_and_elastic(sample, seed):
    _, mask, inst = sample
    t = Augment(scale=(0.7, 1.4), intensity=False, elastic=True)
    img, m, i = t(_as_image(mask), mask, inst, np.random.default_rng(seed))
    assert img.shape == (48, 48, 1)
    # linear vs nearest differ on edge pixels only
    assert ((img[..., 0] > 127) == (m > 0)).mean() > 0.97
    np.testing.assert_array_equal(i > 0, m > 0)  # same nearest mapping: exact
    assert set(np.unique(m)) <= {0, 1}
    # No blended label ids: each is an original or a mirror of one (original + k * max id).
    step = int(inst.max())
    assert set((np.unique(i[i > 0]) - 1) % step + 1) <= set(np.unique(inst[inst > 0]))


@pytest.mark.parametrize('seed', range(3))
def test_elastic_edges_follow_the_image(seed):
    """Where the displacement reaches past the crop's edge, the image shows its mirror;
    the labels must show the same, not background."""
    mask = np.zeros((40, 40), np.uint8)
    mask[:, :12] = 1  # a nucleus cut by the left edge
    inst = mask.astype(np.int32)
    t = Augment(flip=False, rot90=False, scale=None, intensity=False, elastic=True, elastic_alpha=6.0)
    img, m, i = t(_as_image(mask), mask, inst, np.random.default_rng(seed))
    edge = np.s_[:, :3]  # within alpha of the left edge: all mirrored foreground
    assert (img[edge][..., 0] > 127).all()
    np.testing.assert_array_equal(m[edge], 1)
    np.testing.assert_array_equal(i[edge], 1)
    assert ((img[..., 0] > 127) == (m > 0)).mean() > 0.97


def test_transform_changes_something_and_is_reproducible(sample):
    image, mask, inst = sample
    t = make_transform(augment=True, elastic=True)
    a = t(image, mask, inst, np.random.default_rng(5))
    b = t(image, mask, inst, np.random.default_rng(5))
    c = t(image, mask, inst, np.random.default_rng(6))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])
    assert a[0].dtype == np.float32 and 0 <= a[0].min() and a[0].max() <= 1
    assert not np.allclose(a[0], image.astype(np.float32) / 255)


def test_intensity_touches_image_only(sample):
    image, mask, inst = sample
    t = Augment(flip=False, rot90=False, scale=None, intensity=True)
    img, m, i = t(image, mask, inst, np.random.default_rng(1))
    np.testing.assert_array_equal(m, mask)
    np.testing.assert_array_equal(i, inst)
    assert np.abs(img[..., 0] - image[..., 0] / 255.0).max() > 0.01


@pytest.mark.parametrize('seed', range(3))
def test_crop_pads_small_images_and_their_labels_alike(sample, seed):
    _, mask, inst = sample
    t = make_transform(augment=False, crop=64)
    img, m, i = t(_as_image(mask), mask, inst, np.random.default_rng(seed))
    assert img.shape == (64, 64, 1) and m.shape == i.shape == (64, 64)
    # The image is reflected into the border, and the labels with it: a mirrored nucleus
    # is a nucleus (zeros there taught the network that such nuclei are background).
    np.testing.assert_array_equal(img[..., 0] > 127, m > 0)
    np.testing.assert_array_equal(i > 0, m > 0)
    assert m.sum() > mask.sum()
    # The whole image is inside, ids unchanged; every mirrored nucleus has an id of its own.
    rows, cols = np.nonzero(np.isin(i, np.unique(inst[inst > 0])))
    top, left = rows.min() - np.nonzero(inst)[0].min(), cols.min() - np.nonzero(inst)[1].min()
    np.testing.assert_array_equal(i[top:top + 48, left:left + 48], inst)
    outside = i.copy()
    outside[top:top + 48, left:left + 48] = 0
    assert outside.any() and not np.isin(outside[outside > 0], inst).any()


def test_mirrored_nuclei_in_different_borders_get_different_ids():
    from gluon_unet.data.augment import _reflect_instances
    inst = np.zeros((6, 6), np.int32)
    inst[1:5, 1:5] = 1  # one nucleus, mirrored into all 8 borders
    out = _reflect_instances(inst, 12, 12, 3, 3)
    assert out.shape == (12, 12) and out.dtype == np.int32
    np.testing.assert_array_equal(out[3:9, 3:9], inst)
    assert len(np.unique(out[out > 0])) == 9  # the nucleus and 8 mirrors


def test_no_augment_no_crop_is_none():
    assert make_transform(augment=False) is None
    assert make_transform(augment=False, crop=32).flip is False


def test_dataset_with_seeded_transform(sample):
    from gluon_unet.data import SegmentationDataset
    images, masks, instances = synthetic_nuclei(3, size=40, channels=3, seed=2)
    ds = SegmentationDataset(images, masks, instances, transform=make_transform(crop=32))
    x1, y1 = ds[(1, 123)]
    x2, y2 = ds[(1, 123)]
    assert x1.shape == (3, 32, 32) and y1.shape == (1, 32, 32)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
