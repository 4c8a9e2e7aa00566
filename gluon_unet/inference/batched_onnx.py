"""Prediction without MXNet: an export's ``model.onnx`` run by onnxruntime.

:func:`load_onnx_model` gives the same :class:`~gluon_unet.inference.batched.LoadedModel` as
:func:`~gluon_unet.inference.batched.load_model` - same sidecar settings (threshold, tuned
post-processing, normalization, diameter) - whose network is an :class:`OnnxNetwork`, so
tiling, TTA, scale normalization, the watershed, RLE and overlays run unchanged on it:
:func:`~gluon_unet.inference.batched.run_jobs` hands the batches to the network's own
:class:`OnnxScheduler` instead of MXNet's.

This module needs only numpy and, once a model is loaded, onnxruntime (any version with
opset 17, i.e. >= 1.13): it imports neither mxnet nor onnx, and neither do the modules
``bin/predict`` goes through to reach it. :func:`predict_runtime` says which of the two
runtimes ``bin/predict`` uses: onnxruntime when providers are asked for, the export has
no MXNet files or mxnet cannot be imported, else MXNet. The export's ``model.onnx`` and
``model.json`` are all it reads (:func:`onnx_path`): a folder of only those two is an
export to ``--model``, and so is either file.

Execution providers (``providers``, comma-separated): ``cpu``, ``cuda``, ``tensorrt`` or
onnxruntime's own names (``CUDAExecutionProvider``...), tried in the order given, with
the CPU provider always last (onnxruntime runs there what a GPU provider cannot). The GPU
providers need the ``onnxruntime-gpu`` package; they are what runs these models on GPUs
MXNet 1.9.1 has no kernels for (Hopper, Blackwell).
"""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import UserError
from .batched import Scheduler
from .sidecar import ONNX, ONNX_AGAIN, PARAMS, SIDECAR, SYMBOL

#: The ONNX file of an export, beside its ``model.json`` (:mod:`gluon_unet.inference.export_onnx`);
#: the two are all this module reads, so a folder of only those two predicts here.
ONNX_FILE = ONNX
#: Names of the graph's input and output.
INPUT, OUTPUT = 'data', 'logits'
#: Short provider names -> onnxruntime's.
PROVIDERS = {'cpu': 'CPUExecutionProvider', 'cuda': 'CUDAExecutionProvider',
             'tensorrt': 'TensorrtExecutionProvider'}
#: What to install: the requirements file of the environment without MXNet.
INSTALL_HINT = 'pip install -r requirements-onnx.txt'


def import_onnxruntime(why=''):
    """The ``onnxruntime`` module, or a one-line :class:`UserError` saying what to install
    (after ``why``, e.g. 'mxnet is not installed', when that is why it is needed)."""
    try:
        import onnxruntime
    except ImportError:
        raise UserError('%sonnxruntime is not installed in this Python (%s): %s to predict with the export\'s %s'
                        % (why + ' and ' if why else '', _python(), INSTALL_HINT, ONNX_FILE)) from None
    return onnxruntime


def _python():
    import sys
    return sys.executable or 'python'


def predict_runtime(providers=None, model=None):
    """``('mxnet', '')`` or ``('onnx', why)``: which runtime ``bin/predict`` uses.

    onnxruntime when ``providers`` are given, when the export of ``model`` (``--model``,
    if given) has ``model.onnx`` but not MXNet's files, or when mxnet cannot be imported
    (``why`` says which, for the one line bin/predict prints), else MXNet. Importing mxnet
    here is what the MXNet path does next anyway; a broken install (e.g. mxnet beside
    numpy >= 1.24, which it cannot import) counts as none.
    """
    if providers:
        return 'onnx', ''
    try:
        import mxnet  # noqa: F401
    except ImportError as exc:
        return 'onnx', 'mxnet is not installed' if getattr(exc, 'name', None) == 'mxnet' else \
            'mxnet cannot be imported (%s)' % _one_line(exc)
    except Exception as exc:  # e.g. AttributeError: numpy has no 'bool' (mxnet 1.9.1 on numpy >= 1.24)
        return 'onnx', 'mxnet cannot be imported (%s: %s)' % (type(exc).__name__, _one_line(exc))
    # MXNet is here, but the export may be a copy made for a machine without it.
    missing = model and mxnet_files_missing(model)
    return ('onnx', missing) if missing else ('mxnet', '')


