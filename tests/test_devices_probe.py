"""GPU checks on a machine without GPUs: MXNet and the CUDA driver are faked at the lowest
level (the calls devices.py makes), with the texts MXNet 1.9.1 and CUDA really produce,
so the one-line messages a user with a GPU would read are tested here.

- a GPU this build has no kernels for (Hopper under mxnet-cu117) stops ``--gpus`` with one
  line naming the GPU, its compute capability and what to do;
- each GPU is probed once per process;
- ``num_gpus() == 0`` on a CUDA build says why (no driver, driver too old, CUDA error,
  CUDA_VISIBLE_DEVICES), never a bare "no GPU found";
- ``--gpus 4-7`` renumbered by CUDA_VISIBLE_DEVICES maps onto gpu(0..3) and still says
  "GPU 4" in messages and logs.
"""
import ctypes
import os
import subprocess
import sys

import mxnet as mx
import pytest

from gluon_unet.machine import devices, gpus as hardware, runtime
from gluon_unet.errors import UserError
from hang import HANG_SECONDS

# What MXNet 1.9.1 raises at the first kernel on a GPU its wheel has no SASS for
# (src/operator/mxnet_op.h:1120, MSHADOW_CUDA_POST_KERNEL_CHECK; apache/mxnet#21166).
NO_KERNEL_IMAGE = ('Traceback (most recent call last):\n'
                   '  File "../src/operator/mxnet_op.h", line 1120\n'
                   'MXNetError: Check failed: err == cudaSuccess (209 vs. 0) : Name: mxnet_generic_kernel '
                   'ErrStr:no kernel image is available for execution on the device')
OUT_OF_MEMORY = ('Traceback (most recent call last):\n'
                 '  File "../src/storage/./pooled_storage_manager.h", line 197\n'
                 'MXNetError: cudaMalloc retry failed: out of memory')
# Context::GetGPUCount (include/mxnet/base.h:458) on a driver/library mismatch.
DRIVER_MISMATCH = ('Traceback (most recent call last):\n'
                   '  File "../include/mxnet/base.h", line 458\n'
                   'MXNetError: Check failed: e == cudaSuccess (803 vs. 0) :  CUDA: system has unsupported '
                   'display driver / cuda driver combination')
H100 = ('NVIDIA H100 80GB HBM3', (9, 0))
A100 = ('NVIDIA A100-SXM4-80GB', (8, 0))


@pytest.fixture
def fake_gpus(monkeypatch):
    """A CUDA build of mxnet-cu117 that sees ``state['count']`` GPUs (A100s unless
    ``state['props']`` says otherwise); ``state['fail'][i]`` is the MXNetError text the
    probe kernels raise on gpu(i); ``state['calls']`` records the probes run."""
    hardware._reset_gpu_caches()
    state = {'count': 8, 'props': {}, 'fail': {}, 'calls': []}

    def probe(ctx):
        assert ctx.device_type == 'gpu'
        state['calls'].append(ctx.device_id)
        if ctx.device_id in state['fail']:
            raise mx.base.MXNetError(state['fail'][ctx.device_id])

    monkeypatch.setattr(hardware, '_cuda_enabled', lambda: True)
    monkeypatch.setattr(hardware, '_mxnet_gpu_count', lambda: state['count'])
    monkeypatch.setattr(hardware, '_probe_kernels', probe)
    monkeypatch.setattr(hardware, 'gpu_properties', lambda i: state['props'].get(i, A100))
    monkeypatch.setattr(hardware, '_mxnet_wheel', lambda: 'mxnet-cu117')
    monkeypatch.delenv('CUDA_VISIBLE_DEVICES', raising=False)
    monkeypatch.setattr(hardware, '_renumbered', None)
    monkeypatch.setattr(runtime, '_applied', dict(runtime._applied))
    yield state
    hardware._reset_gpu_caches()


def _error(spec):
    with pytest.raises(UserError) as e:
        devices.make_contexts(spec)
    msg = str(e.value)
    assert '\n' not in msg and msg.startswith('--gpus ')
    return msg


# -- the probe ------------------------------------------------------------------------------

def test_a_gpu_without_kernels_in_this_build_stops_gpus_in_one_line(fake_gpus):
    fake_gpus['props'][3] = H100
    fake_gpus['fail'][3] = NO_KERNEL_IMAGE
    assert _error('3') == (
        '--gpus 3: GPU 3 (NVIDIA H100 80GB HBM3, compute 9.0) cannot run this MXNet build: no kernel image is '
        'available for execution on the device (mxnet-cu117 has kernels for compute 5.0-8.6 only: Maxwell to '
        'Ada; Hopper (compute 9.0) needs MXNet 1.9.1 built from source with CUDA 11.8 and 9.0 in MXNET_CUDA_ARCH)')
    # In a list, the first GPU that fails is named.
    assert _error('0-7').startswith('--gpus 0-7: GPU 3 (NVIDIA H100 80GB HBM3, compute 9.0) cannot run')


