"""Hybridized export for inference: ``model-symbol.json`` + ``model-0000.params`` +
``model.json``, loadable with ``mx.gluon.SymbolBlock.imports`` alone.

The export is always an ordinary float32, single-device network with plain BatchNorm,
whatever the training used (several devices, SyncBatchNorm, AMP): it is rebuilt from
the config and the checkpoint, not from the live training block.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile

# mxnet (and .checkpoint, .model, which import it) are imported in the functions that use
# them: importing this module loads no mxnet (bin/predict on an ONNX export runs without it).
from ..errors import UserError, WriteError, stop_signals
from ..machine.runtime import apply_runtime_defaults, user_environ
from ..paths import EXPORT_FILES, export_files, holds_run, remove_files, remove_if_empty
from ..reporting import get_logger
from ..utils import DIGEST, dir_mode, file_crc32, write_errors, write_point
from .batched_onnx import ONNX_FILE
from .export_onnx import onnx_available, write_onnx
from .sidecar import INT8_SYMBOL, PARAMS, SIDECAR, SYMBOL, card_follows, final_folder, geometry, model_card


def export_checkpoint(checkpoint, out_dir, sidecar_extra=None, onnx='auto'):
    """Rebuild the model of ``checkpoint``, hybridize it and export it to ``out_dir``
    (with ``model.onnx`` as ``onnx`` says: see :func:`write_export`).

    The files are written aside and renamed into place one by one (:func:`staged_export`),
    so a reader never sees a half-written file and nothing else in ``out_dir`` is touched.

    Returns
    -------
    str
        The export prefix ``out_dir/model`` (for ``SymbolBlock.imports``).
    """
    from ..checkpoint import model_from_checkpoint
    net, cfg, meta = model_from_checkpoint(checkpoint)
    return export_block(net, cfg, out_dir, meta, dict({'source': export_source(checkpoint)}, **(sidecar_extra or {})),
                        onnx)


def export_source(checkpoint):
    """``{'run': run folder or None, 'checkpoint': path}`` (absolute): what an export was
    made from, recorded in its ``model.json`` so that another run's export is never
    replaced unasked (:func:`check_export_owner`)."""
    checkpoint = os.path.realpath(checkpoint)
    folder = os.path.dirname(checkpoint)
    run = os.path.dirname(folder) if os.path.basename(folder) == 'checkpoints' and \
        holds_run(os.path.dirname(folder)) else None
    return {'run': run, 'checkpoint': checkpoint}


def export_arrays(prefix, model_cfg, flag='--model'):
    """The weights of the export ``prefix`` (``.../model``) by structural name
    (``down.0.conv1.weight``, the names checkpoints use), as CPU NDArrays, for a U-Net of
    ``model_cfg`` (its ``model.json`` config's ``model``).

    MXNet's export names a parameter by its blocks' prefixes (``unet0_...`` here,
    ``unet3_...`` in another process); a fresh U-Net of the same config has the same names
    after its own top prefix, and knows each one's structural name.
    """
    import mxnet as mx
    from ..model import build_model
    saved = {}
    for key, value in mx.nd.load(prefix + '-0000.params').items():
        name = key.split(':', 1)[1] if key[:4] in ('arg:', 'aux:') else key
        saved[name.split('_', 1)[1] if '_' in name else name] = value
    net = build_model(model_cfg)
    out = {}
    for structural, param in net._collect_params_with_prefix().items():
        suffix = param.name[len(net.prefix):]
        if suffix not in saved:
            raise UserError('%s %s: its weights do not fit its own config (no %s): a damaged or foreign export'
                            % (flag, os.path.dirname(prefix), param.name))
        out[structural] = saved[suffix]
    return out


def model_from_export(prefix, cfg, flag='--model', ctxs=None):
    """The U-Net of ``cfg`` (a :class:`~gluon_unet.config.TrainConfig`, the export's
    ``model.json`` config) with the weights of the export ``prefix``, on ``ctxs`` (default
    the CPU), not hybridized."""
    import mxnet as mx
    from ..checkpoint import dummy_input
    from ..model import build_model
    ctxs = ctxs or [mx.cpu()]
    arrays = export_arrays(prefix, cfg.model, flag)
    net = build_model(cfg.model)
    net.initialize(ctx=ctxs)
    net(dummy_input(cfg, ctxs[0]))
    for name, param in net._collect_params_with_prefix().items():
        param.set_data(arrays[name])
    return net


def export_block(net, cfg, out_dir, meta=None, sidecar_extra=None, onnx='auto'):
    """Export the trained HybridBlock ``net`` (any network, e.g. your own passed to
    ``fit``) with the ``model.json`` sidecar of ``cfg`` to ``out_dir``.

    Parameters shared over several devices are averaged into one copy (MXNet's
    ``export``); ``cfg.model.depth`` is what the sidecar tells predictors about the
    input sides (multiples of ``2**depth``). The files are written aside and each is
    renamed into place (:func:`staged_export`); anything else in ``out_dir`` stays.
    ``onnx``: see :func:`write_export`; a note about ``model.onnx`` goes to the
    ``gluon_unet`` logger (a training run's log).

    Returns
    -------
    str
        The export prefix ``out_dir/model``.
    """
    with staged_export(out_dir) as stage:
        note = write_export(net, cfg, stage, meta, sidecar_extra, onnx)
    if note:
        get_logger().info(note)
    return os.path.join(os.path.abspath(out_dir), 'model')


def write_export(net, cfg, folder, meta=None, sidecar_extra=None, onnx='auto', int8=None):
    """Write the export files of ``net`` straight into ``folder`` (a staging folder of
    :func:`staged_export`: a reader there could see them half-written).

    ``onnx``: also write ``model.onnx`` (:func:`~gluon_unet.inference.export_onnx.write_onnx`, for
    predicting without MXNet) - True: always (a one-line error when the onnx package is
    missing or the conversion fails); ``'auto'``: when the onnx package is installed, and
    a conversion that fails leaves the export without it; False: never.

    Returns
    -------
    str
        A note for the user when ``'auto'`` wrote no ``model.onnx`` (why, what to
        install), else ''.

    ``int8``: also write the int8 variant (:mod:`gluon_unet.inference.export_int8`) calibrated as
    this :class:`~gluon_unet.inference.export_int8.Int8Calibration` says (None: none); ``finish_int8`` checks it.
    """
    meta = meta or {}
    ctx = next(iter(net.collect_params().values())).list_ctx()[0]
    net.hybridize(static_alloc=True, static_shape=True)
    from ..checkpoint import dummy_input
    net(dummy_input(cfg, ctx))  # export needs one forward of the hybridized graph
    final = final_folder(folder)
    # MXNet writes the symbol, then the params, in C++: the error names the last file it began.
    with write_errors(lambda: os.path.join(final, PARAMS if os.path.exists(os.path.join(folder, PARAMS))
                                           else SYMBOL), folder):
        net.export(os.path.join(folder, 'model'), epoch=0)
        write_point(os.path.join(final, PARAMS))
    sidecar = {
        'format': 'gluon_unet-export-1',
        'input_name': 'data',
        'in_channels': cfg.model.in_channels,
        'classes': cfg.model.classes,
        **geometry(cfg),
        'normalization': 'uint8 / 255 per channel (16-bit and float images: '
                         'percentile-scaled to uint8 first)',
        'normalize': cfg.normalize,
        # The denoise before the percentile stretch; exports without it predate it (0).
        'normalize_denoise': cfg.denoise,
        'threshold': cfg.threshold,
        # Training nuclei's diameters (px; median, range per image kind), for bin/predict --diameter
        **{key: (meta.get('data') or {}).get(key) for key in ('diameter', 'diameter_ranges')},
        'predict_diameter': cfg.predict_diameter,
        'epoch': meta.get('epoch'),
        'metrics': meta.get('metrics', {}),
        'config': cfg.to_dict(),
        'card': model_card(cfg, meta),
    }
    sidecar.update(sidecar_extra or {})
    if isinstance((sidecar_extra or {}).get('postprocess'), dict):
        card_follows(sidecar)
    record, note = _onnx_beside(folder, cfg, onnx, final)
    if record is not None:
        sidecar['onnx'] = record
    # What load_exported (and the ONNX runner) check the model files against.
    sidecar['digest'] = {name: '%s:%08x' % (DIGEST, file_crc32(os.path.join(folder, name)))
                         for name in (SYMBOL, PARAMS) + ((ONNX_FILE,) if record is not None else ())}
    if int8 is not None:
        from .export_int8 import int8_digests, write_int8
        with write_errors(os.path.join(final, INT8_SYMBOL), folder):  # every int8 file as its symbol
            sidecar['int8'] = write_int8(net, folder, int8, sidecar)
        sidecar['digest'].update(int8_digests(folder))
    with write_errors(os.path.join(final, SIDECAR), folder):
        with open(os.path.join(folder, SIDECAR), 'w') as f:
            json.dump(sidecar, f, indent=2)
        write_point(os.path.join(final, SIDECAR))
    return note


def _onnx_beside(folder, cfg, onnx, shown):
    """``(record, note)``: ``model.onnx`` written into ``folder`` as ``onnx`` asks (see
    :func:`write_export`) and its sidecar record, or None and why not."""
    if onnx is False:
        return None, ''
    if onnx == 'auto':
        available, why = onnx_available()
        if not available:
            return None, 'note: no %s (it predicts without MXNet): %s' % (ONNX_FILE, why)
    try:
        return write_onnx(folder, cfg.model.in_channels, 2 ** cfg.model.depth, shown=shown), ''
    except WriteError:
        raise
    except (UserError, ValueError) as exc:  # a graph the converter or the parity check refuses
        if onnx is True:
            raise
        return None, 'note: no %s: %s; the MXNet export is complete' % (ONNX_FILE, ' '.join(str(exc).split()))


@contextlib.contextmanager
def staged_export(out_dir, on_installed=None):
    """Yield an empty staging folder inside ``out_dir``; on success move its export files
    (:data:`~gluon_unet.paths.EXPORT_FILES`) into ``out_dir``, one ``os.replace`` each,
    ``model.json`` last; one the new export does not have (``model.onnx`` not written) is
    removed from ``out_dir``, so an older one never outlives its weights.

    The deletion rule (:mod:`gluon_unet.paths`): an export replaces only the files of a
    gluon_unet export (recognised by its ``model.json``), never anything else in
    ``out_dir``, and refuses in one line a folder whose export files are not
    gluon_unet's. On any failure or interruption (a search killed by SIGTERM, a full
    disk) the staging folder goes and ``out_dir`` keeps the export it had; the renames
    themselves run with SIGINT/SIGTERM held back, so they are never left half done.
    ``on_installed()`` is called once they are done, before a held-back signal acts.
    """
    out_dir = os.path.abspath(out_dir)
    check_export_folder(out_dir)
    created = None
    top = out_dir
    while not os.path.isdir(top):
        created, top = top, os.path.dirname(top)
    with write_errors(out_dir, top):
        os.makedirs(out_dir, exist_ok=True)
        # Inside out_dir: the renames never cross a file system (out_dir may be a mount).
        stage = tempfile.mkdtemp(prefix='.tmp-export-', dir=out_dir)
        # mkdtemp makes it owner-only; the files renamed out of it keep their own modes.
        os.chmod(stage, dir_mode())
    try:
        yield stage
        with _signals_held():
            for name in EXPORT_FILES:
                with write_errors(os.path.join(out_dir, name), out_dir):
                    if os.path.exists(os.path.join(stage, name)):
                        os.replace(os.path.join(stage, name), os.path.join(out_dir, name))
                    else:
                        remove_files(out_dir, [name])
            if on_installed is not None:
                on_installed()
    finally:
        remove_files(stage, os.listdir(stage))  # only what this export wrote there
        os.rmdir(stage)
        if created is not None and not os.listdir(out_dir):
            # nothing was installed: the folders this export made go too
            folder = out_dir
            while True:
                remove_if_empty(folder)
                if folder == created:
                    break
                folder = os.path.dirname(folder)


def check_export_folder(out_dir):
    """Refuse, in one line, an export folder that is a file or holds export files that
    gluon_unet did not write (they would be replaced)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError('export %s: is a file, not a folder' % out_dir)
    _, foreign = export_files(out_dir) if os.path.isdir(out_dir) else ([], [])
    if foreign:
        raise UserError('export %s: it holds %s, which gluon_unet did not write (no gluon_unet model.json); export '
                        'into another folder, or move them' % (out_dir, ', '.join(foreign)))


@contextlib.contextmanager
def _signals_held():
    """SIGINT, SIGTERM and SIGHUP wait until the block ends, then act: a few renames that must
    not be left half done. (Blocking the signal in this thread would not do: Python runs
    its handlers in the main thread whichever thread the kernel chose, e.g. MXNet's.)"""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in stop_signals()}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for s in held:
            signal.raise_signal(s)


