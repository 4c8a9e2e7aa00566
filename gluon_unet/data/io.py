"""Reading images and masks from files, whatever their format.

Decoders
--------
* PNG, JPEG, BMP (and anything else OpenCV knows): ``cv2.imdecode(..., IMREAD_UNCHANGED)``
  on the file's bytes. OpenCV decodes PNG several times faster than skimage/imageio
  (Pillow), keeps 16-bit PNGs 16-bit, never applies a palette or gamma we did not ask
  for, releases the GIL and works in worker processes. Reading the bytes ourselves
  lets us check for truncation (OpenCV returns a partial image for some truncated
  files instead of failing) and handles non-ASCII paths.
* TIFF: ``tifffile``. It reads every sample format microscopy produces (uint8/16/32,
  int, float32/64, multi-page, planar RGB) where OpenCV silently converts or refuses
  some; it ships with scikit-image, so it adds no dependency. Compressed TIFFs (LZW,
  deflate) need the optional ``imagecodecs`` package in tifffile, so when tifffile
  fails the file goes to OpenCV's libtiff, which reads those.

Every image is used whole or refused: a stack (several pages, or a z, t or channel axis)
is read as the plane ``--plane`` names, else refused naming its shape; more than four
samples per pixel, several full-size images in one TIFF, and arrays that are no image
are refused. A JPEG's EXIF orientation (and a TIFF's Orientation tag) is applied, as
viewers show the image: ``IMREAD_UNCHANGED`` and tifffile return the pixels as stored.

Normalization
-------------
uint8 images are used as they are. Anything else (16-bit, 32-bit, float) is scaled
**per image** so that its 0.5th percentile maps to 0 and its 99.5th percentile to 255
(clipped, rounded to uint8; all channels share one scale so colours keep their balance).
Microscopy 16-bit images rarely use the full range, so dividing by 65535 would leave
them nearly black; percentiles also ignore a few hot pixels. A constant image becomes 0.

Input normalization (``--normalize``)
-------------------------------------
Applied to the uint8 image after the channel conversion, in training and in prediction
alike. ``none`` keeps it; ``invert`` turns an image whose background is bright (median
luma above :data:`BRIGHT_BACKGROUND`: brightfield, H&E tissue) into its negative, so
nuclei are bright on a dark background like in fluorescence; ``percentile`` stretches each image so that its
0.5th and 99.8th percentiles map to 0 and 255 (dim and bright exposures look alike),
after a light Gaussian denoise (:data:`DENOISE_SIGMA`) so that the stretch does not turn
the noise of a dim nucleus into a cluster of specks; ``auto`` does both, in that order.
``stain`` chooses by image kind (:func:`image_kind`): colour images (H&E tissue) become
their hematoxylin channel (:func:`hematoxylin`: nuclei bright, eosin-pink tissue dark),
grey ones get ``auto``. ``stain`` needs the colour, so it runs *before* the conversion to
the model's channels (:func:`input_image`); the other modes after it.

Image kinds
-----------
:func:`image_kind` names an image's appearance from its pixels: ``colour`` (the three
channels differ: stained tissue such as H&E), ``brightfield`` (grey, median above
:data:`BRIGHTFIELD_MEDIAN`: dark nuclei on a bright background) or ``fluorescence``
(grey, dark background). ``--balance groups`` samples these groups equally often.

Channels
--------
Grey stays 1 channel, colour becomes RGB (OpenCV's BGR order is converted), alpha is
dropped. ``channels=1`` converts colour to grey (ITU-R 601 luma, as ``cv2.cvtColor``),
``channels=3`` repeats grey three times; ``channels=0`` keeps what the file has.

Masks
-----
Every mask is read as "foreground where > 0": 0/255, 0/1, label images and RGB masks
(any channel > 0). A grey mask with more than two distinct values is a *label image*
and its values are kept as instance ids; an RGB mask with more than one non-black
colour is read as one instance per colour. JPEG masks are thresholded at 128 instead
of 0, since lossy compression leaves small non-zero values around every edge.

Any file that cannot be decoded (missing, corrupt, truncated, unknown format), and a
float image holding NaN or infinite pixels, raises :class:`~gluon_unet.errors.UserError`
naming the file.

Why one module: every image, mask and label file the package reads (training, prediction,
evaluation) goes through these readers, and the input normalization that training and
prediction share starts from exactly what they decode; a sixth of its length is this
account of the formats.
"""
import os

