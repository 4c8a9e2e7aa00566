"""What gluon_unet may delete or replace: the files it wrote and recognises.

The deletion rule
-----------------
gluon_unet deletes or replaces only files it wrote and can recognise, one file at a time
(a replacement is written aside and renamed over the old file, so it is atomic), and
removes a folder only when it created it and it is empty. "Recognise" is concrete:

* run files, at the top of a run folder: :data:`RUN_FILES`;
* checkpoints, in ``<run>/checkpoints/``: ``best.ckpt``, ``epochNNNN.ckpt``,
  ``epochNNNN-stepNNNNNN.ckpt`` and the ``.tmp-*.ckpt`` a killed write leaves;
* an export: ``model-symbol.json``, ``model-0000.params``, ``model.json`` (and the optional
  ``model.onnx``, ``model-int8-symbol.json``, ``model-int8-0000.params``), but only in
  a folder whose ``model.json`` is a gluon_unet sidecar (a JSON object whose ``format``
  starts with ``gluon_unet-export``): the two model files have the names MXNet gives
  every export, and ``model.json`` is a common name;
* predictions: the files the folder's prediction manifest (:data:`MANIFEST`, written by
  ``bin/predict``) lists, and the manifest itself - ``x_mask.png`` is also how users
  name their ground-truth masks, so names alone cannot tell;
* the demo's inputs (``<run>/demo_inputs/demoNN.png``) and TensorBoard's event files
  (``<run>/tb/events.out.tfevents.*``).
* what a write killed half way leaves in a folder a command owns (:func:`leftovers`): the
  temporary file of an atomic write (``.tmp-`` and ``mkstemp``'s 8 characters, then the
  file's extension), ``.tmp-best.ckpt``, and an export's staging folder
  (``.tmp-export-`` and ``mkdtemp``'s 8 characters) with the export files in it.

A run's files are those the run wrote (:func:`run_files`): in ``<run>/export`` only an
export whose ``model.json`` names this run as its source (or no source: gluon_unet 0.2),
in ``<run>/predictions`` only the demo's predictions (a manifest whose inputs are all the
run's own ``demo_inputs``). ``bin/predict``'s output or another run's export there is not
the run's: ``bin/train --overwrite`` leaves it, and says so.

Anything else, in those folders or elsewhere, is the user's and stays. An output file
named on the command line (``predict --rle``, ``evaluate --csv``) is replaced only when
it is one gluon_unet wrote, recognised by its header. Where outputs may go, their locks
and their records: :mod:`gluon_unet.outputs`.

This module imports nothing heavy (no mxnet), so the run-folder code can use it.
"""
import os
import re

from .errors import UserError
from .utils import read_json

#: What a training run writes at the top of its folder.
RUN_FILES = ('config.json', 'train.log', 'metrics.csv', 'curves.png')
#: The run's subfolders; each holds only files :func:`run_files` recognises by its own rule.
RUN_DIRS = ('checkpoints', 'export', 'predictions', 'demo_inputs', 'tb')
#: An export's files (``bin/export``, the end of training), in the order they are installed:
#: ``model.json`` last, so a reader that finds it finds the model files of the same export
#: (``model.onnx`` and the int8 variant ``model-int8-*`` are optional: an export without
#: them removes older ones, which belong to other weights).
EXPORT_FILES = ('model-symbol.json', 'model-0000.params', 'model.onnx', 'model-int8-symbol.json',
                'model-int8-0000.params', 'model.json')
#: The sidecar ``format`` prefix that marks a ``model.json`` as gluon_unet's.
EXPORT_FORMAT_PREFIX = 'gluon_unet-export'
#: The prediction manifest bin/predict keeps in its output folder.
MANIFEST = 'gluon_unet-predictions.json'
MANIFEST_FORMAT = 'gluon_unet-predictions-1'
#: Caps on the JSON files read here: a sidecar is a few kB, a manifest ~150 bytes per image.
SIDECAR_MAX_BYTES = 16 << 20
MANIFEST_MAX_BYTES = 512 << 20

