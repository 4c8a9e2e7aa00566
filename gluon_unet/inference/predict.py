"""``bin/predict``: segment image files with an exported model and write the results.

Inference is split in modules, as nnU-Net does:

* :mod:`gluon_unet.inference.tiling` - sliding-window geometry, pure numpy: the ``resize``,
  ``tile`` and ``whole`` modes, tile positions, padding to multiples of ``2**depth``,
  blending weights;
* :mod:`gluon_unet.inference.batched` - batched network application: load an export once, run
  batches of equal-shape inputs over the devices, TTA; :func:`predict_image` for one
  image in memory;
* :mod:`gluon_unet.inference.postprocess` - probabilities to instance labels;
* this module - a run over files, with the options of :class:`PredictConfig` (``bin/predict``'s,
  in :mod:`gluon_unet.inference.configs`): find the inputs, read them, stream them through
  the model, post-process each image as soon as its probabilities are complete;
* :mod:`gluon_unet.inference.predict_outputs` - what that writes: masks, instance labels, overlays, the
  failures, the output folder's :class:`~gluon_unet.inference.predict_outputs.Manifest` (which model
  wrote which files); :mod:`gluon_unet.inference.submission` the DSB submission CSV.

Inputs are the uint8 image / 255, as in training (16-bit and float images are
percentile-scaled to uint8 first by :mod:`gluon_unet.data.io`), after the model's
``--normalize`` (read from the export's sidecar) is applied to the whole image, with the
channel conversion, by the function training uses (:func:`~gluon_unet.data.io.input_image`).
"""
import contextlib
import dataclasses
import os
import sys
import time

import cv2
import numpy as np

from .. import models
from ..data.io import IMAGE_TYPES, image_kind, input_image, is_image_file, read_image
from ..data.layouts import dsb_image, is_dsb_sample
from ..errors import UserError
from ..outputs import check_apart, check_inputs, check_replaceable, lock_file, lock_folder
from ..paths import remove_leftovers
from ..utils import check_writable, write_errors
from .batched import ImageDone, load_model, match_channels, predict_image
from .configs import PredictConfig
from .export_int8 import check_support, int8_warning
from .postprocess import SECOND_MAPS
from .predict_outputs import (OUTPUT_SUFFIXES, Manifest, Predictions, backend_record, error_text, failure_summary,
                              model_record, stop_words, summary_line, tuning_note, write_image_outputs,
                              writes_there)
from .scale import estimate_diameter, range_factor, rescale_factor, resolve_diameter
from .sidecar import card_summary, find_export, tuned_prediction
from .submission import submission_rows, write_submission

#: Name endings of our outputs (and of masks in a paired folder): such a file is not an
#: input when the image it belongs to sits next to it.
DERIVED_SUFFIXES = ('_mask', '_labels', '_overlay')


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


# -- the whole run -------------------------------------------------------------------------

