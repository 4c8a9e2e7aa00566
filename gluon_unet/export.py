"""Hybridized export for inference: ``model-symbol.json`` + ``model-0000.params`` +
``model.json``, loadable with ``mx.gluon.SymbolBlock.imports`` alone.

The export is always an ordinary float32, single-device network with plain BatchNorm,
whatever the training used (several devices, SyncBatchNorm, AMP): it is rebuilt from
the config and the checkpoint, not from the live training block.
"""
import contextlib
import hashlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

# mxnet (and .checkpoint, .model, which import it) are imported in the functions that use
# them: bin/predict on an ONNX export reads sidecars through this module without mxnet.
from . import __version__
from .config import TrainConfig, option
from .data.io import NORMALIZE_MODES
from .data.targets import OUTPUTS
from .errors import DamagedFile, UserError, mxnet_message
from .postprocess import MARKERS, SECOND_MAPS, settings_text, tuned_markers
from .runtime import apply_runtime_defaults, user_environ
from .tiling import MODES
from .paths import (EXPORT_FILES, SIDECAR_MAX_BYTES, check_apart, export_files, remove_files,
                    remove_if_empty)
from .utils import (DIGEST, atomic_open, check_writable, dir_mode, file_crc32, read_json, write_errors,
                    write_point)

SYMBOL, PARAMS, SIDECAR = 'model-symbol.json', 'model-0000.params', 'model.json'


def export_checkpoint(checkpoint, out_dir, sidecar_extra=None):
    """Rebuild the model of ``checkpoint``, hybridize it and export it to ``out_dir``.

    The files are written aside and renamed into place one by one (:func:`staged_export`),
    so a reader never sees a half-written file and nothing else in ``out_dir`` is touched.

    Returns
    -------
    str
        The export prefix ``out_dir/model`` (for ``SymbolBlock.imports``).
    """
    net, cfg, meta = model_from_checkpoint(checkpoint)
    return export_block(net, cfg, out_dir, meta, sidecar_extra)


def model_from_checkpoint(checkpoint, ctxs=None):
    """The U-Net of ``checkpoint``'s config with its weights, on ``ctxs`` (default the
    CPU), not hybridized.

    Returns
    -------
    (net, cfg, meta)
        The block, its :class:`TrainConfig` and the checkpoint's record.
    """
    import mxnet as mx

    from .checkpoint import load_checkpoint
    from .model import build_model
    ctxs = ctxs or [mx.cpu()]
    meta = load_checkpoint(checkpoint)
    cfg = TrainConfig.from_dict(meta['config'])
    net = build_model(cfg.model)
    net.initialize(ctx=ctxs)
    net(_dummy_input(cfg, ctxs[0]))  # resolves the deferred parameter shapes before loading
    load_checkpoint(checkpoint, net=net)
    return net, cfg, meta


def geometry(cfg):
    """The part of the export's sidecar that tells predictors how to feed the network of
    ``cfg`` and read its outputs (what :func:`~gluon_unet.inference.predict_image` needs)."""
    return {
        # What each output channel is: predictors read the maps by these names.
        'outputs': list(OUTPUTS[cfg.model.target]),
        'depth': cfg.model.depth,
        'multiple': 2 ** cfg.model.depth,
        'train_size': cfg.crop or cfg.size,
        'resize_mode': 'crop' if cfg.crop else 'resize',
    }


def export_block(net, cfg, out_dir, meta=None, sidecar_extra=None):
    """Export the trained HybridBlock ``net`` (any network, e.g. your own passed to
    ``fit``) with the ``model.json`` sidecar of ``cfg`` to ``out_dir``.

    Parameters shared over several devices are averaged into one copy (MXNet's
    ``export``); ``cfg.model.depth`` is what the sidecar tells predictors about the
    input sides (multiples of ``2**depth``). The files are written aside and each is
    renamed into place (:func:`staged_export`); anything else in ``out_dir`` stays.

    Returns
    -------
    str
        The export prefix ``out_dir/model``.
    """
    with staged_export(out_dir) as stage:
        write_export(net, cfg, stage, meta, sidecar_extra)
    return os.path.join(os.path.abspath(out_dir), 'model')


