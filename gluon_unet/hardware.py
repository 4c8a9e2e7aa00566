"""What this machine's hardware can do, asked of the CUDA driver, MXNet and the CPU.

* :func:`gpu_status` says how many GPUs MXNet sees and, when none, why - MXNet's own
  ``num_gpus()`` returns 0 for "no driver", "driver too old" and "no device" alike
  (``include/mxnet/base.h``, ``Context::GetGPUCount``), so the CUDA driver is asked
  directly (``libcuda.so.1``) to name the cause;
* :func:`probe_gpu` runs a tiny kernel and a cuDNN convolution on a GPU, once per
  process: a GPU this MXNet build has no kernels for (Hopper under the ``mxnet-cu117``
  wheel: "no kernel image is available for execution on the device") is named in one
  line with its compute capability and what to do (:data:`WHEEL_CUDA_ARCHS`,
  :func:`build_supports`), instead of a C++ traceback at the first training step;
* :func:`physical_gpu` says which GPU MXNet's ``gpu(i)`` is when ``CUDA_VISIBLE_DEVICES``
  renumbered them (:func:`set_gpu_renumbering`);
* :func:`cpu_description` and :func:`cpu_bfloat16_support` say what the CPU is and
  whether it runs MXNet's bfloat16 convolutions (``--amp`` on CPU);
* :func:`request_amx_tiles` asks Linux for the AMX tile state that MXNet's oneDNN needs
  before it may use AMX (``runtime.enable_amx`` decides whether to).

mxnet is imported inside the functions that need it. Turning ``--gpus`` / ``--cpus``
into contexts is :mod:`gluon_unet.devices`.

Why one module: the GPU and the CPU probes ask MXNet the same careful way - its C++
side's stderr silenced while they run, its engine's stored errors cleared after them
(:func:`native_stderr_silenced`, :func:`_clear_engine_errors`) - and ``gluon-unet
doctor`` reports them side by side.
"""
import contextlib
import ctypes
import functools
import os
import re
import sys

from .errors import UserError, mxnet_message

# The GPU ids runtime.restrict_visible_gpus() made visible (CUDA_VISIBLE_DEVICES), in
# order: MXNet's gpu(i) is GPU _renumbered[i]. None when this process renumbered none.
_renumbered = None


def set_gpu_renumbering(ids):
    """Record that ``CUDA_VISIBLE_DEVICES`` now shows MXNet GPUs ``ids`` (None: none);
    called by :func:`gluon_unet.runtime.restrict_visible_gpus`."""
    global _renumbered
    _renumbered = None if ids is None else [int(i) for i in ids]


def gpu_renumbering():
    """The GPU ids :func:`gluon_unet.runtime.restrict_visible_gpus` left visible
    (``[4, 5, 6, 7]``: MXNet's ``gpu(i)`` is GPU ``[...][i]``), or None when this process
    did not renumber them (or ``CUDA_VISIBLE_DEVICES`` was changed since)."""
    if _renumbered is None or os.environ.get('CUDA_VISIBLE_DEVICES') != ','.join(map(str, _renumbered)):
        return None
    return list(_renumbered)


def physical_gpu(device_id):
    """What MXNet's ``gpu(device_id)`` is on the machine: ``'4'`` when
    ``CUDA_VISIBLE_DEVICES=4,5,6,7`` (set by gluon_unet or the user) makes GPU 4 the first
    one MXNet sees, the entry itself for UUIDs (``'GPU-...'``, ``'MIG-...'``), the id
    itself without ``CUDA_VISIBLE_DEVICES``."""
    visible = gpu_renumbering()
    if visible is None:
        entries = [e.strip() for e in os.environ.get('CUDA_VISIBLE_DEVICES', '').split(',') if e.strip()]
        if 'CUDA_VISIBLE_DEVICES' not in os.environ or device_id >= len(entries):
            return str(device_id)
        return entries[device_id]
    return str(visible[device_id]) if device_id < len(visible) else str(device_id)


def num_gpus():
    """GPUs MXNet can use (0 on a CPU build of mxnet, or when CUDA finds none:
    :func:`gpu_status` says why)."""
    return gpu_status()[0]


# -- why there is no GPU --------------------------------------------------------------------

def _cuda_enabled():
    import mxnet as mx
    return mx.runtime.Features().is_enabled('CUDA')


