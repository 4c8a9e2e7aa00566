"""Inference with an exported model: ``bin/predict`` and the functions behind it.

An image goes through the network in one of three ways, each giving a foreground
probability map at the image's original resolution:

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
    memory grows with the image).

``auto`` (the default) tiles images larger than the training size and treats smaller
ones like training did: resized, or padded whole for models trained on native-resolution
crops. Inputs are the uint8 image / 255, as in training (16-bit and float images are
percentile-scaled to uint8 first by :mod:`gluon_unet.data.io`), after the model's
``--normalize`` (read from the export's sidecar) is applied to the whole image.

Work is streamed as fixed-shape jobs (tiles, TTA variants, resized images, across
images) batched over the devices with :func:`~gluon_unet.parallel.split_batch`, so the
devices stay busy and memory stays at one batch whatever the image size.
"""
import csv
import os
import sys
import time

import cv2
import mxnet as mx
import numpy as np

from .errors import UserError, reports_errors
from .model import foreground_probability
from .parallel import split_batch
from .utils import atomic_open

MODES = ('auto', 'resize', 'tile', 'whole')
#: Instance separation choices of ``--split`` (see postprocess.instances_from_prob).
SPLITS = ('watershed', 'none')
#: The 8 symmetries of the square: (quarter turns, horizontal flip).
DIHEDRAL = tuple((k, flip) for flip in (False, True) for k in range(4))
#: Name endings of our outputs (and of masks in a paired folder): such a file is not an
#: input when the image it belongs to sits next to it.
DERIVED_SUFFIXES = ('_mask', '_labels', '_overlay')


# -- geometry ------------------------------------------------------------------------------

def _dihedral(x, k, flip):
    """Flip (last axis) then rotate by ``k`` quarter turns, on the last two axes."""
    if flip:
        x = x[..., ::-1]
    return np.rot90(x, k, axes=(-2, -1))


def _undihedral(y, k, flip):
    """Inverse of :func:`_dihedral`."""
    y = np.rot90(y, -k, axes=(-2, -1))
    return y[..., ::-1] if flip else y


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


