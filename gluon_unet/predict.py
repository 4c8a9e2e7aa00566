"""``bin/predict``: segment image files with an exported model and write the results.

Inference is split in three modules, as nnU-Net does:

* :mod:`gluon_unet.tiling` - sliding-window geometry, pure numpy: the ``resize``,
  ``tile`` and ``whole`` modes, tile positions, padding to multiples of ``2**depth``,
  blending weights;
* :mod:`gluon_unet.inference` - batched network application: load an export once, run
  batches of equal-shape inputs over the devices, TTA; :func:`predict_image` for one
  image in memory;
* this module - files in and out: find the inputs, read them, write masks, instance
  labels, overlays and a DSB submission, report failures, keep the output folder's
  :class:`Manifest` (which model wrote which files); :class:`PredictConfig` and the
  command line.

Inputs are the uint8 image / 255, as in training (16-bit and float images are
percentile-scaled to uint8 first by :mod:`gluon_unet.data.io`), after the model's
``--normalize`` (read from the export's sidecar) is applied to the whole image, with the
channel conversion, by the function training uses (:func:`~gluon_unet.data.io.input_image`).
"""
import argparse
import csv
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import cv2
import numpy as np

from .data.io import IMAGE_TYPES, input_image, is_image_file, read_image
from .data.layouts import dsb_image, is_dsb_sample
from .errors import OneLineParser, UserError, reports_errors
from .export import card_summary, find_export, weights_digest
from .inference import _Done, load_model, match_channels
from .postprocess import MARKERS, SECOND_MAPS, SPLITS, instances_from_maps, overlay as draw_overlay, submission_rows
from .scale import estimate_diameter, rescale_factor
from .tiling import MODES
from .paths import (MANIFEST, MANIFEST_FORMAT, check_apart, check_replaceable, manifest_names, read_manifest,
                    remove_files)
from .utils import atomic_open, check_writable, write_errors

# Names that lived here before inference was split into tiling / inference / predict, so
# ``from gluon_unet.predict import predict_image`` (and the benchmarks) keep working.
from .inference import _Job, image_jobs, model_channels, predict_image, run_jobs  # noqa: E402,F401
from .tiling import DIHEDRAL, blend_window, choose_mode, tile_size, tile_starts  # noqa: E402,F401

#: Name endings of our outputs (and of masks in a paired folder): such a file is not an
#: input when the image it belongs to sits next to it.
DERIVED_SUFFIXES = ('_mask', '_labels', '_overlay')
#: What each image becomes in the output folder (``<id>_mask.png``...), the overlay last.
OUTPUT_SUFFIXES = ('_mask', '_labels', '_overlay')


# -- options -------------------------------------------------------------------------------

