"""Every image is used whole or refused (issue 70, rule 1), generated over the kinds of
input rather than picked: stacks of every axis layout (refused naming the file and its
shape, or read as the plane ``--plane`` names), arrays given to the Python API in every
dtype and prediction mode (converted as the CLI converts a file of that dtype), and
JPEGs with each EXIF orientation (turned as viewers show them)."""
import os
import struct

import cv2
import mxnet as mx
import numpy as np
import pytest
import tifffile

from conftest import export_brightness_model, nuclei_png, run_cli
from gluon_unet.cli import predict_main, train_main
from gluon_unet.config import ModelConfig
from gluon_unet.data.io import image_array, read_image, read_mask, read_raw
from gluon_unet.data.readers import LoadOptions, load_dataset
from gluon_unet.errors import UserError
from gluon_unet.inference.batched import predict_image
from gluon_unet.inference.tiling import MODES
from gluon_unet.model import build_model

H, W = 24, 20


def _planes(n, channels=0, dtype=np.uint16):
    """``n`` distinct (H, W[, channels]) planes: plane k is k * 1000 + a ramp."""
    ramp = np.arange(H * W * max(channels, 1)).reshape((H, W) + ((channels,) if channels else ()))
    return np.stack([k * 1000 + ramp for k in range(n)]).astype(dtype)


def _write_tifffile(path, planes, shape, **kw):
    tifffile.imwrite(path, planes.reshape(shape + planes.shape[1:]), **kw)


def _write_opencv(path, planes, shape):
    # OpenCV writes LZW, which tifffile cannot decode without imagecodecs: the fallback path.
    assert cv2.imwritemulti(path, list(planes.astype(np.uint8)))


#: (name, writer, planes, the stack's shape before the image axes, channels per pixel)
STACKS = [('pages', lambda p, a, s: _write_tifffile(p, a, s, photometric='minisblack'), 3, (3,), 0),
          ('imagej-z', lambda p, a, s: _write_tifffile(p, a, s, imagej=True, metadata={'axes': 'ZYX'}), 5, (5,), 0),
          ('imagej-channels', lambda p, a, s: _write_tifffile(p, a, s, imagej=True, metadata={'axes': 'CYX'}), 2,
           (2,), 0),
          ('imagej-tzc', lambda p, a, s: _write_tifffile(p, a, s, imagej=True, metadata={'axes': 'TZCYX'}), 12,
           (2, 3, 2), 0),
          ('rgb-stack', lambda p, a, s: _write_tifffile(p, a, s, photometric='rgb'), 4, (4,), 3),
          ('lzw-opencv', _write_opencv, 3, (3,), 0)]


