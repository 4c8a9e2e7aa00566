"""What an export says about itself: the ``model.json`` sidecar beside its weights.

An export is ``model-symbol.json`` + ``model-0000.params`` (MXNet's own files) + this
sidecar: how predictors feed the network (:func:`geometry`), what it does to its inputs,
its searched post-processing, digests of the files (:func:`verify_export`) and a card of
where the model came from (:func:`model_card`). This module reads, checks and updates it
without mxnet: ``bin/predict`` on an ONNX export goes through it where mxnet is not
installed. Writing an export is :mod:`gluon_unet.inference.export`.
"""
import hashlib
import json
import math
import os
import platform
import time

import numpy as np

from .. import __version__, models
from ..config import shown
from ..data.io import NORMALIZE_MODES
from ..data.sizes import diameter_choice_error
from ..data.targets import OUTPUTS, second_map_of
from ..errors import DamagedFile, UserError
from ..paths import SIDECAR_MAX_BYTES
from ..utils import DIGEST, atomic_open, file_crc32, read_json
from .postprocess import MARKERS, SECOND_MAPS, SPLITS, settings_text, tuned_markers
from .tiling import MODES

SYMBOL, PARAMS, SIDECAR = 'model-symbol.json', 'model-0000.params', 'model.json'
#: The export's ONNX network (:mod:`gluon_unet.inference.export_onnx`): with ``model.json``,
#: all that ``bin/predict`` on onnxruntime reads (:func:`find_export` takes a folder of the two).
ONNX = 'model.onnx'
#: How to get a damaged ``model.onnx`` back where MXNet may not be installed (:func:`verify_export`).
ONNX_AGAIN = 'copy it again from the export it came from, or write it again where mxnet is installed ' \
             '(bin/export RUN --onnx)'
#: The int8 variant's files (:mod:`gluon_unet.inference.export_int8`), beside the float32 ones.
INT8_SYMBOL, INT8_PARAMS = 'model-int8-symbol.json', 'model-int8-0000.params'


def _positive_number(v):
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def geometry(cfg):
    """The part of the export's sidecar that tells predictors how to feed the network of
    ``cfg`` and read its outputs (what :func:`~gluon_unet.inference.batched.predict_image` needs)."""
    return {
        # What each output channel is: predictors read the maps by these names.
        'outputs': list(OUTPUTS[cfg.model.target]),
        'depth': cfg.model.depth,
        'multiple': 2 ** cfg.model.depth,
        'train_size': cfg.crop or cfg.size,
        'resize_mode': 'crop' if cfg.crop else 'resize',
    }


def read_sidecar(path):
    """The export's ``model.json`` as a dict, checked: an error names the file in one line.

    Every key is optional (hand-made and older exports have only some), but a key that
    is there must have the type inference uses; ``config`` (the training config, for
    reference) must be an object.
    """
    meta = read_json(path, path, SIDECAR_MAX_BYTES)
    try:
        if not isinstance(meta, dict):
            raise _Bad('must hold a JSON object, not %s' % _json_kind(meta))
        for check in (_check_geometry, _check_postprocess, _check_sizes, _check_outputs, _check_inputs):
            check(meta)
    except _Bad as exc:
        raise UserError('%s: %s' % (path, exc)) from None
    return meta


class _Bad(Exception):
    """What is wrong with one key of a sidecar (:func:`read_sidecar` names the file)."""


def _check_geometry(meta):
    """The network's shape and the training's geometry: what loading and tiling read."""
    for key in ('in_channels', 'classes', 'depth', 'multiple', 'train_size'):
        value = meta.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise _Bad('%r must be a positive integer (got %s)' % (key, _echo(value)))
    threshold = meta.get('threshold')
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or not 0 < threshold < 1):
        raise _Bad("'threshold' must be a number in (0, 1) (got %s)" % _echo(threshold))
    if meta.get('resize_mode') not in (None, 'crop', 'resize'):
        raise _Bad("'resize_mode' must be \"crop\" or \"resize\" (got %s)" % _echo(meta['resize_mode']))
    config = meta.get('config')
    if config is not None and not isinstance(config, dict):
        raise _Bad("'config' must be an object (the training config), not %s" % _json_kind(config))


