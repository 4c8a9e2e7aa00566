"""Nucleus size (issue 13 item 5): the training diameter in the export, and
bin/predict --diameter N|auto rescaling each image to it and mapping the result back."""
import json
import os
import subprocess
import sys

import cv2
import numpy as np
import pytest

from conftest import BRIGHTNESS_SIDECAR, export_brightness_model
from gluon_unet.data import sizes
from gluon_unet.inference import batched as inference, scale
from gluon_unet.training.loop import fit
from gluon_unet.inference.predict import predict_paths
from hang import HANG_SECONDS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))

BAD_DIAMETER = "--diameter must be 'none', 'auto', 'range' or a finite positive"


def _discs(shape, centres, r):
    yy, xx = np.mgrid[:shape[0], :shape[1]]
    labels = np.zeros(shape, np.int32)
    for k, (cy, cx) in enumerate(centres, start=1):
        labels[(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = k
    return labels


def test_diameters_of_discs_and_a_typical_size_that_specks_do_not_outvote():
    big = _discs((200, 200), [(40, 40), (40, 150), (150, 40), (150, 150), (100, 100)], 20)
    d = sizes.object_diameters(big)
    assert len(d) == 5 and np.allclose(d, 40, atol=1.0)
    assert abs(sizes.nucleus_sizes([big, _discs((60, 60), [(30, 30)], 5)])[0] - 40) < 1
    assert sizes.nucleus_sizes([np.zeros((8, 8), np.int32)]) == (None, None)
    noisy = big.copy()
    for k, (y, x) in enumerate(np.random.default_rng(0).integers(0, 200, size=(30, 2)), start=10):
        if noisy[y, x] == 0:
            noisy[y, x] = k  # 1-pixel specks: the plain median would say ~1 px
    assert np.median(sizes.object_diameters(noisy)) < 5
    assert abs(scale.estimate_diameter(noisy) - 40) < 1
    assert scale.estimate_diameter(_discs((50, 50), [(25, 25)], 10)) is None  # one object: too little


def test_rescale_factor_tolerance_and_limits():
    assert scale.rescale_factor(30, 31) == 1.0 and scale.rescale_factor(30, 27) == 1.0
    assert scale.rescale_factor(30, 60) == 0.5 and scale.rescale_factor(30, 15) == 2.0
    assert scale.rescale_factor(30, 1000) == 0.25 and scale.rescale_factor(30, 1) == 4.0
    assert scale.rescale_factor(None, 40) == 1.0 and scale.rescale_factor(30, None) == 1.0


def test_training_records_the_median_diameter_in_the_export(tiny):
    run = fit(tiny(crop=32, size=32, epochs=1, predict_diameter='range'), verbose=False)
    with open(os.path.join(run.output, 'export', 'model.json')) as f:
        meta = json.load(f)
    from gluon_unet.data.synthetic import synthetic_dataset
    from gluon_unet.data.dataset import split_indices
    full = synthetic_dataset(24, 32, channels=1, seed=0)
    train_idx, _ = split_indices(24, 0.1, 0)
    expected = sizes.nucleus_sizes(full.instances(i) for i in train_idx)[0]
    assert meta['diameter'] == pytest.approx(expected) and 3 < expected < 20
    # generated nuclei have no image kind: one range, over every nucleus
    assert list(meta['diameter_ranges']) == ['all'] and meta['predict_diameter'] == 'range'
    low, high = meta['diameter_ranges']['all']
    assert low < expected < high


@pytest.mark.parametrize('argv, words', [
    (['--predict-diameter', 'big'], '--predict-' + BAD_DIAMETER[2:]),
    (['--predict-diameter', '-4'], '--predict-' + BAD_DIAMETER[2:]),
    (['--predict-diameter', 'range', '--crop', '0'], '--predict-diameter range needs training at native resolution'),
])
def test_bad_predict_diameter_is_one_line(tmp_path, argv, words):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'train'), '--output', str(tmp_path / 'run'),
                           '--epochs', '1', '--no-progress', '--crop', '32'] + argv,
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / 'run')


