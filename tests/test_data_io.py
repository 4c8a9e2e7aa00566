"""Reading images and masks in every supported format (files generated here)."""
import cv2
import numpy as np
import pytest
import tifffile

from gluon_unet.data import synthetic_nuclei
from gluon_unet.data.io import PERCENTILES, read_image, read_mask, to_uint8
from gluon_unet.errors import UserError


@pytest.fixture(scope='module')
def nuclei():
    images, masks, instances = synthetic_nuclei(2, size=40, channels=3, seed=3)
    return images[0], masks[0], instances[0]


def _write(path, rgb_or_gray):
    """Write with OpenCV (which wants BGR)."""
    a = rgb_or_gray
    if a.ndim == 3 and a.shape[2] == 3:
        a = a[..., ::-1]
    elif a.ndim == 3 and a.shape[2] == 4:
        a = a[..., [2, 1, 0, 3]]
    assert cv2.imwrite(str(path), np.ascontiguousarray(a))
    return str(path)


@pytest.mark.parametrize('ext', ['png', 'bmp', 'tif'])
def test_lossless_rgb_roundtrip(tmp_path, nuclei, ext):
    img = nuclei[0]
    path = _write(tmp_path / ('a.' + ext), img)
    out = read_image(path)
    assert out.shape == (40, 40, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out, img)  # RGB order kept (not BGR)


def test_gray_rgba_and_channel_conversion(tmp_path, nuclei):
    img = nuclei[0]
    gray = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY)
    g = read_image(_write(tmp_path / 'g.png', gray))
    assert g.shape == (40, 40, 1)
    np.testing.assert_array_equal(g[..., 0], gray)
    rgba = np.dstack([img, np.full(img.shape[:2], 7, np.uint8)])
    a = read_image(_write(tmp_path / 'a.png', rgba))
    np.testing.assert_array_equal(a, img)  # alpha dropped, colour kept
    one = read_image(str(tmp_path / 'a.png'), channels=1)
    np.testing.assert_array_equal(one[..., 0], gray)
    three = read_image(str(tmp_path / 'g.png'), channels=3)
    assert three.shape == (40, 40, 3)
    np.testing.assert_array_equal(three[..., 2], gray)


def test_jpeg_close_to_source(tmp_path, nuclei):
    img = nuclei[0]
    out = read_image(_write(tmp_path / 'a.jpg', img))
    assert out.shape == img.shape
    assert np.abs(out.astype(int) - img).mean() < 6  # lossy, but the right picture and order


@pytest.mark.parametrize('writer', ['png16', 'tif16', 'tif_float'])
def test_high_bit_depth_normalized_by_percentiles(tmp_path, writer):
    rng = np.random.default_rng(0)
    base = rng.uniform(1000, 3000, (30, 30))
    if writer == 'png16':
        arr = base.astype(np.uint16)
        path = _write(tmp_path / 'a.png', arr)
    elif writer == 'tif16':
        arr = base.astype(np.uint16)
        path = str(tmp_path / 'a.tif')
        tifffile.imwrite(path, arr)
    else:
        arr = (base / 3000).astype(np.float32)
        path = str(tmp_path / 'a.tiff')
        tifffile.imwrite(path, arr)
    out = read_image(path)
    assert out.dtype == np.uint8 and out.shape == (30, 30, 1)
    lo, hi = np.percentile(arr.astype(np.float32), PERCENTILES)
    expect = np.clip(np.rint((arr.astype(np.float32) - lo) * 255 / (hi - lo)), 0, 255)
    np.testing.assert_array_equal(out[..., 0], expect)
    assert out.min() == 0 and out.max() == 255


def test_to_uint8_constant_and_uint8():
    assert to_uint8(np.full((4, 4), 500, np.uint16)).max() == 0
    a = np.arange(16, dtype=np.uint8).reshape(4, 4)
    assert to_uint8(a) is a


@pytest.mark.parametrize('kind', ['0_255', '0_1', 'jpeg'])
def test_binary_masks(tmp_path, nuclei, kind):
    mask = nuclei[1]
    if kind == '0_255':
        path = _write(tmp_path / 'm.png', mask * 255)
    elif kind == '0_1':
        path = _write(tmp_path / 'm.png', mask)
    else:
        path = _write(tmp_path / 'm.jpg', mask * 255)
    m, inst = read_mask(path)
    assert m.dtype == np.uint8 and set(np.unique(m)) <= {0, 1}
    assert inst is None
    if kind == 'jpeg':
        assert (m == mask).mean() > 0.98
    else:
        np.testing.assert_array_equal(m, mask)


def test_label_mask_keeps_instances(tmp_path, nuclei):
    inst = nuclei[2]
    assert inst.max() >= 2
    m, got = read_mask(_write(tmp_path / 'm.png', inst.astype(np.uint16)))
    np.testing.assert_array_equal(got, inst)
    np.testing.assert_array_equal(m, (inst > 0).astype(np.uint8))
    path = str(tmp_path / 'm.tif')
    tifffile.imwrite(path, inst.astype(np.int32))
    np.testing.assert_array_equal(read_mask(path)[1], inst)


def test_rgb_mask_any_channel_and_colour_instances(tmp_path, nuclei):
    inst = nuclei[2]
    rgb = np.zeros(inst.shape + (3,), np.uint8)
    rgb[inst == 1, 0] = 200  # red object
    rgb[inst == 2, 2] = 9    # faint blue object
    m, got = read_mask(_write(tmp_path / 'm.png', rgb))
    np.testing.assert_array_equal(m, np.isin(inst, [1, 2]).astype(np.uint8))
    assert len(np.unique(got[got > 0])) == 2
    assert len(np.unique(got[inst == 1])) == 1 and len(np.unique(got[inst == 2])) == 1
    white = np.repeat((inst > 0)[..., None] * 255, 3, axis=2).astype(np.uint8)
    m2, got2 = read_mask(_write(tmp_path / 'w.png', white))
    np.testing.assert_array_equal(m2, (inst > 0).astype(np.uint8))
    assert got2 is None


@pytest.mark.parametrize('ext', ['png', 'jpg', 'bmp', 'tif'])
def test_truncated_file_names_it(tmp_path, nuclei, ext):
    path = tmp_path / ('t.' + ext)
    if ext == 'tif':
        tifffile.imwrite(str(path), nuclei[0])
    else:
        _write(path, nuclei[0])
    data = path.read_bytes()
    path.write_bytes(data[:len(data) * 2 // 3])
    with pytest.raises(UserError, match=r't\.%s' % ext):
        read_image(str(path))


def test_corrupt_missing_empty(tmp_path):
    bad = tmp_path / 'bad.png'
    bad.write_bytes(b'this is not a png at all' * 10)
    with pytest.raises(UserError, match='bad.png'):
        read_image(str(bad))
    with pytest.raises(UserError, match='nope.png'):
        read_mask(str(tmp_path / 'nope.png'))
    empty = tmp_path / 'empty.jpg'
    empty.write_bytes(b'')
    with pytest.raises(UserError, match='empty.jpg.*empty'):
        read_image(str(empty))
