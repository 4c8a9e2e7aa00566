"""--paste-rate: copies of a crop's own nuclei pasted against other nuclei, the instance
labels (and so every target) following, the augmentation of other runs unchanged."""
import numpy as np
import pytest
from scipy import ndimage as ndi

from gluon_unet.config import TrainConfig
from gluon_unet.data.augment import Augment
from gluon_unet.data.paste import MIN_PASTE_AREA, paste_nuclei
from gluon_unet.data.synthetic import synthetic_nuclei
from gluon_unet.data.targets import make_target
from gluon_unet.errors import UserError


def _crop(seed=0, size=64):
    images, masks, instances = synthetic_nuclei(1, size=size, channels=1, seed=seed)
    return images[0], instances[0].astype(np.int32)


def _touching_pairs(inst):
    """Pairs of labels with 8-adjacent pixels."""
    pairs = set()
    for dy, dx in ((0, 1), (1, 0), (1, 1), (1, -1)):
        a = inst[max(dy, 0):, max(dx, 0):inst.shape[1] + min(dx, 0)]
        b = inst[:inst.shape[0] - dy, max(-dx, 0):inst.shape[1] - max(dx, 0)]
        both = (a > 0) & (b > 0) & (a != b)
        pairs |= {tuple(sorted(p)) for p in zip(a[both], b[both])}
    return pairs


@pytest.mark.parametrize('seed', range(6))
def test_pasted_nuclei_touch_others_and_the_labels_stay_whole(seed):
    image, inst = _crop(seed)
    rng = np.random.default_rng(seed)
    new_image, new_inst = paste_nuclei(image, inst, rng, count=3)
    assert new_image.shape == image.shape and new_inst.shape == inst.shape
    added = sorted(set(np.unique(new_inst)) - set(np.unique(inst)))
    assert 1 <= len(added) <= 3
    for label in added:
        # Each copy touches or overlaps a nucleus that was there: it is in a touching pair.
        assert any(label in pair for pair in _touching_pairs(new_inst)), label
        # Its pixels are those of a nucleus of the crop (turned, flipped): the same values.
        values = np.sort(new_image[new_inst == label].ravel())
        assert len(values) and values.min() >= image[inst > 0].min()
    for label in np.unique(new_inst)[1:]:
        assert ndi.label(new_inst == label)[1] == 1, label  # one piece each
        assert np.count_nonzero(new_inst == label) >= MIN_PASTE_AREA // 3
    assert image is not new_image and np.array_equal(inst, _crop(seed)[1])  # inputs untouched


def test_a_crop_without_nuclei_is_returned_as_it_is():
    image = np.zeros((32, 32, 1), np.uint8)
    inst = np.zeros((32, 32), np.int32)
    out_image, out_inst = paste_nuclei(image, inst, np.random.default_rng(0))
    assert out_image is image and not out_inst.any()


def test_targets_follow_the_pasted_nuclei():
    image, inst = _crop(3)
    _, pasted = paste_nuclei(image, inst, np.random.default_rng(3), count=4)
    border = make_target((pasted > 0).astype(np.uint8), pasted, 'mask+border')
    # the border channel runs between each copy and the nucleus it touches
    for a, b in _touching_pairs(pasted) - _touching_pairs(inst):
        between = ndi.binary_dilation(pasted == a) & ndi.binary_dilation(pasted == b)
        assert border[1][between].mean() > 0.9


def test_the_rate_decides_how_often_and_off_changes_no_seed():
    image, inst = _crop(1)
    mask = (inst > 0).astype(np.uint8)

    def counts(augment):
        return [len(np.unique(augment(image, mask, inst, np.random.default_rng(s))[2])) for s in range(200)]
    plain = counts(Augment(crop=32, paste=0.0))
    always = counts(Augment(crop=32, paste=1.0))
    half = counts(Augment(crop=32, paste=0.5))
    assert plain == counts(Augment(crop=32))  # 0 draws no random number: old runs repeat
    more = [a > p for a, p in zip(always, plain)]
    assert sum(more) > 150  # nearly every crop with a nucleus gets copies
    assert 50 < sum(h > p for h, p in zip(half, plain)) < 150


def test_paste_rate_is_part_of_augment():
    TrainConfig(paste_rate=0.05).validate()
    with pytest.raises(UserError, match='--paste-rate 0.05 pastes nuclei as part of --augment'):
        TrainConfig(paste_rate=0.05, augment=False).validate()
