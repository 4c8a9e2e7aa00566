"""Shared fixtures: tiny configs so the whole suite runs in minutes on 2 CPU cores."""
import json
import os
import signal
import subprocess
import sys
import uuid
import warnings

import pytest

from hang import HANG_SECONDS

# Tests check correctness, not speed: one OpenMP thread per process keeps the multi-process
# tests (launcher jobs of 4 processes, subprocess CLIs) from oversubscribing small CI
# machines. Set before gluon_unet (and so mxnet) is imported; inherited by subprocesses.
os.environ.setdefault('OMP_NUM_THREADS', '1')
# The GPU lane compares float32 results with CPU ones: no TF32 in cuDNN/cuBLAS on Ampere+
# (read when they initialize, at the first GPU operation; no effect without GPUs).
os.environ.setdefault('NVIDIA_TF32_OVERRIDE', '0')
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))
sys.path.insert(0, ROOT)
warnings.filterwarnings('ignore', category=DeprecationWarning)

from gluon_unet.config import ModelConfig, TrainConfig  # noqa: E402


def tiny_config(tmp_path, **overrides):
    """A TrainConfig small enough for tests (width 4, depth 2, 32 px)."""
    model = ModelConfig(in_channels=1, width=4, depth=2, batch_norm=False)
    for key in [k for k in overrides if hasattr(model, k)]:
        setattr(model, key, overrides.pop(key))
    base = dict(model=model, size=32, epochs=2, batch_size=8, synthetic_count=24, workers=0,
                output=str(tmp_path / 'run'), progress=False, augment=False, patience=0)
    base.update(overrides)
    return TrainConfig(**base)


def write_config(path, cfg):
    """``cfg`` as the JSON file ``bin/train --config`` reads; returns its path."""
    with open(path, 'w') as f:
        json.dump(cfg.to_dict(), f)
    return str(path)


def load_dump(path):
    """The arrays of one ``.npz`` parameter dump (tests/dist_helper.py) as a dict."""
    import numpy as np  # here: this module sets OMP_NUM_THREADS before anything loads numpy
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


class UnhandledSignal(Exception):
    """What a signal does in the stop tests when gluon_unet has no handler for it (instead
    of ending the test run)."""