def mxnet_files_missing(model):
    """Why ``model`` (``--model``) cannot run on MXNet when its export is ``model.onnx``
    without MXNet's files (a copy for a machine without MXNet), else ''.

    The reason also says how to run it on MXNet, so that the one line of a missing
    onnxruntime (:func:`import_onnxruntime`) gives both ways on.
    """
    from .sidecar import find_export
    try:
        folder = os.path.dirname(os.path.abspath(find_export(model)))
    except UserError:
        return ''  # bin/predict names a bad --model itself
    mxnet_files = [os.path.join(folder, n) for n in (SYMBOL, PARAMS)]
    if any(os.path.isfile(p) for p in mxnet_files) or not os.path.isfile(os.path.join(folder, ONNX_FILE)):
        return ''
    return ('the export %s has %s but not MXNet\'s %s and %s (copy those beside it to predict with MXNet)'
            % (folder, ONNX_FILE, SYMBOL, PARAMS))


def _one_line(exc, limit=120):
    text = ' '.join(str(exc).split())
    return text if len(text) <= limit else text[:limit - 3] + '...'


def parse_providers(text, gpus=''):
    """onnxruntime provider entries for ``--providers`` (``'cuda,cpu'``...).

    Without ``text``: CUDA when ``gpus`` names GPUs, else the CPU. GPU providers get one
    entry per device (``--gpus``; :func:`gpu_ids`); the CPU provider ends every list.

    Returns
    -------
    list of list of (name, options)
        One provider list per device (one session each).

    Raises
    ------
    UserError
        An unknown provider, or one this onnxruntime does not have (one line naming it,
        the ones it has, and what to install).
    """
    ort = import_onnxruntime()
    if text:
        names = []
        for part in [p.strip() for p in str(text).split(',') if p.strip()]:
            name = PROVIDERS.get(part.lower(), part)
            if name not in PROVIDERS.values() and name not in ort.get_all_providers():
                raise UserError('--providers %s: unknown provider %r; use cpu, cuda, tensorrt or an onnxruntime '
                                'provider name (%s)' % (text, part, ', '.join(ort.get_all_providers())))
            if name not in names:
                names.append(name)
    else:
        names = [PROVIDERS['cuda']] if gpu_ids(gpus) else [PROVIDERS['cpu']]
    available = ort.get_available_providers()
    missing = [n for n in names if n not in available]
    if missing:
        gpu = any(n != PROVIDERS['cpu'] for n in missing)
        raise UserError('%s: this onnxruntime (%s %s) has no %s; it has %s%s' % (
            '--providers %s' % text if text else '--gpus %s' % gpus, _distribution(ort), ort.__version__,
            ', '.join(missing), ', '.join(available),
            ' (GPU providers come with pip install onnxruntime-gpu, in place of onnxruntime)' if gpu else ''))
    if PROVIDERS['cpu'] not in names:
        names.append(PROVIDERS['cpu'])
    gpu_names = [n for n in names if n != PROVIDERS['cpu']]
    if not gpu_names:
        return [[(PROVIDERS['cpu'], {})]]
    ids = gpu_ids(gpus) or [0]
    return [[(n, {'device_id': i} if n != PROVIDERS['cpu'] else {}) for n in names] for i in ids]


def _distribution(ort):
    from importlib import metadata
    for name in ('onnxruntime-gpu', 'onnxruntime'):
        try:
            metadata.version(name)
            return name
        except metadata.PackageNotFoundError:
            continue
    return 'onnxruntime'


def gpu_ids(gpus):
    """The CUDA device ids of ``--gpus`` as onnxruntime sees them: the user's ids, or
    0..n-1 when ``bin/predict`` made them the visible ones (``CUDA_VISIBLE_DEVICES``,
    :func:`~gluon_unet.machine.runtime.restrict_visible_gpus`). ``[]`` for the CPU."""
    from ..machine.devices import parse_gpu_list
    from ..machine.gpus import gpu_renumbering
    ids = parse_gpu_list(gpus)
    if ids is None:
        raise UserError("--gpus all: with onnxruntime, name the GPUs (e.g. --gpus 0-3)")
    if ids and gpu_renumbering() == ids:
        return list(range(len(ids)))
    return ids


