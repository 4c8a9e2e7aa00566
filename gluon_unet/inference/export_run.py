"""``bin/export``: which checkpoint of a run, into which folder, and whose export is there.

:func:`run_export` resolves ``RUN|CHECKPOINT`` (:func:`resolve_run`), refuses an output
that is the working folder, a run folder or a checkpoints folder
(:func:`check_export_output`), locks the export folder for the whole command, refuses to
replace another run's export without ``--overwrite`` (:func:`check_export_owner`, from
the ``source`` each export records), then writes the export staged
(:func:`gluon_unet.inference.export.staged_export`): stopped at any point before its
last step, the folder keeps the export it had.
"""
import contextlib
import os
import signal

# mxnet (and .checkpoint, .model, which import it) are imported in the functions that use
# them: importing this module loads no mxnet.
from .. import models
from ..data.cache import default_cache_dir
from ..data.prepare import check_data_apart, check_run_data, run_data_config
from ..errors import DamagedFile, Stopped, UserError, stop_signals
from ..outputs import LOCK_NAME, check_apart, check_inputs, check_owner, held_elsewhere, lock_folder
from ..paths import EXPORT_FILES, holds_run, is_export_sidecar, others_files, remove_leftovers
from ..utils import check_writable
from .export import check_export_folder, export_source, staged_export, write_export
from .configs import ExportConfig  # noqa: F401 - its name here before configs.py held it
from .export_int8 import check_support, finish_int8, run_calibration
from .export_onnx import onnx_available
from .postprocess import settings_text
from .postprocess_search import retune
from .sidecar import PARAMS, SIDECAR, SYMBOL, read_sidecar, update_sidecar, verify_export, weights_digest


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
    exported = export_prefix(config.run)
    if exported:  # a shipped model or an export: written again (elsewhere, with model.onnx)
        return _export_again(config, exported, onnx)
    ckpt, out = resolve_run(config.run, config.output)
    if config.output:
        check_export_output(config.output, ckpt)
    check_export_folder(out)
    check_writable(out, '--output')
    source = export_source(ckpt)
    if config.tune_postprocess or config.int8:
        check_run_data_apart(config, ckpt, out)
    # Held for the whole command: two exports into one folder never interleave.
    with lock_folder(out, '--output', 'export folder'):
        # What an export killed half way left here goes, unless the run this folder is the
        # export of is training: its own export at the end writes here under its lock.
        if not held_elsewhere(os.path.dirname(os.path.abspath(out))):
            remove_leftovers(out)
        check_export_owner(out, source, resolve_run(config.run, None)[1], config.overwrite)
        prefix, notes, tuned = _export(config, ckpt, out, source, onnx)
        kept = others_files(out, ignore=EXPORT_FILES) if config.overwrite else ''
        if kept:  # said, so that --overwrite never looks as if it cleared the folder
            notes.append('note: --overwrite %s: kept what bin/export did not write: %s' % (out, kept))
        return prefix, notes, tuned


def _export(config, ckpt, out, source, onnx):
    """:func:`run_export` once its checkpoint and ``out`` (locked) are known."""
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
        what = 'export --tune-postprocess' if config.tune_postprocess else 'export --int8'
        # The run's relative paths mean what they meant where it trained, and its data must
        # still be the images it trained on, as --resume requires.
        cfg = run_data_config(cfg, meta, ckpt)
        check_run_data(cfg, meta, what)
    int8 = run_calibration(cfg, config.int8_inputs, config.int8_calibration) if config.int8 else None
    tuned, notes = None, []
    # The new export is built aside and only its last step replaces the old one: stopped
    # at any point before (Ctrl-C, SIGTERM during the search), the old export is intact.
    installed = []
    with _stops_on_sigterm('export %s' % config.run, out, installed):
        with staged_export(out, on_installed=lambda: installed.append(True)) as stage:
            notes.append(write_export(net, cfg, stage, meta, sidecar_extra={'source': source}, onnx=onnx, int8=int8))
            if config.tune_postprocess:
                # As training searched, unless asked otherwise: the way the recipe predicts.
                tuned = retune(ckpt, stage, mode=config.mode or cfg.tune_mode,
                               tta=cfg.tune_tta if config.tta is None else config.tta, cfg=cfg)
            else:
                notes.append(keep_searched(stage, [out, resolve_run(config.run, None)[1]], config.run))
            notes.append(finish_int8(stage, int8))  # int8 against float32 at bin/predict's final threshold
    return os.path.join(os.path.abspath(out), 'model'), [n for n in notes if n], tuned


def export_prefix(run):
    """The export prefix (``FOLDER/model``) when ``bin/export``'s RUN is a shipped model's
    name or an export folder with MXNet's files (not a run folder, whose checkpoints are
    what it exports), else None."""
    path = models.resolve(run)
    if not os.path.isdir(path) or os.path.isdir(os.path.join(path, 'checkpoints')):
        return None
    prefix = os.path.join(path, 'model')
    return prefix if os.path.isfile(prefix + '-0000.params') and os.path.isfile(os.path.join(path, SIDECAR)) else None


