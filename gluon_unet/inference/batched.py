"""Batched network application: an exported model, loaded once, run over the devices.

:func:`load_model` loads an export (:func:`load_exported`: the network, checked against
its sidecar) and everything its sidecar says about its inputs (a :class:`LoadedModel`).
:func:`image_jobs` turns one image into fixed-shape network inputs (the windows of its
:func:`~gluon_unet.inference.tiling.plan_image`, times the TTA symmetries), and :func:`run_jobs`
streams such jobs - across images - in batches of equal-shape inputs spread over the
devices round-robin with work in flight on each (a batch smaller than the device count,
such as one ``whole``-mode image, goes to the next device, not always the first), so the
devices stay busy and memory stays at a batch per device whatever the image size.
:func:`predict_image` does it all for one image in memory. Inputs are the uint8 image /
255, as in training.
"""
import contextlib
import os
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import UserError, mxnet_message
from ..machine.runtime import settle_amx
from .postprocess import DEFAULT_MARKER, instances_from_maps
from .sidecar import (INT8_PARAMS, INT8_SYMBOL, ONNX, PARAMS, SIDECAR, SYMBOL, find_export, read_sidecar,
                      tuned_prediction, verify_export)
from .tiling import TTA_ORDER, Canvas, dihedral, plan_image, second_map


class InputJob:
    """One network input and what to do with its (H, W) probabilities."""
    __slots__ = ('input', 'callback')

    def __init__(self, inp, callback):
        self.input, self.callback = inp, callback


class ImageDone:
    """Marks the end of one image's jobs: ``fn`` runs once all of them are computed."""
    __slots__ = ('fn',)

    def __init__(self, fn):
        self.fn = fn


def image_jobs(image, meta, mode='auto', tta=False, overlap=0.25, on_done=None, buckets=False):
    """The network inputs of one image, then a :class:`ImageDone` that yields its probabilities.

    Parameters
    ----------
    image : (H, W, C) uint8
        Channels already matching the model.
    meta : dict
        Export sidecar (``train_size``, ``multiple``, ``resize_mode``).
    mode, overlap
        See :func:`~gluon_unet.inference.tiling.plan_image`.
    tta : bool
        Also run the 7 other flips/quarter turns of every window, grouped by shape
        (:data:`~gluon_unet.inference.tiling.TTA_ORDER`): the 4 that keep a window's (H, W), then
        the 4 that give (W, H).
    on_done : callable
        ``on_done(maps (K, H, W) float32, mode)`` once every job of the image has run: the
        foreground probability, and for a two-map model its second map.
    buckets : bool
        ``whole`` mode: pad to :func:`~gluon_unet.inference.tiling.bucket_side` sizes.
    """
    plan = plan_image(image, meta, mode, overlap, buckets)
    # Held in a dict the last step empties: this generator stays suspended at its last
    # yield while ``on_done`` post-processes, and must not keep the canvas alive meanwhile.
    state = {'canvas': Canvas(*plan.source.shape[1:], flow=second_map(meta) == 'flow'), 'plan': plan}
    weight = plan.weight
    for y, x, window in plan.windows():
        for k, flip in (TTA_ORDER if tta else TTA_ORDER[:1]):
            def add(prob, y=y, x=x, k=k, flip=flip):
                state['canvas'].add(prob, y, x, k, flip, weight)
            yield InputJob(np.ascontiguousarray(dihedral(window, k, flip)), add)
    del plan, window

    def finish():
        canvas, done = state.pop('canvas'), state.pop('plan')
        maps, used = np.ascontiguousarray(done.to_image(canvas.result()), np.float32), done.mode
        del canvas, done  # only the maps stay while on_done post-processes
        on_done(maps, used)
    yield ImageDone(finish)