def test_the_message_does_without_name_and_capability(fake_gpus, monkeypatch):
    monkeypatch.setattr(hardware, 'gpu_properties', lambda i: (None, None))
    monkeypatch.setattr(hardware, '_mxnet_wheel', lambda: None)  # a source build
    fake_gpus['fail'][0] = NO_KERNEL_IMAGE
    msg = _error('0')
    assert msg.startswith('--gpus 0: GPU 0 cannot run this MXNet build: no kernel image is available')
    assert 'Hopper (compute 9.0) needs MXNet 1.9.1 built from source with CUDA 11.8' in msg
    assert 'Blackwell (compute 10.x, 12.x) needs CUDA >= 12.8' in msg


def test_a_blackwell_gpu_is_not_sent_to_cuda_11_8(fake_gpus):
    # CUDA 11.8 compiles for compute 9.0 at most; sm_100 / sm_120 need CUDA 12.8, which
    # MXNet 1.9.1 does not build with.
    fake_gpus['props'][0] = ('NVIDIA B200', (10, 0))
    fake_gpus['fail'][0] = NO_KERNEL_IMAGE
    msg = _error('0')
    assert msg.startswith('--gpus 0: GPU 0 (NVIDIA B200, compute 10.0) cannot run this MXNet build: no kernel image')
    assert msg.endswith('Blackwell (compute 10.x, 12.x) needs CUDA >= 12.8, which MXNet 1.9.1 does not build '
                        'with: no MXNet 1.9.1 runs on it (train with --cpus))')
    assert '11.8' not in msg


def test_other_probe_failures_name_the_gpu_and_the_cause(fake_gpus):
    fake_gpus['fail'][1] = OUT_OF_MEMORY
    assert _error('0,1') == ('--gpus 0,1: GPU 1 (NVIDIA A100-SXM4-80GB, compute 8.0) failed a test kernel: '
                             'cudaMalloc retry failed: out of memory (is another process using it? see nvidia-smi)')


def test_each_gpu_is_probed_once_per_process(fake_gpus):
    assert devices.make_contexts('0-3') == [mx.gpu(i) for i in range(4)]
    assert devices.make_contexts('0-3') == [mx.gpu(i) for i in range(4)]
    assert devices.make_contexts('2,5') == [mx.gpu(2), mx.gpu(5)]
    assert fake_gpus['calls'] == [0, 1, 2, 3, 5]


def test_cpu_runs_probe_nothing(fake_gpus):
    assert devices.make_contexts('', 2) == [mx.cpu(0), mx.cpu(1)]
    assert fake_gpus['calls'] == []


def test_the_probe_kernels_themselves_run_on_a_cpu_context():
    # The same operators, read back the same way, as on each GPU.
    hardware._probe_kernels(mx.cpu())


def test_build_supports_follows_the_wheels_arch_lists():
    # SASS only: same major, minor <= the GPU's (8.0 runs on 8.6 and Ada's 8.9).
    for cc, ok in [((5, 2), True), ((6, 1), True), ((7, 5), True), ((8, 0), True), ((8, 6), True),
                   ((8, 9), True), ((9, 0), False), ((10, 0), False), ((12, 0), False), ((3, 7), False)]:
        assert hardware.build_supports(cc, 'cu117') is ok, cc
    assert hardware.build_supports((3, 7), 'cu102') is True
    assert hardware.build_supports((8, 6), 'cu110') is True
    assert hardware.build_supports((9, 0), None) is None or hardware._wheel_tag() is not None


MXNET_SOURCE = '/work/.mirror/apache+mxnet/repo'


@pytest.mark.skipif(not os.path.isdir(MXNET_SOURCE), reason='no copy of the MXNet source here')
def test_the_arch_table_is_mxnets_own():
    for tag, archs in hardware.WHEEL_CUDA_ARCHS.items():
        text = subprocess.run(['git', '-C', MXNET_SOURCE, 'show', 'v1.9.x:config/distribution/linux_%s.cmake' % tag],
                              capture_output=True, text=True, timeout=HANG_SECONDS).stdout
        assert 'set(MXNET_CUDA_ARCH "%s"' % archs in text, tag
        assert 'PTX' not in text


# -- why no GPU -----------------------------------------------------------------------------

