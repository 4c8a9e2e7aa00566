"""The multi-device step: splits, short batches, and exact equivalence across device counts."""
import mxnet as mx
import numpy as np
import pytest

from device_checks import (CPU_TOL, check_clipping_device_invariant, check_devices_equivalent, cpu_contexts,
                           check_running_stats_match_imperative, max_diff, train_params, uneven_batches)
from gluon_unet.training.parallel import split_batch

cpus = cpu_contexts


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


@pytest.fixture(scope='module')
def batches():
    # Uneven on purpose: 8 (even), 10 (3,3,2,2 on 4 devices), 3 (fewer samples than devices).
    return uneven_batches()


# The assertions live in device_checks, shared with the GPU lane (tests/test_gpu.py).

@pytest.mark.parametrize('kvstore', ['device', 'local'])
def test_same_parameters_on_1_2_3_4_devices(tiny, batches, kvstore):
    check_devices_equivalent(cpus, (2, 3, 4), kvstore, tiny(), batches, tol=CPU_TOL)


def test_the_lovasz_hinge_trains_the_same_on_1_and_3_devices(tiny, batches):
    # A per-sample loss built on a sort: each device sorts its own samples, so the summed
    # gradients, and the parameters, do not depend on the split.
    check_devices_equivalent(cpus, (3,), 'device', tiny(), batches, tol=CPU_TOL, loss='bce_lovasz')


@pytest.mark.parametrize('ndev', [1, 2, 3])
def test_batchnorm_running_statistics_match_the_imperative_step(tiny, ndev):
    check_running_stats_match_imperative(cpus, ndev, tiny, tol=CPU_TOL)


def test_gradient_clipping_is_device_count_invariant(tiny, batches):
    check_clipping_device_invariant(cpus, 3, tiny(), batches, tol=CPU_TOL)


def test_update_on_kvstore_matches_local_update(tiny, batches):
    cfg = tiny()
    a = train_params(cfg, cpus(2), batches, update_on_kvstore=True)
    b = train_params(cfg, cpus(2), batches, update_on_kvstore=False)
    assert max_diff(a, b) <= 1e-5


def test_every_forward_is_queued_before_any_loss_and_the_loss_is_a_graph(tiny):
    # MXNet hands all CPU contexts scratch buffers from one pool: a loss op of device 0
    # queued ahead of device 1's forward could draw the buffer that forward holds and make
    # it wait for device 0 (measured on Zen 3: 1 step in 5 ran the forwards in turn).
    from gluon_unet.training.step import build_network, make_step
    cfg = tiny(cpus=2)
    ctxs = cpu_contexts(2)
    step = make_step(cfg, build_network(cfg, ctxs), ctxs)
    assert step.loss_fn._active  # hybridized: its backward keeps one scratch buffer
    calls = []
    net, loss_fn = step.net, step.loss_fn
    step.net = lambda x: calls.append(('net', x.context)) or net(x)
    step.loss_fn = lambda out, *rest: calls.append(('loss', out.context)) or loss_fn(out, *rest)
    x = mx.nd.random.uniform(shape=(4, 1, 32, 32))
    y = (mx.nd.random.uniform(shape=(4, 1, 32, 32)) > 0.5).astype('float32')
    out = step(x, y)
    assert [c[0] for c in calls] == ['net', 'net', 'loss', 'loss']
    assert [c[1] for c in calls] == [ctxs[0], ctxs[1], ctxs[0], ctxs[1]]
    assert np.isfinite(sum(s.asscalar() for s in out['loss_sums']))


def test_the_sync_bn_step_keeps_the_imperative_loss(tiny):
    # One thread per device calls the loss there; a HybridBlock's first call (which builds
    # its graph) is not guarded against threads.
    from gluon_unet.training.step import build_network, make_step
    cfg = tiny(cpus=2, sync_bn=True, batch_norm=True)
    ctxs = cpu_contexts(2)
    step = make_step(cfg, build_network(cfg, ctxs), ctxs)
    assert step.sync_bn and not step.loss_fn._active
