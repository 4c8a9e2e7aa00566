"""The multi-device guarantees as functions of the devices, shared by the CPU-context
tests and the GPU lane (``tests/test_gpu.py``, tests marked ``gpu``).

Each ``check_*`` function takes how to make the devices (``make_ctxs(n)`` -> ``n``
contexts, or the ``--gpus``/``--cpus`` settings) and asserts one guarantee. The CPU tests
call them with ``mx.cpu(i)`` contexts, so every line of the logic runs on this machine;
the GPU lane calls the same functions with ``mx.gpu(i)``. Only the tolerances differ:
on GPUs cuDNN picks its convolution algorithms per shape (so a split batch is summed in
another order) and float32 is compared against oneDNN.
"""
import json
import os
import subprocess
import sys
import textwrap

import mxnet as mx
import numpy as np

from gluon_unet.data import synthetic_nuclei
from gluon_unet.training.losses import SegmentationLoss
from gluon_unet.training.optim import make_trainer
from gluon_unet.training.parallel import DataParallelStep
from gluon_unet.training.step import build_network
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))

#: max |difference| allowed between parameters / probabilities, per device type
CPU_TOL = 1e-5
GPU_TOL = 1e-4


def cpu_contexts(n):
    return [mx.cpu(i) for i in range(n)]


def gpu_contexts(n):
    return [mx.gpu(i) for i in range(n)]


