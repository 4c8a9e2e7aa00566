"""Turning ``--gpus`` / ``--cpus`` into a list of MXNet contexts, with one-line errors.

mxnet is imported inside the functions that need it: ``bin/train`` asks
:func:`cpu_context_count` how many CPU contexts it will train on before libmxnet loads,
because the OpenMP thread count can only be chosen then (``runtime.py``).

GPUs are checked before anything trains on them (:func:`make_contexts`): a machine
without a usable GPU, or a GPU this MXNet build cannot run, stops the run with one line
saying why (:mod:`gluon_unet.machine.gpus` asks the driver and probes each GPU).

``bin/train --gpus 4-7`` runs with ``CUDA_VISIBLE_DEVICES=4,5,6,7`` (set by
:func:`gluon_unet.machine.runtime.restrict_visible_gpus` before mxnet loads), so MXNet's
``gpu(0..3)`` are GPUs 4-7 and nothing touches GPU 0; :func:`make_contexts` maps the
user's numbers onto the renumbered devices and :func:`context_names` says which is which.
"""
from ..errors import UserError
from .gpus import gpu_renumbering, no_gpu_reason, num_gpus, physical_gpu, probe_gpu

# --gpus values that mean "no GPU: train on --cpus CPU contexts".
_NO_GPU_SPECS = ('', 'none', 'cpu')


#: No machine has more GPUs than this (a range up to 10**12 would be built before a driver is asked).
MAX_GPU_ID = 1023


def parse_gpu_list(spec):
    """The GPU indices a ``--gpus`` value names, without asking any driver.

    Returns
    -------
    list of int or None
        Sorted, de-duplicated indices; ``[]`` for no GPU; ``None`` for ``'all'``.

    Raises
    ------
    UserError
        Not a list of indices and ranges (one line naming the bad part).
    """
    spec = (spec or '').strip().lower()
    if spec in _NO_GPU_SPECS:
        return []
    if spec == 'all':
        return None
    ids = set()
    for part in spec.split(','):
        part = part.strip()
        try:
            if '-' in part:
                lo, hi = (int(p) for p in part.split('-', 1))
                if lo > hi or hi > MAX_GPU_ID:
                    raise ValueError
                ids.update(range(lo, hi + 1))
            else:
                ids.add(int(part))
                if ids and max(ids) > MAX_GPU_ID:
                    raise ValueError
        except ValueError:
            raise UserError("--gpus %r: %r is not a GPU index or range like '0-7', '0,2,5', 'all'"
                            % (spec, part)) from None
    ids = sorted(ids)
    if ids and ids[0] < 0:
        raise UserError('--gpus %r: negative GPU index %d' % (spec, ids[0]))
    return ids


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
    ids = parse_gpu_list(spec)
    if ids == []:
        return []
    spec = spec.strip().lower()
    if available is None:
        available = num_gpus()
    if ids is None:
        if available == 0:
            raise UserError('--gpus all: ' + no_gpu_reason())
        return list(range(available))
    if available == 0:
        raise UserError('--gpus %s: %s' % (spec, no_gpu_reason()))
    missing = [i for i in ids if i >= available]
    if missing:
        raise UserError('--gpus %s: no GPU %s on this machine (available: %s)'
                        % (spec, ','.join(map(str, missing)), _describe(available)))
    return ids


def gpu_device_ids(spec):
    """MXNet's device ids for ``--gpus spec``, checked and probed (:func:`probe_gpu`).

    Without a renumbering these are the ids the user gave. After
    :func:`gluon_unet.machine.runtime.restrict_visible_gpus` set ``CUDA_VISIBLE_DEVICES=4,5,6,7``
    for ``--gpus 4-7``, MXNet sees those four GPUs as ``gpu(0..3)``: the user's ids are
    mapped onto them (``'all'`` means all four).
    """
    shown = (spec or '').strip().lower()
    visible = gpu_renumbering()
    if visible is None:
        ids = parse_gpu_ids(spec)
    else:
        wanted = parse_gpu_list(spec)
        if not wanted and wanted is not None:
            return []
        count = num_gpus()
        if count == 0:
            raise UserError('--gpus %s: %s' % (shown, no_gpu_reason()))
        if count < len(visible):
            # CUDA ignores CUDA_VISIBLE_DEVICES from its first index that does not exist.
            raise UserError('--gpus %s: no GPU %s on this machine (CUDA_VISIBLE_DEVICES=%s, set from '
                            '--gpus, shows MXNet %d GPU(s))' % (shown, ','.join(map(str, visible[count:])),
                                                               ','.join(map(str, visible)), count))
        if wanted is None:
            ids = list(range(count))
        else:
            hidden = [i for i in wanted if i not in visible]
            if hidden:
                raise UserError('--gpus %s: GPU %s is not visible to this process (CUDA_VISIBLE_DEVICES=%s, '
                                'set from the --gpus it started with)'
                                % (shown, ','.join(map(str, hidden)), ','.join(map(str, visible))))
            ids = [visible.index(i) for i in wanted]
    for i in ids:
        problem = probe_gpu(i)
        if problem:
            raise UserError('--gpus %s: %s' % (shown, problem))
    return ids


def make_contexts(gpus='', cpus=1):
    """Contexts for training: the requested GPUs, else ``cpus`` CPU contexts.

    Each GPU is checked once per process (:func:`probe_gpu`) before it is returned, so a
    GPU this MXNet cannot use stops the run here with one line. Several CPU contexts
    (``mx.cpu(0)``, ``mx.cpu(1)``, ...) are separate devices to MXNet, so the whole
    multi-device path (split, kvstore reduce, SyncBatchNorm) runs for real on a machine
    without GPUs.
    """
    import mxnet as mx
    ids = gpu_device_ids(gpus)
    if ids:
        return [mx.gpu(i) for i in ids]
    if not isinstance(cpus, int) or cpus < 1:
        raise UserError('--cpus must be a positive integer (got %r)' % (cpus,))
    return [mx.cpu(i) for i in range(cpus)]


def cpu_context_count(gpus='', cpus=1):
    """How many CPU contexts :func:`make_contexts` will create (0 with GPUs), without mxnet."""
    return cpus if (gpus or '').strip().lower() in _NO_GPU_SPECS else 0


def has_gpu(ctxs):
    return any(c.device_type == 'gpu' for c in ctxs)


def context_names(ctxs):
    """``'gpu(0)=GPU 4,gpu(1)=GPU 5'`` when ``CUDA_VISIBLE_DEVICES`` renumbered the GPUs,
    else ``'gpu(0),gpu(1)'`` / ``'cpu(0),cpu(1)'``: for the log line naming the devices."""
    names = []
    for c in ctxs:
        name = str(c)
        if c.device_type == 'gpu' and physical_gpu(c.device_id) != str(c.device_id):
            name += '=GPU %s' % physical_gpu(c.device_id)
        names.append(name)
    return ','.join(names)


def _describe(n):
    return 'gpu 0-%d' % (n - 1) if n > 1 else 'gpu 0'
