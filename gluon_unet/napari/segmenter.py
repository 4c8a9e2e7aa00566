"""The napari widget's work, without Qt: an export's ``model.onnx`` on onnxruntime applied
to one image in memory, as ``bin/predict`` applies it to a file.

:class:`Segmenter` loads the export as ``bin/predict``'s ONNX path does
(:func:`~gluon_unet.inference.batched_onnx.load_onnx_model`: the same sidecar checks, digests
and settings) and segments an image with the same steps: the channel conversion and
normalization of training (:func:`~gluon_unet.data.io.input_image`), the tiling of
:func:`~gluon_unet.inference.batched.image_jobs`, ``--diameter``'s rescaling and the
instance step (:meth:`~gluon_unet.inference.batched.LoadedModel.instances`: the export's tuned
split and markers), so its labels are ``bin/predict``'s on the same pixels.
:meth:`Segmenter.segment` is a generator that yields progress between batches of network
inputs (where napari's worker can stop it) and keeps the probability maps of the last image:
changing only the post-processing (threshold, h, minimum size) re-runs only the instance step.

Nothing here imports mxnet or Qt.
"""
import hashlib
import os
import time
from dataclasses import dataclass
from typing import Optional

import cv2
import numpy as np

from .. import models
from ..data.io import image_array, image_kind, input_image
from ..data.sizes import diameter_choice_error
from ..errors import UserError
from ..inference.batched import InputJob, match_channels
from ..inference.batched_onnx import load_onnx_model
from ..inference.scale import estimate_diameter, range_factor, rescale_factor, resolve_diameter
from ..inference.sidecar import card_summary, find_export
from ..inference.tiling import TTA_ORDER, plan_image

#: Network inputs run between two progress reports (a multiple of the batch size, so the
#: batches are those ``bin/predict`` forms from the same image).
BATCHES_PER_STEP = 2


@dataclass
class Settings:
    """The post-processing and ``--diameter`` the widget shows, editable; ``None`` = the
    model's own (chosen on validation after training, else the training defaults)."""
    threshold: Optional[float] = None
    h: Optional[float] = None
    min_size: Optional[int] = None
    diameter: Optional[str] = None  # range | auto | PIXELS | none, as bin/predict --diameter


@dataclass
class Result:
    """One segmentation: the instance ``labels`` (H, W) int32, the probability ``maps``
    (K, H, W) float32 they come from, how long it took and whether the network ran
    (``predicted``) or only the post-processing."""
    labels: np.ndarray
    maps: np.ndarray
    seconds: float
    predicted: bool
    scale: float = 1.0


def layer_image(data, rgb, name):
    """A napari image layer's data as ``bin/predict`` reads an image file: (H, W, C) uint8.

    napari says which layers are colour (``rgb``): a 2-D grey plane or an RGB(A) one is
    taken; anything else (a stack, a grey layer of 3 planes) is refused in one line naming
    the layer. The pixels are converted by the one conversion of every image,
    :func:`~gluon_unet.data.io.image_array` (alpha dropped, other types than uint8 scaled by
    per-image percentiles; NaN or infinite pixels refused), as a file of that type is.
    """
    arr = np.asarray(data)
    shape = 'x'.join(str(n) for n in arr.shape)
    if not (arr.ndim == 2 and not rgb or rgb and arr.ndim == 3 and arr.shape[2] in (3, 4)):
        raise UserError('layer %r: the widget segments one 2-D image, grey or colour (RGB); this layer is %s%s'
                        % (name, shape, ' (a stack: choose or extract one plane)' if arr.ndim > 2 else ''))
    return image_array(arr, 'layer %r' % name)


