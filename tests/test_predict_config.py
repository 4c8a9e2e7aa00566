"""The inference split: tiling geometry without mxnet, PredictConfig, the compatibility
names of gluon_unet.inference.predict."""
import subprocess
import sys

import numpy as np
import pytest

from gluon_unet.errors import UserError
from gluon_unet.inference.predict import PredictConfig, predict_paths
from gluon_unet.inference.tiling import padding_to_multiple, plan_image
from hang import HANG_SECONDS


def test_tiling_is_pure_numpy():
    code = 'import sys, gluon_unet.inference.tiling; assert "mxnet" not in sys.modules'
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize('length, multiple, margin, at_least, expected', [
    (30, 4, 0, 0, 2), (32, 4, 0, 0, 0), (30, 4, 4, 32, 10), (10, 4, 0, 32, 22), (70, 8, 8, 32, 18)])
def test_padding_to_multiple(length, multiple, margin, at_least, expected):
    pad = padding_to_multiple(length, multiple, margin, at_least)
    assert pad == expected and pad >= 2 * margin and (length + pad - at_least) % multiple == 0


def test_window_plans_align_to_the_pooling_grid_and_cover_the_image():
    meta = {'train_size': 32, 'multiple': 8, 'resize_mode': 'resize'}
    image = np.random.default_rng(0).integers(0, 255, (70, 45), dtype=np.uint8)
    whole = plan_image(image, meta, 'whole')
    assert whole.corners == [(0, 0)] and whole.tile == (72, 48) and whole.weight == 1.0
    assert whole.source.dtype == np.uint8  # a quarter of float32's memory on large images
    (_, _, window), = whole.windows()
    assert window.dtype == np.float32 and np.array_equal(whole.to_image(window[0]), image / np.float32(255))
    tiles = plan_image(image, meta, 'tile', overlap=0.25)
    assert tiles.tile == (32, 32) and len(tiles.corners) > 1 and tiles.weight.shape == (32, 32)
    assert all(y % 8 == 0 and x % 8 == 0 for y, x in tiles.corners)
    covered = np.zeros(tiles.source.shape[1:], bool)
    for y, x, window in tiles.windows():
        assert window.shape == (1, 32, 32)
        covered[y:y + 32, x:x + 32] = True
    assert covered.all() and tiles.to_image(covered).shape == (70, 45)
    resized = plan_image(image[:20, :20], meta, 'auto')
    assert resized.mode == 'resize' and resized.source.shape == (1, 32, 32)
    assert resized.to_image(np.zeros((32, 32), np.float32)).shape == (20, 20)


@pytest.mark.parametrize('field, value, flag', [
    ('mode', 'x', '--mode'), ('batch_size', 0, '--batch-size'), ('overlap', 1.0, '--overlap'),
    ('threshold', 1.5, '--threshold'), ('min_size', -1, '--min-size'), ('split', 'kmeans', '--split'),
    ('h', 0.0, '--h'), ('h', float('inf'), '--h'), ('h', float('nan'), '--h'),
    ('markers', 'centres', '--markers'), ('min_score', 1.0, '--min-score'), ('min_score', -0.1, '--min-score')])
def test_predict_config_names_the_flag(tmp_path, field, value, flag):
    with pytest.raises(UserError, match='^%s ' % flag):
        PredictConfig(**{field: value}).validate()
    with pytest.raises(UserError, match='^%s ' % flag):  # before any file is looked at
        predict_paths(str(tmp_path / 'no-model'), str(tmp_path / 'no-input'), str(tmp_path / 'out'),
                      PredictConfig(cpus=2), **{field: value})
    assert not (tmp_path / 'out').exists()


def test_predict_paths_overrides_apply_to_a_copy_and_unknown_ones_fail(tmp_path):
    base = PredictConfig(cpus=2)
    with pytest.raises(UserError, match='--input .*no such file'):
        predict_paths('m', str(tmp_path / 'nope'), str(tmp_path / 'out'), base, overlay=True)
    assert base == PredictConfig(cpus=2)
    with pytest.raises(TypeError):
        predict_paths('m', str(tmp_path), str(tmp_path / 'out'), colour=True)


def test_bin_predict_whole_mode_spreads_images_over_the_devices_and_buckets_keep_masks(tmp_path, capsys):
    import cv2
    from conftest import export_brightness_model, nuclei_png
    from gluon_unet.cli import predict_main as main

    model = export_brightness_model(str(tmp_path / 'model'))
    (tmp_path / 'in').mkdir()
    for i, (h, w) in enumerate(((40, 36), (28, 44), (37, 37), (44, 30), (39, 41))):
        png = cv2.imdecode(np.frombuffer(nuclei_png(i, size=48), np.uint8), cv2.IMREAD_UNCHANGED)
        cv2.imwrite(str(tmp_path / 'in' / ('i%d.png' % i)), png[:h, :w])
    masks = {}
    for flags in ([], ['--buckets']):
        out = tmp_path / ('out' + ''.join(flags))
        assert main(['--model', model, '--input', str(tmp_path / 'in'), '--output', str(out), '--mode', 'whole',
                     '--cpus', '2', '--tta'] + flags) == 0
        summary = capsys.readouterr().out
        # 5 images x 8 TTA inputs, in batches of one shape split over both devices (the
        # old code sent them all, alternating shapes one input at a time, to cpu(0))
        assert '[cpu(0) 20 inputs, cpu(1) 20 inputs]' in summary, summary
        masks[bool(flags)] = [cv2.imread(str(out / ('i%d_mask.png' % i)), cv2.IMREAD_UNCHANGED) for i in range(5)]
    # a 1x1 convolution sees no context: padding more changes nothing
    assert all(np.array_equal(a, b) for a, b in zip(masks[False], masks[True]))
