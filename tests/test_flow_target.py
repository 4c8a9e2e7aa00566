"""--target mask+flow: the direction to each nucleus' centre as two more maps, and the
nuclei gathered by following it (gluon_unet.inference.flows)."""
import numpy as np
import pytest
from skimage.draw import ellipse

from gluon_unet.data.targets import OUTPUTS, TARGETS, flow_map, make_target, nucleus_centres
from gluon_unet.inference.flows import follow_flows
from gluon_unet.inference.postprocess import instances_from_flows, instances_from_prob
from gluon_unet.metrics import dsb_image_score
from test_border_target import _touching_pair


def _decoded(flow):
    return 2 * flow[0] - 1, 2 * flow[1] - 1


def _field(shape=(128, 160), seed=0):
    """Ellipses of random sizes and angles on a grid, some overlapping (the later one
    keeps the shared pixels): touching nuclei of several shapes."""
    rng = np.random.default_rng(seed)
    labels = np.zeros(shape, np.int32)
    k = 0
    for cy in range(14, shape[0] - 6, 22):
        for cx in range(14, shape[1] - 6, 20):
            k += 1
            rr, cc = ellipse(cy + rng.integers(-3, 4), cx + rng.integers(-3, 4), rng.integers(6, 13),
                             rng.integers(6, 14), shape=shape, rotation=rng.uniform(0, np.pi))
            labels[rr, cc] = k
    # an ellipse cut by a later one may fall into pieces: keep each label's largest piece
    from scipy import ndimage as ndi
    for k in range(1, k + 1):
        pieces, n = ndi.label(labels == k)
        if n > 1:
            sizes = np.bincount(pieces.ravel())[1:]
            labels[(pieces > 0) & (pieces != 1 + int(np.argmax(sizes)))] = 0
    return labels


def test_the_flow_is_a_unit_vector_to_the_own_centre_and_flips_across_a_contact():
    labels = _touching_pair(r=12, dist=6)  # heavy overlap: their union has no neck
    flow = flow_map(labels)
    assert flow.shape == (2,) + labels.shape and flow.dtype == np.float32
    assert (flow[:, labels == 0] == 0.5).all() and flow.min() >= 0 and flow.max() <= 1
    vy, vx = _decoded(flow)
    cy, cx = nucleus_centres(labels)
    yy, xx = np.nonzero(labels)
    own = labels[yy, xx]
    length = np.hypot(vy[yy, xx], vx[yy, xx])
    at_centre = (yy == cy[own]) & (xx == cx[own])
    assert at_centre.sum() == 2 and np.allclose(length[~at_centre], 1, atol=1e-5)
    # towards its own centre: the vector is the unit vector from the pixel to it
    to_y, to_x = cy[own] - yy, cx[own] - xx
    dot = (vy[yy, xx] * to_y + vx[yy, xx] * to_x) / np.maximum(np.hypot(to_y, to_x), 1e-9)
    assert np.allclose(dot[~at_centre], 1, atol=1e-5)
    # each centre lies inside its nucleus, and across the contact the x direction flips
    assert all(labels[int(cy[k]), int(cx[k])] == k for k in (1, 2))
    contact = (labels[:, :-1] == 1) & (labels[:, 1:] == 2)
    assert contact.any()
    assert (vx[:, :-1][contact] < 0).all() and (vx[:, 1:][contact] > 0).all()


def test_a_bent_nucleus_keeps_its_centre_inside_it_and_a_tiny_one_gets_one_of_its_pixels():
    labels = np.zeros((40, 40), np.int32)
    labels[5:35, 5:12] = 1
    labels[28:35, 5:35] = 1  # an L: its centroid is outside it
    labels[2:4, 30:32] = 2   # 2 x 2: every pixel is edge
    cy, cx = nucleus_centres(labels)
    assert labels[int(cy[1]), int(cx[1])] == 1
    assert labels[int(cy[2]), int(cx[2])] == 2
    assert (flow_map(np.zeros((6, 7), np.int32)) == 0.5).all()
    with pytest.raises(ValueError):
        flow_map(np.zeros((2, 5, 5), np.int32))


def test_make_target_stacks_the_mask_and_the_two_flow_maps():
    labels = _touching_pair()
    target = make_target((labels > 0).astype(np.uint8), labels, 'mask+flow')
    assert target.shape == (3,) + labels.shape and target.dtype == np.float32
    assert (target[0] == (labels > 0)).all() and np.array_equal(target[1:], flow_map(labels))
    assert 'mask+flow' in TARGETS and len(OUTPUTS['mask+flow']) == 3


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_following_the_true_flows_gives_back_every_nucleus(seed):
    labels = _field(seed=seed)
    got = instances_from_flows((labels > 0).astype(np.float32), flow_map(labels))
    assert got.dtype == np.int32 and got.max() == len(np.unique(labels)) - 1
    assert dsb_image_score(got, labels) > 0.95
    # where the union of two nuclei has no neck the distance watershed cannot part them;
    # the flows do
    pair = _touching_pair(r=12, dist=6)
    assert instances_from_flows((pair > 0).astype(np.float32), flow_map(pair)).max() == 2
    assert instances_from_prob((pair > 0).astype(np.float32)).max() == 1