@dataclass
class PredictConfig:
    """How :func:`predict_paths` segments and what it writes; one field per ``bin/predict``
    flag (``batch_size`` -> ``--batch-size``), with the same defaults."""
    gpus: str = ''                    #: devices, as for training; empty = CPU
    cpus: int = 1                     #: CPU contexts when no GPU is used
    mode: str = 'auto'                #: see :mod:`gluon_unet.tiling`
    tta: bool = False                 #: average the 8 flips / quarter turns
    threshold: Optional[float] = None  #: foreground cut; None = the model's training threshold
    min_size: Optional[int] = None    #: drop objects under this many pixels; None = the model's (tuned)
    min_score: Optional[float] = None  #: drop objects whose mean probability is lower; None = the model's (tuned)
    split: str = 'watershed'          #: instance separation, see postprocess.instances_from_prob
    marker: Optional[float] = None    #: two-map models: the second map's level a marker needs; None = the model's
    h: Optional[float] = None         #: distance watershed: h-maxima depth in pixels; None = the model's
    markers: Optional[str] = None     #: two-map models: their second map or 'distance'; None = the model's
    diameter: Optional[str] = None    #: nuclei's size in the images: 'auto' or pixels; None = no rescaling
    overlay: bool = False             #: also write ``<id>_overlay.png`` outlines
    rle: Optional[str] = None         #: path of a DSB submission CSV, written at the end
    batch_size: int = 8               #: inputs per forward, split over the devices
    overlap: float = 0.25             #: tile mode: fraction of the tile shared with its neighbour
    buckets: bool = False             #: whole mode: pad to a few sizes per octave (fewer shapes)
    progress: bool = True             #: progress bar (stderr) and a one-line summary
    overwrite: bool = False           #: replace another model's (or other settings') predictions in the folder

    def validate(self):
        """Raise :class:`UserError` naming the flag of the first invalid value (devices are
        checked when they are made)."""
        if self.mode not in MODES:
            raise UserError('--mode must be one of %s (got %r)' % (', '.join(MODES), self.mode))
        if self.batch_size < 1:
            raise UserError('--batch-size must be >= 1 (got %r)' % self.batch_size)
        if not 0 <= self.overlap < 1:
            raise UserError('--overlap must be in [0, 1) (got %r)' % self.overlap)
        if self.threshold is not None and not 0 < self.threshold < 1:
            raise UserError('--threshold must be in (0, 1) (got %r)' % self.threshold)
        if self.diameter is not None and self.diameter != 'auto':
            try:
                pixels = float(self.diameter)
                ok = math.isfinite(pixels) and pixels > 0
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise UserError("--diameter must be 'auto' or a finite positive number of pixels (got %r)"
                                % self.diameter)
        if self.marker is not None and not 0 < self.marker < 1:
            raise UserError('--marker must be in (0, 1) (got %r)' % self.marker)
        # inf passes '> 0' but h-maxima of infinite depth finds no markers: every image would
        # come out empty without a word. nan fails any comparison, so it is refused either way.
        if self.h is not None and not (math.isfinite(self.h) and self.h > 0):
            raise UserError('--h must be a finite number > 0 pixels (got %r)' % self.h)
        if self.markers is not None and self.markers not in MARKERS:
            raise UserError('--markers must be one of %s (got %r)' % (', '.join(MARKERS), self.markers))
        if self.min_size is not None and self.min_size < 0:
            raise UserError('--min-size must be >= 0 (got %r)' % self.min_size)
        if self.min_score is not None and not 0 <= self.min_score < 1:
            raise UserError('--min-score must be in [0, 1) (got %r)' % self.min_score)
        if self.split not in SPLITS:
            raise UserError('--split must be one of %s (got %r)' % (', '.join(SPLITS), self.split))
        return self


# -- inputs --------------------------------------------------------------------------------

def find_inputs(path):
    """Images to predict: a file, a folder of images, ``DIR/images/``, or a DSB root.

    Returns
    -------
    list of (image_id, path)
        Sorted; the id names the outputs (the DSB id for the DSB layout, else the stem).
    """
    if not os.path.exists(path):
        raise UserError('--input %s: no such file or folder' % path)
    if os.path.isfile(path):
        if not is_image_file(path):
            raise UserError('--input %s: not an image file (%s)' % (path, IMAGE_TYPES))
        return [(os.path.splitext(os.path.basename(path))[0], path)]
    if os.path.isdir(os.path.join(path, 'images')):
        path = os.path.join(path, 'images')
    found = _without_derived(_folder_inputs(path))
    if not found:
        raise UserError('--input %s: no images (%s) in the folder' % (path, IMAGE_TYPES))
    seen = {}
    for image_id, p in found:
        if image_id in seen:
            raise UserError('--input %s: %s and %s would write the same outputs (same name %r)'
                            % (path, os.path.basename(seen[image_id]), os.path.basename(p), image_id))
        seen[image_id] = p
    return found


def _folder_inputs(path):
    """(id, path) of the images in a folder: its image files and its DSB samples."""
    found = []
    for n in sorted(os.listdir(path)):
        full = os.path.join(path, n)
        if is_dsb_sample(full):  # DSB: ROOT/<id>/images/<id>.png
            image = dsb_image(full)
            if image:
                found.append((n, image))
        elif os.path.isfile(full) and is_image_file(n):
            found.append((os.path.splitext(n)[0], full))
    return found


def _without_derived(found):
    """Drop ``x_mask.png`` & co. when ``x`` is an input too: they are outputs or masks."""
    stems = {s for s, _ in found}
    return [(s, p) for s, p in found
            if not any(s.endswith(x) and s[:-len(x)] in stems for x in DERIVED_SUFFIXES)]


# -- outputs -------------------------------------------------------------------------------

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


def write_submission(path, rows):
    """Atomically write DSB submission rows ``(ImageId, EncodedPixels)`` as CSV."""
    import io
    text = io.StringIO()
    writer = csv.writer(text, lineterminator='\n')
    writer.writerow(('ImageId', 'EncodedPixels'))
    writer.writerows(rows)
    _atomic_write(path, text.getvalue().encode())


