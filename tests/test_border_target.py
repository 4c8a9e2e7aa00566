"""--target mask+border: border targets from instance labels, a two-output network, its
loss, the marker watershed from the interiors, and export/predict of old and new models."""
import json
import os
import subprocess
import sys

import cv2
import mxnet as mx
import numpy as np
import pytest
from scipy import ndimage as ndi

from gluon_unet.config import TrainConfig
from gluon_unet.data.augment import make_transform
from gluon_unet.data.dataset import SegmentationDataset
from gluon_unet.data.targets import border_map, centre_map, contact_map, make_target
from gluon_unet.training.loop import fit
from gluon_unet.errors import UserError
from gluon_unet.inference.batched import load_model, predict_image
from gluon_unet.training.losses import SegmentationLoss
from gluon_unet.metrics import dsb_image_score
from gluon_unet.inference.postprocess import instances_from_maps, instances_from_prob
from gluon_unet.inference.postprocess_search import tune_on_maps
from gluon_unet.training.validation import validate
from hang import HANG_SECONDS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))


def _disc(shape, cy, cx, r):
    yy, xx = np.mgrid[:shape[0], :shape[1]]
    return (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r


def _touching_pair(shape=(48, 64), r=12, dist=16):
    """Two discs whose centres are ``dist`` < 2r apart: they overlap, split down the middle."""
    labels = np.zeros(shape, np.int32)
    cy, cx = shape[0] // 2, shape[1] // 2
    a, b = _disc(shape, cy, cx - dist // 2, r), _disc(shape, cy, cx + dist // 2, r)
    labels[a] = 1
    labels[b & (np.arange(shape[1])[None, :] >= cx)] = 2
    labels[a & ~b] = 1
    return labels


def test_touching_nuclei_get_a_border_between_them_and_keep_separate_interiors():
    labels = _touching_pair()
    border = border_map(labels)
    # The line where the two nuclei meet is border on both sides of it...
    meet = (labels == 1) & (ndi.maximum_filter(labels, footprint=ndi.generate_binary_structure(2, 1)) == 2)
    assert meet.any() and border[meet].all()
    assert border[:, 32].sum() >= meet[:, 31].sum()
    # ...so the interiors (nucleus minus border) are two objects, one inside each nucleus.
    interior, n = ndi.label((labels > 0) & ~border)
    assert n == 2
    assert {int(labels[interior == k].max()) for k in (1, 2)} == {1, 2}
    # The contour of an isolated nucleus: one pixel inside and one outside it, nothing far away.
    assert not border[labels == 0][ndi.distance_transform_edt(labels == 0)[labels == 0] > 3].any()


def test_the_border_of_small_nuclei_does_not_vanish_and_a_narrow_gap_is_filled():
    labels = np.zeros((20, 30), np.int32)
    labels[8:11, 4:7] = 1  # 3x3 nucleus: its contour is still drawn, its centre stays interior
    labels[5:15, 12:17] = 2
    labels[5:15, 20:25] = 3  # 3 px of background between nuclei 2 and 3
    border = border_map(labels)
    assert border[8:11, 4:7].sum() == 8 and not border[9, 5]
    assert border[5:15, 17:20].all()  # the gap between 2 and 3 is border
    assert not border[5:15, 9].any()  # 3 px from nucleus 1 and from nucleus 2: an ordinary background pixel


def test_make_target_channels():
    labels = _touching_pair()
    mask = (labels > 0).astype(np.uint8)
    plain = make_target(mask, labels, 'mask')
    both = make_target(mask, labels, 'mask+border')
    assert plain.shape == (1,) + labels.shape and both.shape == (2,) + labels.shape
    assert both.dtype == np.float32 and np.array_equal(both[0], plain[0])
    assert np.array_equal(both[1] > 0, border_map(labels))
    with pytest.raises(ValueError):
        make_target(mask, labels, 'borders')


@pytest.mark.parametrize('target, second', [('mask+border', lambda inst: border_map(inst).astype(np.float32)),
                                            ('mask+centre', centre_map),
                                            ('mask+contact', lambda inst: contact_map(inst).astype(np.float32))])
def test_the_dataset_builds_the_second_map_from_the_cropped_and_flipped_instances(target, second):
    labels = np.stack([_touching_pair(), _touching_pair()[::-1, ::-1].copy()])
    images = (labels > 0).astype(np.uint8)[..., None] * 200
    ds = SegmentationDataset(images, (labels > 0).astype(np.uint8), labels,
                             transform=make_transform(augment=True, crop=32), target=target)
    for seed in range(6):
        image, maps = ds[(0, seed)]
        _, _, inst = ds.sample(0, seed)
        assert image.shape == (1, 32, 32) and maps.shape == (2, 32, 32)
        assert np.array_equal(maps[1], second(inst))  # borders and centres follow the crop
        assert np.array_equal(maps[0] > 0, inst > 0)
    assert ds.subset([1]).target == target


def test_the_loss_has_one_dice_term_per_channel():
    rng = np.random.RandomState(0)
    logits = mx.nd.array(rng.randn(2, 2, 16, 16))
    target = mx.nd.array(rng.rand(2, 2, 16, 16) > 0.7)
    loss = SegmentationLoss('bce_dice')
    both = loss(logits, target).asnumpy()
    per_channel = [loss(logits[:, c:c + 1], target[:, c:c + 1]).asnumpy() for c in range(2)]
    # BCE is a mean over all pixels, Dice a mean over the channels: the 2-channel loss is
    # the mean of the two 1-channel losses.
    assert np.allclose(both, (per_channel[0] + per_channel[1]) / 2, atol=1e-6)
    wbce = SegmentationLoss('wbce')(logits, target, mx.nd.ones((2, 1, 16, 16)) * 2).asnumpy()
    assert np.allclose(wbce, 2 * SegmentationLoss('bce')(logits, target).asnumpy(), atol=1e-6)


def test_a_border_map_separates_nuclei_the_distance_watershed_merges():
    labels = _touching_pair(r=12, dist=6)  # heavy overlap: no neck for the distance transform
    prob = np.where(labels > 0, 0.95, 0.02).astype(np.float32)
    merged = instances_from_prob(prob)
    assert merged.max() == 1
    border = border_map(labels).astype(np.float32) * 0.9
    split = instances_from_maps(np.stack([prob, border]))
    assert split.max() == 2
    assert dsb_image_score(split, labels) > 0.7 > dsb_image_score(merged, labels)
    # One map, or a 1-channel stack, is the plain foreground path.
    assert np.array_equal(instances_from_maps(prob), merged)
    assert np.array_equal(instances_from_maps(prob[None]), merged)
    # A small nucleus swallowed by its border is kept as an object, not lost.
    small = np.zeros((24, 24), np.int32)
    small[10:12, 10:12] = 1
    maps = np.stack([np.where(small > 0, 0.9, 0.0), border_map(small) * 0.9]).astype(np.float32)
    assert instances_from_maps(maps).max() == 1
    with pytest.raises(ValueError):  # 1, 2 or 3 (a flow model's) maps
        instances_from_maps(np.zeros((4, 8, 8), np.float32))


def test_the_search_tunes_the_marker_for_border_maps():
    pairs = []
    for dist in (10, 12):
        labels = _touching_pair(r=12, dist=dist)
        prob = np.where(labels > 0, 0.95, 0.02).astype(np.float32)
        # A faint border: the default marker score (0.5) keeps it as one interior.
        border = border_map(labels).astype(np.float32) * 0.45
        pairs.append((np.stack([prob, border]), labels))
    result = tune_on_maps(pairs)
    assert 'marker' in result and 'h' not in result
    assert result['score'] > result['base_score'] and result['marker'] > 0.5


def test_train_export_predict_every_kind_of_model(tiny, tmp_path):
    runs = {}
    for target in ('mask', 'mask+border', 'mask+centre', 'mask+contact', 'mask+flow'):
        runs[target] = fit(tiny(target=target, loss='bce_dice', val_split=0.25, crop=32, size=32,
                                output=str(tmp_path / target.replace('+', '_'))), verbose=False)
    new = json.load(open(os.path.join(runs['mask+border'].output, 'export', 'model.json')))
    old = json.load(open(os.path.join(runs['mask'].output, 'export', 'model.json')))
    assert new['outputs'] == ['foreground', 'border'] and new['config']['model']['target'] == 'mask+border'
    assert 'marker' in new['postprocess'] and 'h' in old['postprocess']
    centre = json.load(open(os.path.join(runs['mask+centre'].output, 'export', 'model.json')))
    assert centre['outputs'] == ['foreground', 'centre'] and centre['postprocess']['markers'] == 'centre'
    contact = json.load(open(os.path.join(runs['mask+contact'].output, 'export', 'model.json')))
    assert contact['outputs'] == ['foreground', 'contact'] and contact['postprocess']['markers'] == 'contact'
    flow = json.load(open(os.path.join(runs['mask+flow'].output, 'export', 'model.json')))
    assert flow['outputs'] == ['foreground', 'flow_y', 'flow_x'] and flow['postprocess']['markers'] in ('flow',
                                                                                                       'distance')
    # An export from before borders existed: no 'outputs', no target in its config.
    legacy = str(tmp_path / 'legacy')
    os.makedirs(legacy)
    for name in ('model-symbol.json', 'model-0000.params'):
        os.link(os.path.join(runs['mask'].output, 'export', name), os.path.join(legacy, name))
    del old['outputs'], old['config']['model']['target'], old['postprocess']
    json.dump(old, open(os.path.join(legacy, 'model.json'), 'w'))

    from gluon_unet.data.synthetic import synthetic_nuclei
    image = synthetic_nuclei(1, size=80, channels=1, seed=3)[0][0]
    for path, second in ((runs['mask+border'].output, 'border'), (runs['mask+centre'].output, 'centre'),
                         (runs['mask+contact'].output, 'contact'), (runs['mask+flow'].output, 'flow'),
                         (runs['mask'].output, None), (legacy, None)):
        k = {None: 1, 'flow': 3}.get(second, 2)
        model = load_model(path, [mx.cpu()])
        assert model.second == second
        # a 2-epoch flow model's search may prefer the distance watershed on its foreground
        assert model.markers == second or (second == 'flow' and model.markers == 'distance')
        whole = predict_image(model.net, model.meta, image, [mx.cpu()], mode='whole', maps=True)
        two = load_model(path, [mx.cpu(0), mx.cpu(1)])
        tiled = predict_image(two.net, two.meta, image, two.ctxs, mode='tile', tta=True, maps=True)
        resized = predict_image(model.net, model.meta, image, [mx.cpu()], mode='resize', maps=True)
        assert whole.shape == tiled.shape == resized.shape == (k, 80, 80)
        assert np.isfinite(tiled).all() and 0 <= tiled.min() and tiled.max() <= 1
        assert np.array_equal(predict_image(model.net, model.meta, image, [mx.cpu()], mode='whole'), whole[0])
    # bin/predict on both kinds, with TTA, tiles and the submission.
    cv2.imwrite(str(tmp_path / 'a.png'), image)
    for path in (runs['mask+border'].output, runs['mask+centre'].output, runs['mask+contact'].output,
                 runs['mask+flow'].output, legacy):
        out = str(tmp_path / ('pred_' + os.path.basename(path)))
        proc = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'predict'), '--model', path, '--input',
                               str(tmp_path / 'a.png'), '--output', out, '--tta', '--mode', 'tile', '--marker', '0.4',
                               '--rle', out + '/sub.csv', '--no-progress'],
                              capture_output=True, text=True, timeout=HANG_SECONDS)
        assert proc.returncode == 0, proc.stderr
        assert os.path.exists(os.path.join(out, 'a_labels.png')) and os.path.exists(out + '/sub.csv')
    # a flow model gathers its nuclei along its flows: the random walker's flooding does not apply
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'predict'), '--model', runs['mask+flow'].output,
                           '--input', str(tmp_path / 'a.png'), '--output', str(tmp_path / 'walk'), '--markers', 'flow',
                           '--split', 'randomwalker', '--no-progress'], capture_output=True, text=True,
                          timeout=HANG_SECONDS)
    assert proc.returncode == 2 and proc.stderr.count('\n') == 1 and '--split randomwalker' in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / 'walk')
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'predict'), '--model', runs['mask+flow'].output,
                           '--input', str(tmp_path / 'a.png'), '--output', str(tmp_path / 'walk'), '--markers',
                           'centre'], capture_output=True, text=True, timeout=HANG_SECONDS)
    assert proc.returncode == 2 and 'this one predicts the foreground and two flow maps' in proc.stderr, proc.stderr