import cv2
import numpy as np

from ..errors import UserError

#: The image files read for training, prediction and evaluation (lower-case extensions).
IMAGE_EXTENSIONS = ('.png', '.jpg', '.jpeg', '.tif', '.tiff', '.bmp')
#: The same, for messages: ``'png, jpg, jpeg, tif, tiff, bmp'``.
IMAGE_TYPES = ', '.join(ext[1:] for ext in IMAGE_EXTENSIONS)
#: Percentiles mapped to 0 and 255 when normalizing 16-bit and float images.
PERCENTILES = (0.5, 99.5)

#: ``--normalize`` choices, see :func:`normalize_image`.
NORMALIZE_MODES = ('none', 'invert', 'percentile', 'auto', 'stain')
#: Percentiles mapped to 0 and 255 by ``--normalize percentile|auto`` (uint8 inputs: the
#: upper one is high because nuclei may cover only a few percent of a fluorescence image).
STRETCH_PERCENTILES = (0.5, 99.8)
#: Median luma above which ``--normalize invert|auto`` inverts an image. The median is the
#: background (nuclei cover a minority of pixels). On DSB 2018 stage1_train the medians
#: are 0..44 for fluorescence and 104..231 for H&E tissue and brightfield (whose nuclei
#: are darker than the background), so the cut sits in the gap, not at mid-grey.
BRIGHT_BACKGROUND = 80
#: Gaussian sigma (pixels) of the denoise before the percentile stretch. On the dimmest
#: quarter of DSB 2018's fluorescence images (135 images, 4705 nuclei) an Otsu threshold
#: of the stretched image cuts 293 nuclei into several pieces and leaves 753 specks off
#: the nuclei without it, 59 and 90 with it (4641 vs 4583 nuclei touched;
#: ``experiments/dsb2018/dsb_appearance_stats.py``); exports made before it existed have no
#: ``normalize_denoise`` and are predicted without it.
DENOISE_SIGMA = 1.0
#: Image kinds (:func:`image_kind`), the automatic ``--balance groups`` groups.
KINDS = ('fluorescence', 'brightfield', 'colour')
#: Median grey above which a grey image is ``brightfield`` (:func:`image_kind`); as in
#: ``experiments/dsb2018/dsb_split.py``'s fixed DSB split, which uses this function.
BRIGHTFIELD_MEDIAN = 127

_TIFF = ('.tif', '.tiff')
_JPEG = ('.jpg', '.jpeg')


def is_image_file(name):
    """True when ``name`` has one of :data:`IMAGE_EXTENSIONS` (case-insensitive)."""
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS and not os.path.basename(name).startswith('.')


def _read_bytes(path):
    try:
        with open(path, 'rb') as f:
            return f.read()
    except FileNotFoundError:
        raise UserError('%s: file not found' % path) from None
    except OSError as e:
        raise UserError('%s: cannot read (%s)' % (path, e.strerror or e)) from None


def _check_complete(path, data, ext):
    """Reject truncated files that a decoder might half-decode without complaint."""
    if not data:
        raise UserError('%s: file is empty' % path)
    if ext == '.png' and data[:8] == b'\x89PNG\r\n\x1a\n' and b'IEND' not in data[-32:]:
        raise UserError('%s: truncated PNG (no IEND chunk at the end)' % path)
    if ext in _JPEG and data[:2] == b'\xff\xd8' and data.rfind(b'\xff\xd9') < len(data) - 4096:
        raise UserError('%s: truncated JPEG (no end-of-image marker)' % path)
    if ext == '.bmp' and data[:2] == b'BM' and len(data) >= 6:
        declared = int.from_bytes(data[2:6], 'little')
        if len(data) < declared:
            raise UserError('%s: truncated BMP (%d of %d bytes)' % (path, len(data), declared))


