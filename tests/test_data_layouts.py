"""Layout discovery and load_dataset on folders, the DSB layout and CSVs made here."""
import os
import warnings

import cv2
import numpy as np
import pytest
import tifffile

from gluon_unet.data import discover, load_dataset, synthetic_nuclei
from gluon_unet.errors import UserError

N, S = 5, 48


@pytest.fixture(scope='module')
def nuclei():
    return synthetic_nuclei(N, size=S, channels=3, seed=7)


def _png(path, a):
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    if a.ndim == 3 and a.shape[2] == 3:
        a = a[..., ::-1]
    assert cv2.imwrite(str(path), np.ascontiguousarray(a))


def make_paired(root, nuclei, suffix='_mask', ext='png', mask_kind='255'):
    images, masks, instances = nuclei
    for i in range(N):
        _png(root / 'im' / ('img%d.%s' % (i, ext)), images[i])
        m = {'255': masks[i] * 255, '01': masks[i], 'label': instances[i].astype(np.uint16)}[mask_kind]
        _png(root / 'mk' / ('img%d%s.png' % (i, suffix)), m)
    return str(root / 'im'), str(root / 'mk')


def make_dsb(root, nuclei):
    images, masks, instances = nuclei
    for i in range(N):
        sid = 'id%02d' % i
        rgba = np.dstack([images[i], np.full((S, S), 255, np.uint8)])
        _png(root / sid / 'images' / (sid + '.png'), rgba[..., [2, 1, 0, 3]])  # cv2 writes BGRA
        for k in range(1, instances[i].max() + 1):
            _png(root / sid / 'masks' / ('m%03d.png' % k), (instances[i] == k).astype(np.uint8) * 255)
    return str(root)


def test_paired_folders_resize(tmp_path, nuclei):
    images, masks, instances = nuclei
    im, mk = make_paired(tmp_path, nuclei)
    ds = load_dataset(im, mk, size=32, workers=0, cache_dir=False, progress=False)
    assert ds.layout == 'paired' and ds.names == ['img%d' % i for i in range(N)]
    assert ds.images.shape == (N, 32, 32, 3) and ds.images.dtype == np.uint8
    assert ds.masks.shape == (N, 32, 32) and set(np.unique(ds.masks)) <= {0, 1}
    assert ds.original_sizes == [(S, S)] * N and ds.channels == 3
    expect = cv2.resize(images[1], (32, 32), interpolation=cv2.INTER_AREA)
    np.testing.assert_array_equal(ds.images[1], expect)
    np.testing.assert_array_equal(ds.masks[1], cv2.resize(masks[1], (32, 32), interpolation=cv2.INTER_NEAREST))
    assert ds.instances(1).dtype == np.int32
    np.testing.assert_array_equal(ds.instances(1) > 0, ds.masks[1] > 0)


@pytest.mark.parametrize('mask_kind', ['01', 'label'])
def test_same_name_pairs_and_label_masks(tmp_path, nuclei, mask_kind):
    im, mk = make_paired(tmp_path, nuclei, suffix='', mask_kind=mask_kind)
    ds = load_dataset(im, mk, size=S, workers=0, cache_dir=False, progress=False)
    np.testing.assert_array_equal(ds.masks[2], nuclei[1][2])
    if mask_kind == 'label':
        np.testing.assert_array_equal(ds.instances(2), nuclei[2][2])


def test_custom_suffix_and_one_folder(tmp_path, nuclei):
    images, masks, _ = nuclei
    for i in range(N):
        _png(tmp_path / 'd' / ('x%d.png' % i), images[i])
        _png(tmp_path / 'd' / ('x%d-gt.png' % i), masks[i] * 255)
    layout, samples = discover(str(tmp_path / 'd'), mask_suffix='-gt')
    assert layout == 'paired' and [s.name for s in samples] == ['x%d' % i for i in range(N)]
    assert samples[0].masks[0].endswith('x0-gt.png')


def test_images_masks_subfolders(tmp_path, nuclei):
    images, masks, _ = nuclei
    for i in range(N):
        _png(tmp_path / 'd' / 'images' / ('a%d.png' % i), images[i])
        _png(tmp_path / 'd' / 'masks' / ('a%d.png' % i), masks[i] * 255)
    layout, samples = discover(str(tmp_path / 'd'))
    assert layout == 'paired' and len(samples) == N


def test_dsb_layout_merges_masks_and_instances(tmp_path, nuclei):
    images, masks, instances = nuclei
    root = make_dsb(tmp_path / 'dsb', nuclei)
    ds = load_dataset(root, size=S, workers=2, cache_dir=False, progress=False)
    assert ds.layout == 'dsb' and ds.names == ['id%02d' % i for i in range(N)]
    np.testing.assert_array_equal(ds.images[3], images[3])  # RGBA -> RGB, no resize
    np.testing.assert_array_equal(ds.masks[3], masks[3])
    np.testing.assert_array_equal(ds.instances(3), instances[3])  # mask file k -> id k


