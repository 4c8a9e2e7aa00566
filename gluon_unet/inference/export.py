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
from dataclasses import dataclass
from typing import Optional

# mxnet (and .checkpoint, .model, which import it) are imported in the functions that use
# them: importing this module loads no mxnet (bin/predict on an ONNX export runs without it).
from ..config import option
from ..errors import DamagedFile, UserError, WriteError
from ..machine.runtime import apply_runtime_defaults, user_environ
from ..paths import EXPORT_FILES, check_apart, export_files, holds_run, remove_files, remove_if_empty
from ..reporting import get_logger
from ..utils import DIGEST, check_writable, dir_mode, file_crc32, write_errors, write_point
from .batched_onnx import ONNX_FILE
from .export_int8 import CALIB_MODES, DEFAULT_CALIB_INPUTS, check_options, check_support, run_calibration
from .export_onnx import onnx_available, write_onnx
from .postprocess import settings_text
from .postprocess_search import retune
from .sidecar import (INT8_SYMBOL, PARAMS, SIDECAR, SYMBOL, card_follows, final_folder, geometry, model_card, read_sidecar,
                      update_sidecar, weights_digest)
from .tiling import MODES


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
    return export_block(net, cfg, out_dir, meta, sidecar_extra, onnx)


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
    this :class:`~gluon_unet.inference.export_int8.Int8Calibration` says (None: none).
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
        from .batched import second_map
        from .export_int8 import int8_digests, write_int8
        with write_errors(os.path.join(final, INT8_SYMBOL), folder):  # every int8 file as its symbol
            sidecar['int8'] = write_int8(net, folder, int8, cfg.threshold, second_map(sidecar))
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
    """SIGINT and SIGTERM wait until the block ends, then act: a few renames that must
    not be left half done. (Blocking the signal in this thread would not do: Python runs
    its handlers in the main thread whichever thread the kernel chose, e.g. MXNet's.)"""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
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


@dataclass
class ExportConfig:
    """What ``bin/export`` exports, where, and whether it searches the post-processing
    again; one field per flag (:mod:`gluon_unet.cli.export`)."""
    run: str = option(None, 'run folder (uses checkpoints/best.ckpt, else the latest) or a .ckpt file',
                      positional=True, metavar='RUN_DIR|CHECKPOINT')
    output: Optional[str] = option(None, 'export folder (default: <run>/export)', metavar='DIR')
    tune_postprocess: bool = option(False, "choose the threshold, markers and minimum object size again on the "
                                           "run's own validation split (its data must still be where it trained) "
                                           "and store them in the export, as training does at its end")
    mode: Optional[str] = option(None, 'with --tune-postprocess: predict the validation images with this '
                                       'bin/predict --mode (default auto), the one you will predict with',
                                 choices=MODES)
    tta: bool = option(False, "with --tune-postprocess: search on test-time-augmented maps, for a model you will "
                              "run with bin/predict --tta (8x the search's prediction time)")
    onnx: Optional[bool] = option(None, 'also write model.onnx, checked against MXNet, for bin/predict where MXNet '
                                        'is not installed (default: when the onnx package is installed: pip install '
                                        '-r requirements-onnx-export.txt)')
    int8: bool = option(False, "also write an int8 variant (model-int8-*) for bin/predict --precision int8 on the "
                               "CPU, quantized with MXNet's oneDNN and calibrated on the run's own validation images "
                               "(its data must still be where it trained); float32 stays the default")
    int8_inputs: Optional[int] = option(None, 'with --int8: how many network inputs (windows of the first validation '
                                              'images, as bin/predict --mode auto cuts them) to calibrate on '
                                              '(default %d)' % DEFAULT_CALIB_INPUTS, metavar='N')
    int8_calibration: Optional[str] = option(None, "with --int8: each layer's int8 range is its min..max on the "
                                                   "inputs (naive) or the cut that loses the least information "
                                                   "(entropy; slower) (default naive)", choices=CALIB_MODES)

    def validate(self):
        """Refuse, naming the flag, a search option without ``--tune-postprocess`` and an
        int8 option without ``--int8`` or out of range (:func:`~gluon_unet.inference.export_int8.check_options`)."""
        for flag, given in (('--mode', self.mode is not None), ('--tta', self.tta)):
            if given and not self.tune_postprocess:
                raise UserError('%s goes with --tune-postprocess (it says how the search predicts the validation '
                                'images)' % flag)
        check_options(self.int8, self.int8_inputs, self.int8_calibration)
        return self


