"""Multi-device extras: synchronized BatchNorm and bfloat16 mixed precision on CPU."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from device_checks import (check_amp_trains_and_exports_float32, check_sync_bn_matches_whole_batch,
                           check_sync_bn_uneven_batch_matches_one_device, cpu_contexts)
from gluon_unet.training.loop import fit
from gluon_unet.errors import UserError
from hang import HANG_SECONDS


# The assertions live in device_checks, shared with the GPU lane (tests/test_gpu.py).

def test_sync_bn_on_two_devices_equals_batchnorm_over_the_whole_batch(tiny):
    # Running statistics too: they are the batch statistics of the whole batch.
    check_sync_bn_matches_whole_batch(cpu_contexts, tiny, tol=1e-4)


def test_sync_bn_on_3_devices_with_a_batch_of_8_equals_one_device_on_the_samples_it_trains(tiny):
    # 3, 3, 2 would weigh the third device's statistics as much as the others'.
    check_sync_bn_uneven_batch_matches_one_device(cpu_contexts, tiny, ndev=3, n=8)


def test_sync_bn_refuses_a_batch_size_that_does_not_divide_over_the_devices(tiny):
    with pytest.raises(UserError, match=r'^--batch-size 8 does not divide over the 3 devices: .* use --batch-size '
                                        r'6 or 9, or train without --sync-bn$'):
        fit(tiny(batch_norm=True, sync_bn=True, cpus=3, batch_size=8), verbose=False)
    assert not os.path.exists(tiny().output)


def test_sync_bn_skips_a_batch_smaller_than_the_device_count_instead_of_hanging(tmp_path):
    # 10 training images, batch 3 on 3 devices: the last batch has 1 sample < 3 devices.
    # A regression deadlocks inside MXNet (SyncBatchNorm's barrier has no timeout), so it
    # runs in a child process with a time limit: a hang fails the test, not the CI job.
    script = textwrap.dedent('''
        import json, pathlib, sys
        sys.path.insert(0, sys.argv[2])
        from conftest import tiny_config
        from gluon_unet.training.loop import fit
        cfg = tiny_config(pathlib.Path(sys.argv[1]), batch_norm=True, sync_bn=True, cpus=3,
                          synthetic_count=11, val_split=0.1, batch_size=3, epochs=1)
        print(json.dumps([r['train_loss'] for r in fit(cfg, verbose=False)]))
    ''')
    try:
        done = subprocess.run([sys.executable, '-c', script, str(tmp_path), os.path.dirname(__file__)],
                              capture_output=True, text=True, timeout=HANG_SECONDS, cwd=str(tmp_path), env=_env())
    except subprocess.TimeoutExpired:
        pytest.fail('SyncBatchNorm training hung on a batch smaller than the device count')
    assert done.returncode == 0, done.stderr[-2000:]
    losses = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(losses) == 1 and np.isfinite(losses[0])
    log = (tmp_path / 'run' / 'train.log').read_text()
    assert 'epoch 1: 1 sample(s) of the last batch left out: with --sync-bn each of the 3 devices' in log


def test_sync_bn_on_cpu_contexts_does_not_hang_with_a_single_scratch_buffer(tmp_path):
    # All CPU contexts share MXNet's pool of scratch buffers (MXNET_CPU_TEMP_COPY copies,
    # src/resource.cc) and cpu(0)'s engine worker; with one buffer, SyncBatchNorm on 3
    # contexts hung within 24 steps in 8 runs of 8 while each step was queued behind the
    # last (fit() likewise: 6 of 6). 48 steps as fit() runs them (train_epoch reads the
    # losses two steps late), under a time limit: a hang fails the test, not the CI job.
    script = textwrap.dedent('''
        import json, pathlib, sys
        sys.path.insert(0, sys.argv[2])
        import mxnet as mx, numpy as np
        from conftest import tiny_config
        from gluon_unet.data import synthetic_nuclei
        from gluon_unet.training.step import build_network, make_step, train_epoch
        from gluon_unet.training.stops import StopFlag
        cfg = tiny_config(pathlib.Path(sys.argv[1]), batch_norm=True, sync_bn=True, cpus=3, batch_size=3)
        ctxs = [mx.cpu(i) for i in range(3)]
        step = make_step(cfg, build_network(cfg, ctxs), ctxs)
        images, masks, _ = synthetic_nuclei(12, size=32, seed=0)
        x, y = images.transpose(0, 3, 1, 2).astype(np.float32) / 255, masks[:, None].astype(np.float32)
        batches = [(mx.nd.array(x[i:i + 3]), mx.nd.array(y[i:i + 3])) for i in range(0, 12, 3)]
        for epoch in range(12):
            print(json.dumps(train_epoch(step, batches, epoch, StopFlag())['train_loss']), flush=True)
    ''')
    env = dict(_env(), MXNET_CPU_TEMP_COPY='1')
    try:
        done = subprocess.run([sys.executable, '-c', script, str(tmp_path), os.path.dirname(__file__)],
                              capture_output=True, text=True, timeout=HANG_SECONDS, cwd=str(tmp_path), env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail('SyncBatchNorm on 3 CPU contexts hung with MXNET_CPU_TEMP_COPY=1 (after %d of 12 epochs of '
                    '4 steps)' % len((exc.stdout or b'').splitlines()))
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert len(losses) == 12 and np.all(np.isfinite(losses))


@pytest.mark.usefixtures('requires_bf16')
def test_bfloat16_amp_trains_on_cpu_and_exports_float32(tmp_path):
    check_amp_trains_and_exports_float32(tmp_path, {'cpus': 2})


def _env():
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env['PYTHONPATH'] = root + os.pathsep + env.get('PYTHONPATH', '')
    return env