def _mxnet_gpu_count():
    """``mx.context.num_gpus()``: raises ``MXNetError`` on a CUDA error other than "no
    device" / "insufficient driver", for which it returns 0 (base.h GetGPUCount)."""
    import mxnet as mx
    return mx.context.num_gpus()


@functools.lru_cache(maxsize=None)
def gpu_status():
    """How many GPUs MXNet sees, and why none when none: ``(count, reason)``.

    ``reason`` is ``''`` when ``count > 0``, else one line naming the cause and the fix:
    a CPU build of mxnet, no NVIDIA driver (``libcuda.so.1`` missing: no driver, or a
    container started without ``--gpus``), a driver too old for the CUDA the build needs,
    a CUDA error (the driver's own message), or ``CUDA_VISIBLE_DEVICES`` hiding them.
    Cached: asked once per process.
    """
    import mxnet as mx
    if not _cuda_enabled():
        return 0, ('this mxnet build has no CUDA support (available: cpu); for GPUs install mxnet-cu117 '
                   'and the CUDA 11.7 runtime, cuDNN 8 and NCCL 2 it loads (the wheel holds libmxnet.so '
                   'only), or drop --gpus and use --cpus N')
    try:
        count = _mxnet_gpu_count()
    except mx.base.MXNetError as exc:
        return 0, '%s cannot list the GPUs: %s%s; %s' % (
            _build_name(), mxnet_message(exc), _driver_note(), 'drop --gpus and use --cpus N, or fix CUDA')
    if count > 0:
        return count, ''
    return 0, _why_no_gpu()


def _why_no_gpu():
    """The cause behind MXNet's silent 0 GPUs, from the CUDA driver itself."""
    fix = 'drop --gpus and use --cpus N'
    visible = os.environ.get('CUDA_VISIBLE_DEVICES')
    info = cuda_driver_info()
    if info.get('error') == 'no-libcuda':
        return ('no NVIDIA driver: %s (available: cpu); install the NVIDIA driver (in Docker: run with '
                '--gpus all and the NVIDIA Container Toolkit), or %s' % (info['detail'], fix))
    needed = _build_cuda_version()
    driver = info.get('driver_cuda')
    if driver and needed and driver < needed[0] * 1000:
        return ('the NVIDIA driver supports CUDA %s only, %s needs a driver for CUDA %d.x '
                '(NVIDIA driver >= 450.80.02 for CUDA 11; available: cpu); update the driver, or %s'
                % (_cuda_version_text(driver), _build_name(), needed[0], fix))
    if info.get('init_error'):
        return ('the NVIDIA driver%s cannot start CUDA: %s (available: cpu); check nvidia-smi, or %s'
                % (' (CUDA %s)' % _cuda_version_text(driver) if driver else '', info['init_error'], fix))
    if visible is not None and visible.strip() in ('', '-1', 'none', 'NoDevFiles'):
        return ('CUDA_VISIBLE_DEVICES=%r hides every GPU (available: cpu); unset it, or %s' % (visible, fix))
    if visible is not None:
        return ('no GPU found: CUDA_VISIBLE_DEVICES=%s names none that exists (available: cpu); check it '
                'against nvidia-smi -L, or %s' % (visible, fix))
    return 'no GPU found on this machine (available: cpu); drop --gpus or use --cpus N'


def no_gpu_reason():
    return gpu_status()[1] or 'no GPU found on this machine (available: cpu); drop --gpus or use --cpus N'


# -- the CUDA driver, asked directly ---------------------------------------------------------

_LIBCUDA_NAMES = ('libcuda.so.1', 'libcuda.so')
_CU_ATTR_CC_MAJOR, _CU_ATTR_CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_* (cuda.h)


@functools.lru_cache(maxsize=None)
def _libcuda():
    """The CUDA driver library (``ctypes.CDLL``), or the error loading it as a string."""
    errors = []
    for name in _LIBCUDA_NAMES:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    return '%s not found (%s)' % (_LIBCUDA_NAMES[0], errors[0].split(':')[-1].strip() if errors else '')


def _cu_error(lib, code):
    text = ctypes.c_char_p()
    try:
        if lib.cuGetErrorString(code, ctypes.byref(text)) == 0 and text.value:
            return '%s (CUDA driver error %d)' % (text.value.decode(errors='replace'), code)
    except AttributeError:
        pass
    return 'CUDA driver error %d' % code