def test_bad_target_values_are_one_line(tmp_path):
    for flags, words in ((['--target', 'borders'], '--target must be one of mask, mask-gap, mask+border'),
                         (['--target', 'mask+border', '--loss', 'ce', '--classes', '3'], '--target mask+border')):
        proc = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'train'), '--output', str(tmp_path / 'r'),
                               '--epochs', '1', '--no-progress'] + flags, capture_output=True, text=True,
                                   timeout=HANG_SECONDS)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / 'r')
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'predict'), '--model', str(tmp_path),
                           '--input', str(tmp_path), '--output', str(tmp_path / 'o'), '--marker', '1.5'],
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert proc.returncode == 2 and '--marker must be a number in (0, 1)' in proc.stderr, proc.stderr


def test_a_sidecar_with_unknown_outputs_is_refused_in_one_line(tmp_path):
    from conftest import BRIGHTNESS_SIDECAR, export_brightness_model
    from gluon_unet.inference.sidecar import read_sidecar
    for bad, words in (({'outputs': ['foreground', 'edges']}, "'outputs' must be one of"),
                       ({'config': {'model': {'target': 'rings'}}}, "'config.model.target' must be one of"),
                       ({'postprocess': {'markers': 'rings'}}, "'postprocess' must be an object whose 'markers'"),
                       ({'postprocess': {'min_score': 1.5}}, "'postprocess' 'min_score' must be a number in"),
                       ({'postprocess': {'threshold': 'high'}}, "'postprocess' 'threshold' must be a number in"),
                       ({'postprocess': {'marker': 1.0}}, "'postprocess' 'marker' must be a number in"),
                       ({'postprocess': {'h': float('inf')}}, "'postprocess' 'h' must be a finite number > 0"),
                       ({'postprocess': {'min_size': 16.5}}, "'postprocess' 'min_size' must be a whole number")):
        folder = export_brightness_model(str(tmp_path / str(len(words))), dict(BRIGHTNESS_SIDECAR, **bad))
        with pytest.raises(UserError, match=words.replace('(', r'\(')):
            read_sidecar(os.path.join(folder, 'model.json'))


