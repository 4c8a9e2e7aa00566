"""``load_dataset``: a user's files on disk -> a cached, memory-mapped SegmentationDataset.

Pipeline: :func:`~gluon_unet.data.layouts.discover` lists the samples; the cache key is
computed from the files' paths, mtimes and sizes and the options; on a hit the arrays
are memory-mapped and nothing is decoded. On a miss, worker processes decode and resize
the samples (images with ``cv2.INTER_AREA``, masks and instance labels with
``cv2.INTER_NEAREST``), the main process streams the results into a new cache entry,
which is committed atomically and then memory-mapped.
"""
import dataclasses
import logging
import multiprocessing
import os
from dataclasses import dataclass
from typing import Optional, Union

import cv2
import numpy as np

from ..errors import UserError, WriteError
from . import cache as _cache
from .dataset import SegmentationDataset
from .io import (DENOISE_SIGMA, NORMALIZE_MODES, image_kind, input_image, is_colour, merge_object_masks, read_image,
                 read_mask)
from .layouts import discover

log = logging.getLogger(__name__)


def _size_error(mask_path, mask_shape, image_path, image_shape):
    return UserError('mask %s is %dx%d (HxW) but its image %s is %dx%d'
                     % (mask_path, mask_shape[0], mask_shape[1], image_path, image_shape[0], image_shape[1]))


def decode_sample(sample, size=128, crop=0, channels=0, normalize='none', denoise=DENOISE_SIGMA, plane=None):
    """Decode one sample (in a worker process); ``normalize``, ``denoise``: see
    :func:`~.io.normalize_image`; ``plane``: the plane of stacks to read (``--plane``,
    :func:`~.io.read_raw`).

    Returns
    -------
    image : (H, W, C) uint8
        Resized to ``size`` unless ``crop``; with ``channels=0`` always 3 channels
        (grey repeated) so results can be stacked before the channel count is known.
    mask : (H, W) uint8 in {0, 1}
    instances : (H, W) int32
    original_size : (h, w)
    colour : bool
        The network input has colour (3 channels that differ; ``stain`` leaves none).
    kind : str
        :func:`~.io.image_kind` of the image as read (the automatic appearance group).
    """
    image = read_image(sample.image, plane=plane)
    h, w = image.shape[:2]
    kind = image_kind(image)
    image = network_input(image, channels, normalize, denoise, 0 if crop else size)
    colour = is_colour(image)
    if channels == 0 and image.shape[2] == 1:
        image = np.repeat(image, 3, axis=2)
    if sample.merge:  # DSB: one file per object -> union mask + one id per file
        inst = merge_object_masks(sample.masks, (h, w),
                                  mismatch=lambda path, shape, _: _size_error(path, shape, sample.image, (h, w)))
        mask = (inst > 0).astype(np.uint8)
    else:
        mask, inst = read_mask(sample.masks[0], plane)
        if mask.shape != (h, w):
            raise _size_error(sample.masks[0], mask.shape, sample.image, (h, w))
        if inst is None:  # binary mask: objects are its 4-connected components
            inst = cv2.connectedComponents(mask, connectivity=4, ltype=cv2.CV_32S)[1]
    if not crop:
        mask = cv2.resize(mask, (size, size), interpolation=cv2.INTER_NEAREST)
        inst = cv2.resize(inst, (size, size), interpolation=cv2.INTER_NEAREST)
    return image, mask, inst.astype(np.int32, copy=False), (h, w), colour, kind


def network_input(image, channels, normalize='none', denoise=DENOISE_SIGMA, size=0):
    """What the cache stores of an image as read: :func:`~.io.input_image` (channel
    conversion, ``--normalize``), then resized to ``size`` x ``size`` with area
    interpolation (0 = native resolution, the ``--crop`` mode). The stain jitter
    (:class:`~.augment.StainJitter`) remakes a colour image's input through it.
    """
    image = input_image(image, channels, normalize, denoise)
    if size:
        image = cv2.resize(image, (size, size), interpolation=cv2.INTER_AREA).reshape(size, size, -1)
    return image


def _decode_star(args):
    return decode_sample(*args)


class RaggedArray:
    """Images of different sizes stored flat (a memmap) with offsets; ``a[i]`` is image i.

    Parameters
    ----------
    flat : 1-D array
    shapes : (N, k) int array
        Shape of every item.
    channels_view : int, optional
        Return only the first ``channels_view`` channels of the last axis.
    """

    def __init__(self, flat, shapes, channels_view=None):
        self.flat, self.shapes = flat, np.asarray(shapes, np.int64)
        sizes = np.prod(self.shapes, axis=1)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.channels_view = channels_view

    def __len__(self):
        return len(self.shapes)

    def __getitem__(self, i):
        if i < 0:
            i += len(self)
        a = self.flat[self.offsets[i]:self.offsets[i + 1]].reshape(tuple(self.shapes[i]))
        if self.channels_view is not None:
            a = a[..., :self.channels_view]
        return a