def child_env():
    """The environment for child processes: this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
    return env


# -- 1 vs N devices -------------------------------------------------------------------------

def uneven_batches():
    """Three batches: 8 (even), 10 (3,3,2,2 on 4 devices), 3 (fewer samples than devices)."""
    images, masks, _ = synthetic_nuclei(21, size=32, seed=3)
    x = images.transpose(0, 3, 1, 2).astype(np.float32) / 255
    y = masks[:, None].astype(np.float32)
    return [(x[:8], y[:8]), (x[8:18], y[8:18]), (x[18:21], y[18:21])]


def train_params(cfg, ctxs, batches, kvstore='device', clip=0.0, update_on_kvstore=None, tol=0.0, loss='bce_dice'):
    """Train ``cfg``'s network on ``ctxs`` over ``batches`` (SGD, momentum 0.9) and return
    the parameters of the first replica, after checking that all replicas agree (within
    ``tol``: exactly on CPU) and that every sample was computed once."""
    net = build_network(cfg, ctxs)
    if clip:
        update_on_kvstore = False  # clipping needs the summed gradients before the update
    trainer = make_trainer(net.collect_params(), 'sgd', 0.1, ctxs, kvstore=kvstore, momentum=0.9,
                           update_on_kvstore=update_on_kvstore)
    step = DataParallelStep(net, SegmentationLoss(loss), trainer, ctxs, clip_grad=clip)
    for image, target in batches:
        out = step(mx.nd.array(image), mx.nd.array(target), mx.nd.ones_like(mx.nd.array(target)))
        assert out['samples'] == image.shape[0]
        assert sum(out['per_device']) == image.shape[0]
    params = {k: [d.asnumpy() for d in p.list_data()] for k, p in net._collect_params_with_prefix().items()}
    # Replicas must agree with each other after every update.
    for k, datas in params.items():
        for d in datas[1:]:
            if tol:
                np.testing.assert_allclose(d, datas[0], rtol=0, atol=tol, err_msg=k)
            else:
                np.testing.assert_array_equal(d, datas[0], err_msg=k)
    return {k: v[0] for k, v in params.items()}


def max_diff(a, b):
    return max(np.abs(a[k] - b[k]).max() for k in a)


def check_devices_equivalent(make_ctxs, ndevs, kvstore, cfg, batches=None, tol=CPU_TOL, loss='bce_dice'):
    """Training on 1 device and on each of ``ndevs`` devices (``make_ctxs(n)``) with the
    ``kvstore`` gives the same parameters, over uneven batches. Returns the differences."""
    batches = batches if batches is not None else uneven_batches()
    reference = train_params(cfg, make_ctxs(1), batches, loss=loss)
    untrained = train_params(cfg, make_ctxs(1), batches[:0], loss=loss)
    assert max_diff(reference, untrained) > 1e-3, \
        'training must change the parameters for this test to mean anything'
    diffs = {}
    for ndev in ndevs:
        got = train_params(cfg, make_ctxs(ndev), batches, kvstore=kvstore, tol=0.0 if tol <= CPU_TOL else tol,
                           loss=loss)
        diffs[ndev] = max_diff(got, reference)
        print('kvstore %s: max |params(%d devices) - params(1 device)| = %.2e' % (kvstore, ndev, diffs[ndev]))
        assert diffs[ndev] <= tol, (ndev, diffs[ndev])
    return diffs


def check_clipping_device_invariant(make_ctxs, ndev, cfg, batches=None, tol=CPU_TOL):
    batches = batches if batches is not None else uneven_batches()
    ref = train_params(cfg, make_ctxs(1), batches, clip=0.05)
    unclipped = train_params(cfg, make_ctxs(1), batches)
    assert max_diff(ref, unclipped) > 1e-4, 'clipping must bite here'
    got = train_params(cfg, make_ctxs(ndev), batches, clip=0.05, tol=0.0 if tol <= CPU_TOL else tol)
    assert max_diff(got, ref) <= tol


def check_running_stats_match_imperative(make_ctxs, ndev, tiny, tol=CPU_TOL, steps=3):
    """With BatchNorm on ``ndev`` devices, the hybridized step (static_alloc, the default)
    leaves every replica's parameters *and running statistics* where the imperative
    (not hybridized) step leaves them. The running statistics are per device (each sees
    its share of the batch), so replicas are compared one by one."""
    images, masks, _ = synthetic_nuclei(4 * steps, size=32, seed=7)
    x = images.transpose(0, 3, 1, 2).astype(np.float32) / 255
    y = masks[:, None].astype(np.float32)

    def run(hybridize):
        cfg = tiny(batch_norm=True, hybridize=hybridize)
        ctxs = make_ctxs(ndev)
        net = build_network(cfg, ctxs)
        trainer = make_trainer(net.collect_params(), 'sgd', 0.1, ctxs, momentum=0.9)
        step = DataParallelStep(net, SegmentationLoss('bce'), trainer, ctxs)
        for i in range(steps):
            sl = slice(4 * i, 4 * i + 4)
            step(mx.nd.array(x[sl]), mx.nd.array(y[sl]), mx.nd.ones(y[sl].shape))
        mx.nd.waitall()
        return {k: [d.asnumpy() for d in p.list_data()] for k, p in net._collect_params_with_prefix().items()}

    hybrid, imperative = run(True), run(False)
    stats = [k for k in hybrid if k.endswith('running_mean') or k.endswith('running_var')]
    assert stats, 'the network must have BatchNorm for this test to mean anything'
    # The statistics moved away from their initial values (zeros / ones).
    assert max(np.abs(imperative[k][0] - (k.endswith('running_var'))).max() for k in stats) > 1e-3
    worst = max(np.abs(a - b).max() for k in hybrid for a, b in zip(hybrid[k], imperative[k]))
    print('%d devices: max |hybridized - imperative| over parameters and running statistics = %.2e'
          % (ndev, worst))
    assert worst <= tol, worst
    return worst


# -- SyncBatchNorm --------------------------------------------------------------------------

def sync_bn_params(cfg, ctxs, x, y, steps=2, outputs=False):
    """Parameters (running statistics included) after ``steps`` SGD steps on ``ctxs``
    (and the step's results, with ``outputs``)."""
    net = build_network(cfg, ctxs)
    trainer = make_trainer(net.collect_params(), 'sgd', 0.5, ctxs, momentum=0.0)
    step = DataParallelStep(net, SegmentationLoss('bce'), trainer, ctxs, sync_bn=cfg.sync_bn)
    outs = [step(mx.nd.array(x), mx.nd.array(y), mx.nd.ones(y.shape)) for _ in range(steps)]
    mx.nd.waitall()
    params = {k: p.list_data()[0].asnumpy() for k, p in net._collect_params_with_prefix().items()}
    return (params, outs) if outputs else params


def check_sync_bn_matches_whole_batch(make_ctxs, tiny, tol=1e-4):
    """SyncBatchNorm over 2 devices equals BatchNorm over the whole batch on one device
    (weights and running statistics), and per-device BN does not (so the test means
    something)."""
    images, masks, _ = synthetic_nuclei(8, size=32, seed=5)
    x = images.transpose(0, 3, 1, 2).astype(np.float32) / 255
    y = masks[:, None].astype(np.float32)
    whole = sync_bn_params(tiny(batch_norm=True, sync_bn=False), make_ctxs(1), x, y)
    synced = sync_bn_params(tiny(batch_norm=True, sync_bn=True), make_ctxs(2), x, y)
    unsynced = sync_bn_params(tiny(batch_norm=True, sync_bn=False), make_ctxs(2), x, y)
    diff = max_diff(synced, whole)
    gap = max_diff(unsynced, whole)
    print('sync-bn vs whole-batch BN: %.2e; per-device BN vs whole-batch BN: %.2e' % (diff, gap))
    assert diff <= tol
    assert gap > 10 * max(diff, 1e-6), 'per-device BN must differ, or this test proves nothing'


def check_sync_bn_uneven_batch_matches_one_device(make_ctxs, tiny, ndev=3, n=8, tol=1e-4):
    """SyncBatchNorm averages the devices' statistics with equal weights
    (``sync_batch_norm-inl.h``, ``SharedND::MeanReady``), so a batch of ``n`` that does not
    divide over ``ndev`` devices (8 on 3: 3, 3, 2) would get wrong statistics. The step
    trains on the largest multiple of ``ndev`` (6) and says so; that equals BatchNorm over
    those samples on one device - weights and running statistics, after two steps."""
    images, masks, _ = synthetic_nuclei(n, size=32, seed=5)
    x = images.transpose(0, 3, 1, 2).astype(np.float32) / 255
    y = masks[:, None].astype(np.float32)
    used = n - n % ndev
    assert 0 < used < n, 'the batch must not divide, or this test proves nothing'
    synced, outs = sync_bn_params(tiny(batch_norm=True, sync_bn=True), make_ctxs(ndev), x, y, outputs=True)
    whole = sync_bn_params(tiny(batch_norm=True, sync_bn=False), make_ctxs(1), x[:used], y[:used])
    all_n = sync_bn_params(tiny(batch_norm=True, sync_bn=False), make_ctxs(1), x, y)
    diff, gap = max_diff(synced, whole), max_diff(all_n, whole)
    print('sync-bn, %d of %d samples on %d devices vs one device on them: %.2e (on all %d: %.2e)'
          % (used, n, ndev, diff, n, gap))
    assert diff <= tol
    assert gap > 10 * max(diff, 1e-6), 'the left-out samples must matter, or this test proves nothing'
    assert [o['samples'] for o in outs] == [used, used] and [o['dropped'] for o in outs] == [n - used] * 2
    assert [sum(o['per_device']) for o in outs] == [used, used]
    return diff


# -- mixed precision ------------------------------------------------------------------------

AMP_SCRIPT = textwrap.dedent('''
    import json, sys
    import mxnet as mx
    from gluon_unet.config import ModelConfig, TrainConfig
    from gluon_unet.training.loop import fit
    cfg = TrainConfig(model=ModelConfig(width=8, depth=2, in_channels=1), size=32, epochs=4,
                      batch_size=8, synthetic_count=48, workers=0, output=sys.argv[1], progress=False,
                      amp=True, lr=3e-3, augment=False, patience=0, **json.loads(sys.argv[2]))
    h = fit(cfg, verbose=False)
    print(json.dumps([r['train_loss'] for r in h]))
''')


def check_amp_trains_and_exports_float32(tmp_path, devices):
    """``--amp`` on ``devices`` (``{'cpus': 2}``: bfloat16; ``{'gpus': '0,1'}``: float16)
    trains (the loss falls) and exports a float32 model without casts. In a child
    process: ``amp.init()`` patches MXNet for the whole process."""
    out = tmp_path / 'run'
    done = subprocess.run([sys.executable, '-c', AMP_SCRIPT, str(out), json.dumps(devices)],
                          capture_output=True, text=True, timeout=HANG_SECONDS, cwd=str(tmp_path), env=child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    losses = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] * 0.8, losses
    symbol = (out / 'export' / 'model-symbol.json').read_text()
    assert 'bfloat16' not in symbol and 'float16' not in symbol and 'amp_cast' not in symbol
    params = mx.nd.load(str(out / 'export' / 'model-0000.params'))
    assert params and all(v.dtype == np.float32 for v in params.values())
    return losses


# -- export, predicted on other devices -----------------------------------------------------

def check_export_predicts_like_cpu(cfg, predict_ctxs, tol=CPU_TOL):
    """Train ``cfg`` (its devices: ``cfg.gpus`` / ``cfg.cpus``), then predict images of
    several sizes with the export on ``predict_ctxs`` and on one CPU: the same
    probabilities. Returns the largest difference."""
    from gluon_unet.training.loop import fit
    from gluon_unet.inference.batched import load_model, predict_image
    fit(cfg, verbose=False)
    params = mx.nd.load(os.path.join(cfg.output, 'export', 'model-0000.params'))
    assert params and {v.dtype for v in params.values()} == {np.float32}
    on_cpu = load_model(cfg.output, [mx.cpu()])
    on_devices = load_model(cfg.output, predict_ctxs)
    worst = 0.0
    for size, seed in ((32, 11), (48, 12), (72, 13)):
        image = synthetic_nuclei(1, size=size, channels=1, seed=seed)[0][0]
        expected = predict_image(on_cpu.net, on_cpu.meta, image, on_cpu.ctxs)
        got = predict_image(on_devices.net, on_devices.meta, image, on_devices.ctxs)
        assert got.shape == expected.shape == image.shape[:2]
        worst = max(worst, float(np.abs(got - expected).max()))
    print('export: max |p(%s) - p(cpu)| = %.2e' % (','.join(map(str, predict_ctxs)), worst))
    assert worst <= tol
    return worst


# -- bin/train --benchmark ------------------------------------------------------------------

def check_benchmark_json(capsys, monkeypatch, tmp_path, device_flags, ndev):
    """``bin/train --benchmark`` on ``device_flags`` (``['--cpus', '2']`` /
    ``['--gpus', '0,1']``) ends with one JSON line describing ``ndev`` devices."""
    from gluon_unet.training import benchmark
    from gluon_unet.cli import train_main
    monkeypatch.setattr(benchmark, 'REPEATS', 2)
    monkeypatch.setattr(benchmark, 'MIN_REPEAT_SECONDS', 0.0)
    code = train_main(['--benchmark', '--width', '4', '--depth', '2', '--size', '32',
                       '--batch-size', str(2 * ndev), '--output', str(tmp_path / 'run'), '--no-progress']
                      + list(device_flags))
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    record = json.loads(lines[-1])
    assert set(record) >= {'images_per_s', 'per_device', 'devices', 'scaling_efficiency', 'gflops'}
    assert record['devices'] == ndev and len(record['per_device']) == ndev
    assert record['images_per_s'] > 0 and record['gflops'] > 0 and record['scaling_efficiency'] > 0
    assert abs(sum(record['per_device']) - record['images_per_s']) < 1e-6 * record['images_per_s']
    assert len(set(record['per_device'])) == 1  # an even split: the same share each
    assert not (tmp_path / 'run').exists()  # a benchmark writes no run folder
    return record


# -- the engine's step: kvstore and update placement ----------------------------------------

def engine_step_trainer(cfg, ctxs):
    """Build the step the way fit() does (strategy, update_on_kvstore, make_step), train
    one batch, and return the trainer (its kvstore is created at the first step)."""
    from gluon_unet.training import distributed
    from gluon_unet.training.step import make_step, resolve_update_on_kvstore
    strategy = distributed.make_strategy(cfg.kvstore)
    net = build_network(cfg, ctxs)
    update_on_kv = resolve_update_on_kvstore(cfg, None, strategy)
    step = make_step(cfg, net, ctxs, None, strategy, None, update_on_kv)
    image, target = uneven_batches()[1]
    step(mx.nd.array(image), mx.nd.array(target), mx.nd.ones_like(mx.nd.array(target)))
    mx.nd.waitall()
    return step.trainer


# -- the input pipeline ---------------------------------------------------------------------

def check_loader_pins_memory(pin_device):
    """A loader feeding GPU ``pin_device`` returns batches in page-locked host memory
    (``cpu_pinned``), from which copies to the GPU are asynchronous DMA."""
    from gluon_unet.data import synthetic_dataset
    from gluon_unet.data.loader import make_loader
    loader = make_loader(synthetic_dataset(4, size=32, seed=0), 2, shuffle=False, seed=0, pin_device=pin_device)
    batch = next(iter(loader))
    assert all(a.context == mx.Context('cpu_pinned', pin_device) for a in batch), [a.context for a in batch]
    return batch


# -- resume on another number of devices ----------------------------------------------------

RESUME_STEPS = 6  # the unbroken run; the broken one stops after half and resumes
RESUME_MODES = {  # name -> (update_on_kvstore, clip_grad)
    'kvstore': (True, 0.0),
    'local': (False, 0.0),
    'clip': (False, 1e-3),  # clipping needs the update off the kvstore; 1e-3 always bites
}


def _resume_batches():
    rng = np.random.RandomState(0)
    x = rng.rand(RESUME_STEPS, 6, 1, 8, 8).astype(np.float32)  # 6 over 4 devices: 2, 2, 1, 1
    y = (rng.rand(RESUME_STEPS, 6, 1, 8, 8) > 0.5).astype(np.float32)
    return x, y


def tiny_conv_net(ctxs):
    """Two 3x3 convolutions (1 -> 4 -> 1 channels), the same initial weights every time."""
    mx.random.seed(0)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Conv2D(4, 3, padding=1, in_channels=1, activation='relu'),
            mx.gluon.nn.Conv2D(1, 3, padding=1, in_channels=4))
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    return net


