"""A numpy interpreter for the ONNX graphs gluon_unet exports, for the parity check that
:func:`gluon_unet.inference.export_onnx.write_onnx` runs at export time.

Why not ``onnx.reference.ReferenceEvaluator``: in onnx 1.14.1 (the newest onnx that MXNet
1.9.1's converter works with) it computes ``BatchNormalization`` wrongly for opsets 9-14
(0.04 off on outputs of magnitude 0.15, where onnxruntime agrees with MXNet to 1e-7), its
``Resize`` fails on the empty ``roi`` the converter writes, and one width-8 U-Net forward at
256x256 took it 200 s. onnxruntime cannot run beside MXNet (its wheels need numpy >= 1.24).

This interpreter follows the ONNX operator specifications for the cases the converter
emits (listed in :data:`OPS`) and refuses anything else by name, so a graph it cannot
check is never reported as checked. It is independent of MXNet and of onnxruntime; it
needs numpy only (the graph comes as plain Python data, see :func:`run_graph`).
"""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class UnsupportedGraph(ValueError):
    """The graph uses an operator (or a form of one) this interpreter does not implement."""


def _conv(x, w, b=None, pads=(0, 0, 0, 0), strides=(1, 1), dilations=(1, 1), group=1, **_):
    if group != 1 or tuple(dilations) != (1, 1):
        raise UnsupportedGraph('Conv with group %s, dilations %s' % (group, list(dilations)))
    kh, kw = w.shape[2:]
    x = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    windows = sliding_window_view(x, (kh, kw), axis=(2, 3))[:, :, ::strides[0], ::strides[1]]  # N C H W kh kw
    y = np.tensordot(windows, w, axes=([1, 4, 5], [1, 2, 3]))  # N H W O
    y = np.ascontiguousarray(y.transpose(0, 3, 1, 2))
    return y if b is None else y + b.reshape(1, -1, 1, 1)


def _conv_transpose(x, w, b=None, kernel_shape=None, strides=(1, 1), pads=(0, 0, 0, 0), group=1,
                    dilations=(1, 1), output_padding=(0, 0), **_):
    kh, kw = w.shape[2:]
    if (group != 1 or (kh, kw) != tuple(strides) or any(pads) or any(output_padding)
            or tuple(dilations) != (1, 1)):
        raise UnsupportedGraph('ConvTranspose other than kernel == stride without padding')
    # kernel == stride: every input pixel writes its own kh x kw output block.
    n, _, h, wd = x.shape
    y = np.tensordot(x, w, axes=([1], [0]))  # N H W O kh kw
    y = y.transpose(0, 3, 1, 4, 2, 5).reshape(n, w.shape[1], h * kh, wd * kw)
    return y if b is None else y + b.reshape(1, -1, 1, 1)


def _batch_norm(x, scale, bias, mean, var, epsilon=1e-5, training_mode=0, **_):
    if training_mode:
        raise UnsupportedGraph('BatchNormalization in training mode')
    k = (scale / np.sqrt(var + epsilon)).reshape(1, -1, 1, 1)
    return (x - mean.reshape(1, -1, 1, 1)) * k + bias.reshape(1, -1, 1, 1)


def _max_pool(x, kernel_shape, strides=None, pads=(0, 0, 0, 0), ceil_mode=0, dilations=(1, 1),
              storage_order=0, auto_pad=b'NOTSET', **_):
    if any(pads) or ceil_mode or tuple(dilations) != (1, 1) or auto_pad not in (b'NOTSET', 'NOTSET'):
        raise UnsupportedGraph('MaxPool with padding, ceil_mode or dilations')
    strides = strides or (1, 1)
    return sliding_window_view(x, tuple(kernel_shape), axis=(2, 3))[:, :, ::strides[0], ::strides[1]].max(axis=(4, 5))


def _linear_axis(x, axis, size):
    """Resize one axis of ``x`` to ``size`` by linear interpolation, ``align_corners``."""
    n = x.shape[axis]
    if size == n:
        return x
    pos = np.arange(size, dtype=np.float64) * ((n - 1) / (size - 1) if size > 1 else 0.0)
    lo = np.clip(np.floor(pos).astype(np.int64), 0, n - 1)
    hi = np.minimum(lo + 1, n - 1)
    frac = (pos - lo).astype(x.dtype)
    shape = [1] * x.ndim
    shape[axis] = size
    frac = frac.reshape(shape)
    return np.take(x, lo, axis=axis) * (1 - frac) + np.take(x, hi, axis=axis) * frac


def _resize(x, roi=None, scales=None, sizes=None, mode=b'nearest', coordinate_transformation_mode=b'half_pixel',
            antialias=0, **_):
    mode, ctm = _text(mode), _text(coordinate_transformation_mode)
    if mode != 'linear' or ctm != 'align_corners' or antialias:
        raise UnsupportedGraph('Resize mode %s with coordinate_transformation_mode %s' % (mode, ctm))
    if sizes is not None and sizes.size:
        out = [int(s) for s in sizes]
    else:
        out = [int(np.floor(d * s)) for d, s in zip(x.shape, scales)]
    if out[:2] != list(x.shape[:2]):
        raise UnsupportedGraph('Resize of the batch or channel axis')
    return _linear_axis(_linear_axis(x, 2, out[2]), 3, out[3])


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def _cast(x, to, **_):
    # TensorProto data types the converter uses: FLOAT, INT64 (and INT32, DOUBLE for safety).
    dtypes = {1: np.float32, 6: np.int32, 7: np.int64, 11: np.float64}
    if to not in dtypes:
        raise UnsupportedGraph('Cast to ONNX type %d' % to)
    return x.astype(dtypes[to])


#: op_type -> function(*inputs, **attributes); the operators gluon_unet's exports contain.
OPS = {
    'Conv': _conv,
    'ConvTranspose': _conv_transpose,
    'BatchNormalization': _batch_norm,
    'Relu': lambda x, **_: np.maximum(x, 0),
    'MaxPool': _max_pool,
    'Concat': lambda *xs, axis, **_: np.concatenate(xs, axis=axis),
    'Identity': lambda x, **_: x,
    'Dropout': lambda x, *rest, **_: x,  # inference: the identity
    'Resize': _resize,
    'Shape': lambda x, **_: np.array(x.shape, np.int64),
    'Cast': _cast,
    'Mul': lambda a, b, **_: a * b,
    'Add': lambda a, b, **_: a + b,
    'Sigmoid': lambda x, **_: 1 / (1 + np.exp(-x)),
}


def run_graph(nodes, initializers, feeds, outputs):
    """Run a graph on numpy arrays.

    Parameters
    ----------
    nodes : list of (op_type, inputs, outputs, attributes)
        In topological order (as ONNX stores them); an empty input name is an omitted
        optional input; attributes as Python values (``onnx.helper.get_attribute_value``).
    initializers : dict
        Name -> array: the weights.
    feeds : dict
        Name -> array: the graph inputs.
    outputs : list of str
        The values to return.

    Returns
    -------
    list of numpy arrays

    Raises
    ------
    UnsupportedGraph
        An operator (or a form of it) not in :data:`OPS`.
    """
    values = dict(initializers)
    values.update(feeds)
    for op_type, inputs, outs, attrs in nodes:
        fn = OPS.get(op_type)
        if fn is None:
            raise UnsupportedGraph('operator %s' % op_type)
        args = [values[name] if name else None for name in inputs]
        while args and args[-1] is None:
            args.pop()
        result = fn(*args, **attrs)
        values[outs[0]] = result
    return [values[name] for name in outputs]