def sigmoid(x):
    """1 / (1 + exp(-x)) in float32, as ``mx.nd.sigmoid``."""
    with np.errstate(over='ignore'):
        return (1 / (1 + np.exp(-x))).astype(np.float32, copy=False)


def probability_maps(logits, second=None):
    """numpy twin of :func:`gluon_unet.model.probability_maps`: ``(N, K, H, W)``
    probabilities from ``(N, C, H, W)`` logits."""
    if second or logits.shape[1] == 1:
        return sigmoid(logits)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (1 - e[:, :1] / e.sum(axis=1, keepdims=True)).astype(np.float32)


class OnnxNetwork:
    """One onnxruntime session per device, callable on a float32 ``(N, C, H, W)`` array
    (logits of the first device's session), and the source of its :class:`OnnxScheduler`
    (:func:`~gluon_unet.inference.batched.run_jobs` asks for it)."""

    def __init__(self, path, provider_lists, threads=0):
        ort = import_onnxruntime()
        self.path, self.devices, self.sessions = path, [], []
        for providers in provider_lists:
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.log_severity_level = 3  # errors only: no per-session warnings on stderr
            try:
                session = ort.InferenceSession(path, options, providers=providers)
            except Exception as exc:  # onnxruntime's own exception types differ between versions
                # A model.onnx changed on purpose (its digest removed) can be one onnxruntime refuses.
                raise UserError('%s: onnxruntime cannot load it: %s; %s'
                                % (path, _one_line(exc, 200), ONNX_AGAIN)) from None
            used = session.get_providers()
            wanted = providers[0][0]
            if wanted not in used:
                raise UserError('%s: onnxruntime could not start %s (device %s); it fell back to %s'
                                % (path, wanted, providers[0][1].get('device_id', 0), ', '.join(used)))
            self.sessions.append(session)
            device = providers[0][1].get('device_id')
            self.devices.append('%s(%d)' % (wanted.replace('ExecutionProvider', '').lower(),
                                            len(self.sessions) - 1 if device is None else device))
        inp = self.sessions[0].get_inputs()[0]
        self.input_name, self.output_name = inp.name, self.sessions[0].get_outputs()[0].name
        channels = inp.shape[1]
        self.in_channels = channels if isinstance(channels, int) else None

    def __call__(self, x, device=0):
        return self.sessions[device].run([self.output_name], {self.input_name: np.ascontiguousarray(x, np.float32)})[0]

    def scheduler(self, ctxs, second=None):
        """The :class:`OnnxScheduler` that runs :func:`~gluon_unet.inference.batched.run_jobs`'s
        batches on these sessions (``ctxs``: their labels, :attr:`devices`)."""
        return OnnxScheduler(self, second)


class OnnxScheduler(Scheduler):
    """:class:`gluon_unet.inference.batched.Scheduler` for onnxruntime: the same order of
    results, batches spread over the sessions round-robin.

    ``session.run`` blocks (and releases the GIL), so each session has a thread of its
    own: a part is handed to its session's thread, and the device computes the next batch
    while the host post-processes the last one, as with MXNet's asynchronous engine.
    """

    def __init__(self, net, second=None):
        super().__init__(len(net.sessions), second)
        self.net = net
        self.pool = [ThreadPoolExecutor(1, thread_name_prefix='onnx%d' % i) for i in range(len(net.sessions))]

    def _issue(self, part, dev):
        return self.pool[dev].submit(self._forward, part, dev)

    def _forward(self, part, dev):
        return probability_maps(self.net(part, dev), self.second)

    def _result(self, issued):
        return issued.result()

    def drain(self):
        try:
            super().drain()
        finally:
            for pool in self.pool:
                pool.shutdown(wait=True)