class _MemorySink:
    """Collects decoded samples in memory (no cache)."""

    def __init__(self):
        self.images, self.masks, self.instances = [], [], []

    def add(self, image, mask, inst):
        self.images.append(image)
        self.masks.append(mask)
        self.instances.append(inst)


class _DiskSink:
    """Streams decoded samples into a cache entry being built."""

    def __init__(self, writer):
        self.writer = writer

    def add(self, image, mask, inst):
        self.writer.append('images', image)
        self.writer.append('masks', mask)
        self.writer.append('instances', inst)


def _pool_map(fn, items, workers, progress, desc):
    """Ordered map over ``items``, in ``workers`` processes (in-process for 0 or 1)."""
    from tqdm import tqdm
    bar = tqdm(total=len(items), desc=desc, unit='img', disable=not progress, leave=False)
    try:
        if workers <= 1 or len(items) <= 1:
            for it in items:
                yield fn(it)
                bar.update()
            return
        # fork: workers inherit the imported modules (no second mxnet import), nothing is
        # pickled but the tasks. Do not call cv2.setNumThreads in a forked child: once the
        # parent has used OpenCV's thread pool, that call deadlocks in the child.
        ctx = multiprocessing.get_context('fork')
        with ctx.Pool(min(workers, len(items))) as pool:
            for res in pool.imap(fn, items, chunksize=2):
                yield res
                bar.update()
    finally:
        bar.close()


def _build(entry_arrays, meta, names, channels, crop):
    """SegmentationDataset from stored arrays (memmaps or lists)."""
    shapes = np.asarray(meta['original_sizes'], np.int64).reshape(-1, 2)
    stored_c = meta['stored_channels']
    view = channels if channels != stored_c else None
    if crop:
        n = len(shapes)
        img_shapes = np.concatenate([shapes, np.full((n, 1), stored_c)], axis=1)
        images = RaggedArray(entry_arrays['images'], img_shapes, view)
        masks = RaggedArray(entry_arrays['masks'], shapes)
        instances = RaggedArray(entry_arrays['instances'], shapes)
    else:
        images, masks, instances = entry_arrays['images'], entry_arrays['masks'], entry_arrays['instances']
        if view is not None:
            images = images[..., :view]
    ds = SegmentationDataset(images, masks, instances, names=names,
                             original_sizes=[tuple(int(v) for v in s) for s in shapes])
    ds.channels = channels
    ds.layout = meta['layout']
    ds.kinds = list(meta['kinds'])
    return ds


