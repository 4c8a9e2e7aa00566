"""Hybridized export for inference: ``model-symbol.json`` + ``model-0000.params`` +
``model.json``, loadable with ``mx.gluon.SymbolBlock.imports`` alone.

The export is always an ordinary float32, single-device network with plain BatchNorm,
whatever the training used (several devices, SyncBatchNorm, AMP): it is rebuilt from
the config and the checkpoint, not from the live training block.
"""
import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import mxnet as mx

from . import __version__, add_version_flag
from .checkpoint import list_checkpoints, load_checkpoint
from .config import TrainConfig
from .data.io import NORMALIZE_MODES
from .data.targets import OUTPUTS
from .errors import OneLineParser, UserError, mxnet_message, reports_errors
from .model import build_model
from .postprocess import MARKERS, SECOND_MAPS, settings_text, tuned_markers
from .runtime import apply_runtime_defaults, user_environ
from .tiling import MODES
from .utils import atomic_open, dir_mode

SYMBOL, PARAMS, SIDECAR = 'model-symbol.json', 'model-0000.params', 'model.json'


def export_checkpoint(checkpoint, out_dir, sidecar_extra=None):
    """Rebuild the model of ``checkpoint``, hybridize it and export it to ``out_dir``.

    The folder is written next to its final place and renamed into it, so a reader
    never sees a half-written export.

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
    ``fit``) with the ``model.json`` sidecar of ``cfg`` to ``out_dir``, atomically.

    Parameters shared over several devices are averaged into one copy (MXNet's
    ``export``); ``cfg.model.depth`` is what the sidecar tells predictors about the
    input sides (multiples of ``2**depth``).

    Returns
    -------
    str
        The export prefix ``out_dir/model``.
    """
    meta = meta or {}
    ctx = next(iter(net.collect_params().values())).list_ctx()[0]
    net.hybridize(static_alloc=True, static_shape=True)
    net(_dummy_input(cfg, ctx))  # export needs one forward of the hybridized graph
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix='.tmp-export-', dir=parent)
    try:
        # mkdtemp makes it owner-only (0o700); an export is for sharing: give it the
        # mode os.mkdir would (0o777 minus the umask). Its files are plain open()s.
        os.chmod(tmp, dir_mode())
        net.export(os.path.join(tmp, 'model'), epoch=0)
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
        with open(os.path.join(tmp, SIDECAR), 'w') as f:
            json.dump(sidecar, f, indent=2)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    return os.path.join(out_dir, 'model')


def update_sidecar(out_dir, extra):
    """Add ``extra`` to an export's ``model.json`` (atomically)."""
    path = os.path.join(out_dir, SIDECAR)
    with open(path) as f:
        sidecar = json.load(f)
    sidecar.update(extra)
    card = sidecar.get('card')
    if isinstance(extra.get('postprocess'), dict) and isinstance(card, dict):
        # The card said what the training config would do; the search's winners are what
        # bin/predict now does, so the card follows them.
        card['postprocess'] = dict(card.get('postprocess') or {}, **_card_postprocess(extra['postprocess']))
    with atomic_open(path) as f:
        json.dump(sidecar, f, indent=2)


def model_card(cfg, meta):
    """Where a model came from, for whoever finds it on disk in a year: versions, date,
    training data (path, image counts, a digest of the decoded pixels), the best epoch's
    metrics and the post-processing settings."""
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
    cmd = [sys.executable, '-m', 'gluon_unet.export', checkpoint, '--output', out_dir]
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
    prefix = find_export(prefix_or_dir)
    folder = os.path.dirname(prefix)
    symbol, params = prefix + '-symbol.json', prefix + '-0000.params'
    for path in (symbol, params):
        if not os.path.isfile(path):
            raise UserError('export %s is incomplete: %s is missing' % (folder, os.path.basename(path)))
    sidecar_path = os.path.join(folder, SIDECAR)
    meta = read_sidecar(sidecar_path) if os.path.isfile(sidecar_path) else {}
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            net = mx.gluon.SymbolBlock.imports(symbol, ['data'], params, ctx=ctx or mx.cpu())
        _check_param_shapes(symbol, params, meta)
    except (mx.MXNetError, AssertionError, ValueError, KeyError) as exc:
        raise UserError('export %s: params do not fit the symbol (from another architecture?): %s'
                        % (folder, mxnet_message(exc))) from None
    return net, meta


