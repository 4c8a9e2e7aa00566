"""The napari dock widget: a model, an image layer, the post-processing, and a button.

:class:`SegmentWidget` is what the plugin's manifest (``napari.yaml``) names. The
widget (:class:`SegmentPanel`, magicgui widgets in a container) opens on the shipped
``nuclei`` model (or the export folder chosen) on
onnxruntime (:class:`~gluon_unet.napari.segmenter.Segmenter`) and fills in its own
post-processing settings; *Segment* runs the selected image layer through it in a napari
worker thread (the viewer stays responsive; progress per batch of network inputs; *Cancel*
stops it between batches) and adds a Labels layer with the nuclei, and on request the
probability as an Image layer. A second *Segment* on the same image with only the threshold,
h or minimum size changed re-runs only the watershed. A bad export, a layer the model cannot
take, a missing ``model.onnx`` are a one-line napari notification, never a traceback.

*Fine-tune* (:mod:`.finetune`): the image and its corrected Labels layer are saved as a
training pair in a folder of the user's choice, ``bin/train --init CURRENT`` runs in the
MXNet environment (a Python set once in the widget), with progress and *Cancel*, and the
new export is loaded when it is done; without an MXNet Python the pairs are saved and the
command to run is shown.

napari, magicgui and Qt are imported inside the functions that use them: the package (and
this module) import in an environment without napari, such as the MXNet one.
"""
import os

from .. import models
from ..errors import DEBUG_VARIABLE, UserError, unexpected_error
from . import finetune
from .segmenter import Segmenter, Settings, layer_image

#: What the widget calls itself in messages.
WHO = 'gluon_unet napari widget'
#: The metadata key marking the layers the widget made (only those are updated in place).
MARK = 'gluon_unet'
#: The model choice that means "the folder below" rather than a shipped model.
FOLDER = 'folder below'
#: Outline width (pixels) of a new labels layer: outlines, not filled labels.
LABEL_OUTLINE = 2


class Failure:
    """What a worker returns instead of raising: one line for the viewer."""

    def __init__(self, message):
        self.message = message


def _failure(exc):
    """A :class:`Failure` for ``exc``: a UserError's own line; anything else is a bug, said
    in one line (its traceback on stderr with ``GLUON_UNET_DEBUG=1``)."""
    if isinstance(exc, UserError):
        return Failure(str(exc))
    return Failure(unexpected_error(WHO, exc, os.environ.get(DEBUG_VARIABLE, '') not in ('', '0')))


def load_work(path):
    """Worker: the :class:`Segmenter` of ``path``, or a :class:`Failure`."""
    try:
        return Segmenter(path)
    except Exception as exc:  # noqa: BLE001 - the worker's boundary: one line, never a traceback
        return _failure(exc)


def segment_work(segmenter, path, data, rgb, name, settings, tta):
    """Worker (a generator): loads ``path`` unless ``segmenter`` is its model, then
    segments the layer's ``data``; yields ``(done, total)``, returns ``(segmenter,
    Result)`` or a :class:`Failure`."""
    try:
        if segmenter is None or segmenter.path != path:
            segmenter = Segmenter(path)
        image = layer_image(data, rgb, name)
        result = yield from segmenter.segment(image, settings, tta=tta)
        return segmenter, result
    except Exception as exc:  # noqa: BLE001 - as load_work (GeneratorExit, a cancel, is not caught)
        return _failure(exc)


def prepare_pair_work(folder, name, data, rgb, labels, python):
    """Worker: save the training pair, check the MXNet Python; returns ``(image path,
    why the Python cannot train or '')`` or a :class:`Failure`."""
    try:
        saved = finetune.save_pair(folder, name, layer_image(data, rgb, name), labels)
        return saved, finetune.check_python(python)
    except Exception as exc:  # noqa: BLE001 - the worker's boundary
        return _failure(exc)


def train_work(argv, log_path):
    """Worker (a generator): ``bin/train`` as a subprocess; yields ``(epoch, planned)``,
    returns ``(exit code, last line)`` or a :class:`Failure`."""
    try:
        result = yield from finetune.run_training(argv, log_path)
        return result
    except OSError as exc:
        return _failure(UserError('cannot run %s: %s' % (argv[0], exc.strerror or exc)))


def _path_of(file_edit):
    """A FileEdit's path, '' when none is chosen (magicgui shows an empty one as '.')."""
    value = file_edit.value
    return '' if value is None or str(value) in ('', '.') else str(value)