def read_raw(path, plane=None):
    """Decode a file as stored: (H, W) or (H, W, C) in RGB(A) order, native dtype, turned
    as its orientation tag says (a JPEG's EXIF, a TIFF's own).

    Parameters
    ----------
    path : str
    plane : int, optional
        The plane of a stack (a TIFF with several pages or a z, t or channel axis) to read,
        counted over its non-image axes in order (``--plane``). Without it a stack is
        refused: averaging its planes as colours or keeping the first would segment
        something else than the user's image without a word. A file of one plane is read
        whole either way.

    Raises
    ------
    UserError
        Missing, unreadable, corrupt or truncated file; a stack without ``plane`` (or
        with fewer planes); more samples per pixel than RGBA.
    """
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    data = _read_bytes(path)
    _check_complete(path, data, ext)
    if ext in _TIFF:
        return _finite(_read_tiff(path, data, plane), path)
    arr = _cv2_decode(data)
    if arr is None:
        raise UserError('%s: cannot decode image (corrupt, truncated or not an image)' % path)
    if ext in _JPEG or data[:2] == b'\xff\xd8':
        # IMREAD_UNCHANGED (which keeps 16-bit and alpha) ignores the EXIF orientation
        # that cv2.imread and every viewer apply: a phone or camera JPEG would be
        # segmented lying on its side.
        arr = _oriented(arr, _jpeg_orientation(data))
    return _finite(arr, path)


#: The axes of one 2-D image in tifffile's names: rows, columns, samples per pixel.
_IMAGE_AXES = 'YXS'


def _read_tiff(path, data, plane):
    """A TIFF's image (see :func:`read_raw`): its first series, one plane of a stack."""
    import io
    import tifffile
    try:
        tif = tifffile.TiffFile(io.BytesIO(data))
    except Exception as e:  # tifffile raises many types for bad files
        arr = _cv2_decode(data)
        if arr is None:
            raise UserError('%s: cannot decode TIFF (%s)' % (path, str(e).splitlines()[0] if str(e) else
                                                           type(e).__name__)) from None
        return arr
    with tif:
        series = tif.series[0]
        axes, shape = series.axes, tuple(series.shape)
        # Other series the size of the first are more images; smaller ones are its
        # thumbnails or pyramid levels.
        rows, cols = (shape[axes.index(a)] if a in axes else 1 for a in 'YX')
        others = [s for s in tif.series[1:] if _side(s, 'Y') >= rows and _side(s, 'X') >= cols]
        if others:
            raise UserError('%s: holds %d images (TIFF series of shapes %s); gluon_unet reads one 2-D image per '
                            'file: save the one to use alone' % (path, 1 + len(others), ', '.join(
                                _shape_text(s.shape) for s in [series] + others)))
        stack = [i for i, a in enumerate(axes) if a not in _IMAGE_AXES]
        planes = int(np.prod([shape[i] for i in stack], dtype=np.int64))
        index = _plane_index(path, plane, planes, shape, axes)
        orientation = int(tif.pages[0].tags.valueof(274, 1) or 1)  # 274: Orientation
        try:
            arr = series.asarray()
        except Exception as e:
            # Compressed TIFFs (LZW, deflate, JPEG) need the optional imagecodecs package;
            # OpenCV's libtiff reads those (page by page), so it is the fallback.
            arr = _cv2_pages(data, index, planes)
            if arr is None:
                raise UserError('%s: cannot decode TIFF (%s)' % (path, str(e).splitlines()[0] if str(e) else
                                                               type(e).__name__)) from None
            return _oriented(arr, orientation)
    arr = np.asarray(arr)
    if stack:  # the planes first, in order, then the plane asked for
        rest = [i for i in range(arr.ndim) if i not in stack]
        arr = arr.transpose(stack + rest).reshape((planes,) + tuple(arr.shape[i] for i in rest))[index]
        axes = ''.join(axes[i] for i in rest)
    if axes.startswith('S'):
        arr = np.moveaxis(arr, 0, -1)  # planar RGB: samples last
    if arr.ndim == 3 and not 1 <= arr.shape[-1] <= 4:
        raise UserError('%s: %d samples per pixel (shape %s); gluon_unet reads grey, grey+alpha, RGB and RGBA '
                        'images' % (path, arr.shape[-1], _shape_text(shape)))
    return _oriented(arr, orientation)


def _side(series, axis):
    return series.shape[series.axes.index(axis)] if axis in series.axes else 1


def _shape_text(shape):
    return 'x'.join(str(n) for n in shape)


def _plane_index(path, plane, planes, shape, axes):
    """The plane of a stack of ``planes`` to read (0 for one plane), or the one-line refusal."""
    if planes <= 1:
        return 0
    what = '%s: a stack of %d planes (shape %s, axes %s)' % (path, planes, _shape_text(shape), axes)
    if plane is None:
        raise UserError('%s; gluon_unet segments one 2-D image: choose one with --plane N (0-%d) or save the '
                        'plane to use as its own file' % (what, planes - 1))
    if not 0 <= plane < planes:
        raise UserError('%s has no plane %d (--plane 0-%d)' % (what, plane, planes - 1))
    return plane