def write_export(net, cfg, folder, meta=None, sidecar_extra=None):
    """Write the export files of ``net`` straight into ``folder`` (a staging folder of
    :func:`staged_export`: a reader there could see them half-written)."""
    meta = meta or {}
    ctx = next(iter(net.collect_params().values())).list_ctx()[0]
    net.hybridize(static_alloc=True, static_shape=True)
    net(_dummy_input(cfg, ctx))  # export needs one forward of the hybridized graph
    final = _final_folder(folder)
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
        # Median nucleus diameter (px) of the training images as the network saw them:
        # bin/predict --diameter rescales images to it.
        'diameter': (meta.get('data') or {}).get('diameter'),
        'epoch': meta.get('epoch'),
        'metrics': meta.get('metrics', {}),
        'config': cfg.to_dict(),
        'card': model_card(cfg, meta),
    }
    sidecar.update(sidecar_extra or {})
    if isinstance((sidecar_extra or {}).get('postprocess'), dict):
        _card_follows(sidecar)
    # What load_exported checks the two files against.
    sidecar['digest'] = {name: '%s:%08x' % (DIGEST, file_crc32(os.path.join(folder, name)))
                         for name in (SYMBOL, PARAMS)}
    with write_errors(os.path.join(final, SIDECAR), folder):
        with open(os.path.join(folder, SIDECAR), 'w') as f:
            json.dump(sidecar, f, indent=2)
        write_point(os.path.join(final, SIDECAR))


def _final_folder(folder):
    """Where the files written into ``folder`` will be seen: its parent for a staging
    folder of :func:`staged_export`, else ``folder`` itself (named in error messages)."""
    if os.path.basename(os.path.normpath(folder)).startswith('.tmp-export-'):
        return os.path.dirname(os.path.abspath(folder))
    return folder


@contextlib.contextmanager
def staged_export(out_dir, on_installed=None):
    """Yield an empty staging folder inside ``out_dir``; on success move its three export
    files into ``out_dir``, one ``os.replace`` each, ``model.json`` last.

    The deletion rule (:mod:`gluon_unet.paths`): an export replaces only the three files
    of a gluon_unet export (recognised by its ``model.json``), never anything else in
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
                    os.replace(os.path.join(stage, name), os.path.join(out_dir, name))
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


def update_sidecar(out_dir, extra):
    """Add ``extra`` to an export's ``model.json`` (atomically)."""
    path = os.path.join(out_dir, SIDECAR)
    with open(path) as f:
        sidecar = json.load(f)
    sidecar.update(extra)
    if isinstance(extra.get('postprocess'), dict):
        _card_follows(sidecar)
    with atomic_open(path, shown=os.path.join(_final_folder(out_dir), SIDECAR)) as f:
        json.dump(sidecar, f, indent=2)


def _card_follows(sidecar):
    """The card said what the training config would do; the search's winners (the
    sidecar's ``postprocess``) are what bin/predict now does, so the card follows them."""
    card = sidecar.get('card')
    if isinstance(card, dict):
        card['postprocess'] = dict(card.get('postprocess') or {}, **_card_postprocess(sidecar['postprocess']))


def model_card(cfg, meta):
    """Where a model came from, for whoever finds it on disk in a year: versions, date,
    training data (path, image counts, a digest of the decoded pixels), the best epoch's
    metrics and the post-processing settings."""
    import mxnet as mx
    data = meta.get('data') or {}
    metrics = meta.get('metrics') or {}
    return {
        'gluon_unet': __version__, 'mxnet': mx.__version__, 'python': platform.python_version(),
        'created': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
        'data': {'path': os.path.abspath(cfg.data) if cfg.data else 'generated demo nuclei (seed %d)' % cfg.seed,
                 'train_images': data.get('train'), 'val_images': data.get('val'),
                 'content_sha1': data.get('content_sha1')},
        'best_epoch': meta.get('epoch'),
        'best_metrics': {k: v for k, v in metrics.items() if k.startswith('val_') or k == 'train_loss'},
        'postprocess': {'threshold': cfg.threshold, 'normalize': cfg.normalize, 'target': cfg.model.target,
                        'instances': _INSTANCES[cfg.model.target.partition('+')[2] or 'distance'],
                        'chosen': 'the training config (no search)'},
    }


# How instances grow, by the markers (the second map's name, or the distance watershed).
_INSTANCES = {'border': 'marker watershed from the interiors',
              'centre': 'marker watershed from the centres',
              'contact': 'marker watershed from the foreground less the contacts',
              'distance': 'marker watershed on the distance transform'}


