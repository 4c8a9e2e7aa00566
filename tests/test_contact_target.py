"""--target mask+contact: the lines where nuclei touch as a second map, weighted by the
U-Net paper's gap term, and the watershed from the foreground less the contacts (the
dataset's crops and a trained model's export and prediction: test_border_target.py)."""
import numpy as np
import pytest

from gluon_unet.data.dataset import SegmentationDataset
from gluon_unet.data.targets import border_map, contact_map, make_target
from gluon_unet.data.weights import unet_weight_map
from gluon_unet.metrics import dsb_image_score
from gluon_unet.inference.postprocess import instances_from_maps, instances_from_prob
from gluon_unet.inference.postprocess_search import tune_on_maps
from test_border_target import _touching_pair


def test_the_contact_is_the_border_between_nuclei_and_nothing_around_a_lone_one():
    labels = np.zeros((20, 36), np.int32)
    labels[5:15, 2:8], labels[5:15, 8:14] = 1, 2   # touching along a column
    labels[5:15, 16:20] = 3                        # 2 px of background from nucleus 2
    labels[5:15, 28:33] = 4                        # alone
    contact = contact_map(labels)
    assert contact.dtype == bool and contact.shape == labels.shape
    assert contact[5:15, 7:9].all()                # both sides of the contact
    assert contact[5:15, 14:16].all()              # the narrow gap is filled
    assert not contact[labels == 4].any() and not contact[:, 24:36].any()
    assert not contact[5:15, 3:6].any()            # the rest of a nucleus is not contact
    # Contacts are the part of the border between nuclei: never against the open background.
    assert not (contact & ~border_map(labels)).any()
    assert not contact_map(np.zeros((5, 5), np.int32)).any()
    with pytest.raises(ValueError):
        contact_map(np.zeros((2, 5, 5), np.int32))
    both = make_target((labels > 0).astype(np.uint8), labels, 'mask+contact')
    assert both.shape == (2,) + labels.shape and np.array_equal(both[1] > 0, contact)
    assert np.array_equal(both[0] > 0, labels > 0)  # the foreground stays whole


def test_contact_markers_separate_nuclei_the_distance_watershed_merges():
    labels = _touching_pair(r=12, dist=6)  # heavy overlap: no neck for the distance transform
    prob = np.where(labels > 0, 0.95, 0.02).astype(np.float32)
    assert instances_from_prob(prob).max() == 1
    maps = np.stack([prob, contact_map(labels).astype(np.float32) * 0.9])
    split = instances_from_maps(maps, markers='contact')
    assert split.max() == 2 and dsb_image_score(split, labels) > 0.9
    result = tune_on_maps([(maps, labels)], second='contact')
    assert result['markers'] == 'contact' and result['score'] > 0.9


def test_the_weight_map_of_a_contact_model_is_heavy_on_the_contact_line():
    labels = _touching_pair(r=10, dist=14)
    images = (labels > 0).astype(np.uint8)[..., None] * 200
    ds = SegmentationDataset(images[None], (labels > 0).astype(np.uint8)[None], labels[None], target='mask+contact',
                             weight_fn=lambda inst: unet_weight_map(inst, class_balance=False))
    _, target, weight = ds[0]
    line = target[1] > 0
    assert weight.shape == (1,) + labels.shape and line.any()
    # the contact between the two nuclei weighs several times a pixel far from it
    assert weight[0][line & (labels > 0)].mean() > 5 and weight[0][0, 0] == 1


def test_weight_on_second_weighs_the_contact_output_only():
    import mxnet as mx
    from gluon_unet.training.losses import SegmentationLoss
    rng = np.random.RandomState(0)
    logits = mx.nd.array(rng.randn(2, 2, 16, 16))
    target = mx.nd.array(rng.rand(2, 2, 16, 16) > 0.7)
    weight = mx.nd.array(1 + 9 * (rng.rand(2, 1, 16, 16) > 0.9))
    both = SegmentationLoss('wbce')(logits, target, weight).asnumpy()
    second = SegmentationLoss('wbce', weight_second_only=True)(logits, target, weight).asnumpy()
    plain = SegmentationLoss('bce')(logits[:, :1], target[:, :1]).asnumpy()
    weighted = SegmentationLoss('wbce')(logits[:, 1:], target[:, 1:], weight).asnumpy()
    assert np.allclose(second, (plain + weighted) / 2, atol=1e-6) and not np.allclose(second, both)


def test_weight_on_second_needs_a_weighted_loss_and_a_second_map(tiny):
    from gluon_unet.errors import UserError
    with pytest.raises(UserError, match='--weight-on second needs --loss wbce or wbce_dice'):
        tiny(target='mask+contact', loss='bce_dice', weight_on='second').validate()
    with pytest.raises(UserError, match='--target mask\\)'):
        tiny(loss='wbce_dice', weight_on='second').validate()
    with pytest.raises(UserError, match='--weight-on must be one of all, second'):
        tiny(weight_on='first').validate()
    tiny(target='mask+contact', loss='wbce_dice', weight_on='second').validate()


def test_a_contact_model_trains_with_its_weights_on_the_contacts(tiny):
    from gluon_unet.training.loop import fit
    history = fit(tiny(target='mask+contact', loss='wbce_dice', weight_on='second', val_split=0.25), verbose=False)
    assert len(history) == 2 and all(np.isfinite(r['train_loss']) and np.isfinite(r['val_loss']) for r in history)
    import json
    import os
    meta = json.load(open(os.path.join(history.output, 'export', 'model.json')))
    assert meta['outputs'] == ['foreground', 'contact'] and meta['config']['weight_on'] == 'second'