def _cv2_pages(data, index, planes):
    """Page ``index`` of a TIFF decoded by OpenCV (``planes`` pages), in RGB(A), or None."""
    if planes <= 1:
        return _cv2_decode(data)
    ok, pages = cv2.imdecodemulti(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if not ok or len(pages) != planes:
        return None
    return _rgb(pages[index])


def _jpeg_orientation(data):
    """The EXIF orientation (1-8) of a JPEG's bytes; 1 (as stored) when it has none."""
    i = 2
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD9, 0xDA):  # end of image, start of scan: no more metadata
            break
        length = int.from_bytes(data[i + 2:i + 4], 'big')
        if marker == 0xE1 and data[i + 4:i + 10] == b'Exif\0\0':
            return _exif_orientation(data[i + 10:i + 2 + length])
        i += 2 + length
    return 1


def _exif_orientation(tiff):
    """The Orientation tag (0x0112) of the first IFD of EXIF's TIFF structure, else 1."""
    order = {b'II': 'little', b'MM': 'big'}.get(tiff[:2])
    if order is None:
        return 1
    ifd = int.from_bytes(tiff[4:8], order)
    for k in range(int.from_bytes(tiff[ifd:ifd + 2], order)):
        entry = tiff[ifd + 2 + 12 * k:ifd + 14 + 12 * k]
        if int.from_bytes(entry[:2], order) == 0x0112:
            value = int.from_bytes(entry[8:10], order)
            return value if 1 <= value <= 8 else 1
    return 1


def _oriented(arr, orientation):
    """``arr`` (H, W[, C]) as shown: EXIF/TIFF orientation 2-8 says which corner the stored
    first row and column are (mirrored, turned a half or quarter turn); 1 is as stored."""
    if orientation in (2, 3, 7):
        arr = arr[:, ::-1]
    if orientation in (3, 4, 6, 7):
        arr = arr[::-1]
    if orientation in (5, 6, 7, 8):
        arr = (arr[:, ::-1] if orientation == 8 else arr).swapaxes(0, 1)
    return np.ascontiguousarray(arr) if orientation != 1 else arr


def _finite(arr, path):
    """``arr``, refused when a float image holds NaN or infinite pixels.

    No value for them is right everywhere: zero made an all-NaN image black (and an
    all-NaN mask empty) without a word. The user knows what they mean (no data,
    saturation, background) and can put a number there.
    """
    if arr.dtype.kind == 'f':
        bad = arr.size - int(np.count_nonzero(np.isfinite(arr)))
        if bad:
            raise UserError('%s: %d of %d pixels are NaN or infinite (a float image); replace them with numbers '
                            '(e.g. the background level) first' % (path, bad, arr.size))
    return arr


def _cv2_decode(data):
    """OpenCV decode to RGB(A) order, or None."""
    # OpenCV logs its own warnings to stderr for bad files; we raise one clear line instead.
    # OpenCV 5 keeps the log level in cv2.utils.logging only (4.x: cv2.getLogLevel).
    log = cv2 if hasattr(cv2, 'getLogLevel') else cv2.utils.logging
    level = log.getLogLevel()
    log.setLogLevel(0)  # 0 = silent
    try:
        arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    except cv2.error:
        arr = None
    finally:
        log.setLogLevel(level)
    return _rgb(arr)


def _rgb(arr):
    """An OpenCV image (BGR(A) order) in RGB(A) order; None stays None."""
    if arr is not None and arr.ndim == 3 and arr.shape[2] >= 3:
        arr = arr[..., [2, 1, 0] + list(range(3, arr.shape[2]))]
    return arr