class Scheduler:
    """Runs batches of equal-shape jobs over the devices round-robin, keeping work in
    flight on every device; subclasses say how a part is issued to a device
    (:meth:`_issue`) and read back (:meth:`_result`): :class:`MXNetScheduler` here,
    :class:`~gluon_unet.inference.batched_onnx.OnnxScheduler` for onnxruntime.

    A batch of ``m`` jobs is split over ``min(m, n)`` of the ``n`` devices, starting at
    the device after the last one used (parts as ``split_and_load(even_split=False)``
    sizes them: the first get one more), so a stream of single-image batches - ``whole``
    mode, where every image has its own shape - goes to device 0, 1, ..., n-1, 0, ...
    instead of always to the first. Issuing a part does not wait for its result (MXNet's
    engine is asynchronous; onnxruntime runs it on the device's thread), so every part is
    issued before any result is read back, and results are read in the order they were
    issued. After a batch is issued, the oldest parts are read back until at most one part
    per device is still outstanding: each device has the part it is computing and the next
    one queued while the host post-processes.

    ``jobs_per_device`` and ``forwards_per_device`` count, per device, the network inputs
    it was given and the forward calls that carried them.
    """

    def __init__(self, n_devices, second=None):
        self.second = second
        self.next = 0  # the device the next part goes to
        self.pending = deque()  # [jobs, issued part, finishers] per part, in issue order
        self.jobs_per_device = [0] * n_devices
        self.forwards_per_device = [0] * n_devices

    def submit(self, jobs, finishers):
        n = len(self.jobs_per_device)
        used = min(len(jobs), n)
        x = np.stack([j.input for j in jobs])
        size, extra = divmod(len(jobs), used)
        start = 0
        with self._issuing():
            for i in range(used):
                stop = start + size + (i < extra)
                dev = (self.next + i) % n
                self.pending.append([jobs[start:stop], self._issue(x[start:stop], dev), []])
                self.jobs_per_device[dev] += stop - start
                self.forwards_per_device[dev] += 1
                start = stop
        self.next = (self.next + used) % n
        self.pending[-1][2].extend(finishers)
        while len(self.pending) > n:
            self._collect(self.pending.popleft())

    def after_pending(self, fn):
        """Run ``fn`` once every part issued so far is collected (now if there is none)."""
        if self.pending:
            self.pending[-1][2].append(fn)
        else:
            fn()

    def drain(self):
        while self.pending:
            self._collect(self.pending.popleft())

    def _collect(self, entry):
        jobs, issued, finishers = entry
        for job, p in zip(jobs, self._result(issued)):
            job.callback(p)
        for fn in finishers:
            fn()

    def _issuing(self):
        """A context around issuing a batch's parts."""
        return contextlib.nullcontext()

    def _issue(self, part, dev):
        """Start the network on ``part`` (N, C, H, W numpy) on device ``dev``; a handle."""
        raise NotImplementedError

    def _result(self, issued):
        """The (N, K, H, W) probability maps of an issued part, as numpy."""
        raise NotImplementedError


class MXNetScheduler(Scheduler):
    """:class:`Scheduler` for an MXNet network on ``ctxs``."""

    def __init__(self, net, ctxs, second=None):
        super().__init__(len(ctxs), second)
        self.net, self.ctxs = net, list(ctxs)

    def _issuing(self):
        import mxnet as mx  # here, not at the top: bin/predict on ONNX runs without mxnet (onnx_runner)
        return mx.autograd.predict_mode()

    def _issue(self, part, dev):
        import mxnet as mx

        from ..model import probability_maps
        # Made on the host, then copied by an engine operation: issuing never waits.
        part = mx.nd.array(part, ctx=mx.cpu()).as_in_context(self.ctxs[dev])
        return probability_maps(self.net(part), self.second)

    def _result(self, issued):
        return issued.asnumpy()


def run_jobs(net, ctxs, jobs, batch_size=8, second=None):
    """Run a stream of jobs in batches of equal-shape inputs over ``ctxs``.

    Each job's callback gets its (K, h, w) probability maps (:func:`~gluon_unet.model.
    probability_maps`; ``second`` for a two-map model: :func:`second_map`).

    Consecutive jobs of one shape form a batch of up to ``batch_size``; batches are
    spread over the devices round-robin with work in flight on each
    (:class:`Scheduler`). A :class:`ImageDone` runs once every job before it has been
    post-processed.

    Returns
    -------
    Scheduler
        Its ``jobs_per_device`` / ``forwards_per_device`` say how the work was spread.
    """
    # A network that brings its own scheduler (onnx_runner.OnnxNetwork) runs the batches itself.
    runner = net.scheduler(ctxs, second) if hasattr(net, 'scheduler') else MXNetScheduler(net, ctxs, second)
    batch, finishers = [], []
    for job in jobs:
        if isinstance(job, ImageDone):
            if batch:
                finishers.append(job.fn)
            else:
                runner.after_pending(job.fn)
            continue
        if batch and (len(batch) >= batch_size or job.input.shape != batch[0].input.shape):
            runner.submit(batch, finishers)
            batch, finishers = [], []
        batch.append(job)
    if batch:
        runner.submit(batch, finishers)
    runner.drain()
    return runner


