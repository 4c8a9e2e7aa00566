"""ONNX beside an export: ``model.onnx``, which :mod:`gluon_unet.inference.batched_onnx` runs with
onnxruntime where MXNet is not installed (any Python and numpy onnxruntime ships for).

:func:`write_onnx` converts an export's ``model-symbol.json`` + ``model-0000.params`` with
MXNet's own converter (``mx.onnx.export_model``) and makes the result fit for serving:

* the input ``data`` is ``(batch, C, height, width)`` float32 with the three named axes
  dynamic (height and width multiples of the sidecar's ``multiple``); the output is named
  ``logits``, ``(batch, K, height, width)`` (the same logits MXNet gives; predictors apply
  the sigmoid, as :func:`~gluon_unet.model.probability_maps` does);
* the weights are initializers only: the converter also lists each as a graph input,
  which makes them overridable at run time and so stops onnxruntime's constant folding
  (it ran slower than MXNet that way; 18.4 vs 24.9 ms at width 8 once stripped);
* opset :data:`OPSET`, IR version :data:`IR_VERSION` (onnxruntime >= 1.13, TensorRT >= 8.6);
* a parity check before the file is written: MXNet and the ONNX graph (run by the numpy
  interpreter :mod:`gluon_unet.inference.onnx_numpy`) on :func:`parity_shapes`, largest difference at
  most :data:`TOLERANCE` times the outputs' scale (at least 1), else nothing is written.

:func:`add_onnx` does it for an existing export folder and records the file in its
``model.json`` (``onnx``: opset, axes, the parity figures; ``digest``: the file's CRC-32),
which is what tells the runner the file belongs to these weights. Needs mxnet and
``onnx<=1.15`` (MXNet 1.9.1's converter imports ``onnx.mapping``, gone in 1.16); see
``requirements-onnx-export.txt``.
"""
import json
import os
import tempfile
import time
import warnings

import numpy as np

from ..errors import UserError
from ..reporting import root_logger_untouched
from ..utils import DIGEST, atomic_open, file_crc32, write_errors
from .batched_onnx import INPUT, ONNX_FILE, OUTPUT

#: The opset the file declares. MXNet's converter writes opset-13 operator forms; 17 is
#: the first opset where onnx's reference BatchNormalization is right and the oldest that
#: current runtimes all take (onnxruntime 1.13+, TensorRT 8.6+); the forms used (Conv,
#: ConvTranspose, BatchNormalization, MaxPool, Concat, Relu, Resize, Shape, Cast, Mul)
#: mean the same in 13 and 17 (checked by onnx.checker and by the parity check).
OPSET = 17
#: The IR version that goes with opset 17 (onnx 1.14 writes 9, which onnxruntime < 1.15 refuses).
IR_VERSION = 8
#: Names of the dynamic axes of the input and the output.
AXES = ('batch', 'height', 'width')
#: Parity: largest |MXNet - ONNX| logit difference allowed, relative to max(1, max |logit|).
#: float32 convolutions summed in another order differ by ~1e-6 relative; a wrong operator
#: (onnx 1.14's reference BatchNormalization) differs by 1e-1.
TOLERANCE = 1e-4
#: The onnx versions MXNet 1.9.1's converter works with.
ONNX_REQUIREMENT = 'onnx>=1.10,<=1.15'


def import_onnx():
    """The ``onnx`` module, or a one-line :class:`UserError` saying what to install."""
    try:
        import onnx
        import onnx.mapping  # noqa: F401  (what mx2onnx needs; removed in onnx 1.16)
    except ImportError as exc:
        raise UserError('ONNX export needs the onnx package (%s) beside mxnet: pip install -r '
                        'requirements-onnx-export.txt (%s)' % (ONNX_REQUIREMENT, exc)) from None
    return onnx


def onnx_available():
    """``(True, '')`` when :func:`write_onnx` can run here, else ``(False, why)``: what an
    export that writes model.onnx by default says in one line instead of failing."""
    try:
        import_onnx()
    except UserError as exc:
        return False, str(exc)
    return True, ''


