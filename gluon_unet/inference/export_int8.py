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

The float32 export stays the default and is never changed by this; the sidecar's
``int8`` record says how the variant was calibrated and how far its probabilities are
from float32 on the calibration inputs.
"""
import dataclasses
import json
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from ..utils import DIGEST, file_crc32
from .sidecar import INT8_PARAMS, INT8_SYMBOL, geometry

#: The int8 variant's prefix in an export folder (its files: ``sidecar.INT8_SYMBOL``, ``INT8_PARAMS``).
INT8_PREFIX = INT8_SYMBOL[:-len('-symbol.json')]
#: ``bin/predict --precision``: the export's float32 network, or its int8 variant.
PRECISIONS = ('float32', 'int8')
#: Calibration modes ``bin/export --int8-calibration`` offers (MXNet's names).
CALIB_MODES = ('naive', 'entropy')
#: Network inputs the calibration uses unless told otherwise.
DEFAULT_CALIB_INPUTS = 32
# Operators of a quantized graph that run on int8 (or only convert): the others stay float32.
_INT8_OPS = ('_contrib_quantize_v2', '_contrib_quantize', '_contrib_dequantize', '_contrib_requantize')


@dataclass
class Int8Calibration:
    """What :func:`gluon_unet.inference.export.write_export` calibrates an int8 variant on:
    ``inputs`` (N, C, H, W) float32, the ``images`` they come from, MXNet's ``calib_mode``."""
    inputs: object
    images: list
    calib_mode: str = 'naive'


def run_calibration(cfg, count, calib_mode):
    """The :class:`Int8Calibration` of a run (its config ``cfg``): ``count`` network
    inputs of its own validation split, rebuilt from the config as
    :func:`~gluon_unet.inference.postprocess_search.retune` rebuilds it (the images the run validated on)."""
    from ..data.prepare import build_datasets
    _, val_ds = build_datasets(dataclasses.replace(cfg, progress=False))
    if val_ds is None or not len(val_ds):
        raise UserError('export --int8: the run has no validation images (--val-split 0 and no --val-data) to '
                        'calibrate the int8 variant on')
    inputs, images = calibration_inputs(val_ds, geometry(cfg), count)
    return Int8Calibration(inputs, images, calib_mode)


def check_options(int8, inputs, calibration):
    """Refuse, naming the flag, ``bin/export``'s int8 options without ``--int8`` or out of range."""
    for flag, given in (('--int8-inputs', inputs is not None), ('--int8-calibration', calibration is not None)):
        if given and not int8:
            raise UserError('%s goes with --int8 (it says how the int8 variant is calibrated)' % flag)
    if inputs is not None and inputs < 1:
        raise UserError('--int8-inputs must be >= 1 (got %r)' % inputs)
    if calibration is not None and calibration not in CALIB_MODES:
        raise UserError('--int8-calibration must be one of %s (got %r)' % (', '.join(CALIB_MODES), calibration))


def check_support(flag):
    """Raise a one-line :class:`UserError` starting with ``flag`` where this machine cannot
    run int8 (:func:`~gluon_unet.machine.cpu.cpu_int8_support`), before any work."""
    from ..machine.cpu import cpu_int8_support
    supported, why = cpu_int8_support()
    if not supported:
        raise UserError('%s: %s' % (flag, why))


def calibration_inputs(dataset, meta, count):
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

    Returns
    -------
    (ndarray (N, C, S, S) float32, list of str)
        The inputs and the names of the images they come from.
    """
    from .batched import InputJob, image_jobs
    side = meta['train_size']
    windows = []  # per image: its inputs of the calibration shape
    for i in range(min(len(dataset), count)):
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


def write_int8(net, folder, calibration, threshold, second=None):
    """Quantize ``net`` as the :class:`Int8Calibration` ``calibration`` says, write its
    int8 files into ``folder`` and check them.

    The written files are loaded back and run on the calibration inputs against the
    float32 ``net``: the record keeps the largest and mean difference of the
    probabilities and the fraction of pixels whose mask (at ``threshold``) differs.

    Returns
    -------
    dict
        The sidecar's ``int8`` record.
    """
    import mxnet as mx

    from ..model import probability_maps
    inputs, images, calib_mode = calibration.inputs, calibration.images, calibration.calib_mode
    t0 = time.time()
    qnet = quantize_block(net, inputs, calib_mode)
    qnet.hybridize()
    qnet(mx.nd.array(inputs[:1], ctx=mx.cpu())).wait_to_read()  # export writes no params before a forward
    qnet.export(os.path.join(folder, INT8_PREFIX), epoch=0)
    seconds = time.time() - t0
    loaded = load_int8(os.path.join(folder, INT8_PREFIX), mx.cpu())
    diff, flips = [], []
    with mx.autograd.predict_mode():
        for i in range(0, len(inputs), 8):
            x = mx.nd.array(inputs[i:i + 8], ctx=mx.cpu())
            ref = probability_maps(net(x), second).asnumpy()
            got = probability_maps(loaded(x), second).asnumpy()
            diff.append(np.abs(got - ref).reshape(len(x), -1))
            flips.append(((got[:, 0] > threshold) != (ref[:, 0] > threshold)).reshape(len(x), -1))
    diff, flips = np.concatenate(diff), np.concatenate(flips)
    return {
        'symbol': INT8_SYMBOL, 'params': INT8_PARAMS,
        'calibration': {'images': images, 'inputs': int(len(inputs)), 'input_shape': list(inputs.shape[1:]),
                        'calib_mode': calib_mode, 'quantized_dtype': 'auto', 'quantize_mode': 'full',
                        'excluded_layers': [], 'seconds': round(seconds, 2)},
        'float32_layers': float_layers(os.path.join(folder, INT8_SYMBOL)),
        'vs_float32': {'max_probability_difference': round(float(diff.max()), 5),
                       'mean_probability_difference': round(float(diff.mean()), 6),
                       'mask_disagreement': round(float(flips.mean()), 6), 'threshold': threshold,
                       'on': 'the calibration inputs'},
        'mxnet': mx.__version__,
    }


def int8_digests(folder):
    """The sidecar ``digest`` entries of the int8 files in ``folder``."""
    return {name: '%s:%08x' % (DIGEST, file_crc32(os.path.join(folder, name))) for name in (INT8_SYMBOL, INT8_PARAMS)}


def load_int8(prefix, ctx):
    """The int8 network of ``prefix`` (``.../model-int8``) on the CPU context ``ctx``."""
    import mxnet as mx
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return mx.gluon.SymbolBlock.imports(prefix + '-symbol.json', ['data'], prefix + '-0000.params', ctx=ctx)