def to_uint8(arr, percentiles=PERCENTILES):
    """Scale a non-uint8 image to uint8 by per-image percentiles.

    Parameters
    ----------
    arr : np.ndarray
        Any numeric dtype; uint8 and bool are returned as uint8 unchanged.
    percentiles : (float, float)
        Values mapped to 0 and 255 (default 0.5 and 99.5).

    Returns
    -------
    np.ndarray of uint8, same shape.
    """
    if arr.dtype == np.uint8:
        return arr
    if arr.dtype == bool:
        return arr.astype(np.uint8) * 255
    a = np.asarray(arr, np.float32)
    finite = np.isfinite(a)
    if not finite.all():
        a = np.where(finite, a, 0).astype(np.float32)
    lo, hi = np.percentile(a, percentiles)
    if hi <= lo:  # few distinct values (e.g. a sparse image): fall back to the full range
        lo, hi = float(a.min()), float(a.max())
    if hi <= lo:
        return np.zeros(a.shape, np.uint8)
    out = (a - lo) * (255.0 / (hi - lo))
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def to_channels(img, channels):
    """Convert an (H, W, C) uint8 image to 1 or 3 channels (0 = leave it)."""
    c = img.shape[2]
    if channels == 0 or channels == c:
        return img
    if channels == 1:
        return cv2.cvtColor(np.ascontiguousarray(img), cv2.COLOR_RGB2GRAY)[..., None]
    if channels == 3:
        return np.repeat(img, 3, axis=2)
    raise ValueError('channels must be 0, 1 or 3 (got %r)' % (channels,))


def image_kind(img):
    """``'colour'``, ``'brightfield'`` or ``'fluorescence'`` for an (H, W, C) uint8 image as
    read (before any channel conversion or normalization), see the module doc."""
    if is_colour(img):
        return 'colour'
    return 'brightfield' if np.median(img[..., 0]) > BRIGHTFIELD_MEDIAN else 'fluorescence'


def _stretch(img, denoise):
    """Map the :data:`STRETCH_PERCENTILES` of ``img`` (after a Gaussian blur of sigma
    ``denoise``, 0 = none) to 0 and 255; all channels share one scale."""
    a = img
    if denoise:
        # Blurred in float: a dim image has only a few grey levels, which the stretch would
        # otherwise turn into coarse steps.
        a = cv2.GaussianBlur(img.astype(np.float32), (0, 0), denoise).reshape(img.shape)
    lo, hi = np.percentile(a, STRETCH_PERCENTILES)
    if hi <= lo:
        return img
    scaled = (a.astype(np.float32) - lo) * (255.0 / (hi - lo))
    return np.clip(np.rint(scaled), 0, 255).astype(np.uint8)


def hematoxylin(img, denoise=DENOISE_SIGMA):
    """The hematoxylin channel of an RGB stained-tissue image, stretched to uint8.

    Colour deconvolution (``skimage.color.rgb2hed``, Ruifrok & Johnston) separates the
    hematoxylin that stains nuclei purple-blue from the eosin that stains the rest pink:
    nuclei come out bright, tissue and background dark, which a grey, inverted input
    does not do (there the whole tissue is brighter than the glass).

    Parameters
    ----------
    img : (H, W, 3) uint8 RGB
    denoise : float
        Gaussian sigma before the percentile stretch (0 = none).

    Returns
    -------
    (H, W, 1) uint8
    """
    from skimage.color import rgb2hed

    h = rgb2hed(np.ascontiguousarray(img[..., :3])).astype(np.float32)[..., :1]
    return _stretch(h, denoise)


def normalize_image(img, mode='none', denoise=DENOISE_SIGMA):
    """Per-image input normalization of an (H, W, C) uint8 image (see the module doc).

    Parameters
    ----------
    img : (H, W, C) uint8
    mode : {'none', 'invert', 'percentile', 'auto', 'stain'}
        ``stain`` turns a colour image into its 1-channel :func:`hematoxylin`.
    denoise : float
        Gaussian sigma before the percentile stretch (0 = none, as before it existed).

    Returns
    -------
    (H, W, C) uint8
        A new array unless ``mode == 'none'``; all channels share one scale.
    """
    if mode not in NORMALIZE_MODES:
        raise UserError('--normalize must be one of %s (got %r)' % (', '.join(NORMALIZE_MODES), mode))
    if mode == 'none':
        return img
    if mode == 'stain':
        if is_colour(img):
            return hematoxylin(img, denoise)
        mode = 'auto'
    out = img
    if mode in ('invert', 'auto'):
        grey = out[..., 0] if out.shape[2] == 1 else cv2.cvtColor(np.ascontiguousarray(out[..., :3]),
                                                                    cv2.COLOR_RGB2GRAY)
        if np.median(grey) > BRIGHT_BACKGROUND:  # bright background: make nuclei bright on dark
            out = 255 - out
    if mode in ('percentile', 'auto'):
        out = _stretch(out, denoise)
    return np.ascontiguousarray(out)