def read_sidecar(path):
    """The export's ``model.json`` as a dict, checked: an error names the file in one line.

    Every key is optional (hand-made and older exports have only some), but a key that
    is there must have the type inference uses; ``config`` (the training config, for
    reference) must be an object.
    """
    def bad(what):
        return UserError('%s: %s' % (path, what))

    try:
        with open(path, encoding='utf-8') as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise bad('cannot read it (%s)' % (exc.strerror if isinstance(exc, OSError) and exc.strerror
                                           else exc)) from None
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise bad('not valid JSON (%s)' % exc) from None
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


def _check_param_shapes(symbol_file, params_file, meta):
    """Raise MXNetError when the params file does not fit the symbol file.

    ``SymbolBlock.imports`` takes each parameter's shape from the params file and checks
    nothing, so weights of a wider network load silently and fail at the first forward
    deep inside an operator. Shape inference of the symbol from an input shape and the
    saved shapes finds the mismatch at load time instead.
    """
    saved = {k.split(':', 1)[-1]: v.shape for k, v in mx.nd.load(params_file).items()}
    sym = mx.sym.load(symbol_file)
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


EXPORT_EXAMPLES = """examples:
  # the run's best checkpoint (else its latest) to runs/a/export/
  gluon-unet export runs/a
  # one checkpoint, to another folder
  gluon-unet export runs/a/checkpoints/epoch0040.ckpt --output models/a-epoch40"""


@reports_errors
def main(argv=None, retune=None):
    """``bin/export RUN_DIR|CHECKPOINT [--output DIR] [--tune-postprocess [--mode M] [--tta]]``:
    export the best (or given) checkpoint. ``retune(checkpoint, export_dir, mode=, tta=)``: the search behind
    ``--tune-postprocess`` (``engine.retune``, passed in by the CLI: the engine imports
    this module)."""
    parser = OneLineParser(
        prog='export', formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXPORT_EXAMPLES,
        description='Export a trained model for inference: model-symbol.json + model-0000.params\n'
                    '+ model.json, loadable with mx.gluon.SymbolBlock.imports alone.')
    add_version_flag(parser)
    parser.add_argument('run', metavar='RUN_DIR|CHECKPOINT',
                        help='run folder (uses checkpoints/best.ckpt, else the latest) or a .ckpt file')
    parser.add_argument('--output', metavar='DIR', help='export folder (default: <run>/export)')
    parser.add_argument('--tune-postprocess', action='store_true',
                        help="choose the threshold, markers and minimum object size again on the run's own "
                             "validation split (its data must still be where it trained) and store them in "
                             "the export, as training does at its end")
    parser.add_argument('--mode', choices=MODES, default=None,
                        help='with --tune-postprocess: predict the validation images with this bin/predict '
                             '--mode (default auto), the one you will predict with')
    parser.add_argument('--tta', action='store_true',
                        help='with --tune-postprocess: search on test-time-augmented maps, for a model you '
                             'will run with bin/predict --tta (8x the search\'s prediction time)')
    args = parser.parse_args(argv)
    for flag, given in (('--mode', args.mode is not None), ('--tta', args.tta)):
        if given and not args.tune_postprocess:
            raise UserError('%s goes with --tune-postprocess (it says how the search predicts the validation '
                            'images)' % flag)
    if args.tune_postprocess and retune is None:  # python -m gluon_unet.export
        raise UserError('--tune-postprocess: run it as bin/export or gluon-unet export (they bring the search)')
    ckpt, out = _resolve_run(args.run, args.output)
    prefix = export_checkpoint(ckpt, out)
    print('exported %s-symbol.json and %s-0000.params' % (prefix, prefix))
    if args.tune_postprocess:
        tuned = retune(ckpt, out, mode=args.mode or 'auto', tta=args.tta)
        print('post-processing chosen on %d validation images: %s (val DSB %.4f, untuned %.4f)'
              % (tuned['images'], settings_text(tuned), tuned['score'], tuned['base_score']))
    return 0


def _resolve_run(run, output):
    """(checkpoint, export folder) for ``bin/export RUN``, with errors naming RUN."""
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


if __name__ == '__main__':
    sys.exit(main())
