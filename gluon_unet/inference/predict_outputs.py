"""What ``bin/predict`` writes, and its record: each image's mask, instance labels and
overlay (written whole or not at all), the failures of the images that could not be
done (:class:`Predictions`), and the output folder's :class:`Manifest` - which model with
which settings wrote which files, so that two models' outputs never mix.
"""
import json
import os
import sys
import time

import cv2
import numpy as np

from ..errors import UserError
from ..paths import MANIFEST, MANIFEST_FORMAT, manifest_names, others_files, read_manifest, remove_files
from ..utils import atomic_open
from .overlay import overlay as draw_overlay
from .sidecar import tuned_prediction, weights_digest

#: What each image becomes in the output folder (``<id>_mask.png``...), the overlay last.
OUTPUT_SUFFIXES = ('_mask', '_labels', '_overlay')


def _atomic_write(path, data):
    """Write bytes under a temporary name in the same folder, then rename into place."""
    with atomic_open(path, 'wb') as f:
        f.write(data)


def write_png(path, array):
    """Atomically write a uint8/uint16 (H, W) or RGB (H, W, 3) array as PNG."""
    if array.ndim == 3:
        array = array[..., ::-1]  # OpenCV writes BGR
    ok, buf = cv2.imencode('.png', np.ascontiguousarray(array))
    if not ok:
        raise UserError('%s: could not encode PNG' % path)
    _atomic_write(path, buf.tobytes())


class Predictions(list):
    """What :func:`predict_paths` returns: the records of the images written (a list, as
    before) and ``failures``, one dict per image that could not be predicted or written
    (``id``, ``image`` - its path - and ``error``, a one-line message), in input order."""

    def __init__(self, records=(), failures=()):
        super().__init__(records)
        self.failures = list(failures)
        self.line = ''  # the run's one-line summary (summary_line), set by predict_paths

    def summary(self):
        """One line about the failures (empty when there are none), e.g.
        ``1 of 6 images failed: bad.png (truncated PNG ...)``."""
        return failure_summary(self.failures, len(self) + len(self.failures))


#: Failures named in a summary line; the rest are counted.
SHOWN_FAILURES = 3


def failure_summary(failures, total, shown=SHOWN_FAILURES):
    """``'2 of 6 images failed: a.png (why), b.png (why)'``, the first ``shown`` named."""
    if not failures:
        return ''
    named = ', '.join('%s (%s)' % (os.path.basename(f['image']), _reason(f)) for f in failures[:shown])
    more = ' and %d more' % (len(failures) - shown) if len(failures) > shown else ''
    head = ('all %d images' % total if len(failures) == total else
            '%d of %d image%s' % (len(failures), total, '' if total == 1 else 's'))
    return '%s failed: %s%s' % (head, named, more)


def _reason(failure, limit=120):
    """A failure's message without the image path it usually starts with, shortened."""
    text = failure['error']
    if text.startswith('cannot write '):  # a WriteError: the file's name (its folder is --output) and the cause
        path, _, cause = text[len('cannot write '):].partition(': ')
        return 'cannot write %s: %s' % (os.path.basename(path), cause)
    for prefix in (failure['image'] + ': ', os.path.basename(failure['image']) + ': '):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    return text if len(text) <= limit else text[:limit - 3] + '...'


def error_text(exc, path):
    """One line for an exception raised while predicting ``path``."""
    if isinstance(exc, UserError):
        text = str(exc)
    elif isinstance(exc, OSError) and exc.strerror:
        name = exc.filename2 or exc.filename
        text = '%s: cannot write %s (%s)' % (path, name, exc.strerror) if name else '%s: %s' % (path, exc.strerror)
    else:
        detail = str(exc).strip().splitlines()
        text = '%s: %s%s' % (path, type(exc).__name__, (': ' + detail[-1]) if detail else '')
    return ' '.join(text.split())


def write_image_outputs(rec, image, labels):
    """Write the mask, labels and (if ``rec['overlay']``) overlay of one image; on an error
    remove what was written (no mask without its labels: a failed image has no outputs)."""
    written = []
    try:
        for key, array in (('mask', lambda: (labels > 0).view(np.uint8) * np.uint8(255)),  # no int64 temporary
                           ('labels', lambda: labels.astype(np.uint16)),
                           ('overlay', lambda: draw_overlay(image, labels))):
            if rec[key]:
                write_png(rec[key], array())
                written.append(rec[key])
    except BaseException:
        for path in written:
            _remove_quietly(path)
        raise


def _remove_quietly(path):
    try:
        os.remove(path)
    except OSError:
        pass