class _PredictionRun:
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
        self.diameter = resolve_diameter(config.diameter, model)
        self.markers = model.markers if config.markers is None else config.markers
        self.split = model.split if config.split is None else config.split
        if self.markers in SECOND_MAPS and model.second != self.markers:
            raise UserError('--markers %s needs a mask+%s model; this one predicts %s (use --markers %s or leave '
                            'it out)' % (self.markers, self.markers, 'the foreground only' if model.second is None
                                         else 'the foreground and two flow maps' if model.second == 'flow'
                                         else 'the foreground and a %s map' % model.second,
                                         'distance' if model.second is None else model.second + '|distance'))
        if self.markers == 'flow' and config.split is None and self.split == 'randomwalker':
            self.split = 'watershed'  # the search's walker went with the distance markers --markers flow replaced
        if self.split == 'randomwalker' and self.markers == 'flow':
            raise UserError("--split randomwalker floods from markers; this mask+flow model gathers its nuclei "
                            "along its flows (use --split watershed, or --markers distance --split randomwalker)")
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
        self.failures.append((index, {'id': image_id, 'image': path, 'error': error_text(exc, path)}))
        self.bar.update(1)

    def _jobs(self):
        for index, (image_id, path) in enumerate(self.files):
            try:
                yield from self._image_jobs(index, image_id, path)
            except Exception as exc:
                self._fail(index, image_id, path, exc)

    def _image_jobs(self, index, image_id, path):
        cfg = self.config
        stored = read_image(path, plane=cfg.plane)
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
        if self.diameter is not None:
            net_input, on_done = self._rescaled(rec, net_input, on_done, image_kind(stored))
        for job in self.model.image_jobs(net_input, cfg.mode, cfg.tta, cfg.overlap, on_done=on_done,
                                         buckets=cfg.buckets):
            yield ImageDone(guarded(job.fn)) if isinstance(job, ImageDone) else job

    def _rescaled(self, rec, net_input, on_done, kind):
        """``--diameter``: the network input resized so its nuclei reach the model at its
        training diameter, and an ``on_done`` that maps the probabilities back. ``kind``:
        the image's (as read), which ``--diameter range`` judges its nuclei's size by."""
        cfg, model = self.config, self.model
        if self.diameter in ('auto', 'range'):
            # A first pass at the image's own scale measures its nuclei.
            maps = predict_image(model.net, model.meta, net_input, model.ctxs, cfg.mode, batch_size=cfg.batch_size,
                                 overlap=cfg.overlap, buckets=cfg.buckets, maps=True)
            measured = estimate_diameter(self._instances(maps))
            del maps
        else:
            measured = float(self.diameter)
        if self.diameter == 'range':
            factor = range_factor(model.diameter, model.diameter_ranges, kind, measured)
        else:
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
        return self.model.instances(maps, **{k: getattr(self, k) for k in self.model.INSTANCE_SETTINGS})

    def settings(self):
        """What decides the outputs besides the model: the resolved post-processing and how
        the maps are predicted (a manifest's ``settings``)."""
        cfg = self.config
        return {'threshold': self.threshold, 'min_size': self.min_size, 'min_score': self.min_score,
                'marker': self.marker, 'h': self.h, 'markers': self.markers, 'split': self.split, 'mode': cfg.mode,
                'tta': cfg.tta, 'overlap': cfg.overlap, 'buckets': cfg.buckets, 'diameter': self.diameter,
                # Only when given: folders of before --plane keep matching their manifest.
                **({'plane': cfg.plane} if cfg.plane is not None else {}),
                # Only when int8: float32 folders of before it existed keep matching their manifest.
                **({'precision': cfg.precision} if cfg.precision != 'float32' else {})}

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
        write_image_outputs(rec, image, labels)
        if cfg.rle:
            self.rows.extend(submission_rows(rec['id'], labels))
        self.records.append(rec)
        self.bar.update(1)