def export_in_subprocess(checkpoint, out_dir):
    """Export from a fresh interpreter.

    ``amp.init()`` patches MXNet's operators for the whole process, so a network built
    after it would carry casts to half precision into the exported graph. A clean
    process gives the float32 export users expect.

    The child imports the very ``gluon_unet`` this process runs: the folder holding it
    goes first on the child's ``PYTHONPATH`` (an existing one is kept after it), since
    the package may be importable here only through the ``bin/`` shims' ``sys.path``.
    Its environment is the user's (not the thread counts this process chose for its
    contexts) with the defaults for one context, as ``bin/export`` would choose, and no
    GPU: it exports on the CPU, and with GPUs visible MXNet would create a CUDA context
    (a few hundred MB) on the first of them - from ``user_environ()``, which leaves out
    the ``CUDA_VISIBLE_DEVICES`` ``--gpus`` chose, that is physical GPU 0, maybe another
    job's - as soon as anything touched one (``mx.nd.load`` does, for an array a GPU saved).

    Raises
    ------
    ExportError
        The child failed; the message is one line ending with its last line of stderr.
    """
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds gluon_unet/
    env = user_environ()
    apply_runtime_defaults(env, contexts=1)  # the child loads mxnet as it starts
    env['CUDA_VISIBLE_DEVICES'] = ''  # no GPU for a CPU export (see above)
    env['PYTHONPATH'] = os.pathsep.join([package_root] + [p for p in [env.get('PYTHONPATH')] if p])
    cmd = [sys.executable, '-m', 'gluon_unet', 'export', checkpoint, '--output', out_dir]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise ExportError('exporting %s in a subprocess failed (%s): %s'
                          % (checkpoint, _exit_status(done.returncode), _last_error_line(done.stderr)))
    for line in done.stdout.splitlines():  # what the export says about model.onnx, as export_block does
        if line.startswith('note: no model.onnx'):
            get_logger().info(line)
    return os.path.join(out_dir, 'model')


class ExportError(UserError, RuntimeError):
    """:func:`export_in_subprocess` failed: a one-line :class:`UserError` (exit 1) for the
    CLI, and still a ``RuntimeError`` as before."""

    def __init__(self, message):
        super().__init__(message, exit_code=1)


def _exit_status(code):
    if code < 0:
        import signal
        try:
            return 'killed by %s' % signal.Signals(-code).name
        except ValueError:
            return 'killed by signal %d' % -code
    return 'exit %d' % code


def _last_error_line(stderr):
    """The child's last non-empty stderr line, without our CLIs' ``error:`` prefix."""
    lines = [line.strip() for line in (stderr or '').splitlines() if line.strip()]
    if not lines:
        return 'no error output'
    line = lines[-1]
    return line[len('error: '):] if line.startswith('error: ') else line
