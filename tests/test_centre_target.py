"""--target mask+centre: each nucleus' distance to its edge as a second map, its loss, the
watershed from its hill tops, the search over its markers, and the checks on its export
(the dataset's crops and a trained model's export and prediction: test_border_target.py)."""
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from gluon_unet.data.targets import centre_map, make_target
from gluon_unet.errors import UserError
from gluon_unet.training.losses import SegmentationLoss
from gluon_unet.metrics import dsb_image_score
from gluon_unet.inference.postprocess import instances_from_maps, instances_from_prob, settings_text
from gluon_unet.inference.postprocess_search import tune_on_maps
from test_border_target import _touching_pair
from hang import HANG_SECONDS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))


def test_touching_nuclei_get_two_hills_with_a_valley_to_zero_between_them():
    labels = _touching_pair(r=12, dist=6)  # heavy overlap: their union has no neck
    centre = centre_map(labels)
    assert centre.dtype == np.float32 and centre.shape == labels.shape
    assert (centre[labels == 0] == 0).all() and 0 <= centre.min() and centre.max() == 1
    for k in (1, 2):  # each nucleus reaches 1 at its own centre
        assert centre[labels == k].max() == pytest.approx(1.0)
    # The pixels on both sides of the contact are edge: the valley between the hills is 0.
    contact = (labels[:, :-1] != labels[:, 1:]) & (labels[:, :-1] > 0) & (labels[:, 1:] > 0)
    assert contact.any() and (centre[:, :-1][contact] == 0).all() and (centre[:, 1:][contact] == 0).all()
    # Hill tops above one half: one per nucleus, inside it.
    from scipy import ndimage as ndi
    tops, n = ndi.label(centre > 0.5)
    assert n == 2 and {int(labels[tops == k].max()) for k in (1, 2)} == {1, 2}
    # It rises from the edge inwards along the row through the left nucleus' centre.
    left = int(np.flatnonzero(labels[24])[0])
    row = centre[24, left:left + 6]
    assert row[0] == 0 and (np.diff(row) > 0).all()


def test_small_and_large_nuclei_reach_the_same_height_and_a_tiny_one_has_none():
    labels = np.zeros((40, 60), np.int32)
    labels[5:8, 5:8] = 1      # 3x3: only its middle pixel is off the edge
    labels[10:36, 20:50] = 2  # large
    labels[2:4, 40:42] = 3    # 2x2: all edge
    centre = centre_map(labels)
    assert centre[6, 6] == 1 and centre[labels == 1].sum() == 1
    assert centre[labels == 2].max() == 1
    assert (centre[labels == 3] == 0).all()
    assert (centre_map(np.zeros((5, 5), np.int32)) == 0).all()
    with pytest.raises(ValueError):
        centre_map(np.zeros((2, 5, 5), np.int32))


def test_make_target_stacks_the_mask_and_the_centre_map():
    labels = _touching_pair()
    mask = (labels > 0).astype(np.uint8)
    both = make_target(mask, labels, 'mask+centre')
    assert both.shape == (2,) + labels.shape and both.dtype == np.float32
    assert np.array_equal(both[0], mask) and np.array_equal(both[1], centre_map(labels))


def test_the_centre_channel_takes_the_bce_and_no_dice():
    rng = np.random.RandomState(0)
    logits = mx.nd.array(rng.randn(2, 2, 16, 16))
    target = mx.nd.array(np.concatenate([rng.rand(2, 1, 16, 16) > 0.7, rng.rand(2, 1, 16, 16)], axis=1))
    loss = SegmentationLoss('bce_dice', dice_channels=1)(logits, target).asnumpy()
    bce = SegmentationLoss('bce')(logits, target).asnumpy()  # the mean over both channels
    dice = SegmentationLoss('dice')(logits[:, :1], target[:, :1]).asnumpy()
    assert np.allclose(loss, bce + dice, atol=1e-6)
    # The BCE on a soft target is least where the probability equals it.
    level = mx.nd.full((1, 1, 4, 4), 0.3)
    near = [float(SegmentationLoss('bce')(mx.nd.full((1, 1, 4, 4), np.log(p / (1 - p))), level).asscalar())
            for p in (0.2, 0.3, 0.4)]
    assert near[1] < near[0] and near[1] < near[2]
    # The training loss of a mask+centre run is built that way.
    from gluon_unet.config import TrainConfig
    from gluon_unet.training.step import build_network, make_step
    cfg = TrainConfig(epochs=1, cpus=1)
    cfg.model.target, cfg.model.in_channels, cfg.model.width = 'mask+centre', 1, 4
    net = build_network(cfg, [mx.cpu()])
    assert make_step(cfg, net, [mx.cpu()]).loss_fn.dice_channels == 1