def predict_paths(model, inputs, output_dir, config=None, **overrides):
    """Segment image files and write masks, instance labels, overlays and a submission.

    Parameters
    ----------
    model : str
        A shipped model's name (``'nuclei'``), run folder, export folder or export prefix
        (``.../model``).
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
        (:func:`~gluon_unet.outputs.check_apart`), an output folder the manifest rule refuses
        - or every image failed (nothing is written then).
        An image that cannot be read, predicted or written does not stop the others: it
        is listed in ``failures``, and the submission has the good images.
    """
    config = dataclasses.replace(config or PredictConfig(), **overrides).validate()
    model = models.resolve(model)  # a shipped model's name: its folder in the package
    # --model may be an export prefix (.../model), which is no file: checked when it is one.
    check_inputs([('--input', inputs, 'file|folder')] + ([('--model', model, 'file|folder')]
                                                         if os.path.lexists(model) else []))
    runtime, why, ctxs = _runtime(config, model)
    files = find_inputs(inputs)
    prefix = find_export(model)
    _check_outputs(output_dir, config, inputs, prefix)
    loaded = _load(model, config, runtime, why, ctxs)
    # Unless asked otherwise, predict the way the post-processing was chosen.
    mode, tta = tuned_prediction(loaded.meta)
    config = dataclasses.replace(config, mode=mode if config.mode is None else config.mode,
                                 tta=tta if config.tta is None else config.tta)
    # Both outputs held for the whole run: two predictions into one folder never mix.
    with lock_folder(output_dir, '--output', 'prediction folder'), \
            (lock_file(config.rle, '--rle') if config.rle else contextlib.nullcontext()):
        remove_leftovers(output_dir)  # ours now: what a prediction killed half way left
        run = _PredictionRun(loaded, files, output_dir, config)
        backend = backend_record(runtime, loaded)
        run.manifest = Manifest(output_dir, model_record(prefix, loaded, backend), run.settings(), config.overwrite)
        run.manifest.check(run.planned())
        if config.progress and card_summary(loaded.meta):
            print(card_summary(loaded.meta))
        note = tuning_note(loaded.meta, config.mode, config.tta)
        if config.progress and note:
            print(note, file=sys.stderr)
        if config.progress and config.plane is not None:  # said, since the outputs have no planes
            print('note: --plane %d: every stack (TIFF with several planes) is segmented as its plane %d'
                  % (config.plane, config.plane), file=sys.stderr)
        t0 = time.time()
        try:
            result = run.run()
        except BaseException as exc:
            # The record of what is there, and that the run did not end: never "complete".
            run.manifest.finish(stopped=stop_words(exc))
            raise
        run.manifest.finish()
    result.line = summary_line(result, time.time() - t0, loaded.ctxs, output_dir, config, run.inputs_per_device,
                               backend)
    if config.progress:
        print(result.line)
    return result


def _runtime(config, model):
    """``(runtime, why, ctxs)``: onnxruntime when --providers asks for it, when ``model``
    holds ``model.onnx`` without MXNet's files, or where mxnet cannot be imported (``why``
    says which), else MXNet on the contexts of --gpus/--cpus."""
    from ..machine.devices import make_contexts
    from .batched_onnx import predict_runtime
    runtime, why = predict_runtime(config.providers, model)
    if config.precision == 'int8':  # before any work: the probe is a fraction of a second
        if runtime != 'mxnet':
            raise UserError('--precision int8 runs on MXNet, but %s' % why)
        check_support('--precision int8')
    return runtime, why, make_contexts(config.gpus, config.cpus) if runtime == 'mxnet' else None


def _check_outputs(output_dir, config, inputs, prefix):
    """Refuse, before any work, outputs that are files where folders go (and back), that
    lie inside an input, that hold what is not ours, or that cannot be written."""
    if os.path.isfile(output_dir):
        raise UserError('--output %s: is a file, not a folder' % output_dir)
    if config.rle and os.path.isdir(config.rle):
        raise UserError('--rle %s: is a folder; give a CSV file name' % config.rle)
    check_apart([('--output', output_dir), ('--rle', config.rle)],
                [('--input', inputs), ('--model', os.path.dirname(prefix) or os.curdir)], 'predict',
                own=[('--output', output_dir, writes_there)])
    check_replaceable(config.rle, 'ImageId,EncodedPixels', '--rle', 'a DSB submission')
    # An unwritable output would otherwise be found after every image.
    check_writable(output_dir, '--output')
    if config.rle:
        check_writable(config.rle, '--rle', is_file=True)


def _load(model, config, runtime, why, ctxs):
    """The model, loaded once on MXNet's ``ctxs`` or on onnxruntime."""
    from .batched_onnx import load_onnx_model, runtime_line
    if runtime == 'mxnet':
        loaded = load_model(model, ctxs, config.precision)
        warning = int8_warning(loaded.meta) if config.precision == 'int8' else ''
        if warning:  # a variant the export's check could not vouch for: never silently
            print(warning, file=sys.stderr)
        return loaded
    loaded = load_onnx_model(model, config.gpus, config.cpus, providers=config.providers, why=why)
    if why:  # chosen on its own accord (no mxnet here), not by --providers: say so
        print(runtime_line(loaded, why), file=sys.stderr)
    return loaded


def _progress_bar(total, enabled):
    from tqdm import tqdm
    return tqdm(total=total, unit='img', desc='predict', disable=not enabled or total <= 1, file=sys.stderr)