def model_record(prefix, model, backend=None):
    """Which model predictions come from, for the manifest: the export folder, a digest of
    its weights (:func:`~gluon_unet.inference.sidecar.weights_digest`: the same for every export of
    the same weights), what its sidecar does to the inputs, its card's epoch and date, and
    the ``backend`` that ran it (:func:`backend_record`)."""
    card = model.meta.get('card') if isinstance(model.meta.get('card'), dict) else {}
    return {'export': os.path.dirname(os.path.abspath(prefix)), 'weights_sha256': weights_digest(prefix),
            'normalize': model.normalize, 'denoise': model.denoise, 'epoch': model.meta.get('epoch'),
            'created': card.get('created'), 'backend': backend}


def backend_record(runtime, model):
    """What ran the network: ``{'name': 'mxnet', 'version': '1.9.1', 'devices': ['cpu(0)']}``,
    or onnxruntime's version, devices and execution ``providers``. Recorded, not part of a
    model's identity: the same export on either backend writes into the same folder."""
    devices = [str(c) for c in model.ctxs]
    if runtime == 'mxnet':
        import mxnet as mx
        return {'name': 'mxnet', 'version': mx.__version__, 'devices': devices}
    from .batched_onnx import import_onnxruntime
    return {'name': 'onnxruntime', 'version': import_onnxruntime().__version__, 'devices': devices,
            'providers': sorted({s.get_providers()[0] for s in model.net.sessions})}


def backend_text(backend):
    """``'MXNet 1.9.1'`` / ``'onnxruntime 1.20.1 (CPUExecutionProvider)'`` for the summary line."""
    if backend['name'] == 'mxnet':
        return 'MXNet %s' % backend['version']
    return 'onnxruntime %s (%s)' % (backend['version'], ', '.join(backend['providers']))


#: The model record's keys that make two models different (the rest is for people).
_MODEL_IDENTITY = ('weights_sha256', 'normalize', 'denoise')


class Manifest:
    """A prediction folder's record (:data:`~gluon_unet.paths.MANIFEST`): which model
    (:func:`model_record`) with which settings wrote which files, from which inputs.

    One folder holds the predictions of one model with one set of settings, so that a
    second model's outputs never mix silently with the first's: predicting into a folder
    whose manifest names another model or other settings is refused unless
    ``overwrite``, which first removes the files the manifest lists; the same model with
    the same settings replaces its own files and adds to the record. A file at an output
    path that the manifest does not list (a user's own ``x_mask.png``, or predictions from
    before manifests existed) is never replaced.
    """

    def __init__(self, folder, model, settings, overwrite=False):
        self.folder, self.model, self.settings, self.overwrite = folder, model, settings, overwrite
        self.old = read_manifest(folder) if os.path.isdir(folder) else None
        self.same = self.old is not None and self.old.get('settings') == settings and all(
            (self.old.get('model') or {}).get(k) == model[k] for k in _MODEL_IDENTITY)
        self.kept = manifest_names(self.old) if self.same and not overwrite else []
        self.planned, self.started = [], False

    def check(self, planned):
        """Refuse, before any work, what these predictions must not do in the folder."""
        self.planned = planned
        path = os.path.join(self.folder, MANIFEST)
        if self.old is not None and not self.same and not self.overwrite:
            raise UserError('--output %s holds predictions by %s (%s); predict into another folder, or add '
                            '--overwrite to replace them' % (self.folder, self._difference(), path))
        mine = set(manifest_names(self.old)) if self.old is not None else set()
        for name in planned:
            if name not in mine and os.path.lexists(os.path.join(self.folder, name)):
                raise UserError('--output %s: %s is there and these predictions would replace it, but gluon_unet did '
                                'not write it (%s); move it, or predict into another folder'
                                % (self.folder, name, 'not listed in %s' % MANIFEST if self.old is not None
                                   else 'the folder has no %s' % MANIFEST))

    def _difference(self):
        old_model = self.old.get('model') or {}
        if any(old_model.get(k) != self.model[k] for k in _MODEL_IDENTITY):
            return 'another model (%s, epoch %s)' % (old_model.get('export'), old_model.get('epoch'))
        old = self.old.get('settings') or {}
        # Both sides' keys: a setting recorded only when it is not the default (precision)
        # is missing from one of them.
        keys = list(self.settings) + [k for k in old if k not in self.settings]
        changed = ['%s %s -> %s' % (k, json.dumps(old.get(k)), json.dumps(self.settings.get(k))) for k in keys
                   if old.get(k) != self.settings.get(k)]
        return 'this model with other settings: %s' % ', '.join(changed[:3])

    def begin(self, files):
        """Before the first output is written: remove the old predictions (``overwrite``)
        and record what this run may write, so even a crash leaves no unlisted output."""
        if self.started:
            return
        self.started = True
        if self.old is not None and self.overwrite:
            remove_files(self.folder, manifest_names(self.old))
            kept = others_files(self.folder, ignore=(MANIFEST,))  # the record is bin/predict's own
            if kept:  # said, so that --overwrite never looks as if it cleared the folder
                print('note: --overwrite %s: kept what bin/predict did not write: %s' % (self.folder, kept),
                      file=sys.stderr)
        self.inputs = dict((self.old or {}).get('inputs') or {}) if self.kept else {}
        self.inputs.update({image_id: os.path.abspath(path) for image_id, path in files})
        self.ids = [image_id for image_id, _ in files]
        self._write(sorted(set(self.kept) | set(self.planned)), complete=False)

    def finish(self, stopped=None):
        """After the run: the record of the files that are there (none written: nothing),
        ``complete`` only when every planned file is, and what ``stopped`` the run
        (``'SIGTERM'``, recorded as ``'SIGTERM after 4 of 10 images'``, counting the images
        whose files are there) when something did."""
        if not self.started:
            return
        names = [n for n in sorted(set(self.kept) | set(self.planned)) if os.path.isfile(os.path.join(self.folder, n))]
        if stopped:
            done = sum(1 for image_id in self.ids if '%s_mask.png' % image_id in names)
            stopped = '%s after %d of %d images' % (stopped, done, len(self.ids))
        self._write(names, complete=stopped is None and set(self.planned) <= set(names), stopped=stopped)

    def _write(self, names, complete, stopped=None):
        os.makedirs(self.folder, exist_ok=True)
        record = {'format': MANIFEST_FORMAT, 'model': self.model, 'settings': self.settings, 'files': names,
                  'inputs': self.inputs, 'complete': complete,
                  'written': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}
        if stopped:
            record['stopped'] = stopped
        missing = sorted(set(self.planned) - set(names))
        if missing and not stopped:
            record['missing'] = missing  # the images that failed: their files were never written
        with atomic_open(os.path.join(self.folder, MANIFEST)) as f:
            json.dump(record, f, indent=1)


