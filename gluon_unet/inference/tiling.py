"""Sliding-window geometry for inference: where the network looks, and how results blend.

Pure numpy (and OpenCV for resizing): no network, no mxnet. :func:`plan_image` turns one
image into a :class:`WindowPlan` - the padded network input, the top-left corners of
equal-shape windows, their blending weights and how to map the blended result back to
the image - following one of three modes:

``resize``
    The seed's way: resize the image to the training size, predict, resize the
    probabilities back (linear interpolation). Matches training on resized images, but
    loses detail on large images.
``tile``
    Sliding window of training-size tiles at native resolution. Tiles overlap by
    ``overlap`` and are blended with separable weights that ramp linearly from the tile
    edge to 1 over the overlap: in an overlap the two ramps sum to 1 (a cross-fade),
    and pixels near a tile edge - which saw zero padding instead of their real
    neighbourhood - count least. The image borders are reflect-padded by half the
    overlap so they are not at a tile edge either.
``whole``
    The whole image at once, reflect-padded to a multiple of ``2**depth`` (exact, but
    memory grows with the image). With ``buckets`` it is padded further, to one of 8-16
    sizes per octave (:func:`bucket_side`), so images of many sizes reach the network as
    a few shapes (each new shape costs MXNet a memory re-plan, and on GPUs a cuDNN
    autotune per convolution); pixels nearer the border than the receptive field see more
    reflected context, the others are unchanged.

``auto`` tiles images larger than the training size and treats smaller ones like
training did: resized, or padded whole for models trained on native-resolution crops.

Every mode keeps the network's input shapes clear of those MXNet 1.9.1's CPU build dies
on (:mod:`gluon_unet.machine.limits`: a whole image 2048 px high and 1024 or 2048 wide, tiles of
2048 px): it pads a little further (a few multiples of ``2**depth`` more of reflected
border, cropped away like the rest).

A U-Net pools by ``2**depth``, so it is only shift-equivariant by multiples of that: every
window must start at a multiple of it in image coordinates, or its pooling grid differs
from that of its neighbours (and of a whole-image pass), which shows as seams and a
pixel-periodic pattern. All padding and window offsets here are multiples of it.
"""
from dataclasses import dataclass
from typing import Callable, List, Tuple, Union

import cv2
import numpy as np

from ..data.io import image_array
from ..errors import UserError
from ..machine.limits import safe_square, safe_window
from .configs import MODES

#: The 8 symmetries of the square: (quarter turns, horizontal flip).
DIHEDRAL = tuple((k, flip) for flip in (False, True) for k in range(4))
#: The same 8, grouped by the shape they give a (H, W) window: the 4 with an even number
#: of quarter turns keep (H, W), the 4 odd ones give (W, H). TTA issues them in this order,
#: so a non-square window makes two batches of one shape each instead of 8 that alternate.
TTA_ORDER = tuple(sorted(DIHEDRAL, key=lambda t: t[0] % 2))


def dihedral(x, k, flip):
    """Flip (last axis) then rotate by ``k`` quarter turns, on the last two axes."""
    if flip:
        x = x[..., ::-1]
    return np.rot90(x, k, axes=(-2, -1))


def undihedral(y, k, flip):
    """Inverse of :func:`dihedral`."""
    y = np.rot90(y, -k, axes=(-2, -1))
    return y[..., ::-1] if flip else y


def second_map(meta):
    """What an export's (its sidecar ``meta``) maps after the foreground are: 'border' for a
    ``mask+border`` model, 'centre' for ``mask+centre``, 'contact' for ``mask+contact`` and
    ``mask+touching``, 'flow' for ``mask+flow`` (two maps), None for one map. From the
    sidecar's ``outputs``, else its training config; exports from before borders have one map."""
    from ..data.targets import OUTPUTS, second_map_of

    outputs = meta.get('outputs')
    if outputs is None:
        target = ((meta.get('config') or {}).get('model') or {}).get('target')
        outputs = OUTPUTS.get(target, ('foreground',))
    return second_map_of(outputs)


