"""What this machine's GPUs can do, asked of the CUDA driver and MXNet.

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
  renumbered them (:func:`set_gpu_renumbering`).

mxnet is imported inside the functions that need it. The CPU's features are
:mod:`gluon_unet.machine.cpu`; turning ``--gpus`` / ``--cpus`` into contexts is
:mod:`gluon_unet.machine.devices`.
"""
import ctypes
import functools
import os
import re

from ..errors import mxnet_message
from .probe import run_probe

# The GPU ids runtime.restrict_visible_gpus() made visible (CUDA_VISIBLE_DEVICES), in
# order: MXNet's gpu(i) is GPU _renumbered[i]. None when this process renumbered none.
_renumbered = None


def set_gpu_renumbering(ids):
    """Record that ``CUDA_VISIBLE_DEVICES`` now shows MXNet GPUs ``ids`` (None: none);
    called by :func:`gluon_unet.machine.runtime.restrict_visible_gpus`."""
    global _renumbered
    _renumbered = None if ids is None else [int(i) for i in ids]


def gpu_renumbering():
    """The GPU ids :func:`gluon_unet.machine.runtime.restrict_visible_gpus` left visible
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
def _mxnet_wheel():
    """The pip distribution that installed mxnet (``'mxnet-cu117'``), or None."""
    try:
        import importlib.metadata as metadata
        names = metadata.packages_distributions().get('mxnet') or []
    except Exception:  # noqa: BLE001 - metadata of a broken install: just unknown
        return None
    return names[0] if names else None


def _wheel_tag():
    dist = (_mxnet_wheel() or '').lower()
    match = re.search(r'(cu\d+)', dist)
    return match.group(1) if match else None


def _build_name():
    dist = _mxnet_wheel()
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
        run_probe(_probe_kernels, mx.gpu(device_id))
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


def _reset_gpu_caches():
    """Forget what was learnt about the GPUs (for tests that fake them)."""
    for fn in (gpu_status, probe_gpu, _libcuda, _mxnet_wheel):
        getattr(fn, 'cache_clear', lambda: None)()  # a test may have replaced one