def _check_postprocess(meta):
    """The searched settings: they feed float()/int() and the watershed directly, so a
    hand-edited "threshold": "high" would be a traceback, an "h": Infinity an empty
    result for every image."""
    tuned = meta.get('postprocess')
    if tuned is not None and (not isinstance(tuned, dict) or tuned.get('markers') not in (None,) + MARKERS):
        raise _Bad("'postprocess' must be an object whose 'markers' is one of %s (got %s)"
                   % (', '.join(_echo(m) for m in MARKERS), _echo(tuned)))
    tuned = tuned or {}
    for key, ok, rule in (('min_score', lambda v: 0 <= v < 1, 'a number in [0, 1)'),
                          ('threshold', lambda v: 0 < v < 1, 'a number in (0, 1)'),
                          ('marker', lambda v: 0 < v < 1, 'a number in (0, 1)'),
                          ('h', lambda v: math.isfinite(v) and v > 0, 'a finite number > 0'),
                          ('min_size', lambda v: v >= 0 and float(v).is_integer(), 'a whole number >= 0')):
        value = tuned.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value)):
            raise _Bad("'postprocess' '%s' must be %s (got %s)" % (key, rule, _echo(value)))
    if 'tta' in tuned and not isinstance(tuned['tta'], bool):
        raise _Bad("'postprocess' 'tta' must be true or false (got %s)" % _echo(tuned['tta']))
    if tuned.get('split', 'watershed') not in SPLITS:
        raise _Bad("'postprocess' 'split' must be one of %s (got %s)" % (', '.join(SPLITS), _echo(tuned['split'])))
    if tuned.get('mode', 'auto') not in MODES:
        raise _Bad("'postprocess' 'mode' must be one of %s (got %s)" % (', '.join(MODES), _echo(tuned['mode'])))


def _check_sizes(meta):
    """The nucleus sizes the model was trained on (``bin/predict --diameter``)."""
    diameter = meta.get('diameter')
    if diameter is not None and (isinstance(diameter, bool) or not isinstance(diameter, (int, float))
                                 or not (math.isfinite(diameter) and diameter > 0)):
        raise _Bad("'diameter' must be a finite positive number of pixels or null (got %s)" % _echo(diameter))
    ranges = meta.get('diameter_ranges')
    if ranges is not None and not (isinstance(ranges, dict) and 'all' in ranges and all(
            isinstance(r, list) and len(r) == 2 and all(_positive_number(v) for v in r) and r[0] <= r[1]
            for r in ranges.values())):
        raise _Bad("'diameter_ranges' must map 'all' and image kinds to [low, high] pixels or be null (got %s)"
                   % _echo(ranges))
    default = meta.get('predict_diameter')
    if default is not None and diameter_choice_error(default) is not None:
        raise _Bad("'predict_diameter' %s" % diameter_choice_error(default))


def _check_outputs(meta):
    """The maps the network outputs, and the markers the tuned watershed grows from."""
    outputs = meta.get('outputs')
    if outputs is not None and outputs not in [list(o) for o in OUTPUTS.values()]:
        raise _Bad("'outputs' must be one of %s (got %s)" % (
            ', '.join(_echo(list(o)) for o in OUTPUTS.values()), _echo(outputs)))
    model = (meta.get('config') or {}).get('model')
    target = model.get('target') if isinstance(model, dict) else None
    if target is not None and target not in OUTPUTS:
        raise _Bad("'config.model.target' must be one of %s (got %s)" % (', '.join(OUTPUTS), _echo(target)))
    markers = (meta.get('postprocess') or {}).get('markers')
    if markers in SECOND_MAPS:
        maps = list(outputs if outputs is not None else OUTPUTS.get(target, ('foreground',)))
        if second_map_of(maps) != markers:
            raise _Bad("'postprocess' 'markers' is %s, but the model's outputs are %s" % (_echo(markers), _echo(maps)))


def _check_inputs(meta):
    """The files' digests and the input normalization the model was trained with."""
    digest = meta.get('digest')
    if digest is not None and not (isinstance(digest, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in digest.items())):
        raise _Bad("'digest' must be an object of file name -> \"crc32:<hex>\" (got %s)" % _echo(digest))
    denoise = meta.get('normalize_denoise')
    if denoise is not None and (isinstance(denoise, bool) or not isinstance(denoise, (int, float)) or denoise < 0):
        raise _Bad("'normalize_denoise' must be a number >= 0 (got %s)" % _echo(denoise))
    for where, holder in (('normalize', meta), ('config.normalize', meta.get('config') or {})):
        value = holder.get('normalize')
        if value is not None and value not in NORMALIZE_MODES:
            raise _Bad('%r must be one of %s (got %s)' % (where, ', '.join(NORMALIZE_MODES), _echo(value)))