def cuda_driver_info():
    """What the CUDA driver says, without MXNet: a dict with ``driver_cuda`` (e.g. 12020
    for CUDA 12.2, or None), ``device_count`` (None when unknown), ``init_error`` (the
    driver's message when ``cuInit`` fails) and ``error`` = ``'no-libcuda'`` with
    ``detail`` when there is no driver library. Respects ``CUDA_VISIBLE_DEVICES``."""
    lib = _libcuda()
    if isinstance(lib, str):
        return {'error': 'no-libcuda', 'detail': lib, 'driver_cuda': None, 'device_count': None}
    info = {'driver_cuda': None, 'device_count': None}
    try:
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value > 0:
            info['driver_cuda'] = version.value
        code = lib.cuInit(0)
        if code != 0:
            info['init_error'] = _cu_error(lib, code)
            return info
        count = ctypes.c_int()
        if lib.cuDeviceGetCount(ctypes.byref(count)) == 0:
            info['device_count'] = count.value
    except AttributeError as exc:  # not a CUDA driver after all
        info['init_error'] = str(exc)
    return info


def gpu_properties(device_id):
    """``(name, (major, minor))`` of MXNet's ``gpu(device_id)`` from the CUDA driver (the
    same numbering: both follow ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``), or
    ``(None, None)`` when the driver cannot say. Not ``nvidia-smi -i``: it numbers GPUs
    by PCI bus and ignores ``CUDA_VISIBLE_DEVICES``."""
    lib = _libcuda()
    if isinstance(lib, str):
        return None, None
    try:
        if lib.cuInit(0) != 0:
            return None, None
        dev = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), int(device_id)) != 0:
            return None, None
        buf = ctypes.create_string_buffer(256)
        name = buf.value.decode(errors='replace').strip() if lib.cuDeviceGetName(buf, 256, dev) == 0 else None
        major, minor = ctypes.c_int(), ctypes.c_int()
        cc = None
        if (lib.cuDeviceGetAttribute(ctypes.byref(major), _CU_ATTR_CC_MAJOR, dev) == 0
                and lib.cuDeviceGetAttribute(ctypes.byref(minor), _CU_ATTR_CC_MINOR, dev) == 0):
            cc = (major.value, minor.value)
        return name or None, cc
    except AttributeError:
        return None, None


def _driver_note():
    info = cuda_driver_info()
    if info.get('error') == 'no-libcuda':
        return ' (no NVIDIA driver: %s)' % info['detail']
    if info.get('driver_cuda'):
        return ' (NVIDIA driver for CUDA %s)' % _cuda_version_text(info['driver_cuda'])
    return ''