class FakeCuda:
    """libcuda.so.1's driver API as ctypes sees it: each call returns a CUresult."""

    def __init__(self, version=12020, init=0, count=0, name=b'NVIDIA H100 80GB HBM3', cc=(9, 0)):
        self.version, self.init, self.count, self.name, self.cc = version, init, count, name, cc

    def cuDriverGetVersion(self, ref):
        ref._obj.value = self.version
        return 0

    def cuInit(self, flags):
        return self.init

    def cuDeviceGetCount(self, ref):
        ref._obj.value = self.count
        return 0

    def cuDeviceGet(self, ref, ordinal):
        ref._obj.value = ordinal
        return 0 if ordinal < self.count else 101

    def cuDeviceGetName(self, buf, size, dev):
        ctypes.memmove(buf, self.name + b'\0', len(self.name) + 1)
        return 0

    def cuDeviceGetAttribute(self, ref, attr, dev):
        ref._obj.value = {75: self.cc[0], 76: self.cc[1]}[attr]
        return 0

    def cuGetErrorString(self, code, ref):
        ref._obj.value = {100: b'no CUDA-capable device is detected',
                          999: b'unknown error'}.get(code, b'')
        return 0


@pytest.fixture
def cuda_build_without_gpus(fake_gpus, monkeypatch):
    fake_gpus['count'] = 0
    return lambda lib: monkeypatch.setattr(hardware, '_libcuda', lambda: lib)


def test_a_cuda_error_listing_the_gpus_is_shown_not_called_no_gpu(fake_gpus, monkeypatch):
    def fails():
        raise mx.base.MXNetError(DRIVER_MISMATCH)
    monkeypatch.setattr(hardware, '_mxnet_gpu_count', fails)
    monkeypatch.setattr(hardware, '_libcuda', lambda: FakeCuda(version=11040))
    assert hardware.num_gpus() == 0
    msg = _error('0')
    assert msg == ('--gpus 0: mxnet-cu117 cannot list the GPUs: Check failed: e == cudaSuccess (803 vs. 0) :  CUDA: '
                   'system has unsupported display driver / cuda driver combination (NVIDIA driver for CUDA 11.4); '
                   'drop --gpus and use --cpus N, or fix CUDA')
    assert 'no GPU found' not in msg


def test_no_driver_library_is_named(cuda_build_without_gpus):
    cuda_build_without_gpus('libcuda.so.1 not found (cannot open shared object file)')
    assert _error('all') == (
        '--gpus all: no NVIDIA driver: libcuda.so.1 not found (cannot open shared object file) (available: cpu); '
        'install the NVIDIA driver (in Docker: run with --gpus all and the NVIDIA Container Toolkit), or drop '
        '--gpus and use --cpus N')


def test_a_driver_too_old_for_the_build_is_named(cuda_build_without_gpus):
    # MXNet returns 0 GPUs for cudaErrorInsufficientDriver (base.h:455), silently.
    cuda_build_without_gpus(FakeCuda(version=10020, count=2))
    msg = _error('0-1')
    assert msg.startswith('--gpus 0-1: the NVIDIA driver supports CUDA 10.2 only, mxnet-cu117 needs a driver '
                          'for CUDA 11.x')


def test_a_driver_that_cannot_start_cuda_is_named(cuda_build_without_gpus):
    cuda_build_without_gpus(FakeCuda(init=100))
    assert _error('0') == ('--gpus 0: the NVIDIA driver (CUDA 12.2) cannot start CUDA: no CUDA-capable device is '
                           'detected (CUDA driver error 100) (available: cpu); check nvidia-smi, or drop --gpus '
                           'and use --cpus N')


def test_cuda_visible_devices_hiding_the_gpus_is_named(cuda_build_without_gpus, monkeypatch):
    cuda_build_without_gpus(FakeCuda(count=0))
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '')
    assert "CUDA_VISIBLE_DEVICES='' hides every GPU" in _error('0')
    hardware._reset_gpu_caches()
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '9')
    assert 'CUDA_VISIBLE_DEVICES=9 names none that exists' in _error('0')


def test_gpu_properties_come_from_the_driver_in_cudas_numbering(monkeypatch):
    monkeypatch.setattr(hardware, '_libcuda', lambda: FakeCuda(count=2))
    assert hardware.gpu_properties(1) == H100
    assert hardware.gpu_properties(2) == (None, None)  # no such device
    monkeypatch.setattr(hardware, '_libcuda', lambda: 'libcuda.so.1 not found ()')
    assert hardware.gpu_properties(0) == (None, None)


def test_this_cpu_build_says_it_has_no_cuda():
    hardware._reset_gpu_caches()
    count, reason = hardware.gpu_status()
    assert count == 0 and reason.startswith('this mxnet build has no CUDA support (available: cpu)')


# -- renumbered GPUs ------------------------------------------------------------------------

@pytest.fixture
def renumbered(fake_gpus, monkeypatch):
    """As after ``bin/train --gpus 4-7``: CUDA_VISIBLE_DEVICES=4,5,6,7 set by gluon_unet."""
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '4,5,6,7')
    monkeypatch.setitem(runtime._applied, 'CUDA_VISIBLE_DEVICES', '4,5,6,7')
    monkeypatch.setattr(hardware, '_renumbered', [4, 5, 6, 7])
    fake_gpus['count'] = 4
    return fake_gpus