@pytest.mark.parametrize('loss', ['dice', 'lovasz'])
def test_a_centre_target_without_a_bce_term_is_refused(tiny, loss):
    # Dice and the Lovasz hinge cover the foreground only: the centre map would learn nothing.
    with pytest.raises(UserError, match='--target mask\\+centre needs a loss with a BCE term'):
        tiny(target='mask+centre', loss=loss).validate()
    tiny(target='mask+centre', loss='bce_lovasz').validate()


def test_centre_markers_separate_nuclei_the_distance_watershed_merges():
    labels = _touching_pair(r=12, dist=6)
    prob = np.where(labels > 0, 0.95, 0.02).astype(np.float32)
    assert instances_from_prob(prob).max() == 1  # no neck: the distance watershed sees one
    centre = centre_map(labels) * 0.9
    split = instances_from_maps(np.stack([prob, centre]), markers='centre')
    assert split.max() == 2 and dsb_image_score(split, labels) > 0.9
    # Read as a border map (the default for two maps, as before centre maps), it does not split them.
    assert instances_from_maps(np.stack([prob, centre])).max() != 2
    # A nucleus with no hill (too small, or faint) is still an object.
    small = np.zeros((24, 24), np.int32)
    small[10:12, 10:12] = 1
    maps = np.stack([np.where(small > 0, 0.9, 0.0), np.zeros((24, 24))]).astype(np.float32)
    assert instances_from_maps(maps, markers='centre').max() == 1
    with pytest.raises(ValueError, match='centre markers need a second map'):
        instances_from_maps(prob, markers='centre')
    with pytest.raises(ValueError, match='not both'):
        instances_from_prob(prob, boundary=centre, centre=centre)


def test_the_search_tunes_the_centre_marker_and_names_it():
    pairs = []
    for dist in (10, 12):
        labels = _touching_pair(r=12, dist=dist)
        prob = np.where(labels > 0, 0.95, 0.02).astype(np.float32)
        # A shallow valley (a poorly learned one), 0.07 below the hill tops: at the default
        # depth (0.1) the two hills are one marker, at 0.05 two.
        centre = (0.93 + 0.07 * centre_map(labels)) * (labels > 0)
        pairs.append((np.stack([prob, centre]).astype(np.float32), labels))
    assert instances_from_maps(pairs[0][0], markers='centre').max() == 1
    result = tune_on_maps(pairs, second='centre')
    assert result['markers'] == 'centre' and result['marker'] == 0.05
    assert result['score'] > result['base_score']
    assert settings_text(result).startswith('threshold %.2f, centre markers' % result['threshold'])
    with pytest.raises(ValueError):
        tune_on_maps(pairs, second='rings')


def test_a_sidecar_whose_markers_do_not_match_its_outputs_is_refused(tmp_path):
    from conftest import BRIGHTNESS_SIDECAR, export_brightness_model
    from gluon_unet.inference.sidecar import read_sidecar
    for extra, words in (({'outputs': ['foreground', 'border'], 'postprocess': {'markers': 'centre'}},
                          "'markers' is \"centre\", but the model's outputs are [\"foreground\", \"border\"]"),
                         ({'postprocess': {'markers': 'centre'}},
                          "'markers' is \"centre\", but the model's outputs are [\"foreground\"]")):
        folder = export_brightness_model(str(tmp_path / str(len(extra))), dict(BRIGHTNESS_SIDECAR, **extra))
        with pytest.raises(UserError, match=words.replace('[', r'\[').replace(']', r'\]')):
            read_sidecar(os.path.join(folder, 'model.json'))


def test_predict_refuses_centre_markers_for_a_model_without_a_centre_map(tmp_path):
    from conftest import BRIGHTNESS_SIDECAR, export_brightness_model
    folder = export_brightness_model(str(tmp_path / 'm'), dict(BRIGHTNESS_SIDECAR))
    os.makedirs(tmp_path / 'in')
    import cv2
    cv2.imwrite(str(tmp_path / 'in' / 'a.png'), np.zeros((32, 32), np.uint8))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'predict'), '--model', folder, '--input',
                           str(tmp_path / 'in'), '--output', str(tmp_path / 'o'), '--markers', 'centre',
                           '--no-progress'], capture_output=True, text=True, timeout=HANG_SECONDS)
    assert proc.returncode != 0 and '--markers centre needs a mask+centre model' in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / 'o')