def undihedral_flow(maps, k, flip):
    """Inverse of :func:`dihedral` for a flow model's (3, H, W) maps: the maps move back as
    :func:`undihedral` moves them, and the direction each pixel holds (maps 1 and 2, y and
    x encoded as ``(1 + v) / 2``) turns back with them: a turn took (dy, dx) to (-dx, dy),
    a flip took dx to -dx."""
    maps = undihedral(maps, k, flip)
    fg, ey, ex = maps[0], maps[1], maps[2]
    for _ in range(k % 4):
        ey, ex = ex, 1 - ey  # one turn back: (dy, dx) -> (dx, -dy)
    if flip:
        ex = 1 - ex
    return np.stack([fg, ey, ex])


def tile_starts(length, tile, step):
    """Offsets of ``tile``-px tiles every ``step`` px covering ``[0, length)``.

    The last tile is moved back to end at the edge instead of overhanging it. With
    ``length - tile`` and ``step`` multiples of ``2**depth``, every offset is one too.
    """
    if length <= tile:
        return [0]
    starts = list(range(0, length - tile, step))
    return starts + [length - tile]


def blend_window(tile, ramp):
    """(tile, tile) float32 weights: a linear ramp over ``ramp`` px at each edge, 1 inside.

    Two tiles overlapping by ``ramp`` px have weights ``d/ramp`` and ``1 - d/ramp`` there,
    which cross-fade. Weights never reach 0, so a pixel covered by a single tile edge
    (none, after border padding) still gets a value.
    """
    if ramp <= 0:
        return np.ones((tile, tile), np.float32)
    x = np.arange(tile) + 0.5
    w = np.clip(np.minimum(x, tile - x) / ramp, 1e-3, 1.0).astype(np.float32)
    return np.outer(w, w)