def _card_postprocess(tuned):
    """The card's account of searched post-processing settings (a sidecar ``postprocess``)."""
    markers = tuned_markers(tuned)
    return {'threshold': tuned['threshold'], 'instances': _INSTANCES.get(markers, markers),
            'chosen': 'searched on %s validation images: %s' % (tuned.get('images', '?'), settings_text(tuned))}


def card_summary(meta):
    """One line about an export's origin (``model.json``'s card), or '' when it has none."""
    card = meta.get('card')
    if not isinstance(card, dict):
        return ''
    data = card.get('data') or {}
    metrics = card.get('best_metrics') or {}
    scores = ', '.join('%s %.4f' % (k, metrics[k]) for k in ('val_iou', 'val_dsb') if isinstance(metrics.get(k), float))
    return 'model: gluon_unet %s, trained %s on %s (%s images), best epoch %s%s' % (
        card.get('gluon_unet'), str(card.get('created', '?'))[:10], data.get('path'), data.get('train_images'),
        card.get('best_epoch'), ' (%s)' % scores if scores else '')


def _dummy_input(cfg, ctx):
    import mxnet as mx
    side = cfg.crop or cfg.size
    return mx.nd.zeros((1, cfg.model.in_channels, side, side), ctx=ctx)


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
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = user_environ()
    apply_runtime_defaults(env, contexts=1)  # the child loads mxnet as it starts
    env['CUDA_VISIBLE_DEVICES'] = ''  # no GPU for a CPU export (see above)
    env['PYTHONPATH'] = os.pathsep.join([package_root] + [p for p in [env.get('PYTHONPATH')] if p])
    cmd = [sys.executable, '-m', 'gluon_unet', 'export', checkpoint, '--output', out_dir]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise ExportError('exporting %s in a subprocess failed (%s): %s'
                          % (checkpoint, _exit_status(done.returncode), _last_error_line(done.stderr)))
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


def load_exported(prefix_or_dir, ctx=None):
    """Load an export with ``SymbolBlock.imports``.

    Parameters
    ----------
    prefix_or_dir : str
        The export folder, a run folder (uses ``<run>/export``) or the ``.../model`` prefix.
    ctx : mx.Context or list, optional

    Returns
    -------
    (SymbolBlock, dict)
        The network and its sidecar metadata.
    """
    import mxnet as mx
    prefix = find_export(prefix_or_dir)
    folder = os.path.dirname(prefix)
    symbol, params = prefix + '-symbol.json', prefix + '-0000.params'
    for path in (symbol, params):
        if not os.path.isfile(path):
            raise UserError('export %s is incomplete: %s is missing' % (folder, os.path.basename(path)))
    sidecar_path = os.path.join(folder, SIDECAR)
    meta = read_sidecar(sidecar_path) if os.path.isfile(sidecar_path) else {}
    verify_export(meta, {SYMBOL: symbol, PARAMS: params}, sidecar_path)
    # Each file is read on its own first, so a damaged one is named as such - not taken
    # for a pair of good files that do not fit each other.
    sym = _load_export_file(symbol, mx.sym.load, 'not a complete MXNet symbol file')
    saved = _load_export_file(params, mx.nd.load, 'not a complete MXNet params file')
    if not isinstance(saved, dict):
        raise UserError('%s: its arrays have no names; an export\'s params file names each (arg:..., aux:...)'
                        % params)
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            net = mx.gluon.SymbolBlock.imports(symbol, ['data'], params, ctx=ctx or mx.cpu())
        _check_param_shapes(sym, saved, meta)
    except (mx.MXNetError, AssertionError, ValueError, KeyError) as exc:
        raise UserError('export %s: %s does not fit %s (the two files come from different networks): %s'
                        % (folder, PARAMS, SYMBOL, mxnet_message(exc))) from None
    return net, meta


def _load_export_file(path, load, what):
    """``load(path)``, or a one-line error naming the damaged file and what is wrong."""
    import mxnet as mx
    try:
        return load(path)
    except (mx.MXNetError, ValueError, UnicodeDecodeError) as exc:
        raise UserError('%s is damaged or truncated (%d bytes): %s: %s'
                        % (path, os.path.getsize(path), what, mxnet_message(exc, limit=120))) from None


