"""--normalize (per-image input normalization in training and bin/predict) and --split."""
import json
import os

import cv2
import mxnet as mx
import numpy as np
import pytest

from gluon_unet.cli import predict_main
from gluon_unet.config import TrainConfig
from gluon_unet.data import load_dataset
from gluon_unet.data.io import BRIGHT_BACKGROUND, normalize_image
from gluon_unet.errors import UserError
from gluon_unet.inference.predict import predict_paths


def _discs(size=48, centres=((16, 16), (34, 30)), r=7, fg=200, bg=30):
    """Grey uint8 image (H, W, 1) with bright discs on a dark background, and the labels."""
    yy, xx = np.mgrid[:size, :size]
    img = np.full((size, size), bg, np.uint8)
    labels = np.zeros((size, size), np.int32)
    for k, (cy, cx) in enumerate(centres, start=1):
        disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
        img[disc] = fg
        labels[disc] = k
    return img[..., None], labels


def test_invert_turns_a_bright_background_dark_and_leaves_dark_ones_alone():
    dark, _ = _discs(fg=200, bg=30)
    bright = 255 - dark  # brightfield-like: dark nuclei on a light background
    assert np.array_equal(normalize_image(dark, 'invert'), dark)
    assert np.array_equal(normalize_image(bright, 'invert'), dark)
    # the cut is the documented median, not mid-grey: a background of 100 (H&E-like) flips
    tissue = np.where(dark > 100, 40, BRIGHT_BACKGROUND + 20).astype(np.uint8)
    assert normalize_image(tissue, 'invert')[0, 0, 0] == 255 - BRIGHT_BACKGROUND - 20
    assert normalize_image(dark, 'none') is dark


def test_percentile_stretch_maps_a_dim_image_to_the_full_range_and_keeps_colour_balance():
    rng = np.random.RandomState(0)
    dim = rng.randint(10, 61, size=(40, 40, 3)).astype(np.uint8)
    dim[..., 1] //= 2  # a colour cast that a shared scale must keep
    out = normalize_image(dim, 'percentile')
    assert out.dtype == np.uint8 and out.shape == dim.shape
    assert out.min() == 0 and out.max() == 255
    assert np.percentile(out, 50) > np.percentile(dim, 50)
    assert out[..., 1].mean() < out[..., 0].mean() - 20
    # constant images stay as they are (no division by zero)
    flat = np.full((8, 8, 1), 177, np.uint8)  # bright: inverted, then left unscaled
    assert np.array_equal(normalize_image(flat, 'auto'), 255 - flat)


def test_auto_makes_brightfield_and_fluorescence_versions_of_an_image_identical():
    dark, _ = _discs(fg=120, bg=20)
    bright = 255 - dark
    a, b = normalize_image(dark, 'auto'), normalize_image(bright, 'auto')
    assert np.array_equal(a, b)
    assert a[16, 16, 0] == 255 and a[0, 0, 0] == 0


def test_bad_mode_is_a_user_error_naming_the_flag():
    with pytest.raises(UserError, match='--normalize'):
        normalize_image(np.zeros((4, 4, 1), np.uint8), 'zscore')
    with pytest.raises(UserError, match='--normalize'):
        TrainConfig(normalize='zscore').validate()


def _write_pair(folder, name, image, labels):
    os.makedirs(os.path.join(folder, 'images'), exist_ok=True)
    os.makedirs(os.path.join(folder, 'masks'), exist_ok=True)
    cv2.imwrite(os.path.join(folder, 'images', name + '.png'), image)
    cv2.imwrite(os.path.join(folder, 'masks', name + '.png'), ((labels > 0) * 255).astype(np.uint8))


def test_load_dataset_normalizes_before_caching_and_keys_the_cache_on_it(tmp_path):
    dark, labels = _discs(size=32, centres=((10, 10),), r=5)
    _write_pair(str(tmp_path / 'd'), 'a', 255 - dark[..., 0], labels)
    cache = str(tmp_path / 'cache')
    kw = dict(size=32, channels=1, workers=0, progress=False, cache_dir=cache)
    raw = load_dataset(str(tmp_path / 'd' / 'images'), str(tmp_path / 'd' / 'masks'), **kw)
    inv = load_dataset(str(tmp_path / 'd' / 'images'), str(tmp_path / 'd' / 'masks'), normalize='invert', **kw)
    assert raw.images[0][10, 10, 0] == 55 and raw.images[0][0, 0, 0] == 225
    assert inv.images[0][10, 10, 0] == 200 and inv.images[0][0, 0, 0] == 30
    assert len(os.listdir(cache)) >= 2  # two entries, not one overwritten
    with pytest.raises(UserError, match='--normalize'):
        load_dataset(str(tmp_path / 'd' / 'images'), str(tmp_path / 'd' / 'masks'), normalize='x', **kw)