def test_csv_layout_relative_paths_and_formats(tmp_path, nuclei):
    images, masks, instances = nuclei
    d = tmp_path / 'c'
    gray = [cv2.cvtColor(images[i], cv2.COLOR_RGB2GRAY) for i in range(N)]
    _png(d / 'i' / 'a.bmp', gray[0])
    tifffile.imwrite(str(d / 'i' / 'b.tif'), (gray[1].astype(np.uint16) * 257))
    _png(d / 'i' / 'c.png', gray[2])
    _png(d / 'm' / 'a.png', masks[0])
    rgb = np.zeros((S, S, 3), np.uint8)
    rgb[masks[1] > 0] = (0, 80, 0)
    _png(d / 'm' / 'b.png', rgb)
    tifffile.imwrite(str(d / 'm' / 'c.tif'), instances[2])
    (d / 'list.csv').write_text('image,mask\ni/a.bmp,m/a.png\ni/b.tif,m/b.png\ni/c.png,m/c.tif\n')
    ds = load_dataset(str(d / 'list.csv'), size=S, workers=0, cache_dir=False, progress=False)
    assert ds.layout == 'csv' and ds.names == ['a', 'b', 'c']
    assert ds.channels == 1 and ds.images.shape == (3, S, S, 1)  # all grey -> 1 channel
    np.testing.assert_array_equal(ds.images[0, ..., 0], gray[0])
    assert abs(int(ds.images[1].max()) - 255) <= 0 and ds.images[1].min() == 0  # 16-bit normalized
    for i in range(3):
        np.testing.assert_array_equal(ds.masks[i], masks[i])
    np.testing.assert_array_equal(ds.instances(2), instances[2])


def test_channels_forced_and_from_data(tmp_path, nuclei):
    im, mk = make_paired(tmp_path, nuclei)
    ds1 = load_dataset(im, mk, size=32, channels=1, workers=0, cache_dir=False, progress=False)
    assert ds1.channels == 1 and ds1.images.shape[-1] == 1
    x, y = ds1[0]
    assert x.shape == (1, 32, 32) and y.shape == (1, 32, 32)


def test_crop_mode_keeps_native_resolution(tmp_path, nuclei):
    from gluon_unet.data import make_transform
    im, mk = make_paired(tmp_path, nuclei)
    ds = load_dataset(im, mk, crop=32, workers=0, cache_dir=False, progress=False)
    assert ds.images[0].shape == (S, S, 3)
    np.testing.assert_array_equal(ds.images[4], nuclei[0][4])
    ds.transform = make_transform(augment=False, crop=32)
    x, y = ds[(0, 1)]
    assert x.shape == (3, 32, 32) and y.shape == (1, 32, 32)


def test_unpaired_images_error_lists_names_and_count(tmp_path, nuclei):
    im, mk = make_paired(tmp_path, nuclei)
    os.remove(os.path.join(mk, 'img1_mask.png'))
    os.remove(os.path.join(mk, 'img3_mask.png'))
    with pytest.raises(UserError, match=r'2 of 5 images have no mask.*img1\.png, img3\.png'):
        discover(im, mk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        _, samples = discover(im, mk, skip_unpaired=True)
    assert [s.name for s in samples] == ['img0', 'img2', 'img4']
    assert any('img1.png' in str(w.message) for w in caught)


def test_dsb_sample_without_masks(tmp_path, nuclei):
    root = make_dsb(tmp_path / 'dsb', nuclei)
    import shutil
    shutil.rmtree(os.path.join(root, 'id02', 'masks'))
    with pytest.raises(UserError, match='1 of 5 images have no mask.*id02'):
        discover(root)


def test_mask_size_mismatch(tmp_path, nuclei):
    im, mk = make_paired(tmp_path, nuclei)
    _png(os.path.join(mk, 'img2_mask.png'), np.zeros((S, S + 4), np.uint8))
    with pytest.raises(UserError, match=r'img2_mask\.png is 48x52.*img2\.png is 48x48'):
        load_dataset(im, mk, size=32, workers=2, cache_dir=False, progress=False)


def test_corrupt_image_in_dataset_named(tmp_path, nuclei):
    im, mk = make_paired(tmp_path, nuclei)
    with open(os.path.join(im, 'img3.png'), 'r+b') as f:
        f.truncate(200)
    with pytest.raises(UserError, match=r'img3\.png'):
        load_dataset(im, mk, size=32, workers=0, cache_dir=False, progress=False)


def test_bad_folders(tmp_path, nuclei):
    (tmp_path / 'empty').mkdir()
    with pytest.raises(UserError, match='empty.*folder is empty'):
        discover(str(tmp_path / 'empty'))
    with pytest.raises(UserError, match='no such file or folder'):
        discover(str(tmp_path / 'missing'))
    (tmp_path / 'junk').mkdir()
    (tmp_path / 'junk' / 'notes.txt').write_text('hi')
    with pytest.raises(UserError, match='matches no layout; expected'):
        discover(str(tmp_path / 'junk'))
    im, mk = make_paired(tmp_path, nuclei)
    with pytest.raises(UserError, match='images but no masks'):
        discover(im)
    with pytest.raises(UserError, match='not the DSB layout'):
        discover(im, layout='dsb')
    with pytest.raises(UserError, match='--masks .*no such folder'):
        discover(im, str(tmp_path / 'nomasks'))
    (tmp_path / 'x.csv').write_text('img,label\na.png,b.png\n')
    with pytest.raises(UserError, match='"image" and "mask" columns'):
        discover(str(tmp_path / 'x.csv'))
    (tmp_path / 'y.csv').write_text('image,mask\nnot_there.png,m.png\n')
    with pytest.raises(UserError, match='y.csv line 2: image not_there.png not found'):
        discover(str(tmp_path / 'y.csv'))
