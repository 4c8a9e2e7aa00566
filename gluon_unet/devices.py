"""Turning ``--gpus`` / ``--cpus`` into a list of MXNet contexts, with one-line errors.

mxnet is imported inside the functions that need it: ``bin/train`` asks
:func:`cpu_context_count` how many CPU contexts it will train on before libmxnet loads,
because the OpenMP thread count can only be chosen then (``runtime.py``).
"""
from .errors import UserError

# --gpus values that mean "no GPU: train on --cpus CPU contexts".
_NO_GPU_SPECS = ('', 'none', 'cpu')


def parse_gpu_ids(spec, available=None):
    """Parse a GPU list such as ``'0-7'``, ``'0,2,5'``, ``'0-3,6'`` or ``'all'``.

    Parameters
    ----------
    spec : str or None
        The ``--gpus`` value; empty, ``None`` or ``'none'`` means no GPU.
    available : int, optional
        Number of GPUs on the machine (queried from MXNet when omitted).

    Returns
    -------
    list of int
        Sorted, de-duplicated GPU indices (empty for CPU).
    """
    spec = (spec or '').strip().lower()
    if spec in _NO_GPU_SPECS:
        return []
    if available is None:
        available = num_gpus()
    if spec == 'all':
        if available == 0:
            raise UserError('--gpus all: ' + _no_gpu_reason())
        return list(range(available))
    ids = set()
    for part in spec.split(','):
        part = part.strip()
        try:
            if '-' in part:
                lo, hi = (int(p) for p in part.split('-', 1))
                if lo > hi:
                    raise ValueError
                ids.update(range(lo, hi + 1))
            else:
                ids.add(int(part))
        except ValueError:
            raise UserError("--gpus %r: %r is not a GPU index or range like '0-7', '0,2,5', 'all'"
                            % (spec, part)) from None
    ids = sorted(ids)
    if ids and ids[0] < 0:
        raise UserError('--gpus %r: negative GPU index %d' % (spec, ids[0]))
    if available == 0:
        raise UserError('--gpus %s: %s' % (spec, _no_gpu_reason()))
    missing = [i for i in ids if i >= available]
    if missing:
        raise UserError('--gpus %s: no GPU %s on this machine (available: %s)'
                        % (spec, ','.join(map(str, missing)), _describe(available)))
    return ids


def make_contexts(gpus='', cpus=1):
    """Contexts for training: the requested GPUs, else ``cpus`` CPU contexts.

    Several CPU contexts (``mx.cpu(0)``, ``mx.cpu(1)``, ...) are separate devices to
    MXNet, so the whole multi-device path (split, kvstore reduce, SyncBatchNorm) runs
    for real on a machine without GPUs.
    """
    import mxnet as mx
    ids = parse_gpu_ids(gpus)
    if ids:
        return [mx.gpu(i) for i in ids]
    if not isinstance(cpus, int) or cpus < 1:
        raise UserError('--cpus must be a positive integer (got %r)' % (cpus,))
    return [mx.cpu(i) for i in range(cpus)]


def cpu_context_count(gpus='', cpus=1):
    """How many CPU contexts :func:`make_contexts` will create (0 with GPUs), without mxnet."""
    return cpus if (gpus or '').strip().lower() in _NO_GPU_SPECS else 0


def num_gpus():
    """GPUs MXNet can use (0 on a CPU build of mxnet)."""
    import mxnet as mx
    if not mx.runtime.Features().is_enabled('CUDA'):
        return 0
    try:
        return mx.context.num_gpus()
    except mx.MXNetError:
        return 0


def has_gpu(ctxs):
    return any(c.device_type == 'gpu' for c in ctxs)


def _no_gpu_reason():
    import mxnet as mx
    if not mx.runtime.Features().is_enabled('CUDA'):
        return ('this mxnet build has no CUDA support (available: cpu); install mxnet-cu117 '
                'for GPUs, or drop --gpus and use --cpus N')
    return 'no GPU found on this machine (available: cpu); drop --gpus or use --cpus N'


def _describe(n):
    return 'gpu 0-%d' % (n - 1) if n > 1 else 'gpu 0'
