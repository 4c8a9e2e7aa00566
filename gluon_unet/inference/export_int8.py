"""The int8 variant of an export: ``model-int8-symbol.json`` + ``model-int8-0000.params``
beside the float32 files, for ``bin/predict --precision int8`` on the CPU.

MXNet 1.9.1 quantizes a Gluon network with oneDNN (``mx.contrib.quantization.quantize_net``):
its ``MKLDNN_QUANTIZE`` subgraph pass fuses each Convolution with its BatchNorm and ReLU
into one int8 operator, pooling and concatenation run on int8 too, and the 2x2 transposed
convolutions (``Deconvolution``, which has no quantized kernel) stay float32 between a
dequantize and a quantize. The thresholds for the int8 ranges come from calibration: the
float32 network's layer outputs on a few inputs (``naive``: their min/max; ``entropy``:
the KL-divergence-optimal cut). The calibration inputs are the run's own validation
images, cut into network inputs exactly as ``bin/predict --mode auto`` cuts them.

The float32 export stays the default and is never changed by this. Two guards keep an
int8 variant that predicts nothing from passing for a good one (issue 60):

* calibration inputs without signal (black or constant validation images) are refused
  before anything is written (:func:`check_signal`): ranges fitted to them clip every
  real image;
* every :data:`HOLD_OUT_EVERY`-th validation image is kept out of calibration, and the
  variant is checked on those against float32 at the threshold ``bin/predict`` will use
  (:func:`agreement`). The sidecar's ``int8.check`` record says what was measured and its
  verdict; ``bin/export`` refuses a variant that disagrees (:func:`finish_int8`) and
  ``bin/predict --precision int8`` warns about one it cannot vouch for (:func:`int8_warning`).
"""
import dataclasses
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..errors import UserError
from ..utils import DIGEST, file_crc32
from .configs import CALIB_MODES, DEFAULT_CALIB_INPUTS
from .sidecar import INT8_PARAMS, INT8_SYMBOL, geometry

#: The int8 variant's prefix in an export folder (its files: ``sidecar.INT8_SYMBOL``, ``INT8_PARAMS``).
INT8_PREFIX = INT8_SYMBOL[:-len('-symbol.json')]
# Operators of a quantized graph that run on int8 (or only convert): the others stay float32.
_INT8_OPS = ('_contrib_quantize_v2', '_contrib_quantize', '_contrib_dequantize', '_contrib_requantize')
#: Every HOLD_OUT_EVERY-th validation image (the 4th, 8th, ...) is kept out of calibration to
#: check the variant on; a run with fewer validation images holds none out (its record says so).
HOLD_OUT_EVERY = 4
#: The check predicts at most this many held-out images with both networks, each
#: cut to its central CHECK_MAX_SIDE square: their maps are kept until the threshold is
#: final (at most 16 x 2 x 1 MB), and a few hundred pixels a side show what int8 does.
CHECK_MAX_IMAGES = 16
CHECK_MAX_SIDE = 512
#: Calibration inputs whose pixels (0.1th to 99.9th percentile, all inputs together) span
#: fewer grey levels than this carry no signal to fit int8 ranges to.
MIN_GREY_LEVELS = 4
#: The check's bounds. Masks differing on more than this share of the pixels ...
MAX_MASK_DISAGREEMENT = 0.05
#: ... or int8's foreground overlapping float32's less than this (intersection over union)
#: is a variant that disagrees.
MIN_FOREGROUND_IOU = 0.7
#: Below this share of foreground pixels an overlap says little (a few pixels more or less
#: swing it): the IoU bound applies above it, and float32 must reach it for a verdict.
MIN_FOREGROUND = 0.005
#: An image where float32 finds at least MIN_FOREGROUND and int8 less than this share of
#: float32's foreground has lost its nuclei (the failure of issue 60, image by image).
LOST_SHARE = 0.1