def verify_export(meta, files, sidecar_path):
    """Raise :class:`~.errors.DamagedFile` naming the first of ``files`` (name -> path)
    whose CRC-32 differs from the sidecar's ``digest``. Exports written before digests
    (no ``digest`` in model.json) and hand-made ones are read as they are, unchecked."""
    digests = meta.get('digest') or {}
    for name, path in files.items():
        stored = digests.get(name)
        if stored is None:
            continue
        algo, _, value = stored.partition(':')
        if algo != DIGEST:
            continue  # a digest this version does not know: nothing to check with
        try:
            actual = '%08x' % file_crc32(path)
        except OSError as exc:
            raise UserError('%s: cannot read it (%s)' % (path, exc.strerror)) from None
        if actual != value:
            raise DamagedFile('%s is damaged: its content does not match the digest in %s (changed on disk since '
                              'it was exported; export it again, or remove "digest" from %s if you changed it '
                              'on purpose)' % (path, sidecar_path, SIDECAR), path)


def read_sidecar(path):
    """The export's ``model.json`` as a dict, checked: an error names the file in one line.

    Every key is optional (hand-made and older exports have only some), but a key that
    is there must have the type inference uses; ``config`` (the training config, for
    reference) must be an object.
    """
    def bad(what):
        return UserError('%s: %s' % (path, what))

    meta = read_json(path, path, SIDECAR_MAX_BYTES)
    if not isinstance(meta, dict):
        raise bad('must hold a JSON object, not %s' % _json_kind(meta))

    def positive_int(key):
        value = meta.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise bad('%r must be a positive integer (got %s)' % (key, json.dumps(value)))

    for key in ('in_channels', 'classes', 'depth', 'multiple', 'train_size'):
        positive_int(key)
    threshold = meta.get('threshold')
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or not 0 < threshold < 1):
        raise bad("'threshold' must be a number in (0, 1) (got %s)" % json.dumps(threshold))
    if meta.get('resize_mode') not in (None, 'crop', 'resize'):
        raise bad("'resize_mode' must be \"crop\" or \"resize\" (got %s)" % json.dumps(meta['resize_mode']))
    config = meta.get('config')
    if config is not None and not isinstance(config, dict):
        raise bad("'config' must be an object (the training config), not %s" % _json_kind(config))
    tuned = meta.get('postprocess')
    if tuned is not None and (not isinstance(tuned, dict) or tuned.get('markers') not in (None,) + MARKERS):
        raise bad("'postprocess' must be an object whose 'markers' is one of %s (got %s)"
                  % (', '.join(json.dumps(m) for m in MARKERS), json.dumps(tuned)))
    # The searched settings feed float()/int() and the watershed directly: a hand-edited
    # "threshold": "high" would be a traceback, an "h": Infinity an empty result for every image.
    for key, ok, rule in (('min_score', lambda v: 0 <= v < 1, 'a number in [0, 1)'),
                          ('threshold', lambda v: 0 < v < 1, 'a number in (0, 1)'),
                          ('marker', lambda v: 0 < v < 1, 'a number in (0, 1)'),
                          ('h', lambda v: math.isfinite(v) and v > 0, 'a finite number > 0'),
                          ('min_size', lambda v: v >= 0 and float(v).is_integer(), 'a whole number >= 0')):
        value = (tuned or {}).get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value)):
            raise bad("'postprocess' '%s' must be %s (got %s)" % (key, rule, json.dumps(value)))
    if 'tta' in (tuned or {}) and not isinstance(tuned['tta'], bool):
        raise bad("'postprocess' 'tta' must be true or false (got %s)" % json.dumps(tuned['tta']))
    if (tuned or {}).get('mode', 'auto') not in MODES:
        raise bad("'postprocess' 'mode' must be one of %s (got %s)" % (', '.join(MODES), json.dumps(tuned['mode'])))
    diameter = meta.get('diameter')
    if diameter is not None and (isinstance(diameter, bool) or not isinstance(diameter, (int, float))
                                 or not (math.isfinite(diameter) and diameter > 0)):
        raise bad("'diameter' must be a finite positive number of pixels or null (got %s)" % json.dumps(diameter))
    outputs = meta.get('outputs')
    if outputs is not None and outputs not in [list(o) for o in OUTPUTS.values()]:
        raise bad("'outputs' must be one of %s (got %s)" % (
            ', '.join(json.dumps(list(o)) for o in OUTPUTS.values()), json.dumps(outputs)))
    model = (config or {}).get('model')
    target = model.get('target') if isinstance(model, dict) else None
    if target is not None and target not in OUTPUTS:
        raise bad("'config.model.target' must be one of %s (got %s)" % (', '.join(OUTPUTS), json.dumps(target)))
    markers = (tuned or {}).get('markers')
    if markers in SECOND_MAPS:
        second = list(outputs if outputs is not None else OUTPUTS.get(target, ('foreground',)))[1:]
        if second != [markers]:
            raise bad("'postprocess' 'markers' is %s, but the model's outputs are %s" % (
                json.dumps(markers), json.dumps(['foreground'] + second)))
    digest = meta.get('digest')
    if digest is not None and not (isinstance(digest, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in digest.items())):
        raise bad("'digest' must be an object of file name -> \"crc32:<hex>\" (got %s)" % json.dumps(digest))
    denoise = meta.get('normalize_denoise')
    if denoise is not None and (isinstance(denoise, bool) or not isinstance(denoise, (int, float)) or denoise < 0):
        raise bad("'normalize_denoise' must be a number >= 0 (got %s)" % json.dumps(denoise))
    for where, holder in (('normalize', meta), ('config.normalize', config or {})):
        value = holder.get('normalize')
        if value is not None and value not in NORMALIZE_MODES:
            raise bad('%r must be one of %s (got %s)' % (where, ', '.join(NORMALIZE_MODES), json.dumps(value)))
    return meta


