"""What this machine's CPU can do: its model and flags, bfloat16, AMX and int8.

* :func:`cpu_description` names the CPU as every benchmark figure and ``doctor`` quote
  it (speed differs between CPU kinds);
* :func:`cpu_bfloat16_support` and :func:`cpu_int8_support` probe for real whether this
  MXNet build runs bfloat16 (``--amp`` on CPU) and int8 (``--int8``) convolutions here;
* :func:`request_amx_tiles` asks Linux for the AMX tile state that MXNet's oneDNN needs
  before it may use AMX (:func:`gluon_unet.machine.runtime.enable_amx` decides whether to).

mxnet is imported inside the functions that need it.
"""
import ctypes
import functools
import os

from ..errors import UserError, mxnet_message
from .probe import run_probe

# -- bfloat16 on CPU ------------------------------------------------------------------------

_CPUINFO = '/proc/cpuinfo'


def cpu_description():
    """``'AMD EPYC 7B13, no AVX-512'``: the CPU model and its AVX-512 / bf16 / AMX flags, as
    every benchmark figure and ``doctor`` quote it (speed differs between CPU kinds)."""
    model = None
    try:
        with open(_CPUINFO) as f:
            model = next((line.partition(':')[2].strip() for line in f
                          if line.partition(':')[0].strip() == 'model name'), None)
    except OSError:
        pass
    if not model:
        import platform
        model = platform.processor() or platform.machine() or 'unknown model'
    flags = cpu_flags()
    if not flags:
        return model
    if 'avx512f' not in flags:
        return '%s, no AVX-512' % model
    return '%s, AVX-512, %s%s' % (model, 'avx512_bf16' if 'avx512_bf16' in flags else 'no avx512_bf16',
                                  ', AMX' if 'amx_tile' in flags else '')


def _bfloat16_probe():
    """Run, in bfloat16, the CPU kernels a U-Net trains with under bfloat16 AMP.

    3x3 Convolution (+ BatchNorm, ReLU) and the 1x1 Convolution that stands in for the
    2x2 transposed convolution under AMP (``onednn.TransposedConv2x2``), forward and
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
    cpu = 'this CPU (%s)' % cpu_description()
    try:
        deviation = run_probe(_bfloat16_probe)
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


# -- AMX (Intel Advanced Matrix Extensions) -------------------------------------------------

# Linux x86-64: syscall number of arch_prctl, its code that requests an extended-state
# permission, and the XSAVE feature number of the AMX tile data (arch/x86/include/uapi/asm/prctl.h).
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def cpu_has_amx(flags=None):
    """True when the CPU flags include AMX tiles with bfloat16 (Intel Sapphire Rapids on).

    Parameters
    ----------
    flags : set of str, optional
        The CPU flags (default: :func:`cpu_flags`).
    """
    flags = cpu_flags() if flags is None else flags
    return {'amx_tile', 'amx_bf16'} <= set(flags)


def _arch_prctl(code, arg):
    """``arch_prctl(code, arg)`` through libc's ``syscall``: (return code, errno)."""
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(code), arg)
    return rc, ctypes.get_errno()


@functools.lru_cache(maxsize=None)
def request_amx_tiles():
    """Ask Linux for the AMX tile state, once per process; whether AMX may now be used.

    Since Linux 5.16 a process must request the tile data state
    (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``) before its first AMX
    instruction, or the kernel kills it with SIGILL. oneDNN 3 (PyTorch) asks by itself;
    MXNet 1.9.1's oneDNN 2.4.4 does not, which is why ``DNNL_MAX_CPU_ISA=AVX512_CORE_AMX``
    alone crashes MXNet at its first bfloat16 convolution. The permission holds for the
    whole process and is inherited by ``fork()`` children (loader workers), not across
    ``exec()`` (measured), so every program that wants AMX asks for itself.

    Returns
    -------
    (bool, str)
        Granted or not, and a one-line reason naming the CPU.
    """
    import platform
    cpu = 'this CPU (%s)' % cpu_description()
    if platform.system() != 'Linux' or platform.machine().lower() not in ('x86_64', 'amd64'):
        return False, 'AMX needs Linux on x86-64 (this is %s %s)' % (platform.system(), platform.machine())
    if not cpu_has_amx():
        return False, '%s has no AMX (no amx_tile/amx_bf16 in /proc/cpuinfo)' % cpu
    rc, err = _arch_prctl(_ARCH_REQ_XCOMP_PERM, ctypes.c_long(_XFEATURE_XTILEDATA))
    if rc != 0:
        return False, ('Linux refused AMX tile state to this process (arch_prctl: %s; it needs Linux '
                       '5.16 or newer)' % os.strerror(err))
    return True, '%s has AMX and Linux granted this process its tile state' % cpu