def tile_size(meta):
    """The training size, rounded down to a multiple of ``2**depth``."""
    m = int(meta.get('multiple') or 1)
    size = int(meta.get('train_size') or 256)
    return max(m, size // m * m)


def _pad_to(length, margin, m, at_least=0):
    """Total padding so that ``length`` + it >= ``max(at_least, length + 2 * margin)`` and
    the padded length minus ``at_least`` is a multiple of ``m``."""
    target = max(at_least, length + 2 * margin)
    target = at_least + -(-(target - at_least) // m) * m
    return target - length


def _reflect_pad(x, top, bottom, left, right):
    return np.pad(x, ((0, 0), (top, bottom), (left, right)), mode='reflect')


# -- jobs: fixed-shape network inputs and what to do with their outputs ---------------------

class _Job:
    __slots__ = ('input', 'callback')

    def __init__(self, inp, callback):
        self.input, self.callback = inp, callback


class _Done:
    """Marks the end of one image's jobs: ``fn`` runs once all of them are computed."""
    __slots__ = ('fn',)

    def __init__(self, fn):
        self.fn = fn


class _Canvas:
    """Weighted sum of (un-transformed) predictions over the padded image."""

    def __init__(self, h, w):
        self.acc = np.zeros((h, w), np.float32)
        self.wsum = np.zeros((h, w), np.float32)

    def add(self, prob, y, x, k, flip, weight):
        prob = _undihedral(prob, k, flip)
        h, w = prob.shape
        self.acc[y:y + h, x:x + w] += prob * weight
        self.wsum[y:y + h, x:x + w] += weight

    def result(self):
        return self.acc / np.maximum(self.wsum, 1e-12)


def image_jobs(image, meta, mode='auto', tta=False, overlap=0.25, on_done=None):
    """The network inputs of one image, then a :class:`_Done` that yields its probabilities.

    Parameters
    ----------
    image : (H, W, C) uint8
        Channels already matching the model.
    meta : dict
        Export sidecar (``train_size``, ``multiple``, ``resize_mode``).
    on_done : callable
        ``on_done(prob (H, W) float32, mode)`` once every job of the image has run.
    """
    if image.ndim == 2:
        image = image[..., None]
    h, w = image.shape[:2]
    mode = choose_mode(mode, h, w, meta)
    size, m = tile_size(meta), int(meta.get('multiple') or 1)
    weight = 1.0
    if mode == 'resize':
        # INTER_AREA on the uint8 image, as the training loader resized it.
        small = cv2.resize(image, (size, size), interpolation=cv2.INTER_AREA).reshape(size, size, -1)
        src = small.transpose(2, 0, 1).astype(np.float32) / 255
        starts, tile = [(0, 0)], (size, size)
        crop = (0, 0)

        def finish(p):
            return cv2.resize(p, (w, h), interpolation=cv2.INTER_LINEAR)
    else:
        x = image.transpose(2, 0, 1).astype(np.float32) / 255
        # A U-Net pools by 2**depth, so it is only shift-equivariant by multiples of that:
        # every crop must start at a multiple of m in image coordinates, or its pooling grid
        # differs from that of its neighbours (and of a whole-image pass), which shows as
        # seams and a pixel-periodic pattern. Padding and tile offsets are multiples of m.
        if mode == 'whole':
            ph, pw = _pad_to(h, 0, m), _pad_to(w, 0, m)
            starts, tile = [(0, 0)], (h + ph, w + pw)
            margin = 0
        else:  # tile
            step = max(m, int(size * (1 - overlap)) // m * m)
            # Image borders get half the overlap of real (reflected) context, so they are
            # not at a tile edge either; images smaller than a tile are padded up to one.
            margin = (size - step) // 2 // m * m
            ph, pw = _pad_to(h, margin, m, size), _pad_to(w, margin, m, size)
            ys = tile_starts(h + ph, size, step)
            xs = tile_starts(w + pw, size, step)
            starts, tile = [(y, x0) for y in ys for x0 in xs], (size, size)
            if len(starts) > 1:
                weight = blend_window(size, size - step)
        top = max(margin, ph // 2 // m * m)
        left = max(margin, pw // 2 // m * m)
        src = _reflect_pad(x, top, ph - top, left, pw - left)
        crop = (top, left)

        def finish(p):
            return p[crop[0]:crop[0] + h, crop[1]:crop[1] + w]
    canvas = _Canvas(*src.shape[1:])
    for y, x0 in starts:
        part = src[:, y:y + tile[0], x0:x0 + tile[1]]
        for k, flip in (DIHEDRAL if tta else DIHEDRAL[:1]):
            def add(prob, y=y, x0=x0, k=k, flip=flip):
                canvas.add(prob, y, x0, k, flip, weight)
            yield _Job(np.ascontiguousarray(_dihedral(part, k, flip)), add)
    yield _Done(lambda: on_done(np.ascontiguousarray(finish(canvas.result()), np.float32), mode))


def run_jobs(net, ctxs, jobs, batch_size=8):
    """Run a stream of jobs in batches of equal-shape inputs split over ``ctxs``.

    One batch is kept in flight: the next batch is queued on the devices before the
    previous one's results are read back and post-processed.
    """
    pending = None
    batch, finishers = [], []

    def issue(batch):
        x = mx.nd.array(np.stack([j.input for j in batch]))
        with mx.autograd.predict_mode():
            return [foreground_probability(net(part)) for (part,) in split_batch([x], ctxs)]

    def collect(entry):
        jobs_, outs, fins = entry
        probs = np.concatenate([o.asnumpy() for o in outs])
        for job, p in zip(jobs_, probs):
            job.callback(p)
        for fn in fins:
            fn()

    def flush():
        nonlocal pending, batch, finishers
        entry = (batch, issue(batch), finishers)
        if pending is not None:
            collect(pending)
        pending, batch, finishers = entry, [], []

    for job in jobs:
        if isinstance(job, _Done):
            if batch:
                finishers.append(job.fn)
            elif pending is not None:
                pending[2].append(job.fn)
            else:
                job.fn()
            continue
        if batch and (len(batch) >= batch_size or job.input.shape != batch[0].input.shape):
            flush()
        batch.append(job)
    if batch:
        flush()
    if pending is not None:
        collect(pending)


def predict_image(net, meta, image, ctxs, mode='auto', tta=False, batch_size=8, overlap=0.25):
    """Foreground probabilities of one image at its original resolution.

    Parameters
    ----------
    net : Block
        The exported network (or any block giving logits), on ``ctxs``.
    meta : dict
        Export sidecar: ``train_size``, ``multiple``, ``resize_mode``.
    image : (H, W) or (H, W, C) uint8
        C must be the model's input channels (see :func:`match_channels`).
    ctxs : list of mx.Context
    mode : {'auto', 'resize', 'tile', 'whole'}
    tta : bool
        Average the 8 flips/quarter turns (each un-done before averaging).
    batch_size : int
        Inputs per forward, split over the devices.
    overlap : float
        Tile mode: fraction of the tile shared with its neighbour.

    Returns
    -------
    (H, W) float32 in [0, 1]
    """
    out = {}
    jobs = image_jobs(np.asarray(image), meta, mode, tta, overlap,
                      on_done=lambda prob, used: out.setdefault('prob', prob))
    run_jobs(net, list(ctxs), jobs, batch_size)
    return out['prob']


# -- inputs --------------------------------------------------------------------------------

def find_inputs(path):
    """Images to predict: a file, a folder of images, ``DIR/images/``, or a DSB root.

    Returns
    -------
    list of (image_id, path)
        Sorted; the id names the outputs (the DSB id for the DSB layout, else the stem).
    """
    from .data.io import is_image_file

    if not os.path.exists(path):
        raise UserError('--input %s: no such file or folder' % path)
    if os.path.isfile(path):
        if not is_image_file(path):
            raise UserError('--input %s: not an image file (png, jpg, tif, bmp)' % path)
        return [(os.path.splitext(os.path.basename(path))[0], path)]
    if os.path.isdir(os.path.join(path, 'images')):
        path = os.path.join(path, 'images')
    names = sorted(os.listdir(path))
    found = []
    for n in names:
        full = os.path.join(path, n)
        sub = os.path.join(full, 'images')
        if os.path.isdir(sub):  # DSB: ROOT/<id>/images/<id>.png
            imgs = sorted(f for f in os.listdir(sub) if is_image_file(f))
            pick = [f for f in imgs if os.path.splitext(f)[0] == n] or imgs
            if pick:
                found.append((n, os.path.join(sub, pick[0])))
        elif os.path.isfile(full) and is_image_file(n):
            found.append((os.path.splitext(n)[0], full))
    stems = {s for s, _ in found}
    found = [(s, p) for s, p in found
             if not any(s.endswith(x) and s[:-len(x)] in stems for x in DERIVED_SUFFIXES)]
    if not found:
        raise UserError('--input %s: no images (png, jpg, jpeg, tif, tiff, bmp) in the folder' % path)
    seen = {}
    for image_id, p in found:
        if image_id in seen:
            raise UserError('--input %s: %s and %s would write the same outputs (same name %r)'
                            % (path, os.path.basename(seen[image_id]), os.path.basename(p), image_id))
        seen[image_id] = p
    return found


def match_channels(image, channels, path='image'):
    """Convert a (H, W, C) uint8 image to the model's ``channels``.

    Grey -> RGB repeats the channel and RGB -> grey takes the luma, the same conversions
    the training loader applies; any other combination is an error.
    """
    from .data.io import to_channels

    c = image.shape[2]
    if c == channels:
        return image
    if channels in (1, 3) and c in (1, 3):
        return to_channels(image, channels)
    raise UserError('%s: image has %d channel%s but the model takes %d'
                    % (path, c, '' if c == 1 else 's', channels))


def model_channels(net, meta):
    """Input channels of an export: the sidecar's, else the first convolution's."""
    if meta.get('in_channels'):
        return int(meta['in_channels'])
    for p in net.collect_params().values():
        # SymbolBlock.imports leaves ``shape`` unset; the loaded data has it.
        shape = p.shape or (p.list_data()[0].shape if p._data is not None else ())
        if p.name.endswith('weight') and len(shape) == 4:
            return int(shape[1])
    raise UserError('cannot tell the input channels of the model (no model.json sidecar)')


# -- outputs -------------------------------------------------------------------------------

def _atomic_write(path, data):
    """Write bytes under a temporary name in the same folder, then rename into place."""
    with atomic_open(path, 'wb') as f:
        f.write(data)


def write_png(path, array):
    """Atomically write a uint8/uint16 (H, W) or RGB (H, W, 3) array as PNG."""
    if array.ndim == 3:
        array = array[..., ::-1]  # OpenCV writes BGR
    ok, buf = cv2.imencode('.png', np.ascontiguousarray(array))
    if not ok:
        raise UserError('%s: could not encode PNG' % path)
    _atomic_write(path, buf.tobytes())


def write_submission(path, rows):
    """Atomically write DSB submission rows ``(ImageId, EncodedPixels)`` as CSV."""
    import io
    text = io.StringIO()
    writer = csv.writer(text, lineterminator='\n')
    writer.writerow(('ImageId', 'EncodedPixels'))
    writer.writerows(rows)
    _atomic_write(path, text.getvalue().encode())


# -- the whole run -------------------------------------------------------------------------

class Predictions(list):
    """What :func:`predict_paths` returns: the records of the images written (a list, as
    before) and ``failures``, one dict per image that could not be predicted or written
    (``id``, ``image`` - its path - and ``error``, a one-line message), in input order."""

    def __init__(self, records=(), failures=()):
        super().__init__(records)
        self.failures = list(failures)

    def summary(self):
        """One line about the failures (empty when there are none), e.g.
        ``1 of 6 images failed: bad.png (truncated PNG ...)``."""
        return failure_summary(self.failures, len(self) + len(self.failures))


#: Failures named in a summary line; the rest are counted.
SHOWN_FAILURES = 3


def failure_summary(failures, total, shown=SHOWN_FAILURES):
    """``'2 of 6 images failed: a.png (why), b.png (why)'``, the first ``shown`` named."""
    if not failures:
        return ''
    named = ', '.join('%s (%s)' % (os.path.basename(f['image']), _reason(f)) for f in failures[:shown])
    more = ' and %d more' % (len(failures) - shown) if len(failures) > shown else ''
    head = ('all %d images' % total if len(failures) == total else
            '%d of %d image%s' % (len(failures), total, '' if total == 1 else 's'))
    return '%s failed: %s%s' % (head, named, more)


def _reason(failure, limit=120):
    """A failure's message without the image path it usually starts with, shortened."""
    text = failure['error']
    for prefix in (failure['image'] + ': ', os.path.basename(failure['image']) + ': '):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    return text if len(text) <= limit else text[:limit - 3] + '...'


def _error_text(exc, path):
    """One line for an exception raised while predicting ``path``."""
    if isinstance(exc, UserError):
        text = str(exc)
    elif isinstance(exc, OSError) and exc.strerror:
        name = exc.filename2 or exc.filename
        text = '%s: cannot write %s (%s)' % (path, name, exc.strerror) if name else '%s: %s' % (path, exc.strerror)
    else:
        detail = str(exc).strip().splitlines()
        text = '%s: %s%s' % (path, type(exc).__name__, (': ' + detail[-1]) if detail else '')
    return ' '.join(text.split())


def predict_paths(model, inputs, output_dir, gpus='', cpus=1, mode='auto', tta=False, threshold=None,
                  min_size=0, overlay=False, rle=None, batch_size=8, overlap=0.25, progress=True,
                  split='watershed'):
    """Segment image files and write masks, instance labels, overlays and a submission.

    Parameters
    ----------
    model : str
        Run folder, export folder or export prefix (``.../model``).
    inputs : str
        Image file, folder of images, or DSB root (see :func:`find_inputs`).
    output_dir : str
        Gets ``<id>_mask.png`` (0/255), ``<id>_labels.png`` (16-bit instance ids) and,
        with ``overlay``, ``<id>_overlay.png``. Created when the first file is written.
    gpus, cpus : str, int
        Devices, as for training.
    mode, tta, batch_size, overlap
        See :func:`predict_image`.
    threshold : float, optional
        Foreground cut; default the model's training threshold.
    min_size : int
        Objects smaller than this many pixels are dropped.
    split : {'watershed', 'none'}
        Instance separation: distance watershed, or plain connected components.
    rle : str, optional
        Path of a Data Science Bowl submission CSV, written once every image is done.
    progress : bool
        Show a progress bar (stderr) and print a one-line summary.

    Returns
    -------
    Predictions
        A list with, per image written: ``id``, ``image``, ``height``, ``width``,
        ``mode``, ``objects`` and the paths written (``mask``, ``labels``, ``overlay``);
        its ``failures`` lists the images that failed.

    Raises
    ------
    UserError
        Bad options, model or inputs - or every image failed (nothing is written then).
        An image that cannot be read, predicted or written does not stop the others: it
        is listed in ``failures``, and the submission has the good images.
    """
    from .data.io import normalize_image, read_image
    from .devices import make_contexts
    from .export import load_exported
    from .postprocess import instances_from_prob, overlay as draw_overlay, submission_rows

    _check_options(mode, batch_size, overlap, threshold, min_size)
    if split not in SPLITS:
        raise UserError('--split must be one of %s (got %r)' % (', '.join(SPLITS), split))
    ctxs = make_contexts(gpus, cpus)
    files = find_inputs(inputs)
    if os.path.isfile(output_dir):
        raise UserError('--output %s: is a file, not a folder' % output_dir)
    if rle and os.path.isdir(rle):
        raise UserError('--rle %s: is a folder; give a CSV file name' % rle)
    net, meta = load_exported(model, ctx=ctxs)
    net.hybridize(static_alloc=True)
    channels = model_channels(net, meta)
    thr = float((meta.get('threshold') or 0.5) if threshold is None else threshold)
    # Exports from before --normalize existed have no key: they were trained without it.
    normalize = meta.get('normalize') or (meta.get('config') or {}).get('normalize') or 'none'

    records, rows, failures = [], [], []
    bar = _progress_bar(len(files), progress)
    t0 = time.time()

    def fail(index, image_id, path, exc):
        # One image's problem (unreadable, wrong channels, too many objects, disk full...)
        # must not cost the others, including those read ahead into the same batch.
        failures.append((index, {'id': image_id, 'image': path, 'error': _error_text(exc, path)}))
        bar.update(1)

    def done(rec, image, prob, used):
        labels = instances_from_prob(prob, threshold=thr, min_size=min_size, split=split)
        if labels.max() > np.iinfo(np.uint16).max:
            raise UserError('%s: %d objects do not fit a 16-bit label image' % (rec['image'], labels.max()))
        os.makedirs(output_dir, exist_ok=True)
        base = os.path.join(output_dir, rec['id'])
        rec.update(mode=used, objects=int(labels.max()), mask=base + '_mask.png',
                   labels=base + '_labels.png', overlay=base + '_overlay.png' if overlay else None)
        written = []
        try:
            for key, array in (('mask', lambda: ((labels > 0) * 255).astype(np.uint8)),
                               ('labels', lambda: labels.astype(np.uint16)),
                               ('overlay', lambda: draw_overlay(image, labels))):
                if rec[key]:
                    write_png(rec[key], array())
                    written.append(rec[key])
        except BaseException:
            for path in written:  # no mask without its labels: a failed image has no outputs
                _remove_quietly(path)
            raise
        if rle:
            rows.extend(submission_rows(rec['id'], labels))
        records.append(rec)
        bar.update(1)

    def guarded(fn, index, image_id, path):
        def run():
            try:
                fn()
            except Exception as exc:
                fail(index, image_id, path, exc)
        return run

    def jobs():
        for index, (image_id, path) in enumerate(files):
            try:
                stored = read_image(path)
                image = match_channels(stored, channels, path)
                net_input = normalize_image(image, normalize)
                # Overlays are drawn on the image as stored (colour stays colour for a grey model).
                shown = stored if overlay else None
                rec = {'id': image_id, 'image': path, 'height': image.shape[0], 'width': image.shape[1]}
                for job in image_jobs(net_input, meta, mode, tta, overlap,
                                      on_done=lambda prob, used, rec=rec, shown=shown: done(rec, shown, prob, used)):
                    yield _Done(guarded(job.fn, index, image_id, path)) if isinstance(job, _Done) else job
            except Exception as exc:
                fail(index, image_id, path, exc)

    try:
        run_jobs(net, ctxs, jobs(), batch_size)
    finally:
        bar.close()
    failures = [f for _, f in sorted(failures, key=lambda item: item[0])]
    if failures and not records:
        if len(failures) == 1:
            raise UserError(failures[0]['error'])
        raise UserError(failure_summary(failures, len(failures)))
    if rle:
        if os.path.dirname(os.path.abspath(rle)):
            os.makedirs(os.path.dirname(os.path.abspath(rle)), exist_ok=True)
        write_submission(rle, rows)
    seconds = time.time() - t0
    if progress:
        modes = {}
        for r in records:
            modes[r['mode']] = modes.get(r['mode'], 0) + 1
        print('predicted %d images (%d objects) in %.1f s: %.2f images/s on %d device%s [%s]; mode %s%s; '
              'outputs in %s%s' % (len(records), sum(r['objects'] for r in records), seconds,
                                   len(records) / max(seconds, 1e-9), len(ctxs), 's' if len(ctxs) > 1 else '',
                                   ', '.join(str(c) for c in ctxs),
                                   ', '.join('%s %d' % kv for kv in sorted(modes.items())),
                                   ', tta' if tta else '', output_dir, (', submission %s' % rle) if rle else ''))
    return Predictions(records, failures)


def _remove_quietly(path):
    try:
        os.remove(path)
    except OSError:
        pass


def _check_options(mode, batch_size, overlap, threshold, min_size):
    if mode not in MODES:
        raise UserError('--mode must be one of %s (got %r)' % (', '.join(MODES), mode))
    if batch_size < 1:
        raise UserError('--batch-size must be >= 1 (got %r)' % batch_size)
    if not 0 <= overlap < 1:
        raise UserError('--overlap must be in [0, 1) (got %r)' % overlap)
    if threshold is not None and not 0 < threshold < 1:
        raise UserError('--threshold must be in (0, 1) (got %r)' % threshold)
    if min_size < 0:
        raise UserError('--min-size must be >= 0 (got %r)' % min_size)


def _progress_bar(total, enabled):
    from tqdm import tqdm
    return tqdm(total=total, unit='img', desc='predict', disable=not enabled or total <= 1, file=sys.stderr)


@reports_errors
def main(argv=None):
    """``bin/predict``: segment images with an exported model. Returns the exit code."""
    from .cli import OneLineParser
    parser = OneLineParser(prog='predict', description='Segment nuclei with an exported model, at the '
                           'original resolution; writes <id>_mask.png, <id>_labels.png (16-bit instance '
                           'ids) and optionally overlays and a DSB submission CSV.')
    parser.add_argument('--model', required=True, metavar='RUN_DIR|PREFIX',
                        help='run folder (uses its export/), export folder or export prefix')
    parser.add_argument('--input', required=True, metavar='DIR|FILE',
                        help='an image, a folder of images, or a DSB root (<id>/images/<id>.png)')
    parser.add_argument('--output', required=True, metavar='DIR', help='folder for the outputs')
    parser.add_argument('--gpus', default='', help="GPU ids: '0-7', '0,2', 'all'; empty = CPU")
    parser.add_argument('--cpus', type=int, default=1, help='CPU contexts when no GPU is used (default 1)')
    parser.add_argument('--mode', default='auto', choices=MODES,
                        help='resize to the training size, tile at native resolution, whole image '
                             'padded, or auto (tile if larger than the training size; default)')
    parser.add_argument('--tta', action='store_true', help='average the 8 flips / quarter turns')
    parser.add_argument('--threshold', type=float, default=None,
                        help="foreground probability cut (default: the model's training threshold)")
    parser.add_argument('--min-size', type=int, default=0, help='drop objects under N pixels (default 0)')
    parser.add_argument('--split', default='watershed', choices=SPLITS,
                        help='separate touching nuclei with a distance watershed (default) or keep '
                             'plain connected components (none)')
    parser.add_argument('--overlay', action='store_true', help='also write <id>_overlay.png outlines')
    parser.add_argument('--rle', metavar='CSV', help='write a DSB submission (ImageId,EncodedPixels)')
    parser.add_argument('--batch-size', type=int, default=8, help='inputs per forward, split over devices')
    parser.add_argument('--overlap', type=float, default=0.25, help='tile overlap fraction (default 0.25)')
    parser.add_argument('--progress', action=__import__('argparse').BooleanOptionalAction, default=True,
                        help='progress bar and summary line')
    parser.add_argument('--allow-failures', action='store_true',
                        help='exit 0 even if some images could not be read or written (they are '
                             'listed on stderr either way; the others are always written). If every '
                             'image fails the exit code is 2 regardless')
    args = parser.parse_args(argv)
    result = predict_paths(args.model, args.input, args.output, gpus=args.gpus, cpus=args.cpus, mode=args.mode,
                  tta=args.tta, threshold=args.threshold, min_size=args.min_size, overlay=args.overlay,
                  rle=args.rle, batch_size=args.batch_size, overlap=args.overlap, progress=args.progress,
                  split=args.split)
    if result.failures:
        print('%s: %s' % ('warning' if args.allow_failures else 'error', result.summary()), file=sys.stderr)
        return 0 if args.allow_failures else 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