@dataclass
class LoadOptions:
    """How :func:`load_dataset` reads a dataset; the ``bin/train`` flag of each field is
    its name with dashes (``mask_suffix`` -> ``--mask-suffix``).

    Attributes
    ----------
    layout : {'auto', 'paired', 'dsb', 'csv'}
    mask_suffix : str
        Paired layout: ``name.ext`` <-> ``name<mask_suffix>.ext`` (same names also pair).
    size : int
        Resize mode (``crop == 0``): images become ``size`` x ``size`` (area interpolation),
        masks and instances nearest.
    crop : int
        > 0: keep native resolution (the transform from ``make_transform(crop=crop)``
        crops); ``size`` is then unused.
    channels : {0, 1, 3}
        Convert images to 1 or 3 channels; 0 = 3 if any image has colour, else 1.
        The choice is ``dataset.channels``.
    cache_dir : str or False, optional
        Where cache entries live; None = ``$XDG_CACHE_HOME/gluon_unet`` (usually
        ``~/.cache/gluon_unet``); False = no cache.
    workers : int
        Decoding processes (0 or 1 = in this process).
    skip_unpaired : bool
        Warn about images without masks instead of raising.
    progress : bool
        tqdm progress bar while decoding.
    normalize : {'none', 'invert', 'percentile', 'auto', 'stain'}
        Per-image input normalization (``--normalize``), see :func:`~.io.input_image`;
        applied before resizing and stored in the cache.
    denoise : float
        Gaussian sigma before the percentile stretch of ``percentile``, ``auto`` and
        ``stain`` (0 = none).
    keep_colour : bool
        Also keep the colour images as read (RGB uint8, in memory, not cached) as
        ``dataset.colour``, for the stain jitter (``--stain-jitter``).
    plane : int, optional
        The plane of every stack (TIFFs with several planes: images and masks) to read;
        None refuses stacks (:func:`~.io.read_raw`). Files of one plane are read whole.
    """
    layout: str = 'auto'
    mask_suffix: str = '_mask'
    size: int = 128
    crop: int = 0
    channels: int = 0
    cache_dir: Optional[Union[str, bool]] = None
    workers: int = 2
    skip_unpaired: bool = False
    progress: bool = True
    normalize: str = 'none'
    denoise: float = DENOISE_SIGMA
    keep_colour: bool = False
    plane: Optional[int] = None

    def validate(self):
        """Raise :class:`UserError` naming the flag of the first invalid value (the layout
        and the files are checked by :func:`~.layouts.discover`)."""
        if self.channels not in (0, 1, 3):
            raise UserError('--channels must be 1 or 3 (or 0 = from the data) (got %r)' % (self.channels,))
        if self.normalize not in NORMALIZE_MODES:
            raise UserError('--normalize must be one of %s (got %r)'
                            % (', '.join(NORMALIZE_MODES), self.normalize))
        if not self.denoise >= 0:
            raise UserError('--denoise must be >= 0 (got %r)' % self.denoise)
        if self.crop < 0:
            raise UserError('--crop must be >= 0 (got %r)' % (self.crop,))
        if self.plane is not None and (isinstance(self.plane, bool) or not isinstance(self.plane, int)
                                       or self.plane < 0):
            raise UserError('--plane must be an integer >= 0 (got %r)' % (self.plane,))
        if not self.crop and (not isinstance(self.size, int) or self.size <= 0):
            raise UserError('--size must be a positive integer (got %r)' % (self.size,))
        return self


def load_dataset(path, masks=None, options=None, flag='--data', **overrides):
    """Read a user's dataset (folders, DSB layout or CSV) into a SegmentationDataset.

    Parameters
    ----------
    path : str
        ``--data``: image folder, DSB root or CSV file.
    masks : str, optional
        ``--masks``: mask folder of the paired layout.
    options : LoadOptions, optional
        How to read it; default ``LoadOptions()``.
    flag : str
        The flag that named ``path``, for one-line errors (``'--val-data'``).
    **overrides
        Fields of :class:`LoadOptions` to change, e.g. ``size=256, workers=0``.

    Returns
    -------
    SegmentationDataset
        ``images`` (N,S,S,C) uint8, ``masks`` (N,S,S) uint8 0/1, ``instances`` (N,S,S)
        int32 (memory-mapped when cached; ragged per-sample arrays in crop mode),
        ``names`` (file stems / DSB ids), ``original_sizes`` [(h, w)], ``groups``
        (:func:`appearance_groups`), ``colour`` (with ``keep_colour``: each image as read
        if its kind is colour, else None), plus the attributes ``channels``, ``layout``
        and ``kinds`` (:func:`~.io.image_kind` of every image).

    Raises
    ------
    UserError
        Anything wrong with the input: see :mod:`~gluon_unet.data.layouts` and
        :mod:`~gluon_unet.data.io`.
    """
    opts = dataclasses.replace(options or LoadOptions(), **overrides).validate()
    layout, samples = discover(path, masks, opts.layout, opts.mask_suffix, opts.skip_unpaired, flag)
    if opts.plane is not None:  # said, since nothing else shows that a stack was cut
        log.info('%s %s: every stack (TIFF with several planes) is read as its plane %d (--plane)',
                 flag, path, opts.plane)
    cache_dir = _cache.default_cache_dir(path) if opts.cache_dir is None else opts.cache_dir
    if cache_dir:
        ds = _load_cached(path, samples, layout, opts, cache_dir)
    else:
        ds = _load_in_memory(path, samples, layout, opts)
    ds.groups = appearance_groups(samples, ds.kinds)
    if opts.keep_colour:  # read again: the cache holds the network input, without the stain
        ds.colour = [read_image(s.image, plane=opts.plane) if kind == 'colour' else None
                     for s, kind in zip(samples, ds.kinds)]
    return ds


def appearance_groups(samples, kinds):
    """The ``--balance groups`` group of every sample: its CSV ``group`` column when the
    CSV has one, else its image kind (:func:`~.io.image_kind`: fluorescence, brightfield
    or colour)."""
    return [s.group if s.group is not None else k for s, k in zip(samples, kinds)]


