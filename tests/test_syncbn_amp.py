"""Multi-device extras: synchronized BatchNorm and bfloat16 mixed precision on CPU."""
import json
import os
import subprocess
import sys
import textwrap

import mxnet as mx
import numpy as np
import pytest

from gluon_unet.data import synthetic_nuclei
from gluon_unet.engine import build_network
from gluon_unet.losses import SegmentationLoss
from gluon_unet.optim import make_trainer
from gluon_unet.parallel import DataParallelStep


def _one_step(cfg, ndev, x, y, steps=2):
    ctxs = [mx.cpu(i) for i in range(ndev)]
    net = build_network(cfg, ctxs)
    trainer = make_trainer(net.collect_params(), 'sgd', 0.5, ctxs, momentum=0.0)
    step = DataParallelStep(net, SegmentationLoss('bce'), trainer, ctxs, sync_bn=cfg.sync_bn)
    for _ in range(steps):
        step(mx.nd.array(x), mx.nd.array(y), mx.nd.ones(y.shape))
    mx.nd.waitall()
    return {k: p.list_data()[0].asnumpy() for k, p in net._collect_params_with_prefix().items()}


def test_sync_bn_on_two_devices_equals_batchnorm_over_the_whole_batch(tiny):
    images, masks, _ = synthetic_nuclei(8, size=32, seed=5)
    x = images.transpose(0, 3, 1, 2).astype(np.float32) / 255
    y = masks[:, None].astype(np.float32)
    whole = _one_step(tiny(batch_norm=True, sync_bn=False), 1, x, y)
    synced = _one_step(tiny(batch_norm=True, sync_bn=True), 2, x, y)
    unsynced = _one_step(tiny(batch_norm=True, sync_bn=False), 2, x, y)
    diff = max(np.abs(synced[k] - whole[k]).max() for k in whole)
    gap = max(np.abs(unsynced[k] - whole[k]).max() for k in whole)
    print('sync-bn vs whole-batch BN: %.2e; per-device BN vs whole-batch BN: %.2e' % (diff, gap))
    # Running statistics too: they are the batch statistics of the whole batch.
    assert diff <= 1e-4
    assert gap > 10 * max(diff, 1e-6), 'per-device BN must differ, or this test proves nothing'


def test_sync_bn_skips_a_batch_smaller_than_the_device_count_instead_of_hanging(tmp_path):
    # 10 training images, batch 4 on 3 devices: the last batch has 2 samples < 3 devices.
    # A regression deadlocks inside MXNet (SyncBatchNorm's barrier has no timeout), so it
    # runs in a child process with a time limit: a hang fails the test, not the CI job.
    script = textwrap.dedent('''
        import json, pathlib, sys
        sys.path.insert(0, sys.argv[2])
        from conftest import tiny_config
        from gluon_unet.engine import fit
        cfg = tiny_config(pathlib.Path(sys.argv[1]), batch_norm=True, sync_bn=True, cpus=3,
                          synthetic_count=11, val_split=0.1, batch_size=4, epochs=1)
        print(json.dumps([r['train_loss'] for r in fit(cfg, verbose=False)]))
    ''')
    try:
        done = subprocess.run([sys.executable, '-c', script, str(tmp_path), os.path.dirname(__file__)],
                              capture_output=True, text=True, timeout=240, cwd=str(tmp_path), env=_env())
    except subprocess.TimeoutExpired:
        pytest.fail('SyncBatchNorm training hung on a batch smaller than the device count')
    assert done.returncode == 0, done.stderr[-2000:]
    losses = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(losses) == 1 and np.isfinite(losses[0])


@pytest.mark.usefixtures('requires_bf16')
def test_bfloat16_amp_trains_on_cpu_and_exports_float32(tmp_path):
    # amp.init() patches MXNet for the whole process: run it in a child process.
    script = textwrap.dedent('''
        import json, sys
        import mxnet as mx
        from gluon_unet.config import TrainConfig, ModelConfig
        from gluon_unet.engine import fit
        cfg = TrainConfig(model=ModelConfig(width=8, depth=2, in_channels=1), size=32, epochs=4,
                          batch_size=8, synthetic_count=48, workers=0, output=sys.argv[1], progress=False,
                          amp=True, cpus=2, lr=3e-3, augment=False, patience=0)
        h = fit(cfg, verbose=False)
        print(json.dumps([r['train_loss'] for r in h]))
    ''')
    out = tmp_path / 'run'
    done = subprocess.run([sys.executable, '-c', script, str(out)], capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path), env=_env())
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [float(v) for v in done.stdout.strip().splitlines()[-1].strip('[]').split(',')]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] * 0.8, losses
    symbol = (out / 'export' / 'model-symbol.json').read_text()
    assert 'bfloat16' not in symbol and 'amp_cast' not in symbol
    params = mx.nd.load(str(out / 'export' / 'model-0000.params'))
    assert all(v.dtype == np.float32 for v in params.values())


def _env():
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env['PYTHONPATH'] = root + os.pathsep + env.get('PYTHONPATH', '')
    return env