def _export_again(config, prefix, onnx):
    """``bin/export NAME --output DIR``: the export ``prefix`` (a shipped model's, or any
    export folder) written again into ``DIR`` - its weights, its searched settings and its
    card as they are, ``model.onnx`` as ``onnx`` says."""
    from ..config import TrainConfig
    from .export import model_from_export
    folder = os.path.dirname(prefix)
    name = models.shipped_name(folder) or config.run
    if config.tune_postprocess or config.int8:
        raise UserError('export %s: %s searches or calibrates on the run\'s own validation images, and an export '
                        'has no run; fine-tune it on your images instead (bin/train --init %s)'
                        % (config.run, '--tune-postprocess' if config.tune_postprocess else '--int8', config.run))
    if not config.output:
        raise UserError('export %s: give --output DIR, a folder of its own for the copy (%s is read, not written)'
                        % (config.run, folder))
    out = config.output
    check_apart([('--output', out)], [('export', folder)], 'export')
    check_export_folder(out)
    check_writable(out, '--output')
    sidecar_path = os.path.join(folder, SIDECAR)
    meta = read_sidecar(sidecar_path)
    verify_export(meta, {SYMBOL: prefix + '-symbol.json', PARAMS: prefix + '-0000.params'}, sidecar_path)
    if not isinstance(meta.get('config'), dict):
        raise UserError('export %s: its %s has no training config to rebuild the network from' % (config.run, SIDECAR))
    cfg = TrainConfig.from_dict(meta['config'])
    # Whose export DIR holds: this one's params file stands for the run it came from.
    source = {'run': None, 'checkpoint': os.path.realpath(prefix + '-0000.params'), 'model': name}
    with lock_folder(out, '--output', 'export folder'):
        remove_leftovers(out)
        check_export_owner(out, source, out, config.overwrite)
        net = model_from_export(prefix, cfg, 'export')
        record = {'epoch': meta.get('epoch'), 'metrics': meta.get('metrics') or {},
                  'data': {k: meta.get(k) for k in ('diameter', 'diameter_ranges')}}
        extra = {'source': source}
        extra.update({k: meta[k] for k in ('card', 'postprocess') if isinstance(meta.get(k), dict)})
        with _stops_on_sigterm('export %s' % config.run, out, []):
            with staged_export(out) as stage:
                note = write_export(net, cfg, stage, record, sidecar_extra=extra, onnx=onnx)
    return os.path.join(os.path.abspath(out), 'model'), [note] if note else [], None


def check_run_data_apart(config, ckpt, out):
    """Refuse, before the export folder is made, an ``out`` that is, or lies inside, the
    data ``--tune-postprocess`` / ``--int8`` read again (a CSV's folders included) or the
    cache of decoded images that reading writes; and that cache inside what is read or
    being one of the export's files."""
    from ..checkpoint import load_checkpoint
    from ..config import TrainConfig
    try:
        meta = load_checkpoint(ckpt)
    except DamagedFile:
        return  # the export says so, with the run's newest intact checkpoint
    if not isinstance(meta.get('config'), dict):
        return
    cfg = run_data_config(TrainConfig.from_dict(meta['config']), meta, ckpt)
    what = 'export --tune-postprocess' if config.tune_postprocess else 'export --int8'
    cache = default_cache_dir() if cfg.cache_dir is None else cfg.cache_dir or None
    folder = os.path.dirname(os.path.abspath(ckpt))
    check_data_apart([('--output', out)], cfg, cache, what, whose="the run's ",
                     also_read=[('RUN|CHECKPOINT', ckpt)] + ([("the run's checkpoints", folder)]
                                                             if os.path.basename(folder) == 'checkpoints' else []),
                     own=[('--output', out, _export_writes)])


def _export_writes(name):
    """Whether ``name`` (relative to an export folder) is, or lies in, what an export writes there."""
    first = name.split(os.sep)[0]
    return first in EXPORT_FILES or first == LOCK_NAME or first.startswith('.tmp-export-')


def check_export_owner(out, source, default_out, overwrite):
    """Refuse, in one line, to replace an export in ``out`` that another run (or, outside
    a run, another checkpoint) wrote, unless ``overwrite``. An export that does not record
    its source (gluon_unet 0.2's) is replaced without asking only at the default place of
    this run's export (``default_out``)."""
    path = os.path.join(out, SIDECAR)
    if not is_export_sidecar(path):
        return
    try:
        theirs = read_sidecar(path).get('source')
    except UserError:
        theirs = None  # a damaged record says nothing about its owner
    def owner(record):
        return (record or {}).get('run') or (record or {}).get('checkpoint')
    ours = owner(source)
    if theirs is None and os.path.realpath(out) == os.path.realpath(default_out):
        return
    check_owner('--output', out, owner(theirs), ours, 'export', overwrite)


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
    # What export reads: the checkpoint, and a run's checkpoints folder (it picks the best or
    # the latest there); the run's own export/ beside it is where exports go.
    folder = os.path.dirname(os.path.abspath(checkpoint))
    read = [('RUN|CHECKPOINT', checkpoint)] + ([("the run's checkpoints", folder)]
                                               if os.path.basename(folder) == 'checkpoints' else [])
    check_apart([('--output', output)], read, 'export')


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
        name = signal.Signals(signum).name
        if installed:
            raise Stopped('error: %s stopped by %s as it finished; %s holds the new export' % (what, name, out),
                          128 + signum)
        raise Stopped('error: %s stopped by %s before it finished; %s keeps the export it had'
                      % (what, name, out), 128 + signum)
    previous = {s: signal.signal(s, stop) for s in stop_signals(signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def resolve_run(run, output):
    """(checkpoint, export folder) for ``bin/export RUN``, with errors naming RUN."""
    from ..checkpoint import list_checkpoints
    if os.path.lexists(run):  # a missing one is said below, as what RUN may be
        check_inputs([('export', run, 'file|folder')])
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

