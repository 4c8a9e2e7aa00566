"""--target mask-gap: the foreground target with a background line where nuclei touch, its
weight map, validation against the true nuclei, and a train -> export -> predict run."""
import json
import os

import mxnet as mx
import numpy as np
from scipy import ndimage as ndi

from gluon_unet.data.augment import make_transform
from gluon_unet.data.dataset import SegmentationDataset
from gluon_unet.data.prepare import attach_transforms
from gluon_unet.data.targets import make_target, separate_touching
from gluon_unet.data.weights import unet_weight_map
from gluon_unet.training.loop import fit
from gluon_unet.inference.batched import load_model, predict_image
from gluon_unet.training.losses import SegmentationLoss
from gluon_unet.training.validation import validate

from test_border_target import _Foreground, _disc, _touching_pair

_EIGHT = np.ones((3, 3), bool)


def test_touching_nuclei_are_cut_apart_by_a_one_pixel_line_on_one_side():
    labels = _touching_pair()
    before = labels.copy()
    cut = separate_touching(labels)
    assert np.array_equal(labels, before)  # the caller's labels are not changed
    # Apart under 8-connectivity: two components, one per nucleus.
    comps, n = ndi.label(cut > 0, structure=_EIGHT)
    assert n == 2 and {int(cut[comps == k].max()) for k in (1, 2)} == {1, 2}
    # Only the lower id gave up pixels, and only where it met the other nucleus.
    lost = (before > 0) & (cut == 0)
    assert lost.any() and (before[lost] == 1).all()
    near_two = ndi.binary_dilation(before == 2, structure=_EIGHT)
    assert near_two[lost].all()
    # One pixel wide: every row of the contact loses one or two pixels, not a band.
    rows = lost.sum(1)
    assert rows.max() <= 2 and rows.sum() <= 2 * (rows > 0).sum()


def test_a_nucleus_that_touches_nothing_is_unchanged_and_the_target_matches_mask_without_contacts():
    labels = np.zeros((40, 60), np.int32)
    labels[_disc(labels.shape, 20, 15, 8)] = 1
    labels[_disc(labels.shape, 20, 45, 8)] = 2  # 14 px apart
    assert np.array_equal(separate_touching(labels), labels)
    assert np.array_equal(make_target(labels > 0, labels, 'mask-gap'), make_target(labels > 0, labels, 'mask'))
    touching = _touching_pair()
    gap = make_target(touching > 0, touching, 'mask-gap')
    assert gap.shape == (1,) + touching.shape and gap.dtype == np.float32
    assert 0 < (touching > 0).sum() - gap.sum() <= 2 * touching.shape[0]


def test_the_dataset_cuts_the_cropped_instances_and_weights_the_gap():
    labels = np.stack([_touching_pair(), _touching_pair()[::-1, ::-1].copy()])
    images = (labels > 0).astype(np.uint8)[..., None] * 200
    ds = SegmentationDataset(images, (labels > 0).astype(np.uint8), labels, target='mask-gap',
                             transform=make_transform(augment=True, crop=32), weight_fn=unet_weight_map)
    checked = 0
    for seed in range(6):
        image, target, weight = ds[(0, seed)]
        _, _, inst = ds.sample(0, seed)
        cut = separate_touching(inst)
        assert target.shape == weight.shape == (1, 32, 32)
        assert np.array_equal(target[0] > 0, cut > 0)  # the gap follows the crop
        gap = (inst > 0) & (cut == 0)
        if len(np.unique(cut)) == 3:  # (a crop may keep only a sliver of one nucleus, all contact)
            # The border term lands on the gap between the two: there the weight is well
            # above what the uncut labels give (where the same pixels are inside a nucleus).
            assert gap.any() and (weight[0][gap] > unet_weight_map(inst)[gap] + 1).all()
            checked += 1
    assert checked >= 3
    assert ds.subset([1]).target == 'mask-gap'


def test_training_gives_each_weighted_loss_its_map(tiny):
    labels = np.stack([_touching_pair()] * 2)
    fg = (labels > 0).astype(np.uint8)
    weights = {}
    for loss in ('bce_dice', 'wbce', 'wbce_dice'):
        ds = SegmentationDataset(fg[..., None] * 200, fg, labels, target='mask-gap')
        attach_transforms(tiny(target='mask-gap', loss=loss), ds, None)
        sample = ds[0]
        weights[loss] = sample[2][0] if len(sample) == 3 else None
    assert weights['bce_dice'] is None  # no map batched for nothing
    cut = separate_touching(labels[0])
    # wbce: the paper's map, class balancing included; wbce_dice: its border term on a
    # base of 1 (Dice balances the classes), still heavy in the gap between the two.
    np.testing.assert_allclose(weights['wbce'], unet_weight_map(cut), rtol=1e-6)
    np.testing.assert_allclose(weights['wbce_dice'], unet_weight_map(cut, class_balance=False), rtol=1e-6)
    assert weights['wbce_dice'].min() == 1.0
    gap = (labels[0] > 0) & (cut == 0)
    assert (weights['wbce_dice'][gap] > 5).all()


def test_validation_scores_a_gap_model_against_the_true_nuclei():
    labels = np.stack([_touching_pair(), _touching_pair()[::-1, ::-1].copy()])
    fg = (labels > 0).astype(np.uint8)
    images = fg[..., None] * 255  # the oracle predicts the true foreground, contacts included
    loss = SegmentationLoss('bce_dice')
    scores = {}
    for target in ('mask', 'mask-gap'):
        ds = SegmentationDataset(images, fg, labels, target=target)
        scores[target] = validate(_Foreground(), [mx.cpu()], ds, 2, loss)
    assert scores['mask-gap']['val_iou'] == scores['mask']['val_iou'] == 1.0
    assert scores['mask-gap']['val_dice'] == 1.0
    # The loss is against the target the model learns: the gaps cost the oracle something.
    assert scores['mask-gap']['val_loss'] > scores['mask']['val_loss']


def test_train_export_predict_a_gap_model(tiny, tmp_path):
    run = fit(tiny(target='mask-gap', loss='wbce_dice', val_split=0.25, crop=32, size=32,
                   output=str(tmp_path / 'gap')), verbose=False)
    assert all(np.isfinite(v) for v in run[-1].values() if isinstance(v, float))
    sidecar = json.load(open(os.path.join(run.output, 'export', 'model.json')))
    assert sidecar['outputs'] == ['foreground'] and sidecar['config']['model']['target'] == 'mask-gap'
    assert 'h' in sidecar['postprocess']  # the distance watershed's search, as for a mask model
    from gluon_unet.data.synthetic import synthetic_nuclei
    image = synthetic_nuclei(1, size=64, channels=1, seed=5)[0][0]
    model = load_model(run.output, [mx.cpu(0), mx.cpu(1)])
    assert model.second is None
    maps = predict_image(model.net, model.meta, image, model.ctxs, mode='tile', tta=True, maps=True)
    assert maps.shape == (1, 64, 64) and np.isfinite(maps).all()