# -- the whole run -------------------------------------------------------------------------

class Predictions(list):
    """What :func:`predict_paths` returns: the records of the images written (a list, as
    before) and ``failures``, one dict per image that could not be predicted or written
    (``id``, ``image`` - its path - and ``error``, a one-line message), in input order."""

    def __init__(self, records=(), failures=()):
        super().__init__(records)
        self.failures = list(failures)

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


def _error_text(exc, path):
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


def _write_image_outputs(rec, image, labels):
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


# -- the whole run -------------------------------------------------------------------------

class _Run:
    """One :func:`predict_paths` call: streams every image's jobs through the model and
    writes each image's outputs as soon as its probabilities are complete. An image that
    cannot be read, predicted or written becomes a failure; the others go on."""

    def __init__(self, model, files, output_dir, config):
        self.model, self.files, self.output_dir, self.config = model, files, output_dir, config
        self.threshold = model.threshold if config.threshold is None else float(config.threshold)
        self.min_size = model.min_size if config.min_size is None else int(config.min_size)
        self.min_score = model.min_score if config.min_score is None else float(config.min_score)
        self.marker = model.marker if config.marker is None else float(config.marker)
        self.h = model.h if config.h is None else float(config.h)
        self.markers = model.markers if config.markers is None else config.markers
        if self.markers in SECOND_MAPS and model.second != self.markers:
            raise UserError('--markers %s needs a mask+%s model; this one predicts %s (use --markers %s or leave '
                            'it out)' % (self.markers, self.markers, 'the foreground only' if model.second is None
                                         else 'the foreground and a %s map' % model.second,
                                         'distance' if model.second is None else model.second + '|distance'))
        self.records, self.rows, self.failures = [], [], []
        self.manifest = None  # the output folder's Manifest (predict_paths sets it)
        self.inputs_per_device = [0] * len(model.ctxs)
        self.bar = None

    def run(self):
        """Predict and write every image; returns the :class:`Predictions`."""
        self.bar = _progress_bar(len(self.files), self.config.progress)
        try:
            self.inputs_per_device = self.model.run(self._jobs(), self.config.batch_size).jobs_per_device
        finally:
            self.bar.close()
        failures = [f for _, f in sorted(self.failures, key=lambda item: item[0])]
        if failures and not self.records:
            if len(failures) == 1:
                raise UserError(failures[0]['error'])
            raise UserError(failure_summary(failures, len(failures)))
        if self.config.rle:
            if self.manifest is not None:
                self.manifest.begin(self.files)
            rle = os.path.abspath(self.config.rle)
            with write_errors(self.config.rle):
                os.makedirs(os.path.dirname(rle), exist_ok=True)
            write_submission(self.config.rle, self.rows)
        return Predictions(self.records, failures)

    def _fail(self, index, image_id, path, exc):
        # One image's problem (unreadable, wrong channels, too many objects, disk full...)
        # must not cost the others, including those read ahead into the same batch.
        self.failures.append((index, {'id': image_id, 'image': path, 'error': _error_text(exc, path)}))
        self.bar.update(1)

    def _jobs(self):
        for index, (image_id, path) in enumerate(self.files):
            try:
                yield from self._image_jobs(index, image_id, path)
            except Exception as exc:
                self._fail(index, image_id, path, exc)

    def _image_jobs(self, index, image_id, path):
        cfg = self.config
        stored = read_image(path)
        net_input = input_image(stored, self.model.channels, self.model.normalize, self.model.denoise,
                                convert=lambda img, channels: match_channels(img, channels, path))
        # Overlays are drawn on the image as stored (colour stays colour for a grey model).
        shown = stored if cfg.overlay else None
        rec = {'id': image_id, 'image': path, 'height': stored.shape[0], 'width': stored.shape[1]}

        def guarded(fn):
            def run():
                try:
                    fn()
                except Exception as exc:
                    self._fail(index, image_id, path, exc)
            return run
        on_done = lambda prob, used: self._write(rec, shown, prob, used)  # noqa: E731
        if cfg.diameter is not None:
            net_input, on_done = self._rescaled(rec, net_input, on_done)
        for job in self.model.image_jobs(net_input, cfg.mode, cfg.tta, cfg.overlap, on_done=on_done,
                                         buckets=cfg.buckets):
            yield _Done(guarded(job.fn)) if isinstance(job, _Done) else job

    def _rescaled(self, rec, net_input, on_done):
        """``--diameter``: the network input resized so its nuclei reach the model at its
        training diameter, and an ``on_done`` that maps the probabilities back."""
        cfg, model = self.config, self.model
        if cfg.diameter == 'auto':
            # A first pass at the image's own scale measures its nuclei.
            maps = predict_image(model.net, model.meta, net_input, model.ctxs, cfg.mode, batch_size=cfg.batch_size,
                                 overlap=cfg.overlap, buckets=cfg.buckets, maps=True)
            measured = estimate_diameter(self._instances(maps))
            del maps
        else:
            measured = float(cfg.diameter)
        factor = rescale_factor(model.diameter, measured)
        rec.update(diameter=measured, scale=factor)
        if factor == 1.0:
            return net_input, on_done
        h, w = net_input.shape[:2]
        size = (max(1, int(round(w * factor))), max(1, int(round(h * factor))))
        # Area averaging to shrink (no aliasing), linear to enlarge, as for training images.
        scaled = cv2.resize(net_input, size, interpolation=cv2.INTER_AREA if factor < 1 else cv2.INTER_LINEAR)

        def back(maps, used):
            on_done(np.stack([cv2.resize(m, (w, h), interpolation=cv2.INTER_LINEAR) for m in maps]), used)
        return scaled.reshape(size[1], size[0], -1), back

    def _instances(self, maps):
        """Instance labels of one image's probability maps, with this run's settings."""
        return instances_from_maps(maps, threshold=self.threshold, min_size=self.min_size, split=self.config.split,
                                   h=self.h, marker=self.marker, markers=self.markers, min_score=self.min_score)

    def settings(self):
        """What decides the outputs besides the model: the resolved post-processing and how
        the maps are predicted (a manifest's ``settings``)."""
        cfg = self.config
        return {'threshold': self.threshold, 'min_size': self.min_size, 'min_score': self.min_score,
                'marker': self.marker, 'h': self.h, 'markers': self.markers, 'split': cfg.split, 'mode': cfg.mode,
                'tta': cfg.tta, 'overlap': cfg.overlap, 'buckets': cfg.buckets, 'diameter': cfg.diameter}

    def planned(self):
        """The names of the files this run may write in the output folder."""
        kinds = OUTPUT_SUFFIXES if self.config.overlay else OUTPUT_SUFFIXES[:2]
        names = ['%s%s.png' % (image_id, kind) for image_id, _ in self.files for kind in kinds]
        rle = self.config.rle
        if rle and os.path.realpath(os.path.dirname(os.path.abspath(rle))) == os.path.realpath(self.output_dir):
            names.append(os.path.basename(rle))
        return names

    def _write(self, rec, image, prob, used):
        cfg = self.config
        labels = self._instances(prob)
        if labels.max() > np.iinfo(np.uint16).max:
            raise UserError('%s: %d objects do not fit a 16-bit label image' % (rec['image'], labels.max()))
        if self.manifest is not None:
            self.manifest.begin(self.files)
        with write_errors(self.output_dir):
            os.makedirs(self.output_dir, exist_ok=True)
        base = os.path.join(self.output_dir, rec['id'])
        rec.update(mode=used, objects=int(labels.max()), mask=base + '_mask.png',
                   labels=base + '_labels.png', overlay=base + '_overlay.png' if cfg.overlay else None)
        _write_image_outputs(rec, image, labels)
        if cfg.rle:
            self.rows.extend(submission_rows(rec['id'], labels))
        self.records.append(rec)
        self.bar.update(1)