def writes_there(name):
    """Whether ``name`` (relative to a prediction folder) is a file bin/predict writes
    there: an image's mask, labels or overlay, or the manifest."""
    return os.sep not in name and (name == MANIFEST or any(name.endswith(s + '.png') for s in OUTPUT_SUFFIXES))


def stop_words(exc):
    """``'SIGTERM'`` / ``'SIGINT'`` / ``'an error (WriteError)'``: what stopped a run."""
    signum = getattr(exc, 'signum', None)
    if signum is not None:
        import signal
        return signal.Signals(signum).name
    if isinstance(exc, KeyboardInterrupt):
        return 'SIGINT'
    return 'an error (%s)' % type(exc).__name__


def summary_line(records, seconds, ctxs, output_dir, config, inputs_per_device=None, backend=None):
    """``predicted 6 images (101 objects) in 2.0 s: 3.00 images/s on 1 device [cpu(0)] with
    MXNet 1.9.1; ...``; with several devices each is followed by the network inputs it
    computed (``[cpu(0) 3 inputs, cpu(1) 3 inputs]``); onnxruntime's devices are its
    execution providers."""
    modes = {}
    for r in records:
        modes[r['mode']] = modes.get(r['mode'], 0) + 1
    return ('predicted %d images (%d objects) in %.1f s: %.2f images/s on %d device%s [%s]%s; mode %s%s; '
            'outputs in %s%s' % (len(records), sum(r['objects'] for r in records), seconds,
                                 len(records) / max(seconds, 1e-9), len(ctxs), 's' if len(ctxs) > 1 else '',
                                 _device_list(ctxs, inputs_per_device),
                                 ' with %s' % backend_text(backend) if backend else '',
                                 ', '.join('%s %d' % kv for kv in sorted(modes.items())),
                                 ', tta' if config.tta else '', output_dir,
                                 (', submission %s' % config.rle) if config.rle else ''))


def _device_list(ctxs, inputs_per_device=None):
    if len(ctxs) < 2 or inputs_per_device is None:
        return ', '.join(str(c) for c in ctxs)
    return ', '.join('%s %d input%s' % (c, n, '' if n == 1 else 's') for c, n in zip(ctxs, inputs_per_device))


def tuning_note(meta, mode, tta):
    """A note when the export's post-processing was searched on maps predicted with
    another ``--mode`` / ``--tta`` than these predictions use (given on the command line),
    else ''."""
    tuned = meta.get('postprocess') if isinstance(meta.get('postprocess'), dict) else {}
    chosen, used = tuned_prediction(meta), (mode, bool(tta))
    if 'score' not in tuned or chosen == used:
        return ''

    def flags(m, t):
        return '--mode %s%s' % (m, ' --tta' if t else '')
    return ('note: this model\'s post-processing was chosen on validation maps predicted with %s, these '
            'predictions use %s (`bin/export RUN --tune-postprocess %s` searches on maps like these)'
            % (flags(*chosen), flags(*used), flags(*used)))