def run_export(config):
    """``bin/export``: export the best (or given) checkpoint of ``config.run`` (an
    :class:`ExportConfig`), searching the post-processing again with
    ``--tune-postprocess`` (:func:`gluon_unet.inference.postprocess_search.retune`).

    Returns
    -------
    (str, list of str, dict or None)
        The export prefix, notes for the user and the searched settings.
    """
    onnx = 'auto' if config.onnx is None else config.onnx
    if onnx is True:  # asked for: before any work, not after the search
        available, why = onnx_available()
        if not available:
            raise UserError('--onnx: %s' % why)
    if config.int8:
        check_support('--int8')
    ckpt, out = resolve_run(config.run, config.output)
    if config.output:
        check_export_output(config.output, ckpt)
    check_export_folder(out)
    check_writable(out, '--output')
    from ..checkpoint import earlier_good_checkpoint, model_from_checkpoint
    try:
        net, cfg, meta = model_from_checkpoint(ckpt)
    except DamagedFile as exc:
        earlier = earlier_good_checkpoint(ckpt)
        if earlier is not None:
            exc.args = ('%s; the newest intact checkpoint of the run is %s: export it with bin/export %s'
                        % (exc.args[0], earlier, earlier),)
        raise
    if config.tune_postprocess or config.int8:
        check_apart([('--output', out)], [("the run's --data", cfg.data), ("the run's --masks", cfg.masks),
                                          ("the run's --val-data", cfg.val_data)],
                    'export --tune-postprocess' if config.tune_postprocess else 'export --int8')
    int8 = run_calibration(cfg, config.int8_inputs or DEFAULT_CALIB_INPUTS,
                           config.int8_calibration or 'naive') if config.int8 else None
    tuned, notes = None, []
    # The new export is built aside and only its last step replaces the old one: stopped
    # at any point before (Ctrl-C, SIGTERM during the search), the old export is intact.
    installed = []
    with _stops_on_sigterm('export %s' % config.run, out, installed):
        with staged_export(out, on_installed=lambda: installed.append(True)) as stage:
            notes.append(write_export(net, cfg, stage, meta, onnx=onnx, int8=int8))
            if config.tune_postprocess:
                tuned = retune(ckpt, stage, mode=config.mode or 'auto', tta=config.tta)
            else:
                notes.append(keep_searched(stage, [out, resolve_run(config.run, None)[1]], config.run))
    return os.path.join(os.path.abspath(out), 'model'), [n for n in notes if n], tuned


def check_export_output(output, checkpoint):
    """Refuse, in one line, an ``export --output`` that is the working folder, a run
    folder or a folder of checkpoints (an export belongs in a folder of its own), or the
    checkpoint itself."""
    from ..paths import checkpoint_files
    if os.path.realpath(output) == os.path.realpath(os.getcwd()):
        raise UserError('export --output %s is the working folder; give the export a folder of its own (default: '
                        '<run>/export)' % output)
    if os.path.isdir(output):
        run = holds_run(output)
        if run:
            raise UserError('export --output %s is a run folder (it holds %s); its export goes to %s, the default'
                            % (output, ', '.join(run), os.path.join(output, 'export')))
        if checkpoint_files(output):
            raise UserError('export --output %s holds checkpoints (%s); give the export a folder of its own'
                            % (output, ', '.join(checkpoint_files(output)[:3])))
    check_apart([('--output', output)], [('RUN|CHECKPOINT', checkpoint)], 'export')


def keep_searched(stage, folders, run):
    """Carry the searched post-processing of an earlier export of the same weights (the
    first of ``folders`` whose ``model.json`` has a ``postprocess``) into the staged
    export ``stage``: a plain ``bin/export RUN`` must not drop what training chose.

    Returns
    -------
    str
        A line for the user: what was kept, or why nothing was ('' when no earlier export
        had searched settings).
    """
    import mxnet as mx
    new, note, seen = None, '', set()
    for folder in folders:
        path = os.path.join(folder, SIDECAR)
        if os.path.realpath(path) in seen or not os.path.isfile(path):
            continue
        seen.add(os.path.realpath(path))
        try:
            tuned = read_sidecar(path).get('postprocess')
            if not isinstance(tuned, dict):
                continue
            new = new or weights_digest(os.path.join(stage, 'model'))
            same = weights_digest(os.path.join(folder, 'model')) == new
        except (UserError, mx.MXNetError, OSError):
            continue  # a damaged earlier export has nothing to keep
        if same:
            update_sidecar(stage, {'postprocess': tuned})
            return 'kept the post-processing searched for these weights (from %s): %s' % (path, settings_text(tuned))
        note = note or ('note: the post-processing in %s was searched for other weights, so this export has the '
                        'training defaults; `bin/export %s --tune-postprocess` searches for these' % (path, run))
    return note


@contextlib.contextmanager
def _stops_on_sigterm(what, out, installed):
    """SIGTERM as a one-line error (exit 143) instead of an abrupt end, so the staging
    folder is cleaned up and the user learns which export ``out`` holds (the new one
    once ``installed`` is non-empty, else the one it had)."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        if installed:
            raise UserError('%s stopped by SIGTERM as it finished; %s holds the new export' % (what, out),
                            exit_code=128 + signum)
        raise UserError('%s stopped by SIGTERM before it finished; %s keeps the export it had'
                        % (what, out), exit_code=128 + signum)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def resolve_run(run, output):
    """(checkpoint, export folder) for ``bin/export RUN``, with errors naming RUN."""
    from ..checkpoint import list_checkpoints
    if os.path.isdir(run):
        folder = os.path.join(run, 'checkpoints')
        ckpt = os.path.join(folder, 'best.ckpt')
        if not os.path.isfile(ckpt):
            found = list_checkpoints(folder) or list_checkpoints(run)
            if not found:
                raise UserError('export %s: no checkpoint there (expected checkpoints/best.ckpt '
                                'or epoch*.ckpt; is it a run folder?)' % run)
            ckpt = found[-1]
        return ckpt, output or os.path.join(run, 'export')
    if not os.path.isfile(run):
        raise UserError('export %s: no such run folder or checkpoint file' % run)
    # <run>/checkpoints/x.ckpt -> <run>/export; a checkpoint elsewhere -> export/ beside it
    folder = os.path.dirname(os.path.abspath(run))
    if os.path.basename(folder) == 'checkpoints':
        folder = os.path.dirname(folder)
    return run, output or os.path.join(folder, 'export')