def test_noisy_flows_still_part_the_nuclei():
    """A network's flows are blurred and noisy: the gathering tolerates it."""
    from scipy import ndimage as ndi
    labels = _field(seed=3)
    rng = np.random.default_rng(0)
    flow = flow_map(labels)
    flow = np.stack([ndi.gaussian_filter(f, 1.0) for f in flow]) + rng.normal(0, 0.15, flow.shape)
    prob = np.clip(ndi.gaussian_filter((labels > 0).astype(np.float32), 1.0) + rng.normal(0, 0.05, labels.shape), 0, 1)
    got = instances_from_flows(prob, np.clip(flow, 0, 1).astype(np.float32))
    assert dsb_image_score(got, labels) > 0.8


def test_small_unsure_and_ungathered_objects():
    labels = _field(seed=4)
    labels[2:4, 2:4] = labels.max() + 1  # 4 pixels: too few to gather, kept as its own nucleus
    prob = (labels > 0).astype(np.float32)
    flow = flow_map(labels)
    got = instances_from_flows(prob, flow)
    assert got[2, 2] > 0 and got.max() == len(np.unique(labels)) - 1
    assert instances_from_flows(prob, flow, min_size=5)[2, 2] == 0
    # the mean foreground probability below min_score: dropped, the others renumbered 1..K
    prob[labels == 1] = 0.6
    unsure = instances_from_flows(prob, flow, min_score=0.7)
    assert (unsure[labels == 1] > 0).mean() < 0.01 and unsure.max() == got.max() - 1
    assert (instances_from_flows(np.zeros((9, 9), np.float32), np.full((2, 9, 9), 0.5, np.float32)) == 0).all()
    with pytest.raises(ValueError, match='flow'):
        instances_from_flows(prob, flow[:1])


def test_a_path_never_leaves_the_foreground():
    mask = np.zeros((20, 20), bool)
    mask[5:15, 5:15] = True
    flow = np.zeros((2, 20, 20), np.float32)
    flow[1] = 1.0  # everything points right, out of the square
    flow[0] = 0.5
    yy, xx, ey, ex = follow_flows(flow, mask, steps=30)
    assert mask[ey, ex].all() and (ex == 14).all() and (ey == yy).all()


def test_tta_turns_the_directions_back_with_the_maps():
    """Each of the 8 flips and turns, seen by a perfect flow model, comes back to the
    image's own flows: the directions turn with the pixels."""
    from gluon_unet.inference.tiling import DIHEDRAL, Canvas, dihedral
    labels = np.zeros((33, 41), np.int32)
    yy, xx = np.mgrid[:33, :41]
    labels[(yy - 12) ** 2 + (xx - 11) ** 2 <= 49] = 1  # discs around a pixel: one deepest pixel each
    labels[(yy - 20) ** 2 + (xx - 28) ** 2 <= 64] = 2
    truth = np.concatenate([(labels > 0)[None].astype(np.float32), flow_map(labels)])
    for k, flip in DIHEDRAL:
        seen = dihedral(labels, k, flip)
        maps = np.concatenate([(seen > 0)[None].astype(np.float32), flow_map(seen)])
        canvas = Canvas(33, 41, flow=True)
        canvas.add(maps, 0, 0, k, flip, np.ones(labels.shape, np.float32))
        assert np.allclose(canvas.result(), truth, atol=1e-6), (k, flip)
    # a canvas of another kind of model only moves the maps: the directions come back wrong
    seen = dihedral(labels, 1, True)
    canvas = Canvas(33, 41)
    canvas.add(np.concatenate([(seen > 0)[None].astype(np.float32), flow_map(seen)]), 0, 0, 1, True,
               np.ones(labels.shape, np.float32))
    back = canvas.result()
    assert np.allclose(back[0], truth[0]) and not np.allclose(back[1:], truth[1:])


def test_the_dataset_draws_the_flows_from_the_cropped_and_flipped_instances():
    """The flows are computed after the crop and the flips: a flipped crop's directions
    point to its nuclei's centres as they lie in the crop."""
    from gluon_unet.data.augment import make_transform
    from gluon_unet.data.dataset import SegmentationDataset
    labels = np.stack([_field((64, 64), seed=5), _field((64, 64), seed=6)])
    images = (labels > 0).astype(np.uint8)[..., None] * 200
    ds = SegmentationDataset(images, (labels > 0).astype(np.uint8), labels,
                             transform=make_transform(augment=True, crop=32), target='mask+flow')
    for seed in range(6):
        image, maps = ds[(1, seed)]
        _, _, inst = ds.sample(1, seed)
        assert image.shape == (1, 32, 32) and maps.shape == (3, 32, 32)
        assert np.array_equal(maps[1:], flow_map(inst)) and np.array_equal(maps[0] > 0, inst > 0)


