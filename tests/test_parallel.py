"""The multi-device step: splits, short batches, and exact equivalence across device counts."""
import mxnet as mx
import numpy as np
import pytest

from gluon_unet.data import synthetic_nuclei
from gluon_unet.engine import build_network
from gluon_unet.losses import SegmentationLoss
from gluon_unet.optim import make_trainer
from gluon_unet.parallel import DataParallelStep, split_batch


def cpus(n):
    return [mx.cpu(i) for i in range(n)]


@pytest.mark.parametrize('n, ndev, expected', [
    (10, 4, [3, 3, 2, 2]), (8, 4, [2, 2, 2, 2]), (3, 4, [1, 1, 1]), (1, 4, [1]), (5, 1, [5])])
def test_split_batch_sizes_and_devices(n, ndev, expected):
    x = mx.nd.arange(n).reshape(n, 1)
    parts = split_batch([x, x * 2], cpus(ndev))
    assert [p[0].shape[0] for p in parts] == expected
    assert [p[0].context for p in parts] == cpus(ndev)[:len(expected)]
    # Every sample lands exactly once, in order, and paired arrays stay aligned.
    joined = np.concatenate([p[0].asnumpy() for p in parts])[:, 0]
    assert joined.tolist() == list(range(n))
    assert all((p[1].asnumpy() == 2 * p[0].asnumpy()).all() for p in parts)


def _train_params(cfg, ndev, batches, kvstore='device', clip=0.0, update_on_kvstore=None):
    ctxs = cpus(ndev)
    net = build_network(cfg, ctxs)
    if clip:
        update_on_kvstore = False  # clipping needs the summed gradients before the update
    trainer = make_trainer(net.collect_params(), 'sgd', 0.1, ctxs, kvstore=kvstore, momentum=0.9,
                           update_on_kvstore=update_on_kvstore)
    step = DataParallelStep(net, SegmentationLoss('bce_dice'), trainer, ctxs, clip_grad=clip)
    for image, target in batches:
        out = step(mx.nd.array(image), mx.nd.array(target), mx.nd.ones_like(mx.nd.array(target)))
        assert out['samples'] == image.shape[0]
        assert sum(out['per_device']) == image.shape[0]
    params = {k: [d.asnumpy() for d in p.list_data()] for k, p in net._collect_params_with_prefix().items()}
    # Replicas must agree with each other after every update.
    for k, datas in params.items():
        for d in datas[1:]:
            np.testing.assert_array_equal(d, datas[0], err_msg=k)
    return {k: v[0] for k, v in params.items()}


@pytest.fixture(scope='module')
def batches():
    images, masks, _ = synthetic_nuclei(21, size=32, seed=3)
    x = images.transpose(0, 3, 1, 2).astype(np.float32) / 255
    y = masks[:, None].astype(np.float32)
    # Uneven on purpose: 8 (even), 10 (3,3,2,2 on 4 devices), 3 (fewer samples than devices).
    return [(x[:8], y[:8]), (x[8:18], y[8:18]), (x[18:21], y[18:21])]


@pytest.mark.parametrize('kvstore', ['device', 'local'])
def test_same_parameters_on_1_2_3_4_devices(tiny, batches, kvstore):
    cfg = tiny()
    reference = _train_params(cfg, 1, batches)
    moved = max(np.abs(reference[k] - _train_params(cfg, 1, batches[:0])[k]).max() for k in reference)
    assert moved > 1e-3, 'training must change the parameters for this test to mean anything'
    for ndev in (2, 3, 4):
        got = _train_params(cfg, ndev, batches, kvstore=kvstore)
        diff = max(np.abs(got[k] - reference[k]).max() for k in reference)
        print('kvstore %s: max |params(%d devices) - params(1 device)| = %.2e' % (kvstore, ndev, diff))
        assert diff <= 1e-5


def test_gradient_clipping_is_device_count_invariant(tiny, batches):
    cfg = tiny()
    ref = _train_params(cfg, 1, batches, clip=0.05)
    unclipped = _train_params(cfg, 1, batches)
    assert max(np.abs(ref[k] - unclipped[k]).max() for k in ref) > 1e-4, 'clipping must bite here'
    got = _train_params(cfg, 3, batches, clip=0.05)
    assert max(np.abs(got[k] - ref[k]).max() for k in ref) <= 1e-5


def test_update_on_kvstore_matches_local_update(tiny, batches):
    cfg = tiny()
    a = _train_params(cfg, 2, batches, update_on_kvstore=True)
    b = _train_params(cfg, 2, batches, update_on_kvstore=False)
    assert max(np.abs(a[k] - b[k]).max() for k in a) <= 1e-5