@pytest.mark.parametrize('name, write, n, shape, channels', STACKS, ids=[s[0] for s in STACKS])
def test_a_stack_is_refused_naming_file_and_shape_or_read_as_the_plane_asked(tmp_path, name, write, n, shape,
                                                                             channels):
    planes = _planes(n, channels, np.uint8 if name == 'lzw-opencv' else np.uint16)
    path = str(tmp_path / ('%s.tif' % name))
    write(path, planes, shape)
    with pytest.raises(UserError) as e:
        read_raw(path)
    msg = str(e.value)
    assert path in msg and 'stack of %d planes' % n in msg and '--plane' in msg and '\n' not in msg
    assert 'x'.join(str(s) for s in shape) in msg  # its shape
    for plane in {0, n // 2, n - 1}:
        assert np.array_equal(read_raw(path, plane), planes[plane]), plane
    with pytest.raises(UserError, match='has no plane %d' % n):
        read_raw(path, n)
    with pytest.raises(UserError, match='stack'):  # masks follow the same rule
        read_mask(path)


@pytest.mark.parametrize('kw, shape', [({}, (H, W)), ({'photometric': 'rgb'}, (H, W, 3)),
                                       ({'photometric': 'rgb', 'planarconfig': 'separate'}, (3, H, W))],
                         ids=['grey', 'rgb', 'planar-rgb'])
def test_one_plane_is_read_whole_with_or_without_plane(tmp_path, kw, shape):
    arr = np.random.default_rng(0).integers(0, 60000, shape).astype(np.uint16)
    path = str(tmp_path / 'one.tif')
    tifffile.imwrite(path, arr, **kw)
    want = np.moveaxis(arr, 0, -1) if kw.get('planarconfig') else arr
    assert np.array_equal(read_raw(path), want) and np.array_equal(read_raw(path, 3), want)


def test_more_samples_per_pixel_than_rgba_are_refused(tmp_path):
    path = str(tmp_path / 'five.tif')
    tifffile.imwrite(path, np.zeros((H, W, 5), np.uint8), photometric='minisblack', planarconfig='contig')
    with pytest.raises(UserError, match='five.tif'):
        read_image(path)


# -- the commands ---------------------------------------------------------------------------

def _stack_folder(tmp_path):
    folder = tmp_path / 'in'
    folder.mkdir()
    (folder / 'a.png').write_bytes(nuclei_png(0, 32))
    planes = np.stack([cv2.imdecode(np.frombuffer(nuclei_png(s, 32), np.uint8), cv2.IMREAD_GRAYSCALE)
                       for s in (1, 2, 3)])
    tifffile.imwrite(str(folder / 'b.tif'), planes, imagej=True, metadata={'axes': 'ZYX'})
    return folder, planes


def test_predict_refuses_a_stack_in_one_line_or_segments_the_plane_named(tmp_path, capsys):
    model = export_brightness_model(str(tmp_path / 'export'))
    folder, planes = _stack_folder(tmp_path)
    argv = ['--model', model, '--input', str(folder / 'b.tif'), '--output', str(tmp_path / 'out'), '--no-progress']
    assert run_cli(predict_main, argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and 'b.tif' in err[0] and 'stack of 3 planes' in err[0] and 'Traceback' not in err[0]
    assert not os.path.exists(tmp_path / 'out')
    # in a folder the stack is one failed image among good ones, named
    argv[3] = str(folder)
    assert run_cli(predict_main, argv) == 1
    assert 'b.tif' in capsys.readouterr().err
    argv = argv[:-1] + ['--plane', '2', '--output', str(tmp_path / 'out2')]
    assert run_cli(predict_main, argv) == 0
    assert '--plane 2' in capsys.readouterr().err  # said
    mask = cv2.imread(str(tmp_path / 'out2' / 'b_mask.png'), cv2.IMREAD_GRAYSCALE)
    assert mask.shape == planes[2].shape and mask.any()


def test_train_refuses_a_stack_in_one_line_and_reads_the_plane_named(tmp_path, capsys):
    folder, planes = _stack_folder(tmp_path)
    (folder / 'a.png').unlink()
    masks = (planes > planes.mean()).astype(np.uint8) * 255
    tifffile.imwrite(str(folder / 'b_mask.tif'), masks, imagej=True, metadata={'axes': 'ZYX'})
    cv2.imwrite(str(folder / 'c.png'), planes[0])
    cv2.imwrite(str(folder / 'c_mask.png'), masks[0])
    argv = ['--data', str(folder), '--epochs', '1', '--size', '32', '--width', '4', '--depth', '2', '--no-progress',
            '--output', str(tmp_path / 'run'), '--cache-dir', str(tmp_path / 'cache')]
    assert run_cli(train_main, argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and 'b.tif' in err[0] and 'stack of 3 planes' in err[0], err
    assert not os.path.exists(tmp_path / 'run')
    ds = load_dataset(str(folder), options=LoadOptions(size=32, workers=0, cache_dir=False, progress=False, plane=1))
    b = ds.names.index('b')
    assert np.array_equal(ds.masks[b] > 0, cv2.resize(masks[1], (32, 32), interpolation=cv2.INTER_NEAREST) > 0)
    assert np.array_equal(ds.images[b][..., 0], cv2.resize(planes[1], (32, 32), interpolation=cv2.INTER_AREA))


# -- the Python API takes what the CLI takes ---------------------------------------------------

def _net():
    mx.random.seed(0)
    net = build_model(ModelConfig(in_channels=1, width=4, depth=2, batch_norm=False))
    net.initialize(mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2), ctx=mx.cpu())
    return net


DTYPES = [np.uint16, np.int32, np.float32, np.float64]


@pytest.mark.parametrize('dtype', DTYPES, ids=[np.dtype(d).name for d in DTYPES])
def test_an_array_is_converted_as_the_cli_converts_a_file_of_its_dtype_in_every_mode(tmp_path, dtype):
    rng = np.random.default_rng(1)
    arr = (rng.random((40, 36)) * (1.0 if np.dtype(dtype).kind == 'f' else 4000)).astype(dtype)
    path = str(tmp_path / 'x.tif')
    tifffile.imwrite(path, arr)
    as_file = read_image(path)  # what bin/predict reads
    assert np.array_equal(image_array(arr), as_file)
    net, meta = _net(), {'train_size': 32, 'multiple': 4}
    for mode in MODES:
        got = predict_image(net, meta, arr, [mx.cpu()], mode=mode)
        want = predict_image(net, meta, as_file, [mx.cpu()], mode=mode)
        assert np.array_equal(got, want), (mode, float(np.abs(got - want).max()))


@pytest.mark.parametrize('bad, words', [(np.zeros((3, 32, 32), np.uint8), ['3x32x32']),
                                        (np.zeros((32, 32, 2, 2), np.float32), ['32x32x2x2', 'stack']),
                                        (np.full((32, 32), np.nan, np.float32), ['NaN']),
                                        (np.zeros((32, 32), np.complex64), ['complex64']),
                                        (np.array([['a'] * 32] * 32), ['not an image'])],
                         ids=['three-planes', '4-d', 'nan', 'complex', 'text'])
def test_what_is_no_image_is_refused_by_the_api_in_one_line(bad, words):
    with pytest.raises(UserError) as e:
        predict_image(_net(), {'train_size': 32, 'multiple': 4}, bad, [mx.cpu()], mode='whole')
    assert all(w in str(e.value) for w in words) and '\n' not in str(e.value)


# -- EXIF orientation ------------------------------------------------------------------------

def _exif_jpeg(image, orientation, order):
    """JPEG bytes of ``image`` with an EXIF APP1 segment whose IFD0 holds only Orientation."""
    ok, jpeg = cv2.imencode('.jpg', image, [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok
    end = '<' if order == b'II' else '>'
    ifd = struct.pack(end + 'H', 1) + struct.pack(end + 'HHIHH', 0x0112, 3, 1, orientation, 0) + struct.pack(end + 'I', 0)
    tiff = order + struct.pack(end + 'HI', 42, 8) + ifd
    app1 = b'Exif\0\0' + tiff
    jpeg = jpeg.tobytes()
    return jpeg[:2] + b'\xff\xe1' + struct.pack('>H', len(app1) + 2) + app1 + jpeg[2:]


@pytest.mark.parametrize('orientation', range(1, 9))
@pytest.mark.parametrize('order', [b'II', b'MM'], ids=['little-endian', 'big-endian'])
def test_a_jpeg_is_turned_as_its_exif_orientation_says(tmp_path, orientation, order):
    rng = np.random.default_rng(orientation)
    image = cv2.GaussianBlur(rng.integers(0, 255, (H, W, 3)).astype(np.uint8), (5, 5), 2)
    image[:4, :6] = (250, 10, 10)  # a corner to tell the turns apart
    path = str(tmp_path / 'x.jpg')
    with open(path, 'wb') as f:
        f.write(_exif_jpeg(image, orientation, order))
    # cv2.imread applies EXIF orientation (as viewers do), from the same decoder
    shown = cv2.imread(path, cv2.IMREAD_COLOR)[..., ::-1]
    assert shown.shape[:2] == ((W, H) if orientation >= 5 else (H, W))
    assert np.array_equal(read_image(path), shown)
    mask = read_mask(path)[0]  # a JPEG mask turns with its image
    assert mask.shape == shown.shape[:2]