@pytest.fixture
def big_nuclei(tmp_path, monkeypatch):
    """A fluorescence image of five nuclei 40 px across (``tmp_path/big.png``), its labels,
    and the list that every network input's shape is appended to."""
    labels = _discs((200, 200), [(40, 40), (40, 150), (150, 40), (150, 150), (100, 100)], 20)
    cv2.imwrite(str(tmp_path / 'big.png'), np.where(labels > 0, 220, 30).astype(np.uint8))
    seen = []
    real = inference.LoadedModel.image_jobs
    monkeypatch.setattr(inference.LoadedModel, 'image_jobs',
                        lambda self, image, *a, **k: seen.append(image.shape) or real(self, image, *a, **k))
    return labels, seen


def _crop_model(folder, diameter=10.0, **extra):
    return export_brightness_model(folder, dict(BRIGHTNESS_SIDECAR, resize_mode='crop', diameter=diameter, **extra))


@pytest.mark.parametrize('diameter', ['40', 'auto'])
def test_predict_rescales_to_the_model_diameter_and_maps_back(tmp_path, big_nuclei, diameter):
    model = _crop_model(str(tmp_path / 'model'))
    labels, seen = big_nuclei
    plain = predict_paths(model, str(tmp_path / 'big.png'), str(tmp_path / 'plain'), progress=False)
    assert seen == [(200, 200, 1)] and 'scale' not in plain[0]
    seen.clear()
    got = predict_paths(model, str(tmp_path / 'big.png'), str(tmp_path / 'scaled'), progress=False,
                        diameter=diameter)
    # nuclei of 40 px shown to a model trained on 10 px ones: the image at a quarter of its size
    assert seen == [(50, 50, 1)] and got[0]['scale'] == 0.25 and abs(got[0]['diameter'] - 40) < 1
    out = cv2.imread(got[0]['labels'], cv2.IMREAD_UNCHANGED)
    assert out.shape == (200, 200) and out.max() == 5
    assert (out > 0).sum() == pytest.approx((labels > 0).sum(), rel=0.05)
    # nuclei already at the model's size are left alone
    seen.clear()
    predict_paths(model, str(tmp_path / 'big.png'), str(tmp_path / 'same'), progress=False, diameter='11')
    assert seen == [(200, 200, 1)]


@pytest.mark.parametrize('sidecar, argv, words', [
    ({'resize_mode': 'crop', 'diameter': 10.0}, ['--diameter', '0'], BAD_DIAMETER),
    ({'resize_mode': 'crop', 'diameter': 10.0}, ['--diameter', 'big'], BAD_DIAMETER),
    ({'resize_mode': 'crop', 'diameter': 10.0}, ['--diameter', 'inf'], BAD_DIAMETER),
    ({'resize_mode': 'crop'}, ['--diameter', 'auto'], '--diameter: the model does not record'),
    ({'resize_mode': 'resize', 'diameter': 10.0}, ['--diameter', '20'], '--diameter: this model was trained on images'),
    ({'resize_mode': 'crop', 'diameter': -3}, [], "'diameter' must be a finite positive number"),
    ({'resize_mode': 'crop', 'diameter': float('inf')}, [], "'diameter' must be a finite positive number"),
    ({'resize_mode': 'crop', 'diameter': 10.0}, ['--diameter', 'range'], 'per kind of image'),
    ({'resize_mode': 'crop', 'diameter': 10.0, 'predict_diameter': 'range'}, [],
     "--diameter (the model's default, range): the model does not record"),
    ({'resize_mode': 'crop', 'diameter': 10.0, 'predict_diameter': 'big'}, [], "'predict_diameter' must be"),
    ({'resize_mode': 'crop', 'diameter': 10.0, 'diameter_ranges': {'colour': [5, 9]}}, [],
     "'diameter_ranges' must map 'all'"),
    ({'resize_mode': 'crop', 'diameter': 10.0, 'diameter_ranges': {'all': [9, 5]}}, [],
     "'diameter_ranges' must map 'all'"),
])
def test_bad_diameter_use_is_one_line(tmp_path, sidecar, argv, words):
    model = export_brightness_model(str(tmp_path / 'model'), dict(BRIGHTNESS_SIDECAR, **sidecar))
    cv2.imwrite(str(tmp_path / 'a.png'), np.zeros((40, 40), np.uint8))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'predict'), '--model', model, '--input',
                           str(tmp_path / 'a.png'), '--output', str(tmp_path / 'out'), '--no-progress'] + argv,
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / 'out')