def input_image(img, channels, mode='none', denoise=DENOISE_SIGMA, convert=None):
    """The network's input from an image as read: channel conversion and normalization,
    in the order the mode needs, identical in training and in prediction.

    Parameters
    ----------
    img : (H, W, C) uint8
        As :func:`read_image` returns it with ``channels=0``.
    channels : {0, 1, 3}
        The model's input channels (0 = keep).
    mode, denoise
        See :func:`normalize_image`.
    convert : callable, optional
        ``convert(img, channels)``; default :func:`to_channels` (bin/predict passes one
        that names the file when the counts cannot be converted).

    Returns
    -------
    (H, W, C') uint8
    """
    convert = convert or to_channels
    if mode == 'stain':  # the hematoxylin needs the colour: normalize first
        return np.ascontiguousarray(convert(normalize_image(img, mode, denoise), channels))
    return normalize_image(np.ascontiguousarray(convert(img, channels)), mode, denoise)


def read_image(path, channels=0, plane=None):
    """Read an image as (H, W, C) uint8 RGB or grey.

    Parameters
    ----------
    path : str
        PNG, JPEG, TIFF (8/16-bit, float), BMP; grey, RGB or RGBA (alpha dropped).
    channels : int
        1 or 3 to convert; 0 keeps 1 for grey files and 3 for colour ones.
    plane : int, optional
        The plane of a stack to read (``--plane``, see :func:`read_raw`).

    Returns
    -------
    np.ndarray, (H, W, C) uint8

    Raises
    ------
    UserError
        The file is missing, corrupt or truncated, or a stack without ``plane``.
    """
    path = os.fspath(path)
    return np.ascontiguousarray(to_channels(image_array(read_raw(path, plane), path), channels))


def image_array(arr, name='image'):
    """An image in memory as the readers take a file's pixels: (H, W, C) uint8.

    The one conversion of every image, read from a file (:func:`read_image`) or given
    to the Python API (:func:`~gluon_unet.inference.tiling.plan_image`, so
    ``predict_image`` and friends): the same array gives the same input whatever its
    dtype came from or the prediction mode.

    Parameters
    ----------
    arr : array-like, (H, W) or (H, W, C) with C in 1-4
        Grey, grey + alpha, RGB or RGBA (alpha dropped). uint8 is used as it is, bool
        as 0/255, any other integer or float type is scaled by per-image percentiles
        (:func:`to_uint8`), exactly as a 16-bit or float TIFF is.
    name : str
        The file or array the messages name.

    Raises
    ------
    UserError
        Another shape (a stack: choose one plane first), a type that is no image, NaN
        or infinite pixels.
    """
    arr = np.asarray(arr)
    if arr.dtype.kind not in 'buif':
        raise UserError('%s: pixels of type %s are not an image (expected integers, floats or booleans)'
                        % (name, arr.dtype))
    if arr.ndim == 2:
        arr = arr[..., None]
    if arr.ndim != 3 or not 1 <= arr.shape[2] <= 4 or 0 in arr.shape:
        raise UserError('%s: shape %s is not one 2-D image (H x W, or H x W x 1-4 channels: grey, RGB, RGBA)%s'
                        % (name, _shape_text(arr.shape), '; a stack: choose one plane' if arr.ndim > 3 or
                           arr.ndim == 3 and arr.shape[2] > 4 else ''))
    _finite(arr, name)
    if arr.shape[2] == 2:  # grey + alpha
        arr = arr[..., :1]
    elif arr.shape[2] == 4:
        arr = arr[..., :3]
    return np.ascontiguousarray(to_uint8(arr))


def is_colour(img):
    """True when an (H, W, C) image has 3 channels that are not all equal."""
    if img.ndim < 3 or img.shape[2] < 3:
        return False
    return not (np.array_equal(img[..., 0], img[..., 1]) and np.array_equal(img[..., 0], img[..., 2]))


def read_binary_mask(path):
    """Read a mask file as a (H, W) bool array, foreground where any channel > 0."""
    arr = read_raw(path)
    thr = 127 if os.path.splitext(os.fspath(path))[1].lower() in _JPEG else 0
    fg = arr > thr
    if fg.ndim == 3:
        fg = fg[..., :3].any(axis=2) if fg.shape[2] >= 3 else fg[..., 0]
    return fg