def test_resume_refuses_a_changed_target(tiny):
    from gluon_unet.training.resume import resume_conflicts
    a, b = tiny(), tiny(target='mask+border')
    assert resume_conflicts(TrainConfig.from_dict(a.to_dict()), b) == ['--target mask (now mask+border)']
    assert b.model.outputs == 2 and a.model.outputs == 1


def test_the_search_falls_back_to_the_distance_watershed_when_the_border_map_splits_worse():
    """A border map that draws lines through the middle of nuclei (a poorly learned one)
    over-splits; the search then picks the distance watershed on the foreground, and
    predict follows it."""
    pairs = []
    for dist in (30, 34):
        labels = _touching_pair(shape=(48, 96), r=12, dist=dist)  # two discs barely touching
        prob = np.where(labels > 0, 0.95, 0.02).astype(np.float32)
        border = border_map(labels).astype(np.float32)
        border[:, ::6] = np.maximum(border[:, ::6], 0.95 * (labels[:, ::6] > 0))  # spurious lines
        pairs.append((np.stack([prob, border]), labels))
    result = tune_on_maps(pairs)
    assert result['markers'] == 'distance' and 'h' in result and result['score'] > result['base_score']
    maps, labels = pairs[0]
    assert instances_from_maps(maps, markers='distance').max() == 2 < instances_from_maps(maps).max()
    with pytest.raises(ValueError):
        instances_from_maps(maps, markers='centres')