@dataclass
class Int8Calibration:
    """What :func:`gluon_unet.inference.export.write_export` calibrates an int8 variant on:
    ``inputs`` (N, C, H, W) float32, the ``images`` they come from, MXNet's ``calib_mode``;
    and what it checks the variant on: ``check_images`` ((name, uint8 image) pairs),
    ``held_out`` (whether they were kept out of calibration) of the run's
    ``validation_images``. ``maps`` keeps the check's probability maps (float32, int8)
    so :func:`finish_int8` can measure again at a threshold chosen later."""
    inputs: object
    images: list
    calib_mode: str = 'naive'
    check_images: list = field(default_factory=list)
    held_out: bool = False
    validation_images: int = 0
    maps: Optional[list] = None


def run_calibration(cfg, count=None, calib_mode=None):
    """The :class:`Int8Calibration` of a run (its config ``cfg``): ``count`` (None:
    :data:`DEFAULT_CALIB_INPUTS`) network inputs of its own validation split, calibrated
    with ``calib_mode`` (None: 'naive'), rebuilt from the config as
    :func:`~gluon_unet.inference.postprocess_search.retune` rebuilds it (the images the run
    validated on), without the images held out for the check (:func:`held_out_indices`).

    Raises
    ------
    UserError
        No validation images, none large enough, or inputs without signal (:func:`check_signal`).
    """
    from ..data.prepare import build_datasets
    _, val_ds = build_datasets(dataclasses.replace(cfg, progress=False))
    if val_ds is None or not len(val_ds):
        raise UserError('export --int8: the run has no validation images (--val-split 0 and no --val-data) to '
                        'calibrate the int8 variant on')
    count, calib_mode = count or DEFAULT_CALIB_INPUTS, calib_mode or 'naive'
    held = held_out_indices(len(val_ds))
    inputs, images = calibration_inputs(val_ds, geometry(cfg), count,
                                        [i for i in range(len(val_ds)) if i not in held])
    check_signal(inputs, images)
    # Too few to hold any out: the check runs on calibration images, and its record says so.
    check = held or [i for i in range(len(val_ds)) if val_ds.names[i] in images][:CHECK_MAX_IMAGES]
    return Int8Calibration(inputs, images, calib_mode, [(val_ds.names[i], _check_image(val_ds.raw(i)[0]))
                                                        for i in check], bool(held), len(val_ds))


def held_out_indices(count):
    """Indices of the validation images (of ``count``) kept out of calibration for the
    check: every :data:`HOLD_OUT_EVERY`-th, spread over the split (a ``--val-data`` folder
    is in name order), at most :data:`CHECK_MAX_IMAGES`; none below ``HOLD_OUT_EVERY``
    images, where calibration needs every one."""
    return list(range(HOLD_OUT_EVERY - 1, count, HOLD_OUT_EVERY))[:CHECK_MAX_IMAGES]