def parity_shapes(in_channels, multiple):
    """The input shapes the export-time parity check runs: a square, a wide batch of two
    and a tall one, each side at least 32 px and a multiple of ``multiple``."""
    unit = multiple * -(-32 // multiple)
    return [(1, in_channels, unit, unit), (2, in_channels, unit, unit + multiple),
            (1, in_channels, unit + 2 * multiple, unit)]


def symbol_geometry(symbol_file, params):
    """``(in_channels, multiple)`` of an MXNet U-Net symbol: the input channels of its
    first convolution's weight (``params``: name -> array) and 2 ** (number of poolings)."""
    with open(symbol_file) as f:
        nodes = json.load(f)['nodes']
    names = [n['name'] for n in nodes]
    channels = None
    for n in nodes:
        if n['op'] == 'Convolution':
            weight = names[n['inputs'][1][0]]
            shape = params[weight].shape
            channels = int(shape[1])
            break
    pools = sum(1 for n in nodes if n['op'] == 'Pooling')
    return channels, 2 ** pools


def write_onnx(folder, in_channels=None, multiple=None, shown=None):
    """Convert the export files in ``folder`` to ``folder/model.onnx``, checked.

    Parameters
    ----------
    folder : str
        Holds ``model-symbol.json`` and ``model-0000.params`` (an export folder, or the
        staging folder of :func:`~gluon_unet.inference.export.staged_export`).
    in_channels, multiple : int, optional
        The input channels and what the sides must be multiples of; default: read off the
        symbol (:func:`symbol_geometry`).
    shown : str, optional
        Where the file will be seen (named in errors), default ``folder``.

    Returns
    -------
    dict
        The sidecar's ``onnx`` record: file, opset, IR version, input/output names and axes,
        converter versions, ``parity`` (shapes, largest difference, scale, tolerance,
        reference).

    Raises
    ------
    UserError
        onnx missing or too new, a graph the converter cannot convert, a parity failure.
    """
    import mxnet as mx
    onnx = import_onnx()
    symbol_file, params_file = os.path.join(folder, 'model-symbol.json'), os.path.join(folder, 'model-0000.params')
    params = mx.nd.load(params_file)
    params = {k.split(':', 1)[-1]: v for k, v in params.items()}
    channels, pooled = symbol_geometry(symbol_file, params)
    in_channels, multiple = in_channels or channels, multiple or pooled
    if not in_channels:
        raise UserError('%s: no convolution in the graph, so its input channels are unknown' % symbol_file)
    model = convert(symbol_file, params_file, in_channels, multiple)
    net = _mxnet_block(symbol_file, params_file)
    parity = check_parity(model, net, parity_shapes(in_channels, multiple), symbol_file)
    path = os.path.join(folder, ONNX_FILE)
    with atomic_open(path, 'wb', shown=os.path.join(shown or folder, ONNX_FILE)) as f:
        f.write(model.SerializeToString())
    return {'file': ONNX_FILE, 'opset': OPSET, 'ir_version': IR_VERSION, 'input': INPUT, 'output': OUTPUT,
            'dynamic_axes': list(AXES), 'multiple': multiple,
            'converter': 'mxnet %s mx.onnx.export_model, onnx %s' % (mx.__version__, onnx.__version__),
            'parity': parity}


def convert(symbol_file, params_file, in_channels, multiple):
    """The ONNX ``ModelProto`` of an MXNet export: converted by ``mx.onnx.export_model``,
    then weights taken out of the inputs, axes named, output renamed, opset and IR set,
    and ``onnx.checker`` passed (see the module docstring)."""
    import mxnet as mx
    onnx = import_onnx()
    side = multiple * -(-32 // multiple)
    with tempfile.TemporaryDirectory(prefix='gluon_unet-onnx-') as tmp:
        out = os.path.join(tmp, ONNX_FILE)
        try:
            with warnings.catch_warnings(), root_logger_untouched():  # the converter logs with logging.info
                warnings.simplefilter('ignore')
                mx.onnx.export_model(symbol_file, params_file, in_shapes=[(1, in_channels, side, side)],
                                     in_types=[np.float32], onnx_file_path=out, dynamic=True,
                                     dynamic_input_shapes=[(None, in_channels, None, None)])
            model = onnx.load(out)
        except UserError:
            raise
        except Exception as exc:  # the converter raises whatever its op translation hits
            from ..errors import mxnet_message
            raise UserError('%s: cannot convert to ONNX: %s: %s' % (symbol_file, type(exc).__name__,
                                                                   mxnet_message(exc, limit=160))) from None
    # The converter leaves every output axis unknown; the channels are not.
    _, shapes, _ = mx.sym.load(symbol_file).infer_shape_partial(data=(1, in_channels, side, side))
    return _for_serving(model, onnx, in_channels, int(shapes[0][1]))


def _for_serving(model, onnx, in_channels, out_channels):
    graph = model.graph
    weights = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in weights]
    if len(inputs) != 1 or len(graph.output) != 1:
        raise UserError('ONNX conversion gave %d inputs and %d outputs; a U-Net export has one of each'
                        % (len(inputs), len(graph.output)))
    del graph.input[:]
    graph.input.extend(inputs)
    # Rename the output (its MXNet name carries a block counter: unet0_conv17_fwd) to a
    # stable one, and name the dynamic axes so runtimes and people can read them.
    old = graph.output[0].name
    for node in graph.node:
        node.output[:] = [OUTPUT if o == old else o for o in node.output]
        node.input[:] = [OUTPUT if i == old else i for i in node.input]
    graph.output[0].name = OUTPUT
    for value, channels in ((graph.input[0], in_channels), (graph.output[0], out_channels)):
        dims = value.type.tensor_type.shape.dim
        for index, name in zip((0, 2, 3), AXES):
            dims[index].ClearField('dim_value')
            dims[index].dim_param = name
        dims[1].dim_value = channels
    del model.opset_import[:]
    model.opset_import.add(domain='', version=OPSET)
    model.ir_version = IR_VERSION
    from .. import __version__
    model.producer_name, model.producer_version = 'gluon_unet', __version__
    model.doc_string = ('U-Net logits (batch, K, height, width) of input data (batch, C, height, width) = '
                        'uint8 image / 255; height and width multiples of 2**depth (model.json "multiple")')
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:
        raise UserError('the converted ONNX graph fails onnx.checker: %s' % str(exc).strip().splitlines()[0]) from None
    return model


def graph_data(model):
    """The graph of an ONNX ``ModelProto`` as plain data for :func:`gluon_unet.inference.onnx_numpy.run_graph`:
    ``(nodes, initializers)``."""
    from onnx import helper, numpy_helper
    nodes = [(n.op_type, list(n.input), list(n.output),
              {a.name: helper.get_attribute_value(a) for a in n.attribute}) for n in model.graph.node]
    return nodes, {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def check_parity(model, net, shapes, what, tolerance=TOLERANCE):
    """Run the MXNet block ``net`` and the ONNX ``model`` on random inputs of ``shapes``.

    Returns
    -------
    dict
        ``shapes``, ``max_abs_diff`` (largest over all shapes), ``scale`` (largest |logit|),
        ``tolerance``, ``reference`` (what ran the ONNX graph).

    Raises
    ------
    UserError
        A difference above ``tolerance * max(1, scale)``, naming ``what`` and the shape.
    """
    import mxnet as mx

    from .onnx_numpy import run_graph
    nodes, weights = graph_data(model)
    rng = np.random.default_rng(0)
    worst, scale = 0.0, 0.0
    for shape in shapes:
        x = rng.random(shape, dtype=np.float32)
        expected = net(mx.nd.array(x)).asnumpy()
        got, = run_graph(nodes, weights, {INPUT: x}, [OUTPUT])
        if got.shape != expected.shape:
            raise UserError('%s: the ONNX graph gives %s for input %s, MXNet %s'
                            % (what, got.shape, shape, expected.shape))
        diff = float(np.abs(got - expected).max())
        worst, scale = max(worst, diff), max(scale, float(np.abs(expected).max()))
        if not diff <= tolerance * max(1.0, scale):
            raise UserError('%s: the ONNX graph differs from MXNet by %.3g on input %s (outputs up to %.3g; '
                            'allowed %.3g): not written' % (what, diff, shape, scale, tolerance * max(1.0, scale)))
    return {'shapes': [list(s) for s in shapes], 'max_abs_diff': worst, 'scale': scale, 'tolerance': tolerance,
            'reference': 'gluon_unet.inference.onnx_numpy (numpy), float32 logits'}


def _mxnet_block(symbol_file, params_file):
    import mxnet as mx
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return mx.gluon.SymbolBlock.imports(symbol_file, [INPUT], params_file, ctx=mx.cpu())


def add_onnx(export):
    """Write ``model.onnx`` into an existing export (run folder, export folder or prefix)
    and record it in its ``model.json`` (``onnx`` and the file's ``digest``).

    Returns
    -------
    (str, dict, float)
        The file's path, its ``onnx`` record and the seconds it took (conversion and
        parity check).
    """
    from .sidecar import PARAMS, SIDECAR, SYMBOL, find_export, read_sidecar, update_sidecar, verify_export
    prefix = find_export(export)
    folder = os.path.dirname(os.path.abspath(prefix))
    sidecar = os.path.join(folder, SIDECAR)
    if not os.path.isfile(sidecar):
        raise UserError('export %s has no %s: the ONNX file is recorded there' % (folder, SIDECAR))
    meta = read_sidecar(sidecar)
    verify_export(meta, {SYMBOL: prefix + '-symbol.json', PARAMS: prefix + '-0000.params'}, sidecar)
    start = time.perf_counter()
    record = write_onnx(folder, meta.get('in_channels'), meta.get('multiple'))
    seconds = time.perf_counter() - start
    path = os.path.join(folder, ONNX_FILE)
    with write_errors(path):
        digest = dict(meta.get('digest') or {}, **{ONNX_FILE: '%s:%08x' % (DIGEST, file_crc32(path))})
    update_sidecar(folder, {'onnx': record, 'digest': digest})
    return path, record, seconds