class _Foreground(mx.gluon.HybridBlock):
    """Logits that reproduce the input image: +20 where it is bright, -20 elsewhere (a
    one-map model that draws the true foreground of a bright-on-dark mask image)."""

    def hybrid_forward(self, F, x):
        return (x > 0.5) * 40 - 20


class _BlankSecondMap(_Foreground):
    """The same foreground and a second map of zeros: no border, contact or hill, so its
    markers grow one object per blob and touching nuclei stay merged."""

    def hybrid_forward(self, F, x):
        fg = super().hybrid_forward(F, x)
        return F.concat(fg, fg * 0 - 20, dim=1)


@pytest.mark.parametrize('second', ['border', 'centre', 'contact'])
def test_validation_picks_epochs_by_the_better_markers_of_a_two_map_model(second):
    """A two-map model's val_dsb (what picks its best epoch) is the better of its second
    map's markers and the distance watershed - the two the search chooses between
    afterwards - and both are reported; a one-map model's is as before."""
    labels = np.stack([_touching_pair(r=10, dist=18), _touching_pair(r=10, dist=18)[::-1].copy()])
    fg = (labels > 0).astype(np.uint8)
    ds = SegmentationDataset(fg[..., None] * 255, fg, labels, target='mask+' + second)
    row = validate(_BlankSecondMap(), [mx.cpu()], ds, 2, SegmentationLoss('bce'))
    split = dsb_image_score(instances_from_maps(np.stack([fg[0], fg[0] * 0]).astype(np.float32),
                                                markers='distance'), labels[0])
    assert split > 0.9  # the distance watershed separates this pair...
    assert row['val_dsb_%s' % second] < 0.5 < row['val_dsb_distance']  # ... a blank second map cannot
    assert row['val_dsb'] == row['val_dsb_distance']
    one = validate(_Foreground(), [mx.cpu()], SegmentationDataset(fg[..., None] * 255, fg, labels, target='mask'),
                   2, SegmentationLoss('bce'))
    assert one['val_dsb'] == row['val_dsb_distance'] and not any(k.startswith('val_dsb_') for k in one)


def test_predict_uses_the_markers_the_search_chose(tmp_path):
    from conftest import BRIGHTNESS_SIDECAR, export_brightness_model
    folder = export_brightness_model(str(tmp_path / 'm'), dict(BRIGHTNESS_SIDECAR, postprocess={
        'threshold': 0.5, 'h': 1.0, 'min_size': 0, 'markers': 'distance'}))
    model = load_model(folder, [mx.cpu()])
    assert model.markers == 'distance' and model.h == 1.0