def _cuda_version_text(version):
    return '%d.%d' % (version // 1000, (version % 1000) // 10)


# -- which GPUs this MXNet build has kernels for ---------------------------------------------

# MXNET_CUDA_ARCH of the pip wheels of MXNet 1.9.x, from config/distribution/linux_cu*.cmake
# on branch v1.9.x: SASS only, no PTX, so a GPU runs them only if one entry has its
# major version and a minor version <= its own (8.0 runs on 8.6 and 8.9; nothing runs on 9.0).
WHEEL_CUDA_ARCHS = {
    'cu100': '3.0;5.0;6.0;7.0;7.5', 'cu101': '3.0;5.0;6.0;7.0;7.5', 'cu102': '3.0;5.0;6.0;7.0;7.5',
    'cu110': '5.0;6.0;7.0;8.0',
    'cu111': '5.0;6.0;7.0;8.0;8.6', 'cu112': '5.0;6.0;7.0;8.0;8.6', 'cu113': '5.0;6.0;7.0;8.0;8.6',
    'cu114': '5.0;6.0;7.0;8.0;8.6', 'cu115': '5.0;6.0;7.0;8.0;8.6', 'cu116': '5.0;6.0;7.0;8.0;8.6',
    'cu117': '5.0;6.0;7.0;8.0;8.6'}

_GENERATIONS = {3: 'Kepler', 5: 'Maxwell', 6: 'Pascal', 7: 'Volta/Turing', 8: 'Ampere/Ada', 9: 'Hopper',
                10: 'Blackwell', 12: 'Blackwell'}


@functools.lru_cache(maxsize=None)
def _mxnet_distribution():
    """The pip distribution that installed mxnet (``'mxnet-cu117'``), or None."""
    try:
        import importlib.metadata as metadata
        names = metadata.packages_distributions().get('mxnet') or []
    except Exception:  # noqa: BLE001 - metadata of a broken install: just unknown
        return None
    return names[0] if names else None


def _wheel_tag():
    dist = (_mxnet_distribution() or '').lower()
    match = re.search(r'(cu\d+)', dist)
    return match.group(1) if match else None


def _build_name():
    dist = _mxnet_distribution()
    return dist if dist and _wheel_tag() else 'this MXNet build'


def _build_cuda_version():
    tag = _wheel_tag()
    if not tag:
        return None
    digits = tag[2:]
    return int(digits[:-1]), int(digits[-1])


def _arch_list(tag):
    return [tuple(int(p) for p in a.split('.')) for a in WHEEL_CUDA_ARCHS.get(tag, '').split(';') if a]


def build_supports(cc, tag=None):
    """Whether the wheel ``tag`` (``'cu117'``; default: the installed one) has kernels
    for compute capability ``cc`` = ``(major, minor)``; None when unknown (a source
    build, or an unknown capability)."""
    tag = tag or _wheel_tag()
    archs = _arch_list(tag) if tag else []
    if not archs or not cc:
        return None
    return any(major == cc[0] and minor <= cc[1] for major, minor in archs)


def _arch_advice(cc):
    """What to say after "cannot run this MXNet build: no kernel image ...": what the
    build covers, and what the GPU needs."""
    tag = _wheel_tag()
    archs = _arch_list(tag) if tag else []
    parts = []
    if archs:
        lo, hi = archs[0], archs[-1]
        parts.append('%s has kernels for compute %d.%d-%d.%d only: %s to %s' % (
            _build_name(), lo[0], lo[1], hi[0], hi[1], _GENERATIONS.get(lo[0], '?').split('/')[0],
            _GENERATIONS.get(hi[0], '?').split('/')[-1]))
    hopper = ('Hopper (compute 9.0) needs MXNet 1.9.1 built from source with CUDA 11.8 and 9.0 in '
              'MXNET_CUDA_ARCH')
    # CUDA 11.8 compiles for compute 9.0 at most; Blackwell needs CUDA 12.8, which MXNet
    # 1.9.1 does not build with (apache/mxnet#21190).
    blackwell = ('Blackwell (compute 10.x, 12.x) needs CUDA >= 12.8, which MXNet 1.9.1 does not build '
                 'with: no MXNet 1.9.1 runs on it (train with --cpus)')
    if cc is None:
        parts += [hopper, blackwell]
    elif cc[0] == 9:
        parts.append(hopper)
    elif cc[0] >= 10:
        parts.append(blackwell)
    elif not archs:
        parts.append('rebuild MXNet with %d.%d in MXNET_CUDA_ARCH' % cc)
    elif cc[0] < archs[0][0]:
        parts.append('older GPUs need an older mxnet-cu10x wheel')
    return '; '.join(parts)


# -- probing each GPU ------------------------------------------------------------------------

def _probe_kernels(ctx):
    """A tiny elementwise kernel and a tiny cuDNN convolution (forward and backward) on
    ``ctx``, read back to the host so that asynchronous CUDA errors surface here."""
    import mxnet as mx
    x = mx.nd.ones((1,), ctx=ctx) * 2
    if float(x.asnumpy()[0]) != 2.0:
        raise RuntimeError('wrong result from a test kernel (1 * 2 = %r)' % float(x.asnumpy()[0]))
    data = mx.nd.ones((1, 1, 4, 4), ctx=ctx)
    weight = mx.nd.ones((1, 1, 3, 3), ctx=ctx)
    weight.attach_grad()
    with mx.autograd.record():
        out = mx.nd.Convolution(data, weight, kernel=(3, 3), pad=(1, 1), num_filter=1, no_bias=True)
    out.backward()
    got, grad = out.asnumpy(), weight.grad.asnumpy()
    if float(got[0, 0, 1, 1]) != 9.0 or float(grad.sum()) != 100.0:
        raise RuntimeError('wrong result from a test convolution')


@functools.lru_cache(maxsize=None)
def probe_gpu(device_id):
    """Run a tiny kernel and a cuDNN convolution on MXNet's ``gpu(device_id)``, once per
    process (cached).

    Returns
    -------
    str or None
        None when the GPU works; else one line naming it (its physical number, name and
        compute capability when the driver tells) and the reason, e.g.
        ``GPU 3 (NVIDIA H100 80GB HBM3, compute 9.0) cannot run this MXNet build: no
        kernel image is available for execution on the device (mxnet-cu117 has kernels
        for compute 5.0-8.6 only: Maxwell to Ada; Hopper ...)``.
    """
    import mxnet as mx
    try:
        _run_probe(_probe_kernels, mx.gpu(device_id))
        return None
    except (mx.base.MXNetError, RuntimeError) as exc:
        cause = mxnet_message(exc, limit=300)
    name, cc = gpu_properties(device_id)
    what = ', '.join([p for p in (name, 'compute %d.%d' % cc if cc else None) if p])
    label = 'GPU %s%s' % (physical_gpu(device_id), ' (%s)' % what if what else '')
    if 'no kernel image' in cause or build_supports(cc) is False:
        reason = re.sub(r'^.*ErrStr: ?', '', cause)
        return '%s cannot run %s: %s (%s)' % (label, 'this MXNet build', reason, _arch_advice(cc))
    hint = ''
    if 'out of memory' in cause:
        hint = ' (is another process using it? see nvidia-smi)'
    elif 'busy or unavailable' in cause:
        hint = ' (the GPU is in exclusive-process mode and in use: see nvidia-smi)'
    elif 'CUDNN' in cause.upper():
        hint = ' (cuDNN: check that the cuDNN libraries match %s)' % _build_name()
    return '%s failed a test kernel: %s%s' % (label, cause, hint)


def _run_probe(probe, *args):
    """``probe(*args)``'s result, run with MXNet's native stderr silenced (the C++ side
    logs a failure there too; the caller's one line says it) and the engine's errors of
    failed operators cleared afterwards, whatever happened (:func:`_clear_engine_errors`)."""
    with native_stderr_silenced():
        try:
            return probe(*args)
        finally:
            _clear_engine_errors()


def _clear_engine_errors():
    """Take the errors of failed operators out of MXNet's engine.

    Reading one failed array rethrows its error, but the engine keeps every failed
    operator's error until the next ``waitall`` (``ThreadedEngine::WaitForAll``,
    ``global_exception_refs_``), and the one at exit (``MXNotifyShutdown``) would print
    it as "Exception ignored in atexit callback: _notify_shutdown ...": a second
    message after the probe's one line (seen under doctor on Zen 3, from the bfloat16
    probe's "could not create a primitive descriptor iterator"). Their message is the one already caught."""
    import mxnet as mx
    try:
        mx.nd.waitall()
    except mx.base.MXNetError:
        pass


def _reset_gpu_caches():
    """Forget what was learnt about the GPUs (for tests that fake them)."""
    for fn in (gpu_status, probe_gpu, _libcuda, _mxnet_distribution):
        getattr(fn, 'cache_clear', lambda: None)()  # a test may have replaced one


# -- bfloat16 on CPU ------------------------------------------------------------------------

_CPUINFO = '/proc/cpuinfo'


def cpu_description():
    """``'AMD EPYC 7B13, no AVX-512'``: the CPU model and its AVX-512 / bf16 flags, as every
    benchmark figure and ``doctor`` quote it (speed differs between CPU kinds)."""
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


@contextlib.contextmanager
def native_stderr_silenced():
    """Send file descriptor 2 to /dev/null for a moment. Where the probe fails, MXNet's C++
    side also logs the failure there ('[05:33:00] ../src/operator/nn/mkldnn/
    mkldnn_convolution.cc:139: could not create a primitive descriptor iterator'); that
    failure is the probe's answer, reported in one line by the caller, not news for the user."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, 'w') as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


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
        deviation = _run_probe(_bfloat16_probe)
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
        deviation = _run_probe(_int8_probe)
    except mx.base.MXNetError as exc:
        return False, '%s cannot run int8 convolutions in MXNet %s (%s)' % (cpu, mx.__version__, mxnet_message(exc))
    if not deviation <= 0.05:
        return False, ('%s computes wrong int8 convolutions in MXNet %s (off by %.0f %% of the output)'
                       % (cpu, mx.__version__, 100 * deviation))
    flags = cpu_flags()
    vnni = [f for f in ('avx512_vnni', 'avx_vnni', 'amx_int8') if f in flags]
    return True, ('%s runs int8 convolutions in MXNet %s, %s' % (
        cpu, mx.__version__, 'with %s' % '/'.join(vnni) if vnni else 'without VNNI (int8 may be no faster than float32)'))