def _check_image(image):
    """A validation image as the check predicts it: uint8, at most CHECK_MAX_SIDE a side."""
    image = np.asarray(image)
    if image.dtype != np.uint8:  # float images given through the API (already 0..1)
        image = np.clip(image * 255 + 0.5, 0, 255).astype(np.uint8)
    top, left = (max(0, (side - CHECK_MAX_SIDE) // 2) for side in image.shape[:2])
    return image[top:top + CHECK_MAX_SIDE, left:left + CHECK_MAX_SIDE]


def check_signal(inputs, images):
    """Refuse in one line calibration ``inputs`` ((N, C, H, W) in [0, 1], from the
    validation ``images``) whose pixels span fewer than :data:`MIN_GREY_LEVELS` grey
    levels: int8 ranges fitted to black or constant images cut real ones to nothing."""
    low, high = (int(round(v * 255)) for v in np.percentile(inputs, [0.1, 99.9]))
    if high - low < MIN_GREY_LEVELS:
        shown = ', '.join(images[:3]) + (', ...' if len(images) > 3 else '')
        raise UserError('export --int8: the %d calibration inputs (from the validation images %s) carry no signal: '
                        '99.8 %% of their pixels lie between grey levels %d and %d of 255 (black or constant images), '
                        'and int8 ranges fitted to them would cut real images to nothing; check the run\'s validation '
                        'images (--val-data, --val-split), or export without --int8' % (len(inputs), shown, low, high))


def check_support(flag):
    """Raise a one-line :class:`UserError` starting with ``flag`` where this machine cannot
    run int8 (:func:`~gluon_unet.machine.cpu.cpu_int8_support`), before any work."""
    from ..machine.cpu import cpu_int8_support
    supported, why = cpu_int8_support()
    if not supported:
        raise UserError('%s: %s' % (flag, why))


def calibration_inputs(dataset, meta, count, indices=None):
    """Up to ``count`` network inputs of the training input's shape from the validation
    images, as ``bin/predict --mode auto`` cuts them, spread over as many images as
    there are inputs: the int8 ranges are fitted to every kind of image the run knows,
    not to the first few large ones.

    Parameters
    ----------
    dataset : SegmentationDataset
        The run's validation split (``raw(i)`` gives its network-ready uint8 images).
    meta : dict
        The export's geometry (:func:`~gluon_unet.inference.sidecar.geometry`).
    count : int
    indices : list of int, optional
        The images of ``dataset`` to use, in order (default: all).

    Returns
    -------
    (ndarray (N, C, S, S) float32, list of str)
        The inputs and the names of the images they come from.
    """
    from .batched import InputJob, image_jobs
    side = meta['train_size']
    windows = []  # per image: its inputs of the calibration shape
    for i in (range(len(dataset)) if indices is None else indices)[:count]:
        image = dataset.raw(i)[0]
        if image.dtype != np.uint8:  # float images given through the API (already 0..1)
            image = np.clip(image * 255 + 0.5, 0, 255).astype(np.uint8)
        # MXNet's calibration binds one input shape: windows of other shapes (a small
        # image in whole mode) are left out; in tile and resize mode every window has it.
        found = [job.input for job in image_jobs(image, meta, 'auto')
                 if isinstance(job, InputJob) and job.input.shape[-2:] == (side, side)]
        if found:
            windows.append((dataset.names[i], found))
    if not windows:
        raise UserError('export --int8: the run has no validation images of at least %d x %d pixels to calibrate '
                        'on' % (side, side))
    inputs, names, taken = [], [], 0
    # Round robin over the images: each one's middle window first, then the others in order.
    while len(inputs) < count:
        added = False
        for name, found in windows:
            if taken < len(found) and len(inputs) < count:
                middle = len(found) // 2
                inputs.append(found[middle if taken == 0 else taken - 1 if taken <= middle else taken])
                if name not in names:
                    names.append(name)
                added = True
        taken += 1
        if not added:
            break
    return np.stack(inputs).astype(np.float32), names


def quantize_block(net, inputs, calib_mode='naive'):
    """The int8 SymbolBlock of the float32 HybridBlock ``net``, calibrated on ``inputs``
    ((N, C, H, W) float32) with MXNet's ``quantize_net`` (CPU, oneDNN)."""
    import mxnet as mx
    from mxnet.contrib.quantization import quantize_net

    from ..machine.probe import native_stderr_silenced
    if calib_mode not in CALIB_MODES:
        raise UserError('--int8-calibration must be one of %s (got %r)' % (', '.join(CALIB_MODES), calib_mode))
    calib = [[mx.nd.array(inputs[i:i + 1], ctx=mx.cpu())] for i in range(len(inputs))]
    with warnings.catch_warnings(), native_stderr_silenced():
        # quantize_net warns that it is deprecated after MXNet 2.0 (this is 1.9.1), and
        # MXNet logs each subgraph pass to file descriptor 2: news for nobody here.
        warnings.simplefilter('ignore')
        return quantize_net(net, quantized_dtype='auto', quantize_mode='full', calib_mode=calib_mode,
                            calib_data=calib, num_calib_examples=len(inputs), ctx=mx.cpu())


def float_layers(symbol_file):
    """``{operator: count}`` of the operators of a quantized symbol file that still run in
    float32 (all but int8 operators and the conversions between the two)."""
    with open(symbol_file) as f:
        nodes = json.load(f)['nodes']
    kept = {}
    for node in nodes:
        op, attrs = node.get('op'), node.get('attrs') or {}
        if op == 'null' or op in _INT8_OPS or op.startswith('_contrib_quantized_'):
            continue
        if op.startswith('_sg_mkldnn') and attrs.get('quantized') == 'true':
            continue
        kept[op] = kept.get(op, 0) + 1
    return kept


def write_int8(net, folder, calibration, meta):
    """Quantize ``net`` as the :class:`Int8Calibration` ``calibration`` says, write its
    int8 files into ``folder`` and check them.

    The written files are loaded back and both networks predict the calibration's check
    images as ``bin/predict --mode auto`` does (the maps are kept in
    ``calibration.maps``); :func:`agreement` compares them at the threshold the export's
    sidecar ``meta`` (as written so far) gives ``bin/predict``.

    This marks a variant that disagrees (``check.verdict``) and does not refuse it: the
    threshold may still change (a search after the export, :func:`finish_int8`), and a
    library caller may want to look at a bad variant; ``bin/export`` refuses one.

    Returns
    -------
    dict
        The sidecar's ``int8`` record.
    """
    import mxnet as mx

    from .batched import predict_image
    inputs, images, calib_mode = calibration.inputs, calibration.images, calibration.calib_mode
    t0 = time.time()
    qnet = quantize_block(net, inputs, calib_mode)
    qnet.hybridize()
    qnet(mx.nd.array(inputs[:1], ctx=mx.cpu())).wait_to_read()  # export writes no params before a forward
    qnet.export(os.path.join(folder, INT8_PREFIX), epoch=0)
    seconds = time.time() - t0
    t0 = time.time()
    loaded = load_int8(os.path.join(folder, INT8_PREFIX), mx.cpu())  # the files as bin/predict will read them
    loaded.hybridize(static_alloc=True)
    own = [next(iter(net.collect_params().values())).list_ctx()[0]]
    calibration.maps = [(name, predict_image(net, meta, image, own), predict_image(loaded, meta, image, [mx.cpu()]))
                        for name, image in calibration.check_images]
    check = agreement(calibration, *predict_threshold(meta))
    check['seconds'] = round(time.time() - t0, 2)
    return {
        'symbol': INT8_SYMBOL, 'params': INT8_PARAMS,
        'calibration': {'images': images, 'inputs': int(len(inputs)), 'input_shape': list(inputs.shape[1:]),
                        'calib_mode': calib_mode, 'quantized_dtype': 'auto', 'quantize_mode': 'full',
                        'excluded_layers': [], 'seconds': round(seconds, 2)},
        'float32_layers': float_layers(os.path.join(folder, INT8_SYMBOL)),
        'check': check,
        'mxnet': mx.__version__,
    }


def predict_threshold(meta):
    """``(threshold, where from)``: the foreground cut ``bin/predict`` uses for an export
    whose sidecar is ``meta`` (as :func:`~gluon_unet.inference.batched.loaded_model`
    chooses it): the searched ``postprocess.threshold``, else the training ``threshold``, else 0.5."""
    tuned = meta.get('postprocess') if isinstance(meta.get('postprocess'), dict) else {}
    if tuned.get('threshold'):
        return float(tuned['threshold']), 'postprocess.threshold'
    if meta.get('threshold'):
        return float(meta['threshold']), 'threshold'
    return 0.5, 'default'


def agreement(calibration, threshold, source='threshold'):
    """The sidecar's ``int8.check`` record: int8 against float32 on the check maps of
    ``calibration`` (:func:`write_int8`), foreground cut at ``threshold`` (``source``:
    which sidecar key gave it).

    ``verdict`` is 'disagrees' when the masks differ on more than
    :data:`MAX_MASK_DISAGREEMENT` of the pixels, the foregrounds (:data:`MIN_FOREGROUND`
    or more) overlap less than :data:`MIN_FOREGROUND_IOU`, or an image lost its
    foreground (:data:`LOST_SHARE`); else 'unverified' when the check cannot vouch for
    the variant (no image held out of calibration, or float32 finds less than
    ``MIN_FOREGROUND``), else 'agrees'. ``problem`` says why ('' when it agrees).
    """
    maps = calibration.maps or []
    pixels = sum(ref.size for _, ref, _ in maps)
    both = either = differ = fg32 = fg8 = 0
    diff_max, diff_sum, lost = 0.0, 0.0, []
    for name, ref, got in maps:
        a, b = ref > threshold, got > threshold
        both, either = both + int((a & b).sum()), either + int((a | b).sum())
        differ, fg32, fg8 = differ + int((a != b).sum()), fg32 + int(a.sum()), fg8 + int(b.sum())
        diff = np.abs(got - ref)
        diff_max, diff_sum = max(diff_max, float(diff.max())), diff_sum + float(diff.sum())
        if a.mean() >= MIN_FOREGROUND and b.sum() < LOST_SHARE * a.sum():
            lost.append(name)
    share = lambda n: round(n / max(pixels, 1), 6)  # noqa: E731
    iou = both / either if either else 1.0
    problems = []
    if max(fg32, fg8) >= MIN_FOREGROUND * pixels and iou < MIN_FOREGROUND_IOU:
        problems.append('foreground IoU with float32 %.0f %% (< %.0f %%)' % (100 * iou, 100 * MIN_FOREGROUND_IOU))
    if share(differ) > MAX_MASK_DISAGREEMENT:
        problems.append('masks differ on %.1f %% of the pixels (> %.0f %%)'
                        % (100.0 * share(differ), 100 * MAX_MASK_DISAGREEMENT))
    if lost:
        problems.append('(almost) no foreground on %d image%s where float32 finds some (%s)'
                        % (len(lost), '' if len(lost) == 1 else 's', ', '.join(lost[:3])))
    if problems:
        verdict, problem = 'disagrees', '; '.join(problems)
    elif not calibration.held_out:
        verdict, problem = 'unverified', ('measured on the calibration images: the run has %d validation image%s, '
                                          'too few to hold any out (it takes %d)'
                                          % (calibration.validation_images,
                                             '' if calibration.validation_images == 1 else 's', HOLD_OUT_EVERY))
    elif fg32 < MIN_FOREGROUND * pixels:
        verdict, problem = 'unverified', ('float32 finds foreground on only %.2f %% of the pixels there (< %.1f %%): '
                                          'too little to compare' % (100.0 * share(fg32), 100 * MIN_FOREGROUND))
    else:
        verdict, problem = 'agrees', ''
    return {'on': 'validation images held out of calibration' if calibration.held_out else 'the calibration images',
            'held_out': calibration.held_out, 'images': [name for name, _, _ in maps], 'pixels': pixels,
            'mode': 'auto', 'threshold': threshold, 'threshold_from': source,
            'foreground_float32': share(fg32), 'foreground_int8': share(fg8), 'foreground_iou': round(iou, 4),
            'mask_disagreement': share(differ), 'images_lost': lost,
            'max_probability_difference': round(diff_max, 5),
            'mean_probability_difference': round(diff_sum / max(pixels, 1), 6),
            'bounds': {'mask_disagreement': MAX_MASK_DISAGREEMENT, 'foreground_iou': MIN_FOREGROUND_IOU,
                       'min_foreground': MIN_FOREGROUND, 'lost_share': LOST_SHARE},
            'verdict': verdict, 'problem': problem}


def finish_int8(folder, calibration):
    """After the export in ``folder`` (a staging folder) has its final post-processing:
    measure the int8 check again if the threshold ``bin/predict`` will use changed since
    :func:`write_int8` (a search, or settings kept from an earlier export), and refuse a
    variant that disagrees with float32. ``calibration`` None (no ``--int8``): nothing to do.

    Refusing, not marking: the variant exists to be predicted with, and one that loses
    the nuclei predicts nothing without a word (issue 60); raised inside
    :func:`~gluon_unet.inference.export.staged_export`, the error leaves the export
    folder as it was, float32 files included. A variant the check cannot vouch for
    ('unverified') is installed, with a note here and a warning in ``bin/predict``.

    Returns
    -------
    str
        A line for the user: what the check measured ('' without ``calibration``).

    Raises
    ------
    UserError
        The variant disagrees (exit 1): one line with what was measured and what to do.
    """
    from .sidecar import SIDECAR, read_sidecar, update_sidecar
    if calibration is None:
        return ''
    meta = read_sidecar(os.path.join(folder, SIDECAR))
    record = meta['int8']
    threshold, source = predict_threshold(meta)
    check = record['check']
    if (check['threshold'], check['threshold_from']) != (threshold, source):
        check = dict(agreement(calibration, threshold, source), seconds=check.get('seconds'))
        update_sidecar(folder, {'int8': dict(record, check=check)})
    where = 'held-out validation images' if check['held_out'] else 'calibration images'
    measured = ('on %d %s at threshold %g (%s): foreground int8 %.2f %%, float32 %.2f %% of the pixels, masks '
                'differ on %.2f %%' % (len(check['images']), where, threshold, source, 100 * check['foreground_int8'],
                                        100 * check['foreground_float32'], 100 * check['mask_disagreement']))
    if check['verdict'] == 'disagrees':
        raise UserError('export --int8: the int8 variant disagrees with float32 %s: %s; the export folder is left '
                        'as it was - export without --int8, or try --int8-calibration entropy or more --int8-inputs'
                        % (measured, check['problem']), exit_code=1)
    if check['verdict'] == 'unverified':
        return 'note: int8 checked %s; unverified: %s' % (measured, check['problem'])
    return 'int8 checked against float32 %s' % measured


def int8_warning(meta, threshold=None):
    """A one-line warning for ``bin/predict --precision int8`` on the export whose
    sidecar is ``meta`` when its ``int8.check`` cannot vouch for the variant, else ''.

    Warns (does not refuse) because ``bin/export`` already refuses a variant that
    disagrees: what reaches here was made by an older gluon_unet (no check), by
    :func:`~gluon_unet.inference.export.write_export` from Python (which only marks),
    or could not be verified - the user may know better, but is told.
    ``threshold``: the export's own cut (:func:`predict_threshold` by default); a
    ``--threshold`` given to predict is the user's choice and not compared.
    """
    check = (meta.get('int8') or {}).get('check')
    head = 'warning: --precision int8: '
    if not isinstance(check, dict) or 'verdict' not in check:
        return head + ('this export\'s int8 variant was never checked against float32 at the threshold predict uses '
                       '(made by an older gluon_unet); `bin/export RUN --int8` makes it again and checks it')
    if check['verdict'] == 'disagrees':
        return head + ('model.json says the int8 variant disagrees with float32 (%s); predict without --precision '
                       'int8, or make it again with bin/export RUN --int8' % check.get('problem'))
    threshold = predict_threshold(meta)[0] if threshold is None else threshold
    checked = check.get('threshold')
    if isinstance(checked, bool) or not isinstance(checked, (int, float)) or abs(checked - threshold) > 1e-9:
        return head + ('the int8 variant was checked at threshold %s, the export now predicts at %g (its '
                       'post-processing changed since); `bin/export RUN --int8` checks it again'
                       % (check.get('threshold'), threshold))
    if check['verdict'] != 'agrees':
        return head + 'the int8 variant\'s agreement with float32 is unverified: %s' % check.get('problem')
    return ''


def int8_digests(folder):
    """The sidecar ``digest`` entries of the int8 files in ``folder``."""
    return {name: '%s:%08x' % (DIGEST, file_crc32(os.path.join(folder, name))) for name in (INT8_SYMBOL, INT8_PARAMS)}


def load_int8(prefix, ctx):
    """The int8 network of ``prefix`` (``.../model-int8``) on the CPU context ``ctx``."""
    import mxnet as mx
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return mx.gluon.SymbolBlock.imports(prefix + '-symbol.json', ['data'], prefix + '-0000.params', ctx=ctx)