# -- int8 on CPU ----------------------------------------------------------------------------

def cpu_flags():
    """The CPU's feature flags from /proc/cpuinfo (an empty set where there is none)."""
    try:
        with open(_CPUINFO) as f:
            for line in f:
                key, _, value = line.partition(':')
                if key.strip() == 'flags':
                    return set(value.split())
    except OSError:
        pass
    return set()


def _int8_probe():
    """Quantize a 3x3 convolution + ReLU with MXNet's oneDNN flow and run it; returns its
    largest deviation from float32, relative to the output's magnitude. Raises where
    this build or platform has no int8 kernels (MXNet's quantized operators are oneDNN's,
    on Linux only)."""
    import warnings

    import mxnet as mx
    import numpy as np
    from mxnet.contrib.quantization import quantize_net
    rng = np.random.RandomState(0)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Conv2D(8, 3, padding=1, in_channels=4, activation='relu'))
    net.initialize(mx.init.Uniform(0.5), ctx=mx.cpu())
    x = mx.nd.array(rng.uniform(0, 1, size=(1, 4, 16, 16)), ctx=mx.cpu())
    net.hybridize()
    ref = net(x).asnumpy()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        qnet = quantize_net(net, quantized_dtype='auto', calib_mode='naive', calib_data=[[x]],
                            num_calib_examples=1, ctx=mx.cpu())
    got = qnet(x).asnumpy()
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6))


@functools.lru_cache(maxsize=None)
def cpu_int8_support():
    """Whether this machine runs MXNet's int8 (oneDNN quantized) networks, and how fast.

    Probes for real (:func:`_int8_probe`, a fraction of a second, once per process): the
    quantized operators exist only in oneDNN builds of MXNet on Linux x86-64. Where it
    runs, the reason says whether the CPU has VNNI (``avx512_vnni`` or ``avx_vnni``: int8
    dot products in one instruction), without which int8 brings little speed.

    Returns
    -------
    (bool, str)
        The answer and a one-line reason naming the CPU.
    """
    import platform

    import mxnet as mx
    cpu = 'this CPU (%s)' % cpu_description()
    if platform.system() != 'Linux' or platform.machine().lower() not in ('x86_64', 'amd64'):
        return False, ("MXNet's int8 operators run on Linux x86-64 only (this is %s %s)"
                       % (platform.system(), platform.machine()))
    if not mx.runtime.Features().is_enabled('MKLDNN'):
        return False, 'this MXNet %s build has no oneDNN (MKLDNN), which its int8 operators need' % mx.__version__
    try:
        deviation = run_probe(_int8_probe)
    except mx.base.MXNetError as exc:
        return False, '%s cannot run int8 convolutions in MXNet %s (%s)' % (cpu, mx.__version__, mxnet_message(exc))
    if not deviation <= 0.05:
        return False, ('%s computes wrong int8 convolutions in MXNet %s (off by %.0f %% of the output)'
                       % (cpu, mx.__version__, 100 * deviation))
    flags = cpu_flags()
    vnni = [f for f in ('avx512_vnni', 'avx_vnni', 'amx_int8') if f in flags]
    return True, ('%s runs int8 convolutions in MXNet %s, %s' % (
        cpu, mx.__version__, 'with %s' % '/'.join(vnni) if vnni else 'without VNNI (int8 may be no faster than float32)'))
