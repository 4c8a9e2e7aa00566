"""``bin/train --benchmark``: training speed on the chosen devices, in one command.

A short synthetic run of the real training step (:class:`~gluon_unet.training.parallel.DataParallelStep`
over the network of :func:`~gluon_unet.training.step.build_network`, the configured loss and
optimizer): warm-up, then timed repetitions; the median gives images/s overall and per
device. The same step on one device of the same kind at the same per-device batch gives
the scaling efficiency ``images/s(N) / (N * images/s(1))``. The last printed line is
one JSON object for scripts.

``benchmarks/bench_train.py`` uses :func:`make_training_step` and :func:`time_steps` too,
so the benchmark and the trainer can never measure two different steps.
"""
import json
import statistics
import sys
import time

import mxnet as mx
import numpy as np

from ..data.targets import OUTPUTS
from ..data.weights import WEIGHTED
from ..machine.cpu import cpu_description
from ..machine.devices import make_contexts
from ..model import flops_per_image
from .parallel import check_sync_bn_batch, split_batch

WARMUP_STEPS = 2       # the first steps create oneDNN primitives and allocate memory
REPEATS = 5            # timed repetitions; the median is reported
MIN_REPEAT_SECONDS = 0.5


def synthetic_batch(cfg, batch_size=None, seed=0):
    """A fixed ``(image, target)`` batch on the CPU (plus ``weight`` for ``wbce`` and
    ``wbce_dice``), shaped like a loader's.

    Speed does not depend on pixel values, so uniform noise and a random mask do.
    """
    n = batch_size or cfg.batch_size
    side = cfg.crop or cfg.size
    rng = np.random.RandomState(seed)
    channels = cfg.model.in_channels or 1
    image = mx.nd.array(rng.rand(n, channels, side, side).astype(np.float32))
    maps = len(OUTPUTS[cfg.model.target])  # foreground (+ border)
    target = mx.nd.array((rng.rand(n, maps, side, side) > 0.5).astype(np.float32))
    if cfg.loss not in WEIGHTED:
        return image, target
    return image, target, mx.nd.ones((n, 1, side, side))


def make_training_step(cfg, ctxs):
    """The trainer's own :class:`DataParallelStep` for ``cfg`` on ``ctxs``.

    With ``cfg.amp`` it turns AMP on through :func:`~gluon_unet.training.step.init_amp` (a
    no-op when the caller already did, which it must before building any other model:
    AMP patches MXNet process-wide), and takes the dtype from it, as ``fit()`` does.
    """
    from .step import build_network, init_amp, make_step
    if not cfg.model.in_channels:  # 0 = from the data; the synthetic batch has one channel
        cfg = type(cfg).from_dict(cfg.to_dict())
        cfg.model.in_channels = 1
    amp_dtype = init_amp(cfg, ctxs)
    return make_step(cfg, build_network(cfg, ctxs, amp_dtype), ctxs, amp_dtype)


def time_steps(step, batch, steps):
    """Seconds for ``steps`` training steps on ``batch``, waiting for the devices at the
    end only (as the trainer does: no host synchronization inside the loop)."""
    mx.nd.waitall()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(*batch)
    mx.nd.waitall()
    return time.perf_counter() - t0


def measure(step, batch, warmup=None, repeats=None, min_seconds=None):
    """Steady-state images/s of ``step`` on ``batch``: the median over ``repeats``.

    Returns
    -------
    dict
        ``images_per_s`` (median), ``all`` (every repetition), ``steps_per_repeat``.
    """
    warmup = WARMUP_STEPS if warmup is None else warmup
    repeats = REPEATS if repeats is None else repeats
    min_seconds = MIN_REPEAT_SECONDS if min_seconds is None else min_seconds
    n = batch[0].shape[0]
    time_steps(step, batch, max(1, warmup))
    per_step = max(1e-4, time_steps(step, batch, 1))
    k = int(min(20, max(1, np.ceil(min_seconds / per_step))))
    rates = [k * n / time_steps(step, batch, k) for _ in range(repeats)]
    return {'images_per_s': statistics.median(rates), 'all': rates, 'steps_per_repeat': k}