# -- the prediction manifest -------------------------------------------------------------

def model_record(prefix, model):
    """Which model predictions come from, for the manifest: the export folder, a digest of
    its weights (:func:`~gluon_unet.export.weights_digest`: the same for every export of
    the same weights), what its sidecar does to the inputs, and its card's epoch and date."""
    card = model.meta.get('card') if isinstance(model.meta.get('card'), dict) else {}
    return {'export': os.path.dirname(os.path.abspath(prefix)), 'weights_sha256': weights_digest(prefix),
            'normalize': model.normalize, 'denoise': model.denoise, 'epoch': model.meta.get('epoch'),
            'created': card.get('created')}


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
        changed = ['%s %s -> %s' % (k, json.dumps(old.get(k)), json.dumps(v)) for k, v in self.settings.items()
                   if old.get(k) != v]
        return 'this model with other settings: %s' % ', '.join(changed[:3])

    def begin(self, files):
        """Before the first output is written: remove the old predictions (``overwrite``)
        and record what this run may write, so even a crash leaves no unlisted output."""
        if self.started:
            return
        self.started = True
        if self.old is not None and self.overwrite:
            remove_files(self.folder, manifest_names(self.old))
        self.inputs = dict((self.old or {}).get('inputs') or {}) if self.kept else {}
        self.inputs.update({image_id: os.path.abspath(path) for image_id, path in files})
        self._write(sorted(set(self.kept) | set(self.planned)), complete=False)

    def finish(self):
        """After the run: the record of the files that are there (none written: nothing)."""
        if not self.started:
            return
        names = [n for n in sorted(set(self.kept) | set(self.planned)) if os.path.isfile(os.path.join(self.folder, n))]
        self._write(names, complete=True)

    def _write(self, names, complete):
        os.makedirs(self.folder, exist_ok=True)
        record = {'format': MANIFEST_FORMAT, 'model': self.model, 'settings': self.settings, 'files': names,
                  'inputs': self.inputs, 'complete': complete,
                  'written': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}
        with atomic_open(os.path.join(self.folder, MANIFEST)) as f:
            json.dump(record, f, indent=1)


