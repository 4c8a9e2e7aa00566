"""Image kinds, --balance groups, --normalize stain and the denoise before the stretch
(issue 13 item 4: image kinds that are rare or look different)."""
import json
import os
import subprocess
import sys

import cv2
import numpy as np
import pytest

from gluon_unet.data import load_dataset
from gluon_unet.data.io import image_kind, input_image, normalize_image, read_image
from gluon_unet.data.sampler import EpochSampler, balanced_order
from gluon_unet.errors import UserError
from hang import HANG_SECONDS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))


def _disc_mask(shape, centres, r):
    yy, xx = np.mgrid[:shape[0], :shape[1]]
    mask = np.zeros(shape, bool)
    for cy, cx in centres:
        mask |= (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
    return mask


def _fluorescence(size=32):
    nuc = _disc_mask((size, size), [(10, 10), (22, 20)], 5)
    return np.where(nuc, 180, 15).astype(np.uint8), nuc


def _brightfield(size=32):
    nuc = _disc_mask((size, size), [(12, 12)], 6)
    return np.where(nuc, 90, 210).astype(np.uint8), nuc


def _tissue(h=40, w=60):
    """H&E-like RGB: white glass (left third), pink eosin tissue, purple-blue nuclei in it."""
    img = np.empty((h, w, 3), np.uint8)
    img[:] = (245, 245, 245)
    img[:, w // 3:] = (235, 150, 190)
    nuc = _disc_mask((h, w), [(20, 40), (10, 28)], 5)
    img[nuc] = (95, 60, 160)
    return img, nuc


def _write_rgb(path, img):
    cv2.imwrite(path, np.ascontiguousarray(img[..., ::-1]) if img.ndim == 3 else img)


# -- kinds and groups ------------------------------------------------------------------------

def test_image_kind_tells_fluorescence_brightfield_and_colour_tissue_apart():
    assert image_kind(_fluorescence()[0][..., None]) == 'fluorescence'
    assert image_kind(_brightfield()[0][..., None]) == 'brightfield'
    assert image_kind(_tissue()[0]) == 'colour'
    grey_as_rgb = np.repeat(_brightfield()[0][..., None], 3, axis=2)  # grey saved as RGB is not colour
    assert image_kind(grey_as_rgb) == 'brightfield'


def _folder(tmp_path, kinds):
    """A paired folder with one image per entry of ``kinds``; returns its path."""
    d = tmp_path / 'data'
    (d / 'images').mkdir(parents=True)
    (d / 'masks').mkdir()
    make = {'fluorescence': _fluorescence, 'brightfield': _brightfield, 'colour': lambda: _tissue(32, 32)}
    for i, kind in enumerate(kinds):
        img, nuc = make[kind]()
        _write_rgb(str(d / 'images' / ('%s%d.png' % (kind, i))), img)
        cv2.imwrite(str(d / 'masks' / ('%s%d.png' % (kind, i))), nuc.astype(np.uint8) * 255)
    return d


def test_load_dataset_groups_images_by_kind_and_keeps_them_through_the_cache_and_subsets(tmp_path):
    kinds = ['fluorescence'] * 3 + ['brightfield', 'colour']
    d = _folder(tmp_path, kinds)
    kw = dict(size=32, workers=0, progress=False, cache_dir=str(tmp_path / 'cache'))
    for _ in range(2):  # decode, then a cache hit
        ds = load_dataset(str(d / 'images'), str(d / 'masks'), **kw)
        assert sorted(ds.groups) == sorted(kinds)
        assert all(name.startswith(g) for name, g in zip(ds.names, ds.groups))
    sub = ds.subset([3, 4])
    assert sub.groups == ds.groups[3:]


def test_a_csv_group_column_overrides_the_kinds_and_an_empty_cell_is_refused(tmp_path):
    d = _folder(tmp_path, ['fluorescence', 'fluorescence', 'brightfield'])
    names = sorted(os.listdir(d / 'images'))
    rows = ['image,mask,group'] + ['images/%s,masks/%s,%s' % (n, n, 'rare' if i == 0 else 'common')
                                   for i, n in enumerate(names)]
    (d / 'list.csv').write_text('\n'.join(rows) + '\n')
    ds = load_dataset(str(d / 'list.csv'), size=32, workers=0, progress=False, cache_dir=False)
    assert ds.groups == ['rare', 'common', 'common']
    (d / 'bad.csv').write_text('image,mask,group\nimages/%s,masks/%s,\n' % (names[0], names[0]))
    with pytest.raises(UserError, match=r'bad\.csv line 2: empty group'):
        load_dataset(str(d / 'bad.csv'), size=32, workers=0, progress=False, cache_dir=False)


# -- balanced sampling -----------------------------------------------------------------------

GROUPS = ['fluo'] * 90 + ['bf'] * 4 + ['he'] * 6


def test_balanced_sampler_draws_every_group_equally_often_in_an_epoch_of_the_same_length():
    sampler = EpochSampler(len(GROUPS), seed=3, groups=GROUPS)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        pairs = list(sampler)
        assert len(pairs) == len(GROUPS) == len(sampler)
        counts = {g: sum(GROUPS[i] == g for i, _ in pairs) for g in set(GROUPS)}
        assert sorted(counts.values()) == [33, 33, 34], counts
        # the 4 brightfield images are each drawn 8 or 9 times, never one of them much more
        bf = np.bincount([i for i, _ in pairs if GROUPS[i] == 'bf'], minlength=100)[90:94]
        assert bf.min() >= 8 and bf.max() <= 9, bf
        # the repeats of one image get different augmentation seeds
        assert len({s for i, s in pairs if i == 90}) == bf[0]
    without = EpochSampler(len(GROUPS), seed=3)
    assert sum(GROUPS[i] == 'bf' for i, _ in without) == 4


def test_sqrt_balance_draws_groups_in_proportion_to_the_square_root_of_their_size():
    sampler = EpochSampler(len(GROUPS), seed=3, groups=GROUPS, power=0.5)
    pairs = list(sampler)
    counts = {g: sum(GROUPS[i] == g for i, _ in pairs) for g in set(GROUPS)}
    w = {g: np.sqrt(GROUPS.count(g)) for g in counts}
    expected = {g: 100 * w[g] / sum(w.values()) for g in w}  # fluo ~64.8, he ~16.7, bf ~13.6
    assert len(pairs) == 100 and all(abs(counts[g] - expected[g]) <= 1 for g in counts), (counts, expected)
    assert counts['bf'] > 4 and counts['fluo'] > 33  # rarer than equal shares, commoner than none
    assert np.bincount(balanced_order(np.asarray([0] * 7 + [1] * 3), 10, np.random.default_rng(0), 1.0),
                       minlength=10).tolist() == [1] * 10  # power 1: every sample once, no balancing


def test_oversample_draws_every_group_as_often_as_the_largest_and_keeps_all_of_it():
    from gluon_unet.data.prepare import balanced_epoch_length
    length = balanced_epoch_length(GROUPS, 'oversample')
    assert length == 3 * 90 and balanced_epoch_length(GROUPS, 'groups') is None
    assert balanced_epoch_length(None, 'oversample') is None
    sampler = EpochSampler(len(GROUPS), seed=3, groups=GROUPS, epoch_length=length, block=8, num_shards=2, shard=1)
    assert len(sampler) == 136  # 270 draws dealt to 2 shards in blocks of 8, padded
    sampler = EpochSampler(len(GROUPS), seed=3, groups=GROUPS, epoch_length=length)
    pairs = list(sampler)
    assert len(pairs) == len(sampler) == 270
    counts = {g: sum(GROUPS[i] == g for i, _ in pairs) for g in set(GROUPS)}
    assert counts == {'fluo': 90, 'bf': 90, 'he': 90}
    # every fluorescence image exactly once: the common group is not cut down
    assert sorted(i for i, _ in pairs if GROUPS[i] == 'fluo') == list(range(90))
    assert len({s for _, s in pairs}) > 260  # every draw its own augmentation seed
    with pytest.raises(ValueError, match='epoch_length must be >= 1'):
        EpochSampler(len(GROUPS), groups=GROUPS, epoch_length=0)


def test_balanced_sampler_is_deterministic_for_a_seed_and_changes_with_seed_and_epoch():
    def order(seed, epoch):
        s = EpochSampler(len(GROUPS), seed=seed, groups=GROUPS)
        s.set_epoch(epoch)
        return list(s)
    assert order(1, 2) == order(1, 2)
    assert order(1, 2) != order(1, 3) and order(1, 2) != order(2, 2)
    # group labels of any type; the same draws whatever their names
    ids = np.unique(GROUPS, return_inverse=True)[1]
    assert np.array_equal(balanced_order(ids, 100, np.random.default_rng(5)),
                          balanced_order(np.asarray(GROUPS), 100, np.random.default_rng(5)))


def test_balanced_shards_partition_the_epoch_in_blocks_and_resume_skips_its_start():
    single = EpochSampler(len(GROUPS), seed=7, groups=GROUPS, block=4)
    full = list(single)
    shards = [list(EpochSampler(len(GROUPS), seed=7, groups=GROUPS, num_shards=3, shard=r, block=4))
              for r in range(3)]
    assert len({len(s) for s in shards}) == 1  # equal lengths: nobody waits at the end of an epoch
    dealt = []
    for k in range(len(shards[0]) // 4):  # round k: block k of every shard, in rank order
        for s in shards:
            dealt += s[4 * k:4 * k + 4]
    assert dealt[:len(full)] == full  # the single-process epoch, dealt out ...
    assert dealt[len(full):] == full[:len(dealt) - len(full)]  # ... padded by wrapping around
    resumed = EpochSampler(len(GROUPS), seed=7, groups=GROUPS, block=4)
    resumed.set_epoch(0, skip_samples=12)
    assert list(resumed) == full[12:]


# -- stain-aware input and the denoise -------------------------------------------------------

def test_stain_makes_hematoxylin_nuclei_bright_and_pink_tissue_and_glass_dark():
    img, nuc = _tissue()
    tissue = ~nuc & (np.arange(img.shape[1]) >= img.shape[1] // 3)[None]
    out = normalize_image(img, 'stain')
    assert out.shape == img.shape[:2] + (1,) and out.dtype == np.uint8
    h = out[..., 0].astype(float)
    assert h[nuc].mean() > 180 and h[tissue].mean() < 30 and h[:, :10].mean() < 30
    # the grey, inverted input of 'auto' makes the tissue itself look half like foreground
    grey = input_image(img, 1, 'auto')[..., 0].astype(float)
    assert grey[tissue].mean() > 60 > grey[:, :10].mean()
    # grey images get 'auto'; for a 3-channel model the hematoxylin is repeated
    bf = _brightfield()[0][..., None]
    assert np.array_equal(normalize_image(bf, 'stain'), normalize_image(bf, 'auto'))
    three = input_image(img, 3, 'stain')
    assert three.shape[2] == 3 and np.array_equal(three[..., 0], out[..., 0]) and np.array_equal(three[..., 2],
                                                                                                 out[..., 0])


def test_the_denoise_keeps_a_dim_noisy_nucleus_one_object():
    from skimage.filters import threshold_otsu
    from skimage.measure import label
    rng = np.random.default_rng(0)
    nuc = _disc_mask((64, 64), [(32, 32)], 12)
    # a dim nucleus (4 grey levels above the background) in shot-like noise
    img = np.clip(rng.normal(np.where(nuc, 8.0, 4.0), 2.0), 0, 255).round().astype(np.uint8)[..., None]
    pieces = {}
    for sigma in (0.0, 1.0):
        x = normalize_image(img, 'percentile', denoise=sigma)[..., 0]
        pieces[sigma] = label(x > threshold_otsu(x), connectivity=2).max()
    assert pieces[0.0] > 10 and pieces[1.0] <= 3, pieces


# -- training -> export -> predict -----------------------------------------------------------

def test_training_and_predict_feed_the_network_the_same_stain_normalized_input(tiny, tmp_path, monkeypatch):
    from gluon_unet.inference import batched as inference, predict
    from gluon_unet.training.loop import fit

    d = _folder(tmp_path, ['colour', 'colour', 'fluorescence', 'brightfield'])
    cfg = tiny(data=str(d / 'images'), masks=str(d / 'masks'), crop=16, epochs=1, batch_size=2, val_split=0.0,
               normalize='stain', balance='oversample', cache_dir=str(tmp_path / 'cache'), in_channels=0,
               tune_postprocess=False)
    run = fit(cfg, verbose=False)
    with open(os.path.join(run.output, 'train.log')) as f:
        log = f.read()
    # 3 groups as large as the largest (colour, 2 images): 6 draws, 3 batches of 2
    assert 'draws per epoch: brightfield ~2, colour ~2, fluorescence ~2' in log and ' 3 steps per epoch' in log, log
    trained = load_dataset(str(d / 'images'), str(d / 'masks'), crop=16, workers=0, progress=False,
                           normalize='stain', cache_dir=str(tmp_path / 'cache'))
    assert trained.channels == 1  # the hematoxylin leaves no colour
    seen = []
    monkeypatch.setattr(inference.LoadedModel, 'image_jobs',
                        lambda self, image, *a, **k: seen.append(np.array(image)) or [])
    files = [str(d / 'images' / (n + '.png')) for n in trained.names]
    for path in files:
        predict.predict_paths(run.output, path, str(tmp_path / 'pred'), mode='whole', progress=False)
    for name, net_input in zip(trained.names, seen):
        assert np.array_equal(net_input, np.asarray(trained.images[trained.names.index(name)])), name
    # an export from before the denoise existed predicts as before (no denoise)
    sidecar = os.path.join(run.output, 'export', 'model.json')
    with open(sidecar) as f:
        meta = json.load(f)
    assert meta['normalize'] == 'stain' and meta['normalize_denoise'] == 1.0
    del meta['normalize_denoise']
    with open(sidecar, 'w') as f:
        json.dump(meta, f)
    seen.clear()
    grey = [f for f in files if 'fluorescence' in f][0]
    predict.predict_paths(run.output, grey, str(tmp_path / 'pred'), mode='whole', progress=False)
    assert np.array_equal(seen[0], normalize_image(read_image(grey, 1), 'auto', denoise=0))
    assert not np.array_equal(seen[0], normalize_image(read_image(grey, 1), 'auto'))


# -- bad values --------------------------------------------------------------------------------

@pytest.mark.parametrize('argv, flag', [(['--balance', 'kinds'], '--balance'), (['--normalize', 'he'], '--normalize'),
                                        (['--denoise', '-1'], '--denoise')])
def test_bin_train_refuses_bad_values_in_one_line_with_exit_2(argv, flag, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'train')] + argv + ['--output', str(tmp_path / 'r')],
                       capture_output=True, text=True, env=env, timeout=HANG_SECONDS)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], r.stderr


def test_balance_groups_without_groups_is_refused_in_one_line(tiny):
    from gluon_unet.training.loop import fit
    with pytest.raises(UserError, match='--balance groups'):
        fit(tiny(balance='groups', epochs=1), verbose=False)


def test_denoise_is_a_setting_the_data_and_the_export_follow(tiny, tmp_path):
    """--denoise 0 reproduces the inputs of runs made before the denoise existed."""
    from gluon_unet.data.prepare import build_datasets
    from gluon_unet.training.loop import fit
    d = _folder(tmp_path, ['fluorescence', 'fluorescence', 'brightfield'])
    base = dict(data=str(d / 'images'), masks=str(d / 'masks'), crop=16, epochs=1, batch_size=2, val_split=0.0,
                normalize='auto', cache_dir=str(tmp_path / 'cache'), in_channels=0, tune_postprocess=False)
    off, on = build_datasets(tiny(denoise=0.0, **base))[0], build_datasets(tiny(**base))[0]
    for i, name in enumerate(off.names):
        raw = read_image(str(d / 'images' / (name + '.png')), 1)
        assert np.array_equal(np.asarray(off.images[i]), normalize_image(raw, 'auto', denoise=0))
        assert np.array_equal(np.asarray(on.images[i]), normalize_image(raw, 'auto', denoise=1.0))
    run = fit(tiny(denoise=0.0, output=str(tmp_path / 'r0'), **base), verbose=False)
    with open(os.path.join(run.output, 'export', 'model.json')) as f:
        assert json.load(f)['normalize_denoise'] == 0.0