_CHECKPOINT = re.compile(r'(best|epoch\d+(-step\d+)?)\.ckpt$|\.tmp-.*\.ckpt$')
_DEMO_INPUT = re.compile(r'demo\d\d\.png$')
# utils.atomic_path's temporary file (tempfile's names: 8 of [a-z0-9_]), recorder's best link,
# staged_export's folder: exactly these, never any other name starting with .tmp.
_TEMPORARY = re.compile(r'\.tmp-([a-z0-9_]{8}(\.[A-Za-z0-9]+)?|best\.ckpt)$')
_STAGING = re.compile(r'\.tmp-export-[a-z0-9_]{8}$')
_TB_EVENTS = re.compile(r'events\.out\.tfevents\.')


def is_export_sidecar(path):
    """True when ``path`` is the ``model.json`` of a gluon_unet export."""
    if not os.path.isfile(path):
        return False
    try:
        meta = read_json(path, path, SIDECAR_MAX_BYTES)
    except UserError:
        return False
    return isinstance(meta, dict) and str(meta.get('format', '')).startswith(EXPORT_FORMAT_PREFIX)


def export_files(folder):
    """``(ours, foreign)``: the export file names in ``folder`` that gluon_unet recognises
    as its own (all of them, when its ``model.json`` is a gluon_unet sidecar) and those it
    does not (all of them otherwise)."""
    present = [n for n in EXPORT_FILES if os.path.lexists(os.path.join(folder, n))]
    if not present:
        return [], []
    if is_export_sidecar(os.path.join(folder, 'model.json')):
        return present, []
    return [], present


def read_manifest(folder):
    """The prediction manifest of ``folder`` as a dict, or None when it has none.

    Raises
    ------
    UserError
        The manifest is there but damaged or not gluon_unet's.
    """
    path = os.path.join(folder, MANIFEST)
    if not os.path.lexists(path):
        return None
    manifest = read_json(path, path, MANIFEST_MAX_BYTES)
    if not (isinstance(manifest, dict) and manifest.get('format') == MANIFEST_FORMAT
            and isinstance(manifest.get('files'), list)):
        raise UserError('%s: not a gluon_unet prediction manifest (format %s with a "files" list); move it away'
                        % (path, MANIFEST_FORMAT))
    return manifest


def manifest_names(manifest):
    """The file names a manifest lists, keeping only plain names in its own folder: a
    hand-edited ``../x`` can never make gluon_unet delete outside the folder."""
    return [n for n in manifest.get('files', []) if isinstance(n, str) and n == os.path.basename(n)
            and n not in ('', '.', '..', MANIFEST)]


def prediction_files(folder):
    """The files of ``folder`` that its prediction manifest lists and that exist, then the
    manifest itself ([] when it has none or it is damaged: nothing is recognised then)."""
    try:
        manifest = read_manifest(folder)
    except UserError:
        return []
    if manifest is None:
        return []
    names = [n for n in manifest_names(manifest) if os.path.isfile(os.path.join(folder, n))]
    return names + [MANIFEST]


def _matching(folder, pattern):
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [n for n in names if pattern.match(n) and os.path.isfile(os.path.join(folder, n))]


def checkpoint_files(folder):
    """The checkpoint files of ``folder`` by gluon_unet's names (module docstring)."""
    return _matching(folder, _CHECKPOINT)


def export_of_run(export, run):
    """Whether the export in ``export`` is the run ``run``'s own: its ``model.json``
    records that run as its source, or records no source (gluon_unet 0.2's exports, which
    only training wrote at ``<run>/export``)."""
    try:
        meta = read_json(os.path.join(export, 'model.json'), export, SIDECAR_MAX_BYTES)
    except UserError:
        return False
    source = meta.get('source') if isinstance(meta, dict) else None
    if source is None:
        return True
    theirs = source.get('run') if isinstance(source, dict) else None
    return isinstance(theirs, str) and os.path.realpath(theirs) == os.path.realpath(run)


