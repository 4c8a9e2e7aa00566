"""A device that fails in the first SyncBatchNorm step is named, instead of a hang.

The failing device never reaches SyncBatchNorm's barrier, and MXNet's barrier has no
timeout: the other devices' operators wait forever. Each case runs in a subprocess (its
engine stays stuck afterwards, as it would for a user) with a timeout, so a regression
fails the test instead of hanging the suite.
"""
import os
import subprocess
import sys

import pytest
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import os, sys, faulthandler
faulthandler.dump_traceback_later(100, exit=True)  # where it hangs, if it ever does
sys.path.insert(0, %(root)r)
import mxnet as mx
from gluon_unet.config import ModelConfig, TrainConfig
from gluon_unet.training.parallel import DeviceFailure
from gluon_unet.training.step import build_network, make_step

cfg = TrainConfig(model=ModelConfig(in_channels=1, width=4, depth=2, batch_norm=True), size=32,
                  sync_bn=True, cpus=2, batch_size=4)
ctxs = [mx.cpu(0), mx.cpu(1)]
net = build_network(cfg, ctxs)
step = make_step(cfg, net, ctxs)
step.failure_grace_s = 2.0
real_loss, real_net = step.loss_fn, step.net


def loss(logits, y, w):
    if logits.context == mx.cpu(1) and %(mode)r == 'queue':
        raise RuntimeError('simulated driver error')  # fails while its work is being queued
    return real_loss(logits, y, w)


# Made here, not in the device threads: creating an array waits on cpu(0)'s engine worker.
not_positive_definite = mx.nd.array([[-1.0]], ctx=mx.cpu(0))


class FailingInput:
    """Device 0's input comes from an op that fails inside the engine (a LAPACK error,
    as an allocation failure would), so device 0 never reaches a SyncBatchNorm. Device 0,
    not 1: MXNet serves every wait_to_read on cpu(0)'s worker, so on CPU contexts the
    waiting device must not be cpu(0) (on GPUs any device can fail)."""

    def __call__(self, x):
        if x.context == mx.cpu(0) and %(mode)r == 'engine':
            x = x + mx.nd.linalg.potrf(not_positive_definite).sum()
        return real_net(x)

    def collect_params(self, *args):
        return real_net.collect_params(*args)


step.loss_fn, step.net = loss, FailingInput()
x = mx.nd.random.uniform(shape=(4, 1, 32, 32))
try:
    step(x, mx.nd.zeros((4, 1, 32, 32)), mx.nd.ones((4, 1, 32, 32)))
except DeviceFailure as exc:
    print('DeviceFailure:', exc, exc.process_unusable, flush=True)
    os._exit(0)
print('no failure reported', flush=True)
os._exit(1)
'''


@pytest.mark.parametrize('mode', ['queue', 'engine'])
def test_a_failing_device_in_the_first_syncbn_step_is_named_not_a_hang(mode):
    done = subprocess.run([sys.executable, '-c', SCRIPT % {'root': ROOT, 'mode': mode}],
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stdout + done.stderr
    line = [l for l in done.stdout.splitlines() if l.startswith('DeviceFailure')][0]
    failing = 'cpu(1)' if mode == 'queue' else 'cpu(0)'
    assert '%s failed at the first training step' % failing in line
    assert ('simulated' in line or 'potrf' in line) and '--sync-bn' in line and line.endswith('True')


def test_the_cli_exits_at_once_when_the_engine_is_stuck():
    # What bin/train's entry point does with a DeviceFailure: print one line and leave,
    # without the interpreter's exit waiting for the stuck engine.
    script = SCRIPT.split("try:\n    step(")[0] % {'root': ROOT, 'mode': 'engine'} + r'''
from gluon_unet.cli.common import reports_errors

@reports_errors
def main(argv=None):
    step(x, mx.nd.zeros((4, 1, 32, 32)), mx.nd.ones((4, 1, 32, 32)))
    return 0

sys.exit(main())
'''
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 1, done.stderr
    lines = [l for l in done.stderr.splitlines() if l.startswith('error:')]
    assert len(lines) == 1 and 'cpu(0) failed at the first training step' in lines[0]
    assert 'Traceback' not in done.stderr