def _json_kind(value):
    """'a list', 'a number'...: what a JSON value is, for messages."""
    if value is None:
        return 'null'
    if isinstance(value, bool):
        return 'a boolean'
    return {list: 'a list', str: 'a string', dict: 'an object'}.get(type(value), 'a number')


def _check_param_shapes(sym, arrays, meta):
    """Raise MXNetError when the params (``arrays``, as ``mx.nd.load`` gives them) do not
    fit the symbol ``sym``.

    ``SymbolBlock.imports`` takes each parameter's shape from the params file and checks
    nothing, so weights of a wider network load silently and fail at the first forward
    deep inside an operator. Shape inference of the symbol from an input shape and the
    saved shapes finds the mismatch at load time instead.
    """
    saved = {k.split(':', 1)[-1]: v.shape for k, v in arrays.items()}
    inputs = {}
    first = next((saved[n] for n in sym.list_arguments() if len(saved.get(n, ())) == 4), None)
    channels = meta.get('in_channels') or (first[1] if first else None)
    if channels:
        side = meta.get('train_size') or 2 ** 7
        inputs['data'] = (1, channels, side, side)
    sym.infer_shape_partial(**inputs, **saved)


def find_export(path):
    """Resolve a run folder, export folder or prefix to the export prefix."""
    if os.path.isdir(path):
        for cand in (os.path.join(path, 'export', 'model'), os.path.join(path, 'model')):
            if os.path.isfile(cand + '-symbol.json') or os.path.isfile(cand + '-0000.params'):
                return cand
        raise UserError('--model %s: no exported model there (expected export/%s or %s)'
                        % (path, SYMBOL, SYMBOL))
    if path.endswith('-symbol.json'):
        return path[:-len('-symbol.json')]
    if os.path.isfile(path + '-symbol.json') or os.path.isfile(path + '-0000.params'):
        return path
    raise UserError('--model %s: not a run folder, export folder or export prefix' % path)


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

    def validate(self):
        """Refuse, naming the flag, a search option without ``--tune-postprocess``."""
        for flag, given in (('--mode', self.mode is not None), ('--tta', self.tta)):
            if given and not self.tune_postprocess:
                raise UserError('%s goes with --tune-postprocess (it says how the search predicts the validation '
                                'images)' % flag)
        return self


