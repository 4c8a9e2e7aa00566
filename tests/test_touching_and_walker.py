"""--target mask+touching (the touching border drawn wider for larger nuclei) and the random
walker as the instance step, which the post-processing search chooses like its other settings."""
import numpy as np
import pytest
from scipy import ndimage as ndi

from gluon_unet.data.targets import OUTPUTS, contact_map, make_target, touching_map
from gluon_unet.inference.postprocess import SPLITS, instances_from_maps, instances_from_prob, random_walker_split
from gluon_unet.inference.postprocess_search import RANDOM_WALKER, search_arms, tune_on_maps
from gluon_unet.metrics import dsb_image_score


def _discs(shape, centres, radius):
    yy, xx = np.mgrid[:shape[0], :shape[1]]
    labels = np.zeros(shape, np.int32)
    for i, (cy, cx) in enumerate(centres, start=1):
        labels[(yy - cy) ** 2 + (xx - cx) ** 2 <= radius ** 2] = i
    return labels


@pytest.mark.parametrize('radius, reach', [(7, 1), (15, 2), (30, 3)])  # areas ~150, ~700, ~2800 px
def test_the_touching_band_widens_with_the_nuclei(radius, reach):
    labels = _discs((4 * radius + 20, 4 * radius + 20), [(2 * radius + 10, radius + 10),
                                                         (2 * radius + 10, 3 * radius + 10)], radius)
    band = touching_map(labels)
    row = band[2 * radius + 10]
    inside_a = row & (labels[2 * radius + 10] == 1)
    assert inside_a.sum() == reach  # a nucleus' side of the band: its reach, in pixels
    assert not band[labels == 0].sum() == 0  # the narrow gap between them is filled
    alone = _discs(labels.shape, [(2 * radius + 10, radius + 10)], radius)
    assert not touching_map(alone).any()  # a nucleus that touches nothing has no band
    np.testing.assert_array_equal(contact_map(labels)[labels > 0].sum() > 0, True)
    if reach == 1:  # small nuclei: as the contact map inside them
        np.testing.assert_array_equal(band & (labels > 0), contact_map(labels) & (labels > 0))


def test_touching_is_a_two_map_target_whose_second_map_is_a_contact_map():
    labels = _discs((40, 40), [(20, 12), (20, 27)], 8)
    target = make_target((labels > 0).astype(np.uint8), labels, 'mask+touching')
    assert target.shape == (2, 40, 40) and OUTPUTS['mask+touching'] == ('foreground', 'contact')
    assert target[1].any() and (target[1] <= 1).all()


def _touching_pair():
    labels = _discs((48, 64), [(24, 20), (24, 41)], 11)
    prob = ndi.gaussian_filter((labels > 0).astype(np.float32), 1)
    contact = ndi.gaussian_filter(contact_map(labels).astype(np.float32), 1) * 2
    return labels, np.stack([prob, np.clip(contact, 0, 1)])


def test_the_random_walker_separates_touching_nuclei_from_their_markers():
    truth, maps = _touching_pair()
    for markers in ('contact', 'distance'):
        found = instances_from_maps(maps, split='randomwalker', markers=markers)
        assert found.max() == 2, markers
        assert dsb_image_score(found, truth) > 0.6, markers
    assert 'randomwalker' in SPLITS
    one = instances_from_prob(maps[0] * (truth == 1), split='randomwalker')  # one blob, one marker
    assert one.max() == 1


def test_the_random_walker_gives_every_blob_pixel_a_marker_or_its_own_label():
    mask = np.zeros((20, 30), bool)
    mask[5:15, 3:27] = True
    markers = np.zeros(mask.shape, np.int32)
    markers[10, 6], markers[10, 23] = 1, 2
    elevation = -ndi.distance_transform_edt(mask)
    labels = random_walker_split(markers, elevation, mask)
    assert set(np.unique(labels[mask])) == {1, 2} and not labels[~mask].any()
    assert labels[10, 4] == 1 and labels[10, 25] == 2


def test_the_search_chooses_the_random_walker_only_when_it_scores_higher(monkeypatch):
    from gluon_unet.inference import postprocess_search as search
    truth, maps = _touching_pair()
    arms = search_arms('contact')
    assert arms[-1] == (RANDOM_WALKER, 1)
    result = tune_on_maps([(maps, truth)], second='contact')
    assert result.get('split', 'watershed') in ('watershed', RANDOM_WALKER)
    merged = (truth > 0).astype(np.int32)

    def walker_better(m, **setting):  # every flood merges the pair; the random walker finds it
        return truth if setting.get('split') == RANDOM_WALKER else merged
    monkeypatch.setattr(search, 'instances_from_maps', walker_better)
    chosen = tune_on_maps([(maps, truth)], second='contact')
    assert chosen['split'] == RANDOM_WALKER and chosen['score'] == pytest.approx(1.0)
    assert chosen['base_score'] < 0.5

    def walker_worse(m, **setting):
        return merged if setting.get('split') == RANDOM_WALKER else truth
    monkeypatch.setattr(search, 'instances_from_maps', walker_worse)
    assert 'split' not in tune_on_maps([(maps, truth)], second='contact')


def _separate_pairs(pairs):
    """``pairs`` blobs of two touching discs each, side by side, and their foreground."""
    centres = [(16 + 32 * (k // 2), 12 + 40 * (k % 2) + dx) for k in range(pairs) for dx in (0, 13)]
    truth = _discs((32 * ((pairs + 1) // 2) + 4, 84), centres, 7)
    return truth, ndi.gaussian_filter((truth > 0).astype(np.float32), 1)


@pytest.mark.parametrize('pairs', [1, 2, 3, 4])
@pytest.mark.parametrize('markers', ['distance', 'contact'])
def test_the_random_walker_gives_each_nucleus_its_own_id_across_blobs(pairs, markers):
    # skimage's random_walker numbers its output 1..k in each call, not by seed: solved blob by
    # blob, every blob's nuclei came out as 1 and 2, so separate nuclei shared an id.
    truth, prob = _separate_pairs(pairs)
    second = np.clip(ndi.gaussian_filter(contact_map(truth).astype(np.float32), 1) * 2, 0, 1)
    found = instances_from_maps(np.stack([prob, second]), split='randomwalker', markers=markers, h=0.3)
    flooded = instances_from_maps(np.stack([prob, second]), split='watershed', markers=markers, h=0.3)
    assert found.max() == flooded.max() == 2 * pairs  # the same markers: as many nuclei as the watershed
    blobs, _ = ndi.label(found > 0)
    for i in range(1, found.max() + 1):
        assert len(np.unique(blobs[found == i])) == 1, 'id %d spans separate blobs' % i
        assert ndi.label(found == i)[1] == 1, 'id %d is not one region' % i
    assert dsb_image_score(found, truth) > 0.6