def predict_paths(model, inputs, output_dir, config=None, **overrides):
    """Segment image files and write masks, instance labels, overlays and a submission.

    Parameters
    ----------
    model : str
        Run folder, export folder or export prefix (``.../model``).
    inputs : str
        Image file, folder of images, or DSB root (see :func:`find_inputs`).
    output_dir : str
        Gets ``<id>_mask.png`` (0/255), ``<id>_labels.png`` (16-bit instance ids) and,
        with ``overlay``, ``<id>_overlay.png``, and the :class:`Manifest` of them
        (``gluon_unet-predictions.json``). Created when the first file is written. A folder
        holding another model's predictions (or other settings') is refused unless
        ``overwrite``; files there that gluon_unet did not write are never replaced.
    config : PredictConfig, optional
        The options; default ``PredictConfig()``.
    **overrides
        Fields of :class:`PredictConfig` to change, e.g. ``cpus=2, overlay=True``.

    Returns
    -------
    Predictions
        A list with, per image written: ``id``, ``image``, ``height``, ``width``,
        ``mode``, ``objects`` and the paths written (``mask``, ``labels``, ``overlay``);
        its ``failures`` lists the images that failed.

    Raises
    ------
    UserError
        Bad options, model or inputs, an output that is or lies inside an input
        (:func:`~gluon_unet.paths.check_apart`), an output folder the manifest rule refuses
        - or every image failed (nothing is written then).
        An image that cannot be read, predicted or written does not stop the others: it
        is listed in ``failures``, and the submission has the good images.
    """
    from .devices import make_contexts
    from .onnx_runner import load_onnx_model, predict_runtime, runtime_line

    config = dataclasses.replace(config or PredictConfig(), **overrides).validate()
    # onnxruntime where mxnet cannot be imported (issue 48); ``--providers`` will also choose it.
    runtime, why = predict_runtime(None)
    ctxs = make_contexts(config.gpus, config.cpus) if runtime == 'mxnet' else None
    files = find_inputs(inputs)
    if os.path.isfile(output_dir):
        raise UserError('--output %s: is a file, not a folder' % output_dir)
    if config.rle and os.path.isdir(config.rle):
        raise UserError('--rle %s: is a folder; give a CSV file name' % config.rle)
    prefix = find_export(model)
    check_apart([('--output', output_dir), ('--rle', config.rle)],
                [('--input', inputs), ('--model', os.path.dirname(prefix) or os.curdir)], 'predict')
    check_replaceable(config.rle, 'ImageId,EncodedPixels', '--rle', 'a DSB submission')
    # Before any work: an unwritable output would otherwise be found after every image.
    check_writable(output_dir, '--output')
    if config.rle:
        check_writable(config.rle, '--rle', is_file=True)
    if runtime == 'mxnet':
        loaded = load_model(model, ctxs)
    else:
        loaded = load_onnx_model(model, config.gpus, config.cpus, why=why)
        ctxs = loaded.ctxs
        print(runtime_line(loaded, why), file=sys.stderr)
    check_diameter(config.diameter, loaded)
    run = _Run(loaded, files, output_dir, config)
    run.manifest = Manifest(output_dir, model_record(prefix, loaded), run.settings(), config.overwrite)
    run.manifest.check(run.planned())
    if config.progress and card_summary(loaded.meta):
        print(card_summary(loaded.meta))
    note = tuning_note(loaded.meta, config.mode, config.tta)
    if config.progress and note:
        print(note, file=sys.stderr)
    t0 = time.time()
    try:
        result = run.run()
    finally:
        run.manifest.finish()  # what is there, even after an error
    if config.progress:
        print(_summary_line(result, time.time() - t0, ctxs, output_dir, config, run.inputs_per_device))
    return result


