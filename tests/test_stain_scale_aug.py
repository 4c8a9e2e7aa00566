"""--stain-jitter (HED jitter of colour training images, before --normalize) and
--scale-aug (the zoom range of --augment)."""
import dataclasses
import os

import cv2
import numpy as np
import pytest

from gluon_unet.config import TrainConfig
from gluon_unet.data.augment import hed_jitter
from gluon_unet.data.prepare import attach_transforms, build_datasets
from gluon_unet.errors import UserError


def _tissue(size=40, seed=0):
    """An H&E-like RGB uint8 image: purple discs on pink tissue, and their labels."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    img = np.empty((size, size, 3), np.float32)
    img[:] = (230, 170, 200)  # eosin pink
    labels = np.zeros((size, size), np.int32)
    for k, (cy, cx) in enumerate(((12, 12), (26, 28)), start=1):
        disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= 36
        img[disc] = (110, 70, 160)  # hematoxylin purple
        labels[disc] = k
    img += rng.normal(0, 4, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8), labels


def test_hed_jitter_changes_colour_reproducibly_and_zero_gives_the_image_back():
    img, _ = _tissue()
    out = hed_jitter(img, np.random.default_rng(3), 0.1)
    assert out.shape == img.shape and out.dtype == np.uint8
    assert np.abs(out.astype(int) - img).mean() > 2  # the stain changed
    np.testing.assert_array_equal(out, hed_jitter(img, np.random.default_rng(3), 0.1))  # seeded
    assert not np.array_equal(out, hed_jitter(img, np.random.default_rng(4), 0.1))
    np.testing.assert_array_equal(hed_jitter(img, np.random.default_rng(3), 0.0), img)


@pytest.mark.parametrize('grey', [np.full((8, 8, 1), 90, np.uint8), np.full((8, 8, 3), 90, np.uint8)])
def test_hed_jitter_leaves_grey_images_and_the_generator_alone(grey):
    rng = np.random.default_rng(5)
    assert hed_jitter(grey, rng, 0.2) is grey
    assert rng.random() == np.random.default_rng(5).random()  # nothing drawn


def _write(folder, name, image, labels):
    for sub in ('images', 'masks'):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    cv2.imwrite(os.path.join(folder, 'images', name + '.png'), image[..., ::-1] if image.ndim == 3 else image)
    cv2.imwrite(os.path.join(folder, 'masks', name + '.png'), ((labels > 0) * 255).astype(np.uint8))


@pytest.mark.parametrize('crop', [0, 32])
def test_stain_jitter_acts_on_colour_training_images_before_the_normalization(tmp_path, crop):
    colour, labels = _tissue(seed=1)
    grey = cv2.cvtColor(_tissue(seed=2)[0], cv2.COLOR_RGB2GRAY)
    _write(str(tmp_path / 'd'), 'a_colour', colour, labels)
    _write(str(tmp_path / 'd'), 'b_grey', grey, labels)
    cfg = TrainConfig(data=str(tmp_path / 'd' / 'images'), masks=str(tmp_path / 'd' / 'masks'), val_split=0,
                      size=32, crop=crop, workers=0, progress=False, cache_dir=str(tmp_path / 'cache'),
                      normalize='auto', denoise=0.0, stain_jitter=0.2, augment=False)
    cfg.model.in_channels, cfg.model.depth = 1, 2
    train, _ = build_datasets(cfg.validate())
    attach_transforms(cfg, train, None)
    assert [c is not None for c in train.colour] == [True, False]
    # With no jitter, the stain's path remakes exactly what the cache holds: the same
    # channels, normalization and size as the colour image's cached input.
    still = dataclasses.replace(train.stain, sigma=0.0)
    np.testing.assert_array_equal(still(train.colour[0], np.random.default_rng(0)), train.images[0])
    # The grey image is untouched; the colour one changes, the same way for the same seed.
    jittered = [train[(i, seed)][0] for i, seed in ((0, 7), (0, 7), (0, 8), (1, 7))]
    stain, train.stain = train.stain, None
    plain = [train[(i, 7)][0] for i in (0, 1)]
    train.stain = stain
    for x in jittered:
        assert x.shape == (1, 32, 32) and x.dtype == np.float32 and np.isfinite(x).all()
    np.testing.assert_array_equal(jittered[0], jittered[1])
    assert not np.array_equal(jittered[0], jittered[2])
    assert not np.array_equal(jittered[0], plain[0])
    np.testing.assert_array_equal(jittered[3], plain[1])


def test_scale_aug_sets_the_zoom_range_of_the_augmentation(tiny):
    from gluon_unet.data.synthetic import synthetic_dataset
    ds = synthetic_dataset(2, 32, channels=1, seed=0)
    attach_transforms(tiny(augment=True, scale_aug='0.5,2.0'), ds, None)
    assert ds.transform.scale == (0.5, 2.0)
    attach_transforms(tiny(augment=True), ds, None)
    assert ds.transform.scale == (0.8, 1.25)  # the range before the flag existed


@pytest.mark.parametrize('overrides, flag', [
    ({'scale_aug': '2,1'}, '--scale-aug'), ({'scale_aug': '0,1'}, '--scale-aug'),
    ({'scale_aug': '0.5'}, '--scale-aug'), ({'scale_aug': 'a,b'}, '--scale-aug'),
    ({'scale_aug': 'nan,2'}, '--scale-aug'), ({'scale_aug': '0.5,inf'}, '--scale-aug'),
    ({'scale_aug': '0.5,1,2'}, '--scale-aug'),
    ({'stain_jitter': 1.0}, '--stain-jitter'), ({'stain_jitter': -0.1}, '--stain-jitter'),
    ({'stain_jitter': float('nan')}, '--stain-jitter')])
def test_bad_values_are_a_one_line_error_naming_the_flag(tiny, overrides, flag):
    with pytest.raises(UserError) as e:
        tiny(**overrides).validate()
    assert flag in str(e.value) and '\n' not in str(e.value)