def predict_image(net, meta, image, ctxs, mode='auto', tta=False, batch_size=8, overlap=0.25, buckets=False,
                  maps=False):
    """Foreground probabilities of one image at its original resolution.

    Parameters
    ----------
    net : Block
        The exported network (or any block giving logits), on ``ctxs``.
    meta : dict
        Export sidecar: ``train_size``, ``multiple``, ``resize_mode``.
    image : (H, W) or (H, W, C) uint8
        C must be the model's input channels (see :func:`match_channels`). Other
        types (uint16, float) are converted as ``bin/predict`` converts a file of that
        type (:func:`~gluon_unet.data.io.image_array`), in every mode.
    ctxs : list of mx.Context
    mode : {'auto', 'resize', 'tile', 'whole'}
    tta : bool
        Average the 8 flips/quarter turns (each un-done before averaging).
    batch_size : int
        Inputs per forward, split over the devices.
    overlap : float
        Tile mode: fraction of the tile shared with its neighbour.
    buckets : bool
        Whole mode: pad the image up to one of a few sizes per octave
        (:func:`~gluon_unet.inference.tiling.bucket_side`) instead of the next multiple of
        ``2**depth``, so many images share a few network shapes. The padding is cropped
        away; pixels farther than the receptive field from the border are unchanged, those
        nearer see more reflected context.
    maps : bool
        Return every output map (see below), not only the foreground.

    Returns
    -------
    (H, W) float32 in [0, 1]
        The foreground probability; with ``maps``, (K, H, W): the foreground, and for a
        two-map model (:func:`second_map`) its second map.
    """
    out = {}
    jobs = image_jobs(np.asarray(image), meta, mode, tta, overlap,
                      on_done=lambda prob, used: out.setdefault('prob', prob), buckets=buckets)
    run_jobs(net, list(ctxs), jobs, batch_size, second_map(meta))
    return out['prob'] if maps else out['prob'][0]


def match_channels(image, channels, path='image'):
    """Convert a (H, W, C) uint8 image to the model's ``channels``.

    Grey -> RGB repeats the channel and RGB -> grey takes the luma, the same conversions
    the training loader applies; any other combination is an error.
    """
    from ..data.io import to_channels

    c = image.shape[2]
    if c == channels:
        return image
    if channels in (1, 3) and c in (1, 3):
        return to_channels(image, channels)
    raise UserError('%s: image has %d channel%s but the model takes %d'
                    % (path, c, '' if c == 1 else 's', channels))


def model_channels(net, meta):
    """Input channels of an export: the sidecar's, else the first convolution's."""
    if meta.get('in_channels'):
        return int(meta['in_channels'])
    for p in net.collect_params().values():
        # SymbolBlock.imports leaves ``shape`` unset; the loaded data has it.
        shape = p.shape or (p.list_data()[0].shape if p._data is not None else ())
        if p.name.endswith('weight') and len(shape) == 4:
            return int(shape[1])
    raise UserError('cannot tell the input channels of the model (no model.json sidecar)')