class SegmentWidget:
    """The manifest's widget (``gluon_unet.segment``): ``SegmentWidget(viewer)`` is the
    docked container of a :class:`SegmentPanel` for that viewer."""

    def __new__(cls, napari_viewer):
        return SegmentPanel(napari_viewer).container

    def __init__(self, napari_viewer):
        # Never runs (__new__ returns the container): napari passes the viewer to a widget
        # whose __init__ names a ``napari_viewer`` parameter, and reads only that signature.
        pass


class SegmentPanel:
    """The widget's parts and what they do; :attr:`container` is what napari docks.

    Parameters
    ----------
    viewer : napari.Viewer
    """

    def __init__(self, viewer):
        from magicgui import widgets
        from qtpy.QtCore import QTimer
        self.viewer, self.segmenter, self.worker, self.result = viewer, None, None, None
        self._then, self.command = None, None  # the next stage of a fine-tune; its bin/train command
        self._settings_of = None  # the model whose settings the fields hold
        w = widgets
        shipped = [name for name in models.names() if models.folder(name)]
        self.choice = w.ComboBox(label='model', choices=shipped + [FOLDER], value=(shipped or [FOLDER])[0],
                                 tooltip='a model shipped with gluon_unet (gluon-unet models lists them), or the '
                                         'export in the folder below')
        self.model = w.FileEdit(mode='d', label='folder', tooltip='run folder, export folder, or a folder with an '
                                'export\'s model.onnx and model.json')
        self.layer = w.ComboBox(label='image', choices=self._image_layers, tooltip='a 2-D grey or colour image layer')
        self.threshold = w.FloatSpinBox(label='threshold', min=0.01, max=0.99, step=0.01, value=0.5,
                                        tooltip='foreground probability cut (bin/predict --threshold)')
        self.h = w.FloatSpinBox(label='watershed h', min=0.01, max=1000.0, step=0.1, value=0.5,
                                tooltip='how much deeper than its surroundings, in pixels of distance, a nucleus '
                                        'centre must be to seed its own object (bin/predict --h)')
        self.min_size = w.SpinBox(label='min size', min=0, max=10 ** 9, value=0,
                                  tooltip='drop objects under this many pixels (bin/predict --min-size)')
        self.diameter = w.LineEdit(label='diameter', value='none',
                                   tooltip='range | auto | PIXELS | none: rescale the image so its nuclei reach the '
                                           'network at its training size (bin/predict --diameter)')
        self.tta = w.CheckBox(text='TTA: average 8 flips and turns (8x the time)', value=False)
        self.probability = w.CheckBox(text='add the probability as an image layer', value=False)
        self.run_button = w.PushButton(text='Segment')
        self.cancel_button = w.PushButton(text='Cancel', enabled=False)
        self.pairs = w.FileEdit(mode='d', label='training pairs',
                                tooltip='Fine-tune saves the image and its corrected labels here (name.png + '
                                        'name_mask.png, what bin/train --data reads); runs go beside it')
        self.python = w.FileEdit(mode='r', label='MXNet Python', value=finetune.remembered_python() or None,
                                 tooltip='the python of an environment with gluon_unet and MXNet (pip install -r '
                                         'requirements.txt); kept for next time. Empty: the pairs are saved and '
                                         'the command to run is shown')
        self.finetune_button = w.PushButton(text='Fine-tune on the corrected labels')
        self.progress = w.ProgressBar(min=0, max=1, value=0, label='progress')
        self.status = w.Label(value='choose a model')
        self.container = w.Container(widgets=[self.choice, self.model, self.layer, self.threshold, self.h,
                                              self.min_size, self.diameter, self.tta, self.probability,
                                              self.run_button, self.cancel_button, self.pairs, self.python,
                                              self.finetune_button, self.progress, self.status])
        self.container.native._gluon_unet_panel = self  # napari holds the widget, the widget holds this
        # Typing a path fires on every key: load once it stops changing. The timer is the
        # widget's child, so it goes with the widget (a closed viewer loads nothing).
        self._load_timer = QTimer(self.container.native)
        self._load_timer.setSingleShot(True)
        self._load_timer.setInterval(400)
        self._load_timer.timeout.connect(self.load)
        self.model.changed.connect(lambda *_: self._folder_chosen())
        self.choice.changed.connect(lambda *_: self._load_timer.start())
        self.run_button.changed.connect(lambda *_: self.run())
        self.finetune_button.changed.connect(lambda *_: self.fine_tune())
        self.cancel_button.changed.connect(lambda *_: self.cancel())
        for event in (viewer.layers.events.inserted, viewer.layers.events.removed, viewer.layers.events.reordered):
            event.connect(lambda *_: self.layer.reset_choices())
        if self.choice.value != FOLDER:  # open on the shipped model: segment before training anything
            self._load_timer.start()

    # -- choices and messages ------------------------------------------------------------------

    def _image_layers(self, *_):
        from napari.layers import Image
        return [(layer.name, layer) for layer in self.viewer.layers
                if isinstance(layer, Image) and not layer.metadata.get(MARK)]

    def notify(self, message, error=True):
        """A napari notification (and the status line)."""
        from napari.utils.notifications import show_error, show_info
        self.status.value = message if len(message) < 120 else message[:117] + '...'
        (show_error if error else show_info)(message)

    def _path(self):
        if self.choice.value != FOLDER:
            return models.folder(self.choice.value) or ''
        return _path_of(self.model)

    def _folder_chosen(self):
        """A folder typed or picked: it is the model now."""
        if _path_of(self.model):
            self.choice.value = FOLDER
        self._load_timer.start()

    def _busy(self, busy):
        self.run_button.enabled = not busy
        self.finetune_button.enabled = not busy
        self.cancel_button.enabled = busy

    # -- loading --------------------------------------------------------------------------------

    def load(self):
        """Load the chosen export in a worker, then show its settings."""
        from napari.qt.threading import create_worker
        self._load_timer.stop()
        path = self._path()
        if not path or self.worker is not None or (self.segmenter and self.segmenter.path == path):
            return
        self.status.value = 'loading %s ...' % path
        self._start(create_worker(load_work, path, _start_thread=False, _ignore_errors=True), self._loaded)

    def _loaded(self, segmenter):
        if isinstance(segmenter, Failure):
            self.notify(segmenter.message)
            return
        self._use(segmenter)
        self.status.value = segmenter.summary()

    def _use(self, segmenter):
        """Make ``segmenter`` the widget's model; its own settings fill the fields."""
        self.segmenter = segmenter
        if self._settings_of == segmenter.path:
            return
        d = segmenter.defaults()
        self.threshold.value, self.h.value, self.min_size.value = d.threshold, d.h, d.min_size
        self.diameter.value = d.diameter
        self.tta.value = segmenter.model.prediction()[1]  # as its post-processing was chosen
        self._settings_of = segmenter.path

    # -- segmenting -----------------------------------------------------------------------------

    def settings(self):
        """The fields' :class:`Settings`; None (the model's own) until a model filled them."""
        if self._settings_of is None or self._settings_of != self._path():
            return Settings()
        return Settings(self.threshold.value, self.h.value, int(self.min_size.value), self.diameter.value)

    def run(self):
        """Segment the chosen layer (the button's action)."""
        from napari.qt.threading import create_worker
        if self.worker is not None:
            return
        path, layer = self._path(), self.layer.value
        if not path:
            return self.notify('choose a model: a run folder or an export folder')
        if layer is None:
            return self.notify('open an image first: there is no image layer to segment')
        worker = create_worker(segment_work, self.segmenter, path, layer.data, layer.rgb, layer.name,
                               self.settings(), self.tta.value, _start_thread=False, _ignore_errors=True)
        worker.yielded.connect(self._progress)
        worker.aborted.connect(lambda: self.notify('cancelled: nothing was added', error=False))
        self.status.value = 'segmenting %s ...' % layer.name
        self._start(worker, lambda out: self._show(out, layer))

    def cancel(self):
        """Stop the running segmentation between two batches."""
        if self.worker is not None and hasattr(self.worker, 'quit'):
            self.status.value = 'cancelling ...'
            self.worker.quit()

    # -- fine-tuning ----------------------------------------------------------------------------

    def labels_of(self, layer):
        """The Labels layer of ``layer``'s nuclei as the user corrected it (the widget's
        ``<image> nuclei`` layer), or None."""
        from napari.layers import Labels
        name = '%s nuclei' % layer.name
        return next((x for x in self.viewer.layers if isinstance(x, Labels) and x.name == name), None)

    def fine_tune(self):
        """Save the image and its corrected labels as a training pair, then fine-tune the
        current model on the pairs folder (the button's action)."""
        import numpy as np
        from napari.qt.threading import create_worker
        if self.worker is not None:
            return
        model, layer = self._path(), self.layer.value
        if not model:
            return self.notify('choose the model to fine-tune')
        if layer is None:
            return self.notify('open an image first: there is no image layer to train on')
        labels = self.labels_of(layer)
        if labels is None:
            return self.notify('segment %r first and correct its labels layer %r: those are what it trains on'
                               % (layer.name, '%s nuclei' % layer.name))
        pairs = _path_of(self.pairs)
        if not pairs:
            return self.notify('choose a folder for the training pairs')
        python = _path_of(self.python)
        if python:
            finetune.remember_python(python)
        worker = create_worker(prepare_pair_work, pairs, layer.name, layer.data, layer.rgb, np.asarray(labels.data),
                               python, _start_thread=False, _ignore_errors=True)
        self.status.value = 'saving the training pair ...'
        self._start(worker, lambda out: self._prepared(out, model, pairs, python))

    def _prepared(self, out, model, pairs, python):
        if isinstance(out, Failure):
            return self.notify(out.message)
        saved, why = out
        output = finetune.next_output(pairs)
        argv = finetune.train_command(python, model, pairs, output)
        self.command = finetune.shown_command(argv)
        if why:  # no MXNet here: the pairs are saved, the user runs it
            return self.notify('saved %s; %s. In an environment with MXNet run: %s' % (saved, why, self.command),
                               error=False)
        self._then = lambda: self._train(argv, output)

    def _train(self, argv, output):
        from napari.qt.threading import create_worker
        log = output + '.log'
        worker = create_worker(train_work, argv, log, _start_thread=False, _ignore_errors=True)
        worker.yielded.connect(self._epoch)
        worker.aborted.connect(lambda: self.notify('fine-tuning cancelled; its checkpoint is in %s: the same command '
                                                   'with --resume auto continues it (%s)' % (output, log),
                                                   error=False))
        self.progress.value, self.status.value = 0, 'fine-tuning %s ... (log: %s)' % (os.path.basename(output), log)
        self._start(worker, lambda out: self._trained(out, output, log))

    def _epoch(self, step):
        epoch, total = step
        self.progress.max = max(1, total)
        if epoch is not None:
            self.progress.value = min(epoch, total)
            self.status.value = 'fine-tuning: epoch %d of %d' % (epoch, total)

    def _trained(self, out, output, log):
        if isinstance(out, Failure):
            return self.notify(out.message)
        code, last = out
        if code:
            return self.notify('fine-tuning failed (exit %d): %s (log: %s)' % (code, last, log))
        self.model.value = os.path.join(output, 'export')  # the new model: loaded like a chosen folder
        self.notify('fine-tuned: %s' % os.path.join(output, 'export'), error=False)

    def _start(self, worker, on_return):
        self.worker = worker
        worker.returned.connect(on_return)
        worker.finished.connect(self._finished)
        self._busy(True)
        worker.start()

    def _finished(self):
        self.worker = None
        self._busy(False)
        then, self._then = self._then, None
        if then is not None:  # the next stage of a fine-tune, once this worker is done
            then()

    def _progress(self, step):
        done, total = step
        self.progress.max = max(1, total)
        self.progress.value = done

    def _show(self, out, layer):
        if isinstance(out, Failure):
            self.notify(out.message)
            return
        segmenter, result = out
        self._use(segmenter)
        self.result = result
        count = int(result.labels.max())
        # The probability first, so that a new one lies under the labels (and starts hidden).
        if self.probability.value:
            self._put('image', '%s probability' % layer.name, result.maps[0], layer)
        self._put('labels', '%s nuclei' % layer.name, result.labels, layer)
        rescaled = ', rescaled x%.2f' % result.scale if result.scale != 1.0 else ''
        self.status.value = ('%d nuclei in %.2f s%s%s' % (count, result.seconds, rescaled, '' if result.predicted
                                                          else ' (post-processing only)'))

    def _put(self, kind, name, data, source):
        """Update the widget's own layer ``name`` (never one the user made), else add it
        aligned with ``source``."""
        for existing in self.viewer.layers:
            if existing.name == name and existing.metadata.get(MARK) == kind:
                existing.data = data
                return existing
        # A new layer's look (a layer already there keeps the user's): outlines, so the
        # nuclei stay visible under them, and the probability hidden until asked for.
        add = self.viewer.add_labels if kind == 'labels' else self.viewer.add_image
        extra = {} if kind == 'labels' else {'colormap': 'magma', 'contrast_limits': (0, 1), 'blending': 'additive',
                                             'visible': False}
        added = add(data, name=name, scale=source.scale, translate=source.translate, metadata={MARK: kind}, **extra)
        if kind == 'labels':
            added.contour = LABEL_OUTLINE
        return added