def test_nucleus_sizes_give_each_kind_its_range_and_all_of_them():
    small = [_discs((100, 100), [(20, 20), (20, 70), (70, 20), (70, 70)], 5)] * 15  # 60 nuclei of ~10 px
    large = [_discs((200, 200), [(50, 50), (50, 150), (150, 50), (150, 150)], 20)] * 15  # 60 of ~40 px
    few = [_discs((60, 60), [(30, 30)], 10)]  # one nucleus of a kind: too few for a range of its own
    median, ranges = sizes.nucleus_sizes(small + large + few, ['fluorescence'] * 15 + ['colour'] * 15 + ['brightfield'])
    assert set(ranges) == {'all', 'fluorescence', 'colour'}
    assert 9 < ranges['fluorescence'][0] <= ranges['fluorescence'][1] < 12
    assert 39 < ranges['colour'][0] <= ranges['colour'][1] < 42
    assert ranges['all'][0] < 12 and ranges['all'][1] > 39 and 9 < median < 42
    assert sizes.nucleus_sizes(small, None)[1].keys() == {'all'}  # kinds unknown: one range


def test_range_enlarges_always_and_shrinks_only_sizes_a_kind_was_not_trained_on():
    ranges = {'all': [8.0, 45.0], 'fluorescence': [8.0, 45.0], 'colour': [9.0, 25.0]}
    assert scale.range_factor(16, ranges, 'fluorescence', 40) == 1.0  # seen: native resolution
    assert scale.range_factor(16, ranges, 'colour', 40) == pytest.approx(0.4)  # large tissue: to the median
    assert scale.range_factor(16, ranges, 'brightfield', 40) == 1.0  # a kind never seen: every nucleus
    assert scale.range_factor(16, ranges, 'brightfield', 60) == pytest.approx(16 / 60)
    # up to 15 % above the range: close enough to what it saw (and to the measurement's error)
    assert scale.range_factor(16, ranges, 'colour', 28) == 1.0
    assert scale.range_factor(16, ranges, 'colour', 29) == pytest.approx(16 / 29)
    # smaller than the median: enlarged as by auto, seen or not (within auto's 15 % nothing)
    assert scale.range_factor(16, ranges, 'fluorescence', 10) == pytest.approx(1.6)
    assert scale.range_factor(16, ranges, 'colour', 6) == pytest.approx(16 / 6)
    assert scale.range_factor(16, ranges, 'colour', 14.5) == 1.0
    assert scale.range_factor(16, ranges, 'colour', None) == 1.0  # too few objects to measure
    assert scale.range_factor(16, None, 'colour', 40) == 1.0 and scale.range_factor(16, None, 'colour', 8) == 2.0


def _ranged_model(folder, ranges, **extra):
    return _crop_model(folder, diameter=10.0, diameter_ranges=ranges, **extra)


@pytest.mark.parametrize('ranges, scaled', [({'all': [30.0, 50.0]}, False), ({'all': [5.0, 12.0]}, True),
                                            ({'all': [30.0, 50.0], 'fluorescence': [5.0, 12.0]}, True)])
def test_predict_range_rescales_an_image_only_outside_its_kinds_sizes(tmp_path, big_nuclei, ranges, scaled):
    model = _ranged_model(str(tmp_path / 'model'), ranges)
    _, seen = big_nuclei
    got = predict_paths(model, str(tmp_path / 'big.png'), str(tmp_path / 'out'), progress=False, diameter='range')
    # the first pass measures 40 px nuclei; the second is at a quarter of the size only when
    # 40 px is outside what the model saw of fluorescence
    assert seen[-1] == ((50, 50, 1) if scaled else (200, 200, 1)) and got[0]['scale'] == (0.25 if scaled else 1.0)
    out = cv2.imread(got[0]['labels'], cv2.IMREAD_UNCHANGED)
    assert out.shape == (200, 200) and out.max() == 5


def test_the_models_default_diameter_applies_unless_the_flag_says_otherwise(tmp_path, big_nuclei):
    model = _ranged_model(str(tmp_path / 'model'), {'all': [5.0, 12.0]}, predict_diameter='range')
    _, seen = big_nuclei
    got = predict_paths(model, str(tmp_path / 'big.png'), str(tmp_path / 'default'), progress=False)
    assert seen[-1] == (50, 50, 1) and got[0]['scale'] == 0.25
    seen.clear()
    got = predict_paths(model, str(tmp_path / 'big.png'), str(tmp_path / 'off'), progress=False, diameter='none')
    assert seen == [(200, 200, 1)] and 'scale' not in got[0]