def tile_size(meta):
    """The training size, rounded down to a multiple of ``2**depth``."""
    m = pooling_multiple(meta)
    size = int(meta.get('train_size') or 256)
    return max(m, size // m * m)


def pooling_multiple(meta):
    """``2**depth`` of an export (its sidecar's ``multiple``; 1 when unknown)."""
    return int(meta.get('multiple') or 1)


def choose_mode(mode, height, width, meta):
    """Resolve ``'auto'`` for an image of ``height`` x ``width`` (see the module doc)."""
    if mode not in MODES:
        raise UserError('--mode must be one of %s (got %r)' % (', '.join(MODES), mode))
    if mode != 'auto':
        return mode
    size = tile_size(meta)
    if height > size or width > size:
        return 'tile'
    return 'whole' if meta.get('resize_mode') == 'crop' else 'resize'


def padding_to_multiple(length, multiple, margin=0, at_least=0):
    """Total padding of a side of ``length`` px: at least ``2 * margin``, the padded side at
    least ``at_least``, and the padded side minus ``at_least`` a multiple of ``multiple``
    (so tiles of ``at_least`` px every ``multiple``-aligned step cover it exactly)."""
    target = max(at_least, length + 2 * margin)
    target = at_least + -(-(target - at_least) // multiple) * multiple
    return target - length


def bucket_side(length, multiple):
    """The side a ``whole``-mode image of ``length`` px is padded to with buckets: the next
    multiple of ``max(multiple, 2**(bit_length(length) - 4))``, i.e. one of 8 to 16 sizes
    per octave (256 -> 256, 260 -> 288, 520 -> 576, 1040 -> 1152). A side grows by less
    than 1/8; the network meets a few shapes instead of one per distinct image size."""
    step = max(multiple, 2 ** max(0, int(length).bit_length() - 4))
    step = -(-step // multiple) * multiple
    return -(-length // step) * step


def reflect_pad(x, top, bottom, left, right):
    """Reflect-pad the last two axes of a (C, H, W) array."""
    return np.pad(x, ((0, 0), (top, bottom), (left, right)), mode='reflect')


@dataclass
class WindowPlan:
    """How one image goes through the network.

    ``source`` (C, H', W') is the network's view of the image (resized, float32 in [0, 1], or
    padded, uint8: a quarter of the memory on large images, scaled by :meth:`windows`);
    the network sees ``source[:, y:y + tile[0], x:x + tile[1]]`` for each ``(y, x)`` of
    ``corners``; the results (K, tile) - one map per model output - are blended with
    ``weight`` (a scalar or a (tile) array) into (K, H', W') maps, which :meth:`to_image`
    maps back onto the image as (K, H, W).
    """
    mode: str
    source: np.ndarray
    corners: List[Tuple[int, int]]
    tile: Tuple[int, int]
    weight: Union[float, np.ndarray]
    to_image: Callable[[np.ndarray], np.ndarray]

    def windows(self):
        """``(y, x, window)`` for every corner; each window is a (C, tile) float32 array
        in [0, 1] (the uint8 image / 255, as in training)."""
        th, tw = self.tile
        for y, x in self.corners:
            window = self.source[:, y:y + th, x:x + tw]
            if window.dtype == np.uint8:
                window = window.astype(np.float32) / np.float32(255)
            yield y, x, window


def head_channels(meta):
    """Output channels of an export's network (its last, 1x1, convolution)."""
    outputs = meta.get('outputs') or ['foreground']
    return int(meta.get('classes') or 1) + len(outputs) - 1


def plan_image(image, meta, mode='auto', overlap=0.25, buckets=False):
    """The :class:`WindowPlan` of an (H, W) or (H, W, C) uint8 image.

    Parameters
    ----------
    image : array-like, (H, W) or (H, W, C)
        uint8 is used as it is; other types (uint16, float, ...) are converted as
        ``bin/predict`` converts a file of that type (:func:`~gluon_unet.data.io.image_array`),
        so the result never depends on the dtype and the mode together; a stack or a
        type that is no image is refused.
    meta : dict
        Export sidecar: ``train_size``, ``multiple`` (``2**depth``), ``resize_mode``
        (and ``classes``, ``outputs``).
    mode : {'auto', 'resize', 'tile', 'whole'}
    overlap : float
        Tile mode: fraction of the tile shared with its neighbour.
    buckets : bool
        Whole mode: pad to :func:`bucket_side` sizes.
    """
    image = image_array(image)
    h, w = image.shape[:2]
    mode = choose_mode(mode, h, w, meta)
    outputs, multiple = head_channels(meta), pooling_multiple(meta)
    if mode == 'resize':
        return _plan_resize(image, tile_size(meta), multiple, outputs, second_map(meta) == 'flow')
    x = image.transpose(2, 0, 1)  # stays uint8 until a window is cut out
    if mode == 'whole':
        return _plan_whole(x, multiple, buckets, outputs)
    return _plan_tiles(x, safe_square(tile_size(meta), multiple, outputs), multiple, overlap)


def _plan_resize(image, size, multiple=1, outputs=1, flow=False):
    """One window: the image resized to ``size`` x ``size``, the result resized back (the
    window reflect-padded further if the network cannot run on that size). ``flow``: the
    maps are a flow model's, whose directions a non-square image's resizing turned: they
    are stretched back with it (:func:`unstretch_flow`)."""
    h, w = image.shape[:2]
    # INTER_AREA on the uint8 image, as the training loader resized it.
    small = cv2.resize(image, (size, size), interpolation=cv2.INTER_AREA).reshape(size, size, -1)
    source = small.transpose(2, 0, 1).astype(np.float32) / 255
    side = safe_square(size, multiple, outputs)
    if side != size:  # the network runs on a larger window: the border is reflected, then cut away
        source = reflect_pad(source, 0, side - size, 0, side - size)

    def to_image(maps):  # (K, size, size) or one (size, size) map
        maps = maps[..., :size, :size]
        if maps.ndim == 2:
            return cv2.resize(maps, (w, h), interpolation=cv2.INTER_LINEAR)
        maps = np.stack([cv2.resize(m, (w, h), interpolation=cv2.INTER_LINEAR) for m in maps])
        return unstretch_flow(maps, h / size, w / size) if flow and h != w else maps
    return WindowPlan('resize', source, [(0, 0)], (side, side), 1.0, to_image)


def unstretch_flow(maps, sy, sx):
    """A flow model's (3, H, W) maps seen on an image scaled by ``1 / sy`` and ``1 / sx``:
    each direction (maps 1 and 2, encoded as ``(1 + v) / 2``) stretched back by ``sy`` and
    ``sx``, keeping its length (how sure the network is of it)."""
    vy, vx = 2 * maps[1] - 1, 2 * maps[2] - 1
    length = np.hypot(vy, vx)
    vy, vx = vy * sy, vx * sx
    scale = length / np.maximum(np.hypot(vy, vx), 1e-12)
    return np.stack([maps[0], 0.5 + 0.5 * vy * scale, 0.5 + 0.5 * vx * scale]).astype(np.float32)


def _plan_whole(x, multiple, buckets=False, outputs=1):
    """One window: the (C, H, W) image reflect-padded to sides that are multiples of
    ``multiple`` (with ``buckets``, to :func:`bucket_side`), and further where the network
    could not run on those (:func:`~gluon_unet.machine.limits.safe_window`)."""
    if buckets:
        pad_h, pad_w = (bucket_side(n, multiple) - n for n in x.shape[1:])
    else:
        pad_h, pad_w = padding_to_multiple(x.shape[1], multiple), padding_to_multiple(x.shape[2], multiple)
    height, width = safe_window(x.shape[1] + pad_h, x.shape[2] + pad_w, multiple, outputs)
    return _padded_plan('whole', x, height - x.shape[1], width - x.shape[2], 0, multiple, None, 1.0)


def _plan_tiles(x, size, multiple, overlap):
    """Overlapping ``size`` x ``size`` tiles over the reflect-padded (C, H, W) image."""
    step = max(multiple, int(size * (1 - overlap)) // multiple * multiple)
    # Image borders get half the overlap of real (reflected) context, so they are not at a
    # tile edge either; images smaller than a tile are padded up to one.
    margin = (size - step) // 2 // multiple * multiple
    pad_h = padding_to_multiple(x.shape[1], multiple, margin, size)
    pad_w = padding_to_multiple(x.shape[2], multiple, margin, size)
    ys = tile_starts(x.shape[1] + pad_h, size, step)
    xs = tile_starts(x.shape[2] + pad_w, size, step)
    corners = [(y, x0) for y in ys for x0 in xs]
    weight = blend_window(size, size - step) if len(corners) > 1 else 1.0
    return _padded_plan('tile', x, pad_h, pad_w, margin, multiple, (corners, (size, size)), weight)


def _padded_plan(mode, x, pad_h, pad_w, margin, multiple, windows, weight):
    """Reflect-pad (C, H, W) ``x`` by ``pad_h``/``pad_w`` (top/left at least ``margin``, all
    offsets multiples of ``multiple``); ``windows`` = (corners, tile), None = the whole."""
    h, w = x.shape[1:]
    top = max(margin, pad_h // 2 // multiple * multiple)
    left = max(margin, pad_w // 2 // multiple * multiple)
    source = reflect_pad(x, top, pad_h - top, left, pad_w - left)
    corners, tile = windows or ([(0, 0)], source.shape[1:])

    def to_image(maps):
        return maps[..., top:top + h, left:left + w]
    return WindowPlan(mode, source, corners, tuple(tile), weight, to_image)


class Canvas:
    """Weighted sum of window results (each un-transformed first) over a plan's source."""

    def __init__(self, h, w, flow=False):
        self.shape, self.flow = (h, w), flow  # flow: a mask+flow model's maps (undihedral_flow)
        self.acc = None  # (K, h, w), K from the first result
        self.wsum = np.zeros((h, w), np.float32)

    def add(self, prob, y, x, k, flip, weight):
        """Blend the result ``prob`` ((K, tile) maps, or one (tile) map) of the window at
        ``(y, x)`` that was seen through the symmetry ``(k, flip)``."""
        prob = undihedral_flow(prob, k, flip) if self.flow and (k or flip) else undihedral(prob, k, flip)
        if prob.ndim == 2:
            prob = prob[None]
        if self.acc is None:
            self.acc = np.zeros((len(prob),) + self.shape, np.float32)
        h, w = prob.shape[1:]
        self.acc[:, y:y + h, x:x + w] += prob * weight
        self.wsum[y:y + h, x:x + w] += weight

    def result(self):
        """The blended (K, h, w) maps, computed in place: the canvas is used up."""
        np.maximum(self.wsum, 1e-12, out=self.wsum)
        self.acc /= self.wsum
        self.wsum = None
        return self.acc