def _brightness_export(folder, normalize):
    """1x1 conv: probability > 0.5 where the (normalized) input is brighter than ~0.5."""
    net = mx.gluon.nn.Conv2D(1, 1, in_channels=1)
    net.initialize(mx.init.Constant(20.0))
    net.bias.set_data(mx.nd.array([-10.0]))
    net.hybridize()
    net(mx.nd.zeros((1, 1, 16, 16)))
    os.makedirs(folder, exist_ok=True)
    net.export(os.path.join(folder, 'model'), epoch=0)
    with open(os.path.join(folder, 'model.json'), 'w') as f:
        json.dump({'in_channels': 1, 'classes': 1, 'multiple': 4, 'train_size': 16, 'resize_mode': 'crop',
                   'threshold': 0.5, 'normalize': normalize}, f)
    return folder


def test_predict_applies_the_models_normalization_to_brightfield_images(tmp_path):
    dark, labels = _discs()
    path = str(tmp_path / 'bf.png')
    cv2.imwrite(path, 255 - dark[..., 0])  # dark nuclei on a bright background
    for normalize, expect_fg in (('invert', labels > 0), ('none', labels == 0)):
        out = str(tmp_path / ('out_' + normalize))
        predict_paths(_brightness_export(str(tmp_path / normalize), normalize), path, out, mode='whole',
                      progress=False)
        mask = cv2.imread(os.path.join(out, 'bf_mask.png'), cv2.IMREAD_UNCHANGED) > 0
        assert np.array_equal(mask, expect_fg), normalize
    # the overlay is drawn on the image as stored, not on the network's input
    out = str(tmp_path / 'ov')
    predict_paths(str(tmp_path / 'invert'), path, out, mode='whole', overlay=True, progress=False)
    ov = cv2.imread(os.path.join(out, 'bf_overlay.png'))
    assert ov[0, 0].min() > 200
    # ... and in colour when the file has colour, although the model sees grey
    colour = np.dstack([255 - dark[..., 0], 255 - dark[..., 0] // 2, np.full(dark.shape[:2], 250, np.uint8)])
    cv2.imwrite(str(tmp_path / 'he.png'), colour[..., ::-1])
    predict_paths(str(tmp_path / 'invert'), str(tmp_path / 'he.png'), out, mode='whole', overlay=True,
                  progress=False)
    ov = cv2.imread(os.path.join(out, 'he_overlay.png'))[..., ::-1]
    assert np.array_equal(ov[0, 0], colour[0, 0]) and not np.array_equal(ov[..., 0], ov[..., 2])


def test_predict_split_none_keeps_touching_nuclei_as_one_component(tmp_path):
    touching, _ = _discs(centres=((24, 16), (24, 29)), r=7)
    path = str(tmp_path / 't.png')
    cv2.imwrite(path, touching[..., 0])
    model = _brightness_export(str(tmp_path / 'm'), 'none')
    counts = {}
    for split in ('watershed', 'none'):
        out = str(tmp_path / split)
        rec = predict_paths(model, path, out, mode='whole', split=split, progress=False)
        counts[split] = rec[0]['objects']
    assert counts == {'watershed': 2, 'none': 1}
    with pytest.raises(UserError, match='--split'):
        predict_paths(model, path, str(tmp_path / 'bad'), split='kmeans', progress=False)
    assert not os.path.exists(str(tmp_path / 'bad'))
    # the CLI flag reaches predict_paths
    assert predict_main(['--model', model, '--input', path, '--output', str(tmp_path / 'cli'),
                         '--split', 'none', '--mode', 'whole', '--no-progress']) == 0
    labels = cv2.imread(str(tmp_path / 'cli' / 't_labels.png'), cv2.IMREAD_UNCHANGED)
    assert labels.max() == 1