def onnx_path(model, flag='--model'):
    """The checked ``model.onnx`` of an export (run folder, export folder, prefix or one of
    its files), and its sidecar: ``(path, meta)``.

    ``model.json`` must be beside it (the input size, normalization and post-processing
    are there) and record the file (its ``onnx`` entry, written with it): a later export
    of other weights into the same folder drops that entry, and a ``model.onnx`` put back
    by hand must not run with the new settings. The file must match the CRC-32 stored in
    ``digest``, unless the user removed that (a file changed on purpose), as the MXNet
    files are checked (:func:`~gluon_unet.inference.sidecar.verify_export`).
    """
    from .sidecar import find_export, read_sidecar, verify_export
    prefix = find_export(model, flag)
    folder = os.path.dirname(os.path.abspath(prefix))
    path = os.path.join(folder, ONNX_FILE)
    sidecar = os.path.join(folder, SIDECAR)
    if not os.path.isfile(path):
        raise UserError('%s %s: the export has no %s; write it where mxnet is installed (bin/export RUN --onnx)'
                        % (flag, model, ONNX_FILE))
    if not os.path.isfile(sidecar):
        raise UserError('%s has no %s beside it: copy the export\'s %s with it (the input size, normalization '
                        'and post-processing the model needs)' % (path, SIDECAR, SIDECAR))
    meta = read_sidecar(sidecar)
    if not isinstance(meta.get('onnx'), dict):
        raise UserError('%s is not recorded in %s, so it may come from other weights (an export replaced since); '
                        'write it again where mxnet is installed (bin/export RUN --onnx)' % (path, sidecar))
    verify_export(meta, {ONNX_FILE: path}, sidecar, again=ONNX_AGAIN)
    return path, meta


def load_onnx_model(model, gpus='', cpus=1, providers=None, threads=None, why=''):
    """Load an export's ``model.onnx`` into onnxruntime sessions, with its sidecar settings.

    Parameters
    ----------
    model : str
        Run folder, export folder, export prefix or one of the export's files
        (:func:`~gluon_unet.inference.sidecar.find_export`).
    gpus : str
        ``--gpus``: the CUDA/TensorRT device ids (one session each); '' for the CPU.
    cpus : int
        ``--cpus``: sessions on the CPU (as MXNet's CPU contexts), when no GPU is used.
    providers : str, optional
        ``--providers`` (see :func:`parse_providers`).
    threads : int, optional
        onnxruntime's intra-op threads per session; default ``$OMP_NUM_THREADS`` (which
        ``bin/predict`` sets as for MXNet: the physical cores), else onnxruntime's own.
    why : str
        Why onnxruntime is used (:func:`predict_runtime`), for the error when it is missing.

    Returns
    -------
    LoadedModel
        ``net`` an :class:`OnnxNetwork`, ``ctxs`` the device labels (``['cpu(0)']``,
        ``['cuda(0)', 'cuda(1)']``).
    """
    from .batched import loaded_model
    import_onnxruntime(why)
    provider_lists = parse_providers(providers, gpus)
    if len(provider_lists) == 1 and provider_lists[0][0][0] == PROVIDERS['cpu']:
        if not isinstance(cpus, int) or cpus < 1:
            raise UserError('--cpus must be a positive integer (got %r)' % (cpus,))
        provider_lists = provider_lists * cpus
    path, meta = onnx_path(model)
    if threads is None:
        try:
            threads = max(0, int(os.environ.get('OMP_NUM_THREADS', '0')))
        except ValueError:
            threads = 0
    net = OnnxNetwork(path, provider_lists, threads)
    channels = meta.get('in_channels') or net.in_channels
    if not channels:
        raise UserError('%s: cannot tell the input channels of the model' % path)
    if net.in_channels and int(channels) != net.in_channels:
        raise UserError('%s takes %d input channels but model.json says %d' % (path, net.in_channels, channels))
    return loaded_model(net, meta, list(net.devices), int(channels))


def runtime_line(model, why):
    """The one line ``bin/predict`` prints when it predicts with onnxruntime on its own
    accord (``why``: :func:`predict_runtime`'s reason)."""
    ort = import_onnxruntime()
    return '%s: predicting with %s on onnxruntime %s (%s)' % (why, model.net.path, ort.__version__,
                                                             ', '.join(model.ctxs))