def test_renumbered_gpus_map_onto_the_visible_devices(renumbered):
    ctxs = devices.make_contexts('4-7')
    assert ctxs == [mx.gpu(i) for i in range(4)]
    assert devices.context_names(ctxs) == 'gpu(0)=GPU 4,gpu(1)=GPU 5,gpu(2)=GPU 6,gpu(3)=GPU 7'
    assert devices.make_contexts('5,7') == [mx.gpu(1), mx.gpu(3)]
    assert devices.make_contexts('all') == ctxs
    assert 'GPU 3 is not visible to this process (CUDA_VISIBLE_DEVICES=4,5,6,7' in _error('3')


def test_renumbered_gpus_are_named_by_their_own_number(renumbered):
    renumbered['props'][0] = H100
    renumbered['fail'][0] = NO_KERNEL_IMAGE
    assert _error('4-7').startswith('--gpus 4-7: GPU 4 (NVIDIA H100 80GB HBM3, compute 9.0) cannot run this MXNet')


def test_requested_gpus_that_do_not_exist_are_named(renumbered):
    # CUDA stops at the first id in CUDA_VISIBLE_DEVICES that does not exist: 6 on a
    # 6-GPU machine leaves MXNet 4, 5.
    renumbered['count'] = 2
    assert _error('4-7') == ('--gpus 4-7: no GPU 6,7 on this machine (CUDA_VISIBLE_DEVICES=4,5,6,7, set from '
                             '--gpus, shows MXNet 2 GPU(s))')


def test_a_users_cuda_visible_devices_is_indexed_as_cuda_does(fake_gpus, monkeypatch):
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '2,3')
    fake_gpus['count'] = 2
    assert runtime.gpu_renumbering() is None
    ctxs = devices.make_contexts('1')
    assert ctxs == [mx.gpu(1)] and devices.context_names(ctxs) == 'gpu(1)=GPU 3'
    assert 'no GPU 2 on this machine (available: gpu 0-1)' in _error('2')
    fake_gpus['fail'][0] = NO_KERNEL_IMAGE
    assert _error('0').startswith('--gpus 0: GPU 2 (NVIDIA A100-SXM4-80GB, compute 8.0) cannot run')


def test_context_names_without_renumbering():
    assert devices.context_names([mx.cpu(0), mx.cpu(1)]) == 'cpu(0),cpu(1)'
    if 'CUDA_VISIBLE_DEVICES' not in os.environ:
        assert devices.context_names([mx.gpu(0), mx.gpu(1)]) == 'gpu(0),gpu(1)'


# A GPU that fails the probe, on this CPU machine: the fakes of fake_gpus, and probe kernels
# whose operators fail inside MXNet's engine (LAPACK refuses a matrix that is not positive
# definite), the first read rethrowing one error and the other failed operator left behind,
# as on a GPU without kernels for this build.
PROBE_FAILS_IN_THE_ENGINE = '''
import sys
sys.path.insert(0, sys.argv[1])
import mxnet as mx
from gluon_unet.machine import gpus as hardware
from gluon_unet.cli import train_main

def failing_kernels(ctx):
    bad = mx.nd.array([[-1.0]])
    first = mx.nd.linalg.potrf(bad)
    second = mx.nd.linalg.potrf(bad * 2)
    first.asnumpy()

hardware._cuda_enabled = lambda: True
hardware._mxnet_gpu_count = lambda: 1
hardware.gpu_properties = lambda i: ('NVIDIA H100 80GB HBM3', (9, 0))
hardware._mxnet_wheel = lambda: 'mxnet-cu117'
hardware._probe_kernels = failing_kernels
sys.exit(train_main(['--gpus', '0', '--output', sys.argv[2], '--no-progress']))
'''


def test_a_failed_probe_prints_one_line_and_leaves_no_error_in_the_engine(tmp_path):
    # The failed operators' errors stayed in the engine, and the waitall at exit printed
    # one of them again: "Exception ignored in atexit callback: _notify_shutdown ...".
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env.pop('CUDA_VISIBLE_DEVICES', None)
    # A time-out only against a hang: a busy machine took over 120 s to import and probe.
    done = subprocess.run([sys.executable, '-c', PROBE_FAILS_IN_THE_ENGINE, root, str(tmp_path / 'run')],
                          capture_output=True, text=True, timeout=HANG_SECONDS, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith('error: --gpus 0: GPU 0 (NVIDIA H100 80GB HBM3, compute 9.0) cannot run this MXNet '
                               'build: Check failed: ret == 0')
    assert not (tmp_path / 'run').exists()