def check_diameter(diameter, model):
    """Refuse ``--diameter`` in one line for a model that cannot be rescaled to."""
    if diameter is None:
        return
    if model.meta.get('resize_mode') == 'resize':
        raise UserError('--diameter: this model was trained on images resized to %s px, where nuclei have no one '
                        'size; it needs a model trained at native resolution (bin/train --crop)'
                        % model.meta.get('train_size'))
    if not model.diameter:
        raise UserError('--diameter: the model does not record the nucleus size it was trained on (exported before '
                        '--diameter existed, or trained without labelled nuclei); predict without --diameter')


def _summary_line(records, seconds, ctxs, output_dir, config, inputs_per_device=None):
    """``predicted 6 images (101 objects) in 2.0 s: 3.00 images/s on 1 device [cpu(0)]; ...``;
    with several devices each is followed by the network inputs it computed
    (``[cpu(0) 3 inputs, cpu(1) 3 inputs]``)."""
    modes = {}
    for r in records:
        modes[r['mode']] = modes.get(r['mode'], 0) + 1
    return ('predicted %d images (%d objects) in %.1f s: %.2f images/s on %d device%s [%s]; mode %s%s; '
            'outputs in %s%s' % (len(records), sum(r['objects'] for r in records), seconds,
                                 len(records) / max(seconds, 1e-9), len(ctxs), 's' if len(ctxs) > 1 else '',
                                 _device_list(ctxs, inputs_per_device),
                                 ', '.join('%s %d' % kv for kv in sorted(modes.items())),
                                 ', tta' if config.tta else '', output_dir,
                                 (', submission %s' % config.rle) if config.rle else ''))


def tuning_note(meta, mode, tta):
    """A note when the export's post-processing was searched on maps predicted with
    another ``--mode`` / ``--tta`` than these predictions use, else ''."""
    tuned = meta.get('postprocess') if isinstance(meta.get('postprocess'), dict) else {}
    chosen, used = (tuned.get('mode', 'auto'), bool(tuned.get('tta'))), (mode, bool(tta))
    if 'score' not in tuned or chosen == used:
        return ''

    def flags(m, t):
        return '--mode %s%s' % (m, ' --tta' if t else '')
    return ('note: this model\'s post-processing was chosen on validation maps predicted with %s, these '
            'predictions use %s (`bin/export RUN --tune-postprocess %s` searches on maps like these)'
            % (flags(*chosen), flags(*used), flags(*used)))


def _device_list(ctxs, inputs_per_device=None):
    if len(ctxs) < 2 or inputs_per_device is None:
        return ', '.join(str(c) for c in ctxs)
    return ', '.join('%s %d input%s' % (c, n, '' if n == 1 else 's') for c, n in zip(ctxs, inputs_per_device))


def _progress_bar(total, enabled):
    from tqdm import tqdm
    return tqdm(total=total, unit='img', desc='predict', disable=not enabled or total <= 1, file=sys.stderr)


# -- the command line ----------------------------------------------------------------------