def _echo(value):
    """A value of the sidecar in a message, as JSON, cut short (a hand-edited file may hold anything)."""
    return shown(value, limit=120, as_json=True)


def _json_kind(value):
    """'a list', 'a number'...: what a JSON value is, for messages."""
    if value is None:
        return 'null'
    if isinstance(value, bool):
        return 'a boolean'
    return {list: 'a list', str: 'a string', dict: 'an object'}.get(type(value), 'a number')


def verify_export(meta, files, sidecar_path, again='export it again'):
    """Raise :class:`~.errors.DamagedFile` naming the first of ``files`` (name -> path)
    whose CRC-32 differs from the sidecar's ``digest``. Exports written before digests
    (no ``digest`` in model.json) and hand-made ones are read as they are, unchecked.

    ``again`` says how to get the file back on the path the caller is on: the MXNet files
    are exported again; ``model.onnx`` on a machine without MXNet is copied again
    (:data:`ONNX_AGAIN`). The other way out, removing ``digest`` from model.json, works on
    both paths (the ONNX path then runs a ``model.onnx`` its ``onnx`` record vouches for).
    """
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
                              'it was exported); %s, or remove "digest" from %s if you changed it on purpose'
                              % (path, sidecar_path, again, SIDECAR), path)


def find_export(path, flag='--model'):
    """Resolve ``--model`` to the export prefix, ``FOLDER/model``.

    Parameters
    ----------
    path : str
        A shipped model's name (``nuclei``, :mod:`gluon_unet.models`; a path of that name
        that exists wins), a run folder (its ``export/``), an export folder, an export prefix (``.../model``)
        or one of an export's files (``model.onnx``, ``model.json``, ``model-0000.params``,
        ``...-symbol.json``): a file names the export in its folder, and which of the
        folder's files run is the runtime's choice, as for the folder. A folder is an export
        when it holds MXNet's files or ``model.onnx``: ``model.onnx`` and ``model.json``
        are all that onnxruntime needs, so a copy of only those two is one.

    Returns
    -------
    str
        The prefix (``FOLDER/model``; an MXNet file's own prefix for ``X-symbol.json``).

    Raises
    ------
    UserError
        One line naming ``flag`` (``--model``) and what an export holds.
    """
    path = models.resolve(path)
    if os.path.isdir(path):
        for cand in (os.path.join(path, 'export', 'model'), os.path.join(path, 'model')):
            if _export_at(cand):
                return cand
        raise UserError('%s %s: no exported model there (expected %s + %s, or %s + %s, in it or in its '
                        'export/)' % (flag, path, SYMBOL, PARAMS, ONNX, SIDECAR))
    if path.endswith('-symbol.json'):
        return path[:-len('-symbol.json')]
    name = os.path.basename(path)
    if name in (ONNX, SIDECAR, PARAMS):
        if not os.path.isfile(path):
            raise UserError('%s %s: no such file' % (flag, path))
        prefix = os.path.join(os.path.dirname(path), 'model')
        if _export_at(prefix):
            return prefix
        raise UserError('%s %s: no exported model beside it (expected %s + %s, or %s + %s)'
                        % (flag, path, SYMBOL, PARAMS, ONNX, SIDECAR))
    if _export_at(path):
        return path
    if name.endswith('.onnx'):
        # The sidecar vouches for model.onnx by name (its 'onnx' record and digest); a
        # renamed file could be any network, fed with another's settings.
        raise UserError('%s %s: an export\'s %s is read beside its %s; give that file or its folder'
                        % (flag, path, ONNX, SIDECAR))
    raise UserError('%s %s: not a shipped model (%s), run folder, export folder, export prefix or export file'
                    % (flag, path, ', '.join(models.names())))


def _export_at(prefix):
    """Whether ``prefix`` (``FOLDER/model``...) names an export: MXNet's files, or a
    ``model.onnx`` in its folder."""
    if os.path.isfile(prefix + '-symbol.json') or os.path.isfile(prefix + '-0000.params'):
        return True
    return os.path.basename(prefix) == 'model' and os.path.isfile(os.path.join(os.path.dirname(prefix), ONNX))