@pytest.mark.parametrize('flags, words', [
    (dict(loss='dice'), '--target mask+flow needs a loss with a BCE term for its flow maps'),
    (dict(loss='wbce', weight_on='second'), '--weight-on second is for a --target with one second map'),
])
def test_a_flow_model_refuses_the_losses_that_cannot_train_its_flows(tiny, flags, words):
    from gluon_unet.errors import UserError
    import re
    with pytest.raises(UserError, match=re.escape(words)):
        tiny(target='mask+flow', **flags).validate()
    assert tiny(target='mask+flow').model.outputs == 3


def test_maps_of_three_go_to_the_flows_unless_the_distance_is_asked_for():
    from gluon_unet.inference.postprocess import instances_from_maps
    pair = _touching_pair(r=12, dist=6)
    maps = np.concatenate([(pair > 0)[None].astype(np.float32), flow_map(pair)])
    assert instances_from_maps(maps).max() == 2 and instances_from_maps(maps, markers='flow').max() == 2
    assert instances_from_maps(maps, markers='distance').max() == 1  # no neck: the distance merges them
    with pytest.raises(ValueError, match='two flow maps'):
        instances_from_maps(maps[:2], markers='flow')
    with pytest.raises(ValueError, match='a second map'):
        instances_from_maps(maps, markers='centre')
    with pytest.raises(ValueError, match='randomwalker'):
        instances_from_maps(maps, split='randomwalker')
    assert instances_from_maps(maps, split='none').max() == 1  # plain components: the pair is one blob


def test_the_search_tunes_a_flow_model_and_never_offers_it_the_random_walker():
    from gluon_unet.inference.postprocess_search import tune_on_maps
    pairs = []
    for seed in range(3):
        labels = _field((64, 80), seed=seed)
        pairs.append((np.concatenate([(labels > 0)[None].astype(np.float32), flow_map(labels)]), labels))
    best = tune_on_maps(pairs)
    assert best['markers'] == 'flow' and best['score'] > 0.95 and 'split' not in best
    assert 0 < best['marker'] < 1


def test_resize_mode_stretches_the_directions_back_with_the_image():
    """A non-square image resized to the network's square turns its directions; the maps
    resized back carry the image's own (a perfect model, seen through the plan)."""
    import cv2
    from gluon_unet.inference.tiling import unstretch_flow
    labels = np.zeros((40, 80), np.int32)
    yy, xx = np.mgrid[:40, :80]
    labels[(yy - 20) ** 2 / 12 ** 2 + (xx - 40) ** 2 / 30 ** 2 <= 1] = 1
    squeezed = cv2.resize(labels.astype(np.uint8), (40, 40), interpolation=cv2.INTER_NEAREST).astype(np.int32)
    seen = np.concatenate([(squeezed > 0)[None].astype(np.float32), flow_map(squeezed)])
    back = np.stack([cv2.resize(m, (80, 40), interpolation=cv2.INTER_NEAREST) for m in seen])
    fixed = unstretch_flow(back, 1.0, 2.0)
    truth = flow_map(labels)
    inside = labels > 0
    inside &= np.hypot(yy - 20, xx - 40) > 4  # away from the centre, where a pixel of rounding turns much
    err = lambda f: np.degrees(np.abs(np.arctan2(2 * f[0] - 1, 2 * f[1] - 1) - np.arctan2(
        2 * truth[0] - 1, 2 * truth[1] - 1)))[inside]
    assert np.median(err(fixed[1:])) < 5 < np.median(err(back[1:]))
    assert np.allclose(np.hypot(2 * fixed[1] - 1, 2 * fixed[2] - 1), np.hypot(2 * back[1] - 1, 2 * back[2] - 1),
                       atol=1e-5)


def test_markers_that_do_not_fit_the_model_name_its_maps(tmp_path):
    """--markers of another kind of model is one line naming what this model predicts."""
    import os
    import subprocess
    import sys
    from conftest import BRIGHTNESS_SIDECAR, export_brightness_model
    from hang import HANG_SECONDS
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    import cv2
    one = export_brightness_model(str(tmp_path / 'one'), BRIGHTNESS_SIDECAR)
    cv2.imwrite(str(tmp_path / 'a.png'), np.zeros((32, 32), np.uint8))
    done = subprocess.run([sys.executable, os.path.join(root, 'bin', 'predict'), '--model', one, '--input',
                           str(tmp_path / 'a.png'), '--output', str(tmp_path / 'out'), '--markers', 'flow'],
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 2 and done.stderr.count('\n') == 1, done.stderr
    assert '--markers flow needs a mask+flow model; this one predicts the foreground only' in done.stderr