def resume_run(ctxs, optimizer, mode, steps, resume=None, save=None):
    """Train :func:`tiny_conv_net` on ``ctxs`` over batches ``steps`` (numbers), from the
    checkpoint ``resume`` if given, writing ``save`` at the end if given; the replicas'
    parameters ``{name: [array per device]}``."""
    from gluon_unet.checkpoint import load_checkpoint, save_checkpoint
    update_on_kvstore, clip = RESUME_MODES[mode]
    net = tiny_conv_net(ctxs)
    trainer = make_trainer(net.collect_params(), optimizer, 0.01, ctxs, update_on_kvstore=update_on_kvstore,
                           weight_decay=1e-2)
    step = DataParallelStep(net, SegmentationLoss('bce'), trainer, ctxs, clip_grad=clip)
    if resume:
        load_checkpoint(resume, net, trainer, ctx=ctxs)
    x, y = _resume_batches()
    for s in steps:
        step(mx.nd.array(x[s]), mx.nd.array(y[s]), mx.nd.ones(y[s].shape))
    if save:
        save_checkpoint(save, net, trainer, {'epoch': 1})
    return {k: [d.asnumpy() for d in p.list_data()] for k, p in net._collect_params_with_prefix().items()}


def check_resume_across_device_counts(make_ctxs, before, after, optimizer, mode, folder, tol=1e-6,
                                      unbroken=None):
    """``RESUME_STEPS // 2`` steps on ``before`` devices, checkpointed and resumed on
    ``after`` for the rest: every device's parameters equal those of the unbroken run on
    ``before`` devices (``unbroken``: its result, when the caller keeps it). Returns the
    largest difference."""
    path = os.path.join(str(folder), 'half.ckpt')
    half = RESUME_STEPS // 2
    resume_run(make_ctxs(before), optimizer, mode, range(half), save=path)
    got = resume_run(make_ctxs(after), optimizer, mode, range(half, RESUME_STEPS), resume=path)
    expected = unbroken or resume_run(make_ctxs(before), optimizer, mode, range(RESUME_STEPS))
    worst = max(float(np.abs(d - expected[k][0]).max()) for k, datas in got.items() for d in datas)
    print('%s %s, %d -> %d devices: max |resumed - unbroken| over every device = %.2e'
          % (optimizer, mode, before, after, worst))
    assert worst <= tol, 'a device drifted from the unbroken run by %.2e' % worst
    return worst