@dataclass
class LoadedModel:
    """An export on its devices, with what its sidecar says about its inputs."""
    net: object
    meta: dict
    ctxs: list
    channels: int
    threshold: float
    normalize: str
    min_size: int = 0  # chosen on validation after training (sidecar 'postprocess'), else 0
    h: float = 0.5
    marker: float = 0.5  # two-map models: the marker setting (postprocess.DEFAULT_MARKER)
    second: Optional[str] = None  # a two-map model's second output (:func:`second_map`)
    denoise: float = 0.0  # Gaussian sigma before the percentile stretch (0: exports from before it)
    diameter: Optional[float] = None  # median nucleus diameter in training (px); None: not recorded
    markers: Optional[str] = None  # a two-map model's watershed markers: its second map's kind or 'distance'
    min_score: float = 0.0  # objects with a lower mean probability are dropped (tuned; 0 before it existed)
    diameter_ranges: Optional[dict] = None  # {kind: [low, high]} nucleus diameters in training (--diameter range)
    predict_diameter: Optional[str] = None  # the --diameter bin/predict uses when none is given (training's choice)
    split: str = 'watershed'  # the instance step the search chose ('randomwalker' or the watershed)

    #: The settings of the instance step (:meth:`instances`), each the model's own unless given.
    INSTANCE_SETTINGS = ('threshold', 'min_size', 'min_score', 'split', 'h', 'marker', 'markers')

    def instances(self, maps, **given):
        """Instance labels of this model's (K, H, W) probability ``maps``: the one instance
        step of ``bin/predict``, the napari widget and the bioimage.io cover. ``given``: any of
        :data:`INSTANCE_SETTINGS`; a missing or None one is the export's own (its tuned split
        and markers included), so no caller can drop one."""
        unknown = set(given) - set(self.INSTANCE_SETTINGS)
        if unknown:
            raise TypeError('unknown instance settings: %s' % ', '.join(sorted(unknown)))
        s = {k: getattr(self, k) if given.get(k) is None else given[k] for k in self.INSTANCE_SETTINGS}
        return instances_from_maps(maps, threshold=float(s['threshold']), min_size=int(s['min_size']),
                                   split=s['split'], h=float(s['h']), marker=float(s['marker']),
                                   markers=s['markers'], min_score=float(s['min_score']))

    def prediction(self):
        """``(mode, tta)`` the export's post-processing was chosen with (:func:`tuned_prediction`)."""
        return tuned_prediction(self.meta)

    def image_jobs(self, image, mode='auto', tta=False, overlap=0.25, on_done=None, buckets=False):
        """:func:`image_jobs` with this model's sidecar."""
        return image_jobs(image, self.meta, mode, tta, overlap, on_done, buckets)

    def run(self, jobs, batch_size=8):
        """:func:`run_jobs` on this model's devices; returns its :class:`_Scheduler`."""
        return run_jobs(self.net, self.ctxs, jobs, batch_size, self.second)


def load_exported(prefix_or_dir, ctx=None, precision='float32'):
    """Load an export with ``SymbolBlock.imports``.

    Parameters
    ----------
    prefix_or_dir : str
        The export folder, a run folder (uses ``<run>/export``), the ``.../model`` prefix or
        one of the export's files (its folder: :func:`~gluon_unet.inference.sidecar.find_export`).
    ctx : mx.Context or list, optional
    precision : {'float32', 'int8'}
        Which network of the export: the float32 model, or its int8 variant
        (:mod:`gluon_unet.inference.export_int8`, written by ``bin/export --int8``; CPU only).
        Loaded whatever its sidecar's ``int8.check`` says;
        :func:`~gluon_unet.inference.export_int8.int8_warning` words what that check cannot vouch for.

    Returns
    -------
    (SymbolBlock, dict)
        The network and its sidecar metadata.
    """
    import mxnet as mx
    prefix = find_export(prefix_or_dir)
    folder = os.path.dirname(prefix)
    if precision not in ('float32', 'int8'):
        raise UserError("--precision must be 'float32' or 'int8' (got %r)" % precision)
    names = (INT8_SYMBOL, INT8_PARAMS) if precision == 'int8' else (SYMBOL, PARAMS)
    symbol, params = (os.path.join(folder, name) for name in names)
    missing = [p for p in (prefix + '-symbol.json', prefix + '-0000.params') if not os.path.isfile(p)]
    if len(missing) == 2 and os.path.isfile(os.path.join(folder, ONNX)):
        raise UserError(_onnx_only(folder))
    if missing:
        raise UserError('export %s is incomplete: %s is missing' % (folder, os.path.basename(missing[0])))
    sidecar_path = os.path.join(folder, SIDECAR)
    meta = read_sidecar(sidecar_path) if os.path.isfile(sidecar_path) else {}
    if precision == 'int8':
        if not isinstance(meta.get('int8'), dict):
            raise UserError('--precision int8: the export %s has no int8 variant (%s); make one with bin/export '
                            'RUN --int8' % (folder or os.curdir, INT8_SYMBOL))
        for path in (symbol, params):
            if not os.path.isfile(path):
                raise UserError('export %s is incomplete: %s is missing' % (folder, os.path.basename(path)))
    verify_export(meta, dict(zip(names, (symbol, params))), sidecar_path)
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
                        % (folder, names[1], names[0], mxnet_message(exc))) from None
    settle_amx()  # mxnet is loaded: AMX (if on) is fixed for this process, out of the environment
    return net, meta