class Segmenter:
    """An export loaded on onnxruntime, and the probability maps of the last image it saw.

    Parameters
    ----------
    model : str
        A run folder (its ``export/``), an export folder, or a folder holding only an
        export's ``model.onnx`` and ``model.json``.
    threads : int, optional
        onnxruntime's threads (default ``$OMP_NUM_THREADS``, else all cores).

    Raises
    ------
    UserError
        No export there, no (or a damaged) ``model.onnx``, no onnxruntime: one line.
    """

    def __init__(self, model, threads=None):
        self.path = models.resolve(str(model or '').strip())  # a shipped model's name: its folder
        if not self.path or self.path == '.' or not os.path.exists(self.path):
            raise UserError('model %s: no such folder; choose a run folder or an export folder'
                            % (self.path or '(none chosen)'))
        self.folder = os.path.dirname(os.path.abspath(find_export(self.path)))
        self.model = load_onnx_model(self.path, threads=threads)
        self._maps = {}  # (image key, scale) -> maps: the last image's only

    def defaults(self):
        """The model's own :class:`Settings` (what ``bin/predict`` uses without flags)."""
        m = self.model
        return Settings(threshold=m.threshold, h=m.h, min_size=m.min_size, diameter=m.predict_diameter or 'none')

    def summary(self):
        """One line about the model: its card, else its folder."""
        return card_summary(self.model.meta) or 'model: %s' % self.folder

    def resolved(self, settings):
        """``settings`` with the model's own values where they are None; refused in one
        line when a value is out of range or the model cannot be rescaled to ``diameter``."""
        d = self.defaults()
        s = Settings(*(d.__dict__[k] if v is None else v for k, v in settings.__dict__.items()))
        if not 0 < float(s.threshold) < 1:
            raise UserError('threshold must be in (0, 1) (got %s)' % s.threshold)
        if not (np.isfinite(float(s.h)) and float(s.h) > 0):
            raise UserError('h must be a number > 0 (got %s)' % s.h)
        if int(s.min_size) < 0:
            raise UserError('min size must be >= 0 (got %s)' % s.min_size)
        s.diameter = str(s.diameter).strip() or 'none'
        if diameter_choice_error(s.diameter):
            raise UserError('diameter %s' % diameter_choice_error(s.diameter))
        resolve_diameter(s.diameter, self.model)  # refuses a model that cannot be rescaled
        return s

    def instances(self, maps, settings):
        """Instance labels of probability ``maps`` with ``settings`` (resolved)."""
        # The model's own split, markers and min score: the export's, as bin/predict's.
        return self.model.instances(maps, threshold=float(settings.threshold), min_size=int(settings.min_size),
                                    h=float(settings.h))

    def segment(self, image, settings=None, tta=None, mode=None, overlap=0.25, batch_size=8):
        """Segment an (H, W, C) uint8 image (:func:`layer_image`): a generator.

        Yields ``(done, total)`` network inputs as they are computed, and returns the
        :class:`Result`. The network runs only when the image, ``tta``, ``mode``,
        ``overlap`` or the rescaling ``settings.diameter`` asks for differ from the last
        call's; else only the post-processing does. ``tta`` and ``mode`` None: as the
        export's post-processing was chosen (``bin/predict``'s defaults).
        """
        t0 = time.time()
        settings = self.resolved(settings or Settings())
        m = self.model
        tuned_mode, tuned_tta = m.prediction()
        mode, tta = tuned_mode if mode is None else mode, tuned_tta if tta is None else tta
        net_input = input_image(image, m.channels, m.normalize, m.denoise,
                                convert=lambda img, channels: match_channels(img, channels, 'the image'))
        key = (hashlib.sha1(net_input.tobytes()).hexdigest(), net_input.shape, mode, bool(tta), float(overlap))
        if any(k[0] != key for k in self._maps):
            self._maps = {}  # another image: only the last one's maps are kept
        before = len(self._maps)
        diameter = resolve_diameter(settings.diameter, m)
        scale = 1.0
        if diameter is None:
            maps = yield from self._maps_at(net_input, key, 1.0, batch_size)
        else:
            if diameter in ('auto', 'range'):  # a first pass at the image's own scale measures its nuclei
                first = yield from self._maps_at(net_input, key, 1.0, batch_size)
                measured = estimate_diameter(self.instances(first, settings))
            else:
                measured = float(diameter)
            scale = range_factor(m.diameter, m.diameter_ranges, image_kind(image), measured) \
                if diameter == 'range' else rescale_factor(m.diameter, measured)
            maps = yield from self._maps_at(net_input, key, scale, batch_size)
        labels = self.instances(maps, settings)
        return Result(labels, maps, time.time() - t0, predicted=len(self._maps) > before, scale=scale)

    def _maps_at(self, net_input, key, scale, batch_size):
        """The maps of ``net_input`` rescaled by ``scale`` (and back), from the cache or the
        network (a generator, as :meth:`segment`)."""
        if (key, scale) in self._maps:
            return self._maps[key, scale]
        _, _, mode, tta, overlap = key
        if scale == 1.0:
            maps = yield from self._predict(net_input, mode, tta, overlap, batch_size)
        else:
            # As bin/predict --diameter: area averaging to shrink, linear to enlarge, and the
            # maps back to the image's own pixels linearly.
            h, w = net_input.shape[:2]
            size = (max(1, int(round(w * scale))), max(1, int(round(h * scale))))
            scaled = cv2.resize(net_input, size, interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)
            small = yield from self._predict(scaled.reshape(size[1], size[0], -1), mode, tta, overlap, batch_size)
            maps = np.stack([cv2.resize(p, (w, h), interpolation=cv2.INTER_LINEAR) for p in small])
        self._maps[key, scale] = maps
        return maps

    def _predict(self, net_input, mode, tta, overlap, batch_size):
        """The (K, H, W) maps of one network input image, yielding progress between steps
        of :data:`BATCHES_PER_STEP` batches (where a napari worker may stop it)."""
        m, out = self.model, {}
        total = len(plan_image(net_input, m.meta, mode, overlap).corners) * (len(TTA_ORDER) if tta else 1)
        jobs = m.image_jobs(net_input, mode, tta, overlap, on_done=lambda maps, used: out.update(maps=maps))
        step, chunk, count, done = batch_size * BATCHES_PER_STEP * len(m.ctxs), [], 0, 0
        yield 0, total
        for job in jobs:
            chunk.append(job)
            count += isinstance(job, InputJob)
            if count == step:
                m.run(iter(chunk), batch_size)
                done += count
                chunk, count = [], 0
                yield done, total
        m.run(iter(chunk), batch_size)  # the last inputs and the image's end
        yield total, total
        return out['maps']