def build_parser():
    """The ``bin/predict`` parser; every option is a :class:`PredictConfig` field."""
    parser = OneLineParser(prog='predict', description='Segment nuclei with an exported model, at the '
                           'original resolution; writes <id>_mask.png, <id>_labels.png (16-bit instance '
                           'ids) and optionally overlays and a DSB submission CSV.')
    parser.add_argument('--model', required=True, metavar='RUN_DIR|PREFIX',
                        help='run folder (uses its export/), export folder or export prefix')
    parser.add_argument('--input', required=True, metavar='DIR|FILE',
                        help='an image, a folder of images, or a DSB root (<id>/images/<id>.png)')
    parser.add_argument('--output', required=True, metavar='DIR', help='folder for the outputs')
    parser.add_argument('--gpus', default='', help="GPU ids: '0-7', '0,2', 'all'; empty = CPU")
    parser.add_argument('--cpus', type=int, default=1, help='CPU contexts when no GPU is used (default 1)')
    parser.add_argument('--mode', default='auto', choices=MODES,
                        help='resize to the training size, tile at native resolution, whole image '
                             'padded, or auto (tile if larger than the training size; default)')
    parser.add_argument('--tta', action='store_true', help='average the 8 flips / quarter turns')
    parser.add_argument('--threshold', type=float, default=None,
                        help="foreground probability cut (default: the model's, chosen on validation after "
                             "training; else its training threshold)")
    parser.add_argument('--min-size', type=int, default=None,
                        help="drop objects under N pixels (default: the model's, chosen on validation; else 0)")
    parser.add_argument('--min-score', type=float, default=None,
                        help="drop objects whose mean foreground probability is below this: debris and faint "
                             "blobs (default: the model's, chosen on validation; else 0 = keep all)")
    parser.add_argument('--split', default='watershed', choices=SPLITS,
                        help='separate touching nuclei with a watershed (default: from the interiors of a '
                             'mask+border model or those a mask+contact model leaves, from the centres of a '
                             'mask+centre model, else on the distance transform) or keep plain connected components '
                             '(none)')
    parser.add_argument('--diameter', default=None, metavar='auto|PIXELS',
                        help="rescale each image so its nuclei reach the network at the size the model was "
                             "trained on (Cellpose-style): PIXELS = the typical nucleus diameter in your images, "
                             "auto = measured from a first prediction of each image (twice the work); "
                             "default: no rescaling")
    parser.add_argument('--marker', type=float, default=None,
                        help="mask+border and mask+contact models: the interior score (foreground x (1 - "
                             "border or contact)) a watershed marker needs (else 0.5); mask+centre models: how far "
                             "a hill top of the centre map must rise above its valley to seed its own nucleus (else "
                             "0.1) (default: the model's, chosen on validation)")
    parser.add_argument('--h', type=float, default=None,
                        help="distance watershed: how much deeper than its surroundings (in pixels of distance "
                             "to the background) a nucleus centre must be to seed its own object (default: the "
                             "model's, chosen on validation; else 0.5)")
    parser.add_argument('--markers', default=None,
                        help="two-map models: seed the watershed from the interiors a border map leaves "
                             "(border) or a contact map (contact), from the hill tops of a centre map (centre) or "
                             "from the distance transform of the foreground (distance) (default: the model's, "
                             "chosen on validation; else its second map)")
    parser.add_argument('--overlay', action='store_true', help='also write <id>_overlay.png outlines')
    parser.add_argument('--rle', metavar='CSV', help='write a DSB submission (ImageId,EncodedPixels)')
    parser.add_argument('--batch-size', type=int, default=8, help='inputs per forward, split over devices')
    parser.add_argument('--overlap', type=float, default=0.25, help='tile overlap fraction (default 0.25)')
    parser.add_argument('--buckets', action='store_true',
                        help='whole mode: pad each image up to one of 8-16 sizes per octave (sides grow '
                             'by < 1/8) so images of many sizes share a few network shapes: fewer memory '
                             're-plans and, on GPUs, cuDNN autotunes; pixels near the border see more '
                             'reflected context')
    parser.add_argument('--progress', action=argparse.BooleanOptionalAction, default=True,
                        help='progress bar and summary line')
    parser.add_argument('--overwrite', action='store_true',
                        help='--output holds predictions by another model or with other settings (its %s '
                             'says): remove the files it lists, then predict. Without it such a folder is refused, '
                             'so two models\' outputs never mix; files gluon_unet did not write are never '
                             'replaced' % MANIFEST)
    parser.add_argument('--allow-failures', action='store_true',
                        help='exit 0 even if some images could not be read or written (they are '
                             'listed on stderr either way; the others are always written). If every '
                             'image fails the exit code is 2 regardless')
    return parser


@reports_errors
def main(argv=None):
    """``bin/predict``: segment images with an exported model. Returns the exit code."""
    args = build_parser().parse_args(argv)
    config = PredictConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PredictConfig)})
    result = predict_paths(args.model, args.input, args.output, config)
    if result.failures:
        print('%s: %s' % ('warning' if args.allow_failures else 'error', result.summary()), file=sys.stderr)
        return 0 if args.allow_failures else 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