@pytest.fixture
def guarded_signals():
    """SIGTERM's and SIGHUP's default end the process: where gluon_unet lacks a handler,
    the test fails with :class:`UnhandledSignal` instead of ending the test run (the stop
    tests use it: ``pytestmark = pytest.mark.usefixtures('guarded_signals')``)."""
    def unhandled(signum, frame):
        raise UnhandledSignal(signal.Signals(signum).name)
    old = {s: signal.signal(s, unhandled) for s in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, handler in old.items():
        signal.signal(s, handler)


@pytest.fixture
def tiny(tmp_path):
    return lambda **kw: tiny_config(tmp_path, **kw)


def skip_unless_cpu_bfloat16():
    """Skip the calling test, with the probe's reason, when this CPU cannot run bfloat16.

    MXNet 1.9.1's oneDNN has no bfloat16 convolution without AVX-512 (e.g. AMD Zen 3):
    there a bf16 AMP network fails at its first forward. Only that case skips; on a CPU
    that passes the probe, a failing bf16 test is a real failure.
    """
    from gluon_unet.machine.cpu import cpu_bfloat16_support
    ok, reason = cpu_bfloat16_support()
    if not ok:
        pytest.skip(reason)


@pytest.fixture
def requires_bf16():
    """For tests that train with bfloat16 AMP on CPU (``amp=True`` / ``--amp``):
    ``@pytest.mark.usefixtures('requires_bf16')``."""
    skip_unless_cpu_bfloat16()


#: The model.json :func:`export_brightness_model` writes unless told otherwise.
def export_names():
    """The files an export holds here, sorted: with ``model.onnx`` where the onnx package
    is installed (exports write it by default then), without it elsewhere."""
    from gluon_unet.inference.export_onnx import onnx_available
    return sorted(['model-0000.params', 'model-symbol.json', 'model.json'] + (['model.onnx'] if onnx_available()[0]
                                                                              else []))


BRIGHTNESS_SIDECAR = {'in_channels': 1, 'classes': 1, 'multiple': 4, 'train_size': 32,
                      'resize_mode': 'resize', 'threshold': 0.5}


def export_brightness_model(folder, sidecar=BRIGHTNESS_SIDECAR):
    """Export a 1x1 conv segmenting bright nuclei (tiny, 32 px) into ``folder`` the way
    export_checkpoint does; returns ``folder``. ``sidecar``: a dict is written to
    model.json as JSON, a string as it is (broken sidecars), None writes no model.json."""
    import json
    import mxnet as mx

    os.makedirs(folder, exist_ok=True)
    net = mx.gluon.nn.Conv2D(1, 1, in_channels=1)
    net.initialize(mx.init.Constant(20.0))
    net.bias.set_data(mx.nd.array([-10.0]))
    net.hybridize()
    net(mx.nd.zeros((1, 1, 32, 32)))
    net.export(os.path.join(folder, 'model'), epoch=0)
    if sidecar is not None:
        with open(os.path.join(folder, 'model.json'), 'w') as f:
            f.write(sidecar if isinstance(sidecar, str) else json.dumps(sidecar))
    return folder


def unet_twin(seed, x, hybridize=True, **unet_kwargs):
    """A small UNet built with ``unet_kwargs`` (seeded, Xavier), one forward and backward of
    ``sum(y**2)`` on ``x``: ``(net, structural parameter names, y, x's gradient)``. For tests
    that two builds of the network are the same function with the same parameters."""
    import mxnet as mx
    from gluon_unet.model import UNet
    mx.random.seed(seed)
    net = UNet(**unet_kwargs)
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize()
    xg = x.copy()
    xg.attach_grad()
    with mx.autograd.record():
        y = net(xg)
        loss = (y * y).sum()
    loss.backward()
    return net, sorted(net._collect_params_with_prefix()), y.asnumpy(), xg.grad.asnumpy()


def nuclei_png(seed, size=40):
    """The PNG bytes of one grey synthetic nuclei image."""
    import cv2
    from gluon_unet.data.synthetic import synthetic_nuclei
    image = synthetic_nuclei(1, size=size, channels=1, seed=seed)[0][0]
    return cv2.imencode('.png', image)[1].tobytes()


def run_cli(main, argv):
    """A CLI ``main``'s exit code, also for argparse's SystemExit (usage errors, --help)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def pids_with(marker):
    """PIDs whose command line contains ``marker`` (read from /proc: no psutil), this
    process excluded: how the tests that start process trees find what is left of them."""
    found = []
    for pid in os.listdir('/proc'):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open('/proc/%s/cmdline' % pid, 'rb') as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def reaped_tag(prefix):
    """A unique tag (``prefix-<hex>``) for a test's processes to carry on their command
    line; a generator for a fixture: after the test, leftovers are killed and reported."""
    tag = '%s-%s' % (prefix, uuid.uuid4().hex[:12])
    yield tag
    left = pids_with(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, 'processes left behind: %s' % left


def run_in_own_group(argv, timeout=HANG_SECONDS, **kw):
    """``(exit code, stdout + stderr)`` of ``argv`` run from the repository root in a
    process group of its own; on ``timeout`` seconds the whole group is killed (workers it
    forked too) and the test fails with its output."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=ROOT, **kw)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        pytest.fail('timed out after %ds:\n%s' % (timeout, out.decode(errors='replace')[-3000:]))
    return proc.returncode, out.decode(errors='replace')


# -- the GPU lane ---------------------------------------------------------------------------

def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` (``@pytest.mark.gpu`` or ``@pytest.mark.gpu(min_gpus=2)``) run
    where MXNet sees enough GPUs; elsewhere they are collected and skipped with the reason
    from :func:`gluon_unet.machine.gpus.gpu_status` (``pytest -m gpu -rs`` prints it)."""
    marked = [item for item in items if item.get_closest_marker('gpu')]
    if not marked:
        return
    from gluon_unet.machine.gpus import gpu_status
    count, reason = gpu_status()
    for item in marked:
        need = item.get_closest_marker('gpu').kwargs.get('min_gpus', 1)
        if count == 0:
            item.add_marker(pytest.mark.skip(reason='no GPU: %s' % reason))
        elif count < need:
            item.add_marker(pytest.mark.skip(reason='needs %d GPUs: MXNet sees %d' % (need, count)))
