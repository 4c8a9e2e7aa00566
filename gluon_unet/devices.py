"""Turning ``--gpus`` / ``--cpus`` into a list of MXNet contexts, with one-line errors.

mxnet is imported inside the functions that need it: ``bin/train`` asks
:func:`cpu_context_count` how many CPU contexts it will train on before libmxnet loads,
because the OpenMP thread count can only be chosen then (``runtime.py``).
"""
import functools

from .errors import UserError, mxnet_message

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


# -- bfloat16 on CPU ------------------------------------------------------------------------

_CPUINFO = '/proc/cpuinfo'


def _cpu_description():
    """``'AMD EPYC 7B13, no AVX-512'``: the CPU model and its AVX-512 / bf16 flags."""
    model, flags = None, None
    try:
        with open(_CPUINFO) as f:
            for line in f:
                key, _, value = line.partition(':')
                key = key.strip()
                if key == 'model name' and model is None:
                    model = value.strip()
                elif key == 'flags' and flags is None:
                    flags = set(value.split())
                if model is not None and flags is not None:
                    break
    except OSError:
        pass
    if not model:
        import platform
        model = platform.processor() or platform.machine() or 'unknown model'
    if flags is None:
        return model
    if 'avx512f' not in flags:
        return '%s, no AVX-512' % model
    return '%s, AVX-512, %s' % (model, 'avx512_bf16' if 'avx512_bf16' in flags else 'no avx512_bf16')


def _bfloat16_probe():
    """Run, in bfloat16, the CPU kernels a U-Net trains with under bfloat16 AMP.

    3x3 Convolution (+ BatchNorm, ReLU) and the 1x1 Convolution that stands in for the
    2x2 transposed convolution under AMP (``model._TransposedConv2x2``), forward and
    backward, with ``mx.nd`` directly: ``amp.init`` patches MXNet for the whole process
    and cannot be undone, so it must not run just to find out. Raises ``MXNetError``
    where oneDNN has no bfloat16 kernel (MXNet 1.9.1 on a CPU without AVX-512:
    "could not create a primitive descriptor iterator"); returns the largest deviation
    of the bfloat16 convolution from float32, relative to the output's magnitude.
    """
    import mxnet as mx
    import numpy as np
    bf16 = np.dtype([('bfloat16', np.uint16)])  # how MXNet 1.9 names bfloat16 to numpy
    ctx = mx.cpu()
    rng = np.random.RandomState(0)

    def array(*shape):
        return mx.nd.array(rng.uniform(-1, 1, size=shape), ctx=ctx, dtype='float32')

    x, w, w1 = array(2, 4, 8, 8), array(8, 4, 3, 3), array(16, 8, 1, 1)
    xb, wb, w1b = (mx.nd.amp_cast(a, dtype=bf16) for a in (x, w, w1))
    gamma, beta = mx.nd.ones((8,), ctx=ctx), mx.nd.zeros((8,), ctx=ctx)
    mean, var = mx.nd.zeros((8,), ctx=ctx), mx.nd.ones((8,), ctx=ctx)
    for a in (xb, wb, w1b, gamma, beta):
        a.attach_grad()
    with mx.autograd.record():
        y = mx.nd.Convolution(xb, wb, kernel=(3, 3), pad=(1, 1), num_filter=8, no_bias=True)
        z = mx.nd.relu(mx.nd.BatchNorm(y, gamma, beta, mean, var))
        u = mx.nd.Convolution(z, w1b, kernel=(1, 1), num_filter=16, no_bias=True)
        loss = mx.nd.amp_cast(u, dtype='float32').sum()
    loss.backward()
    got = mx.nd.amp_cast(y, dtype='float32').asnumpy()  # waits: engine errors surface here
    for g in (xb.grad, wb.grad, w1b.grad):
        g.wait_to_read()
    ref = mx.nd.Convolution(mx.nd.amp_cast(xb, dtype='float32'), mx.nd.amp_cast(wb, dtype='float32'),
                            kernel=(3, 3), pad=(1, 1), num_filter=8, no_bias=True).asnumpy()
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6))


@functools.lru_cache(maxsize=None)
def cpu_bfloat16_support():
    """Whether this CPU runs MXNet's bfloat16 convolutions (``--amp`` on CPU).

    Probes for real (:func:`_bfloat16_probe`, a fraction of a second, once per process)
    instead of trusting CPU flags: what counts is whether this MXNet build's oneDNN has
    the kernels. MXNet 1.9.1's oneDNN 2.4 has none without AVX-512 (AMD Zen 3), where a
    bfloat16 AMP network would fail at its first forward.

    Returns
    -------
    (bool, str)
        The answer, and a one-line reason naming the CPU (model, AVX-512 flags).
    """
    import mxnet as mx
    where = "in MXNet %s's oneDNN" % mx.__version__
    cpu = 'this CPU (%s)' % _cpu_description()
    try:
        deviation = _bfloat16_probe()
    except mx.base.MXNetError as exc:
        return False, '%s cannot run bfloat16 convolutions %s (%s)' % (cpu, where, mxnet_message(exc))
    if deviation is not None and not deviation <= 0.05:
        return False, ('%s computes wrong bfloat16 convolutions %s (off by %.0f %% of the output)'
                       % (cpu, where, 100 * deviation))
    return True, '%s runs bfloat16 convolutions %s' % (cpu, where)


def require_cpu_bfloat16():
    """Stop with one line when ``--amp`` (bfloat16 on CPU) cannot run here.

    No silent fallback to float32: the user asked for mixed precision, so the run stops
    before anything is loaded and says what to do.
    """
    ok, reason = cpu_bfloat16_support()
    if not ok:
        raise UserError('--amp: bfloat16 mixed precision needs a CPU with AVX-512, but %s; '
                        'train without --amp (float32)' % reason)