# -- what a checkpoint file holds -----------------------------------------------------------

def saved_contexts(path):
    """``{name: (device_type, device_id)}`` of every array in an ``mx.nd.save`` file, read
    from the file itself: ``mx.nd.load`` cannot tell (it puts a CPU array on cpu(0) and a
    GPU array on CPU when no GPU is visible). The layout is ``NDArray::Save`` of MXNet 1.9.1
    (src/ndarray/ndarray.cc): list magic 0x112, reserved, count, then per array magic,
    storage type, shape (int32 ndim, int64 dims), context (int32 type, int32 id: 1 cpu,
    2 gpu, 3 cpu_pinned, 5 cpu_shared), dtype, data; then the names."""
    import struct
    sizes = {0: 4, 1: 8, 2: 2, 3: 1, 4: 4, 5: 1, 6: 8, 7: 1, 12: 2}
    with open(path, 'rb') as f:
        buf = f.read()
    pos = 0

    def take(fmt):
        nonlocal pos
        values = struct.unpack_from('<' + fmt, buf, pos)
        pos += struct.calcsize('<' + fmt)
        return values

    header, _, count = take('QQQ')
    assert header == 0x112, 'not an mx.nd.save file: %s' % path
    contexts = []
    for _ in range(count):
        magic, stype = take('Ii')
        assert magic in (0xF993FAC9, 0xF993FACA) and stype == 0, (hex(magic), stype)  # dense arrays only
        ndim, = take('i')
        shape = take('%dq' % ndim) if ndim > 0 else ()
        dev_type, dev_id, dtype = take('iii')
        contexts.append((dev_type, dev_id))
        pos += int(np.prod(shape)) * sizes[dtype]
    names = []
    n_names, = take('Q')
    for _ in range(n_names):
        length, = take('Q')
        names.append(buf[pos:pos + length].decode())
        pos += length
    assert pos == len(buf) and len(names) == count
    return dict(zip(names, contexts))