def merge_object_masks(paths, shape=None, mismatch=None):
    """One instance label image from one mask file per object (the DSB layout).

    Parameters
    ----------
    paths : list of str
        Mask files; file k (1-based, in this order) becomes id k, later files win overlaps.
    shape : (H, W), optional
        The size every mask must have; default the first mask's.
    mismatch : callable, optional
        ``mismatch(path, mask_shape, expected_shape)`` returns the exception to raise for
        a mask of another size (default: a UserError naming the file).

    Returns
    -------
    (H, W) int32, 0 = background
    """
    labels = None if shape is None else np.zeros(tuple(shape), np.int32)
    for k, path in enumerate(paths, start=1):
        fg = read_binary_mask(path)
        if labels is None:
            labels = np.zeros(fg.shape, np.int32)
        if fg.shape != labels.shape:
            if mismatch is not None:
                raise mismatch(path, fg.shape, labels.shape)
            raise UserError('mask %s is %dx%d (HxW) but the others are %dx%d'
                            % (path, fg.shape[0], fg.shape[1], labels.shape[0], labels.shape[1]))
        labels[fg] = k
    if labels is None:
        raise ValueError('merge_object_masks: no mask files and no shape')
    return labels


def read_labels(path, threshold=0.5):
    """Read a label image, binary mask or probability map as instance labels.

    Label images keep their ids, binary masks (and single-colour RGB masks) become their
    4-connected components, multi-colour RGB masks one id per colour, float images
    holding probabilities are cut at ``threshold`` first (float images holding integer
    ids > 1 are label images). See :func:`read_mask` for the rest.

    Returns
    -------
    (H, W) int64, 0 = background.
    """
    from skimage.measure import label

    arr = read_raw(path)
    if arr.dtype.kind == 'f':
        arr = np.nan_to_num(arr)
        if arr.ndim == 2 and not (arr.max(initial=0) > 1 and np.array_equal(arr, np.round(arr))):
            return label(arr > threshold, connectivity=1)
    mask, instances = _mask_from_array(arr, os.fspath(path))
    if instances is None:
        return label(mask, connectivity=1)
    return instances.astype(np.int64)


def read_mask(path, plane=None):
    """Read a mask: binary foreground and, for label masks, the instance ids.

    Parameters
    ----------
    path : str
        0/255, 0/1, label image (grey, any integer dtype) or RGB mask.
    plane : int, optional
        The plane of a stack to read (``--plane``, see :func:`read_raw`).

    Returns
    -------
    mask : (H, W) uint8 in {0, 1}
    instances : (H, W) int32 or None
        The labels of a label image (values kept), one id per colour of a multi-colour RGB
        mask, or None for a plain binary mask (the caller labels connected components).
    """
    path = os.fspath(path)
    return _mask_from_array(read_raw(path, plane), path)


def _mask_from_array(arr, path):
    """:func:`read_mask` of a decoded file ``arr``; ``path`` tells JPEGs and names errors."""
    jpeg = os.path.splitext(path)[1].lower() in _JPEG
    if arr.ndim == 3 and arr.shape[2] in (2, 4):
        arr = arr[..., :-1]  # alpha
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[..., 0]
    if jpeg:
        fg = arr > 127
        if fg.ndim == 3:
            fg = fg.any(axis=2)
        return fg.astype(np.uint8), None
    if arr.ndim == 3:  # RGB mask: colours may encode instances
        a = arr.astype(np.int64)
        code = (a[..., 0] << 32) | (a[..., 1] << 16) | a[..., 2]
        fg = code > 0
        colours, inv = np.unique(code, return_inverse=True)
        inv = inv.reshape(code.shape)
        n_fg = len(colours) - (1 if colours[0] == 0 else 0)
        if n_fg <= 1:
            return fg.astype(np.uint8), None
        # consecutive ids; background (code 0, if present) sorts first
        inst = (inv + (0 if colours[0] == 0 else 1)).astype(np.int32)
        return fg.astype(np.uint8), inst
    if np.issubdtype(arr.dtype, np.floating):
        arr = np.rint(np.nan_to_num(arr)).astype(np.int64)
    fg = arr > 0
    values = np.unique(arr)
    values = values[values > 0]
    if len(values) <= 1:
        return fg.astype(np.uint8), None
    if values.max() > np.iinfo(np.int32).max:
        raise UserError('%s: label values exceed int32' % path)
    return fg.astype(np.uint8), np.where(fg, arr, 0).astype(np.int32)