def demo_predictions(predictions, run):
    """Whether the predictions in ``predictions`` are the demo's of the run ``run``: its
    manifest's inputs are all the run's own ``demo_inputs`` (``bin/train`` without
    ``--data`` predicts those; anything else there came from ``bin/predict``)."""
    try:
        manifest = read_manifest(predictions)
    except UserError:
        return False
    inputs = (manifest or {}).get('inputs')
    if not isinstance(inputs, dict) or not inputs:
        return False
    own = os.path.realpath(os.path.join(run, 'demo_inputs')) + os.sep
    return all(isinstance(p, str) and os.path.realpath(p).startswith(own) for p in inputs.values())


def run_files(folder):
    """The files of a run in ``folder`` that gluon_unet recognises as that run's own
    (module docstring), as paths relative to it; [] when it holds none."""
    found = [n for n in RUN_FILES if os.path.isfile(os.path.join(folder, n))]
    rules = {'checkpoints': checkpoint_files,
             'export': lambda d: export_files(d)[0] if export_of_run(d, folder) else [],
             'predictions': lambda d: prediction_files(d) if demo_predictions(d, folder) else [],
             'demo_inputs': lambda d: _matching(d, _DEMO_INPUT),
             'tb': lambda d: _matching(d, _TB_EVENTS)}
    for sub in RUN_DIRS:
        path = os.path.join(folder, sub)
        if os.path.isdir(path):
            found += [os.path.join(sub, n) for n in rules[sub](path)]
    return found


def holds_run(folder):
    """What of a run ``folder`` holds: the run files and the run subfolders holding files
    gluon_unet recognises (:func:`run_files`); empty when it holds no run."""
    if not os.path.isdir(folder):
        return []
    found = []
    for path in run_files(folder):
        top = path.split(os.sep, 1)[0]
        if top not in found:
            found.append(top)
    return found


def others_files(folder, ignore=()):
    """``'predictions/ (121 files), notes.txt'``: what is left in ``folder`` (its files,
    grouped by top-level entry) apart from lock files and ``ignore``; '' when nothing is."""
    groups = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), folder)
            if name == '.lock' or (name.startswith('.') and name.endswith('.lock')) or rel in ignore:
                continue
            top = rel.split(os.sep, 1)[0]
            groups.setdefault(top + (os.sep if os.sep in rel else ''), []).append(rel)
    shown = ['%s (%d file%s)' % (top, len(names), '' if len(names) == 1 else 's') if top.endswith(os.sep) else top
             for top, names in sorted(groups.items())]
    return ', '.join(shown[:6] + (['and %d more' % (len(shown) - 6)] if len(shown) > 6 else []))


def remove_files(folder, names):
    """Delete ``folder``/name for each of ``names``, one file at a time (already gone: fine)."""
    for name in names:
        try:
            os.remove(os.path.join(folder, name))
        except FileNotFoundError:
            pass


def leftovers(folder):
    """The names in ``folder`` of what gluon_unet's writes leave when killed half way
    (module docstring): temporary files, and staging folders holding nothing but export
    files and temporary files. Only for a folder the caller owns (holds its lock): another
    process's write in progress looks the same."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(folder, name)
        if os.path.islink(path):
            continue
        if _TEMPORARY.match(name) and os.path.isfile(path):
            found.append(name)
        elif _STAGING.match(name) and os.path.isdir(path):
            try:
                inside = os.listdir(path)
            except OSError:
                continue
            if all((n in EXPORT_FILES or _TEMPORARY.match(n)) and not os.path.islink(os.path.join(path, n))
                   and os.path.isfile(os.path.join(path, n)) for n in inside):
                found.append(name)
    return found


def remove_leftovers(folder):
    """Remove :func:`leftovers` from ``folder`` (one the caller owns); returns their names.
    A name that cannot be removed stays: the command's own writes say if the folder is bad."""
    removed = []
    for name in leftovers(folder):
        path = os.path.join(folder, name)
        try:
            if os.path.isdir(path):
                remove_files(path, os.listdir(path))
                os.rmdir(path)
            else:
                os.remove(path)
            removed.append(name)
        except OSError:
            pass
    return removed


def remove_if_empty(folder):
    """Remove ``folder`` when it is empty (a folder a run made); keep it otherwise."""
    try:
        os.rmdir(folder)
    except OSError:
        pass