def run_export(config, retune=None):
    """``bin/export``: export the best (or given) checkpoint of ``config.run`` (an
    :class:`ExportConfig`), searching the post-processing again with
    ``--tune-postprocess``. ``retune(checkpoint, export_dir, mode=, tta=)``: the search
    (``engine.retune``, passed in by the CLI: the engine imports this module).

    Returns
    -------
    (str, str, dict or None)
        The export prefix, a note for the user ('' when none) and the searched settings.
    """
    if config.tune_postprocess and retune is None:
        raise UserError('--tune-postprocess: run it as bin/export or gluon-unet export (they bring the search)')
    ckpt, out = resolve_run(config.run, config.output)
    if config.output:
        check_export_output(config.output, ckpt)
    check_export_folder(out)
    check_writable(out, '--output')
    try:
        net, cfg, meta = model_from_checkpoint(ckpt)
    except DamagedFile as exc:
        from .checkpoint import earlier_good_checkpoint
        earlier = earlier_good_checkpoint(ckpt)
        if earlier is not None:
            exc.args = ('%s; the newest intact checkpoint of the run is %s: export it with bin/export %s'
                        % (exc.args[0], earlier, earlier),)
        raise
    if config.tune_postprocess:
        check_apart([('--output', out)], [("the run's --data", cfg.data), ("the run's --masks", cfg.masks),
                                          ("the run's --val-data", cfg.val_data)], 'export --tune-postprocess')
    tuned, note = None, ''
    # The new export is built aside and only its last step replaces the old one: stopped
    # at any point before (Ctrl-C, SIGTERM during the search), the old export is intact.
    installed = []
    with _stops_on_sigterm('export %s' % config.run, out, installed):
        with staged_export(out, on_installed=lambda: installed.append(True)) as stage:
            write_export(net, cfg, stage, meta)
            if config.tune_postprocess:
                tuned = retune(ckpt, stage, mode=config.mode or 'auto', tta=config.tta)
            else:
                note = keep_searched(stage, [out, resolve_run(config.run, None)[1]], config.run)
    return os.path.join(os.path.abspath(out), 'model'), note, tuned


def check_export_output(output, checkpoint):
    """Refuse, in one line, an ``export --output`` that is the working folder, a run
    folder or a folder of checkpoints (an export belongs in a folder of its own), or the
    checkpoint itself."""
    from .paths import checkpoint_files
    from .rundir import holds_run
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


def weights_digest(prefix):
    """SHA-256 of the weights of the export ``prefix`` (``.../model``), the same for every
    export of the same weights.

    MXNet writes a params file as its arrays, then their names; the names carry block
    counters that differ between processes (``unet0_conv0_weight`` here,
    ``unet1_conv0_weight`` there), so the digest covers the arrays' bytes only. Where the
    names section begins follows from the symbol's variable names (verified against the
    file's tail); a file where it does not is digested array by array (slower: a full load).
    """
    params = prefix + '-0000.params'
    size = os.path.getsize(params)
    names = _variable_names(prefix + '-symbol.json')
    tail = 8 + sum(8 + len(('arg:' + n).encode()) for n in names)
    digest = hashlib.sha256()
    with open(params, 'rb') as f:
        if names and tail < size:
            f.seek(size - tail)
            if _names_section(f.read()) == sorted(names):
                f.seek(0)
                left = size - tail
                while left:
                    chunk = f.read(min(left, 1 << 22))
                    if not chunk:
                        break
                    digest.update(chunk)
                    left -= len(chunk)
                return digest.hexdigest()
    import mxnet as mx
    arrays = mx.nd.load(params)
    for name in sorted(arrays):
        a = arrays[name].asnumpy()
        digest.update(('%s %s %s;' % (name.split(':', 1)[0], a.dtype.str, a.shape)).encode())
        digest.update(np.ascontiguousarray(a).tobytes())
    return 'arrays:' + digest.hexdigest()


def _variable_names(symbol_file):
    """The parameter names of an MXNet symbol file (its variables but the input), or []."""
    try:
        with open(symbol_file, 'rb') as f:
            nodes = json.loads(f.read()).get('nodes', [])
        return [n['name'] for n in nodes if n.get('op') == 'null' and n['name'] != 'data']
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return []


def _names_section(data):
    """The names of MXNet's NDArray-list names section ``data`` (uint64 count, then uint64
    length + bytes each) without their ``arg:``/``aux:``, sorted; None when it is not one."""
    import struct
    try:
        (count,), at, names = struct.unpack_from('<Q', data), 8, []
        for _ in range(count):
            (length,) = struct.unpack_from('<Q', data, at)
            name = data[at + 8:at + 8 + length].decode()
            at += 8 + length
            if len(name) < 4 or name[:4] not in ('arg:', 'aux:'):
                return None
            names.append(name[4:])
    except (struct.error, UnicodeDecodeError):
        return None
    return sorted(names) if at == len(data) else None


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
    from .checkpoint import list_checkpoints
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