def _onnx_only(folder):
    """The one line for an export copied with ``model.onnx`` but without MXNet's files
    (for a machine without MXNet), met on MXNet: both ways to predict with it from here."""
    import importlib.util
    if importlib.util.find_spec('onnxruntime') is not None:
        onnx = 'add --providers cpu to predict with it on onnxruntime'
    else:
        # onnxruntime needs numpy >= 1.24, which MXNet 1.9.1 cannot import: not beside it.
        onnx = ('predict with it where onnxruntime is installed (pip install -r requirements-onnx.txt, in an '
                'environment without mxnet)')
    return ('export %s has %s but not MXNet\'s %s and %s: copy those beside it to predict with MXNet, or %s'
            % (folder or os.curdir, ONNX, SYMBOL, PARAMS, onnx))


def _load_export_file(path, load, what):
    """``load(path)``, or a one-line error naming the damaged file and what is wrong."""
    import mxnet as mx
    try:
        return load(path)
    except (mx.MXNetError, ValueError, UnicodeDecodeError) as exc:
        raise UserError('%s is damaged or truncated (%d bytes): %s: %s'
                        % (path, os.path.getsize(path), what, mxnet_message(exc, limit=120))) from None


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


def load_model(model, ctxs, precision='float32'):
    """Load an export (run folder, export folder or prefix) onto ``ctxs``, hybridized
    (``precision``: its float32 network or its int8 variant, see :func:`load_exported`).

    The threshold, watershed ``h`` and minimum object size are those chosen on the
    validation split after training when the sidecar has them (``postprocess``), else
    the training threshold (0.5 if unknown), 0.5 and 0; ``normalize`` the
    ``--normalize`` it was trained with ('none' for exports from before it existed), and
    ``denoise`` its denoise before the stretch (0 for exports from before that existed).
    """
    net, meta = load_exported(model, ctx=ctxs, precision=precision)
    net.hybridize(static_alloc=True)
    return loaded_model(net, meta, ctxs, model_channels(net, meta))


def loaded_model(net, meta, ctxs, channels):
    """The :class:`LoadedModel` of a loaded network and its sidecar ``meta`` (see
    :func:`load_model`); also for :func:`gluon_unet.inference.batched_onnx.load_onnx_model`."""
    # Exports from before --normalize existed have no key: they were trained without it.
    normalize = meta.get('normalize') or (meta.get('config') or {}).get('normalize') or 'none'
    # Settings tuned on the validation split after training win over the training threshold.
    tuned = meta.get('postprocess') if isinstance(meta.get('postprocess'), dict) else {}
    second = second_map(meta)
    return LoadedModel(net, meta, list(ctxs), channels,
                       float(tuned.get('threshold') or meta.get('threshold') or 0.5), normalize,
                       int(tuned.get('min_size') or 0), float(tuned.get('h') or 0.5),
                       float(tuned.get('marker') or DEFAULT_MARKER.get(second, 0.5)), second,
                       float(meta.get('normalize_denoise') or 0.0), meta.get('diameter'),
                       tuned.get('markers') or second,  # untuned: the model's own second map seeds the watershed
                       float(tuned.get('min_score') or 0.0), meta.get('diameter_ranges'),
                       None if meta.get('predict_diameter') is None else str(meta['predict_diameter']),
                       tuned.get('split') or 'watershed')