def check_ema_checkpoint_holds_only_cpu_arrays(ctxs, folder):
    """A checkpoint of an ``--ema`` run on ``ctxs`` (the average lives on ``ctxs[0]``)
    holds every array as saved from cpu(0): weights, average, optimizer state, record."""
    from gluon_unet.training.ema import WeightAverage
    from gluon_unet.checkpoint import save_checkpoint
    from gluon_unet.config import ModelConfig
    from gluon_unet.model import build_model
    net = build_model(ModelConfig(in_channels=1, width=4, depth=2, batch_norm=True))
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    net(mx.nd.zeros((1, 1, 32, 32), ctx=ctxs[0]))
    trainer = make_trainer(net.collect_params(), 'adam', 1e-3, ctxs, update_on_kvstore=False)
    average = WeightAverage(net, ctxs, 0.9)
    step = DataParallelStep(net, SegmentationLoss('bce'), trainer, ctxs)
    x, y = uneven_batches()[0]
    step(mx.nd.array(x), mx.nd.array(y), mx.nd.ones(y.shape))
    average.update(1)
    path = os.path.join(str(folder), 'ema.ckpt')
    save_checkpoint(path, net, trainer, {'epoch': 1}, average=average)
    found = saved_contexts(path)
    assert any(k.startswith('opt:') for k in found) and any(k.startswith('train:') for k in found)
    elsewhere = {k: v for k, v in found.items() if v != (1, 0)}
    assert not elsewhere, 'saved from another device than cpu(0): %s' % sorted(elsewhere.items())[:3]
    return found