def _load_in_memory(path, samples, layout, opts):
    """:func:`load_dataset` without a cache: decode into arrays in memory."""
    sink = _MemorySink()
    meta = _decode_all(path, samples, layout, opts, sink)
    if opts.crop:
        return _build_lists(sink, meta)
    arrays = {'images': np.stack(sink.images), 'masks': np.stack(sink.masks),
              'instances': np.stack(sink.instances)}
    return _build(arrays, meta, meta['names'], meta['channels'], opts.crop)


def _load_cached(path, samples, layout, opts, cache_dir):
    """:func:`load_dataset` through the cache: memory-map a hit, else decode into a new entry."""
    files = [f for s in samples for f in s.files()]
    files_hash = _cache.file_digest(files)
    key = _cache.cache_key(files, _cache_options(samples, layout, opts), files_hash=files_hash)
    entry = _cache.load(cache_dir, key)
    if entry is not None:
        return _build(entry.arrays, entry.meta, [s.name for s in samples], entry.meta['channels'], opts.crop)
    writer = _cache.open_writer(cache_dir, key, source={'data': os.path.abspath(path), 'files': files_hash})
    if writer is None:  # not writable: warned, loads without a cache
        return _load_in_memory(path, samples, layout, opts)
    try:
        with writer:
            meta = _decode_all(path, samples, layout, opts, _DiskSink(writer))
            writer.commit(_entry_shapes(meta, opts), meta)
    except WriteError as exc:  # the cache's disk is full, or turned read-only: train without it
        _cache.no_cache(exc)
        return _load_in_memory(path, samples, layout, opts)
    entry = _cache.load(cache_dir, key, verify=False)  # just written: its digests came from these arrays
    if entry is None:  # committed but unreadable (e.g. a concurrent prune): should not happen
        raise UserError('cache %s: could not read back the entry just written' % cache_dir)
    return _build(entry.arrays, entry.meta, meta['names'], meta['channels'], opts.crop)


def _cache_options(samples, layout, opts):
    """What, besides the files, a cache entry depends on."""
    options = {'size': 0 if opts.crop else int(opts.size), 'crop_mode': bool(opts.crop),
               'channels': int(opts.channels), 'layout': layout,
               'samples': _cache._digest([[s.name, s.image, s.masks, s.merge] for s in samples])}
    if opts.normalize != 'none':  # only then, so existing cache entries keep their keys
        options['normalize'] = opts.normalize
        options['denoise'] = float(opts.denoise)
    if opts.plane is not None:  # the same rule
        options['plane'] = int(opts.plane)
    return options


def _decode_all(path, samples, layout, opts, sink):
    """Decode every sample into ``sink`` (in worker processes); returns the dataset meta:
    ``original_sizes``, ``stored_channels``, ``channels`` (chosen), ``layout``, ``names``."""
    sizes, kinds, any_colour = [], [], False
    tasks = [(s, opts.size, opts.crop, opts.channels, opts.normalize, opts.denoise, opts.plane) for s in samples]
    desc = 'decoding %s' % os.path.basename(os.path.normpath(path))
    for image, mask, inst, hw, colour, kind in _pool_map(_decode_star, tasks, opts.workers, opts.progress, desc):
        sink.add(image, mask, inst)
        sizes.append(hw)
        kinds.append(kind)
        any_colour |= colour
    return {'original_sizes': [list(hw) for hw in sizes], 'stored_channels': opts.channels or 3,
            'channels': opts.channels or (3 if any_colour else 1), 'layout': layout,
            'names': [s.name for s in samples], 'kinds': kinds}


def _entry_shapes(meta, opts):
    """Shapes of the arrays of a cache entry: flat (ragged) in crop mode, else (N, S, S[, C])."""
    stored_c, sizes = meta['stored_channels'], meta['original_sizes']
    if opts.crop:
        total = int(sum(h * w for h, w in sizes))
        return {'images': (total * stored_c,), 'masks': (total,), 'instances': (total,)}
    n, size = len(sizes), opts.size
    return {'images': (n, size, size, stored_c), 'masks': (n, size, size), 'instances': (n, size, size)}


def _build_lists(sink, meta):
    """Crop mode without a cache: plain lists of native-size arrays."""
    chosen = meta['channels']
    images = sink.images if chosen == meta['stored_channels'] else [im[..., :chosen] for im in sink.images]
    ds = SegmentationDataset(images, sink.masks, sink.instances, names=meta['names'],
                             original_sizes=[tuple(s) for s in meta['original_sizes']])
    ds.channels = chosen
    ds.layout = meta['layout']
    ds.kinds = list(meta['kinds'])
    return ds