def run_benchmark(cfg, warmup=None, repeats=None):
    """Measure ``cfg`` on its devices and on one device at the same per-device batch.

    Returns
    -------
    dict
        The JSON record printed by ``bin/train --benchmark``: ``images_per_s``,
        ``per_device`` (images/s of each device), ``devices``, ``scaling_efficiency``,
        ``gflops`` (achieved, training = 3 forward passes), ``single_device_images_per_s``,
        ``per_device_batch``, ``global_batch``.
    """
    from .step import init_amp
    ctxs = make_contexts(cfg.gpus, cfg.cpus)
    init_amp(cfg, ctxs)
    n_dev = min(len(ctxs), cfg.batch_size)
    ctxs = ctxs[:n_dev]
    if cfg.sync_bn:
        check_sync_bn_batch(cfg.batch_size, n_dev)
    batch = synthetic_batch(cfg)
    step = make_training_step(cfg, ctxs)
    result = measure(step, batch, warmup, repeats)
    split = [p[0].shape[0] for p in split_batch([batch[0]], ctxs)]
    steps_per_s = result['images_per_s'] / cfg.batch_size
    per_device = [k * steps_per_s for k in split]
    per_device_batch = split[0]
    if n_dev > 1:
        single_cfg = type(cfg).from_dict(cfg.to_dict())
        single_cfg.batch_size = per_device_batch
        single = measure(make_training_step(single_cfg, ctxs[:1]),
                         synthetic_batch(single_cfg), warmup, repeats)['images_per_s']
    else:
        single = result['images_per_s']
    train_flops = 3.0 * flops_per_image(cfg.model, cfg.crop or cfg.size)
    return {'images_per_s': result['images_per_s'], 'per_device': per_device, 'devices': n_dev,
            'scaling_efficiency': result['images_per_s'] / (n_dev * single),
            'gflops': result['images_per_s'] * train_flops / 1e9,
            'single_device_images_per_s': single, 'per_device_batch': per_device_batch,
            'global_batch': cfg.batch_size, 'device_kind': ctxs[0].device_type,
            'repeats': result['all']}


def format_table(record, cfg):
    """The human-readable part of the benchmark output."""
    lines = ['U-Net width %d depth %d, %d px, global batch %d on %d %s device(s)%s'
             % (cfg.model.width, cfg.model.depth, cfg.crop or cfg.size, record['global_batch'],
                record['devices'], record['device_kind'], ', AMP' if cfg.amp else ''),
             '%-10s %8s %12s' % ('device', 'batch', 'images/s')]
    share = record['per_device']
    for i, rate in enumerate(share):
        lines.append('%-10s %8d %12.2f' % ('%s(%d)' % (record['device_kind'], i),
                                          round(rate / record['images_per_s'] * record['global_batch']),
                                          rate))
    lines.append('%-10s %8d %12.2f   (%.1f GFLOP/s)' % ('total', record['global_batch'],
                                                      record['images_per_s'], record['gflops']))
    lines.append('one device at batch %d: %.2f images/s -> scaling efficiency %.1f %%'
                 % (record['per_device_batch'], record['single_device_images_per_s'],
                    100 * record['scaling_efficiency']))
    if record['device_kind'] == 'cpu' and record['devices'] > 1:
        lines.append('note: CPU contexts share the machine\'s cores (the one-device figure ran on '
                     'cores/N threads, as each context does), so their efficiency is at most '
                     'cores/N; on GPUs it measures real scaling.')
    return '\n'.join(lines)


def benchmark_main(cfg):
    """Entry point of ``bin/train --benchmark``; returns the process exit code."""
    record = run_benchmark(cfg)
    record['cpu'] = cpu_description()  # figures differ between CPU kinds: say which one
    print('machine: %s' % record['cpu'])
    print(format_table(record, cfg))
    keys = ('images_per_s', 'per_device', 'devices', 'scaling_efficiency', 'gflops', 'cpu')
    print(json.dumps({k: record[k] for k in keys}))
    sys.stdout.flush()
    return 0
