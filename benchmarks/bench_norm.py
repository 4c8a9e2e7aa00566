"""Training speed of the U-Net with BatchNorm against per-image normalizations.

nnU-Net normalizes each image by itself (InstanceNorm), which suits a data set whose
images look unlike each other (DSB: fluorescence, brightfield, H&E). This asks what it
would cost here before any recipe uses it: the same U-Net (width 16, depth 4, 1 input
channel, random weights), hybridized, one Adam step (forward, BCE, backward, update) on a
batch of ``--batch`` x ``--size`` px random images on one CPU context, with the norm layer
after each convolution swapped for each kind. Kinds are timed in turn, ``--rounds``
times, so a load change hits all; the best step of each round after ``--warmup`` is kept.

    python benchmarks/bench_norm.py [--kinds batch,instance,group4] [--size 256] [--batch 16]
"""
import argparse
import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

# As bin/train: all the physical cores for OpenMP (set before mxnet loads), unless the
# environment says otherwise; MXNet's own default would use half of them.
from gluon_unet.runtime import apply_runtime_defaults  # noqa: E402

apply_runtime_defaults()

import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from mxnet.gluon import nn  # noqa: E402

from gluon_unet import model  # noqa: E402


def norm_factory(kind):
    """A constructor for the norm layer ``kind``: batch, instance, or groupN (N groups)."""
    if kind == 'batch':
        return nn.BatchNorm
    if kind == 'instance':
        return lambda **_: nn.InstanceNorm()
    if kind.startswith('group') and kind[5:].isdigit() and int(kind[5:]) > 0:
        return lambda **_: nn.GroupNorm(num_groups=int(kind[5:]))
    raise SystemExit('error: --kinds: %r is not batch, instance or groupN (e.g. group4)' % kind)


def images_per_second(kind, size, batch, warmup, steps):
    """Best images/s over ``steps`` training steps, after ``warmup`` untimed ones, with
    the norm layer ``kind``."""
    # UNet builds its norm layers from nn.BatchNorm; swap the name while it is built.
    with mock.patch.object(model.nn, 'BatchNorm', norm_factory(kind)):
        net = model.UNet(in_channels=1, classes=1, width=16, depth=4, batch_norm=True)
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    net.hybridize(static_alloc=True, static_shape=True)
    trainer = gluon.Trainer(net.collect_params(), 'adam', {'learning_rate': 1e-3})
    loss_fn = gluon.loss.SigmoidBCELoss()
    x = mx.nd.random.uniform(shape=(batch, 1, size, size))
    y = mx.nd.random.uniform(shape=(batch, 1, size, size)) > 0.5
    best = float('inf')
    for i in range(warmup + steps):
        t = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(batch)
        mx.nd.waitall()
        if i >= warmup:
            best = min(best, time.perf_counter() - t)
    return batch / best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--kinds', default='batch,instance,group4')
    p.add_argument('--size', type=int, default=256)
    p.add_argument('--batch', type=int, default=16)
    p.add_argument('--rounds', type=int, default=2)
    p.add_argument('--steps', type=int, default=4, help='timed steps per kind and round, after --warmup')
    p.add_argument('--warmup', type=int, default=2)
    args = p.parse_args(argv)
    kinds = args.kinds.split(',')
    for k in kinds:
        norm_factory(k)  # a bad name fails before anything is timed
    if min(args.size, args.batch, args.rounds, args.steps) < 1 or args.warmup < 0 or args.size % 16:
        raise SystemExit('error: --size must be a positive multiple of 16; --batch, --rounds, --steps >= 1; --warmup >= 0')
    rates = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k in kinds:
            rates[k].append(images_per_second(k, args.size, args.batch, args.warmup, args.steps))
    print('%-10s %s' % ('norm', ' '.join('round %d' % (i + 1) for i in range(args.rounds))) + '  vs batch')
    for k in kinds:
        ratio = ('%.2fx' % (sum(rates[k]) / sum(rates['batch']))) if 'batch' in rates else '-'
        print('%-10s %s  %s' % (k, ' '.join('%5.2f img/s' % r for r in rates[k]), ratio))


if __name__ == '__main__':
    main()