def update_sidecar(out_dir, extra):
    """Add ``extra`` to an export's ``model.json`` (atomically)."""
    path = os.path.join(out_dir, SIDECAR)
    with open(path) as f:
        sidecar = json.load(f)
    sidecar.update(extra)
    if isinstance(extra.get('postprocess'), dict):
        card_follows(sidecar)
    with atomic_open(path, shown=os.path.join(final_folder(out_dir), SIDECAR)) as f:
        json.dump(sidecar, f, indent=2)


def final_folder(folder):
    """Where the files written into ``folder`` will be seen: its parent for a staging
    folder of :func:`staged_export`, else ``folder`` itself (named in error messages)."""
    if os.path.basename(os.path.normpath(folder)).startswith('.tmp-export-'):
        return os.path.dirname(os.path.abspath(folder))
    return folder


def card_follows(sidecar):
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
                 'content_sha1': data.get('content_sha1'),
                 # how many of them are DSB 2018 stage1_train's, by id: what gluon-unet package cites
                 'dsb2018_ids': data.get('dsb2018_ids')},
        # The model it was fine-tuned from (bin/train --init), by name and weights' digest.
        'init': _init_card(cfg.init, meta.get('init_scores')),
        'best_epoch': meta.get('epoch'),
        'best_metrics': {k: v for k, v in metrics.items() if k.startswith('val_') or k == 'train_loss'},
        'postprocess': {'threshold': cfg.threshold, 'normalize': cfg.normalize, 'target': cfg.model.target,
                        # by the second map (mask+touching's is a contact map), else the distance
                        'instances': _INSTANCES[second_map_of(OUTPUTS[cfg.model.target]) or 'distance'],
                        'chosen': 'the training config (no search)'},
    }


def _init_card(init, scores):
    """The card's ``init``: the model a run started from, and how it scored on the run's
    validation images before the first step (a fine-tune with validation images)."""
    card = models.reference_card(init)
    if card is not None and scores:
        card['val_before'] = dict(scores)
    return card


# How instances grow, by the markers (the second map's name, or the distance watershed).
_INSTANCES = {'border': 'marker watershed from the interiors',
              'centre': 'marker watershed from the centres',
              'contact': 'marker watershed from the foreground less the contacts',
              'flow': 'pixels gathered where the predicted directions to the centres meet',
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
    init = card.get('init')
    start = ' from %s (%s)' % (init.get('model'), init.get('digest')) if isinstance(init, dict) else ''
    return 'model: gluon_unet %s, trained %s on %s (%s images)%s, best epoch %s%s' % (
        card.get('gluon_unet'), str(card.get('created', '?'))[:10], data.get('path'), data.get('train_images'),
        start, card.get('best_epoch'), ' (%s)' % scores if scores else '')


def weights_digest(prefix):
    """SHA-256 of the weights of the export ``prefix`` (``.../model``), the same for every
    export of the same weights.

    MXNet writes a params file as its arrays, then their names; the names carry block
    counters that differ between processes (``unet0_conv0_weight`` here,
    ``unet1_conv0_weight`` there), so the digest covers the arrays' bytes only. Where the
    names section begins follows from the symbol's variable names (verified against the
    file's tail); a file where it does not is digested array by array (slower: a full load).

    An export copied without MXNet's files (``model.onnx`` + ``model.json``, all the ONNX
    path needs) gives ``'onnx:'`` + the SHA-256 of its ``model.onnx``: the file that runs.
    Its initializers carry MXNet's block names, so that is the file's identity, never
    equal to a weights digest.
    """
    params = prefix + '-0000.params'
    onnx = os.path.join(os.path.dirname(prefix), ONNX)
    if not os.path.isfile(params) and os.path.isfile(onnx):
        return 'onnx:' + file_sha256(onnx)
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


def file_sha256(path):
    """SHA-256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 22), b''):
            digest.update(chunk)
    return digest.hexdigest()


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


def tuned_prediction(meta):
    """``(mode, tta)``: how the validation maps were predicted when the export's
    post-processing was searched (``bin/predict``'s defaults), else ``('auto', False)``."""
    tuned = meta.get('postprocess') if isinstance(meta.get('postprocess'), dict) else {}
    if 'score' not in tuned:
        return 'auto', False
    return tuned.get('mode', 'auto'), bool(tuned.get('tta'))
