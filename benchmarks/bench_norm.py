"""Training speed of the U-Net with BatchNorm against per-image normalizations.

nnU-Net normalizes each image by itself (InstanceNorm), which suits a data set whose
images look unlike each other (DSB: fluorescence, brightfield, H&E). This asks what it
would cost here before any recipe uses it. The step timed is the trainer's own
(``gluon_unet.training.benchmark.make_training_step``: the network of ``step.build_network``,
hybridized, the recipe's loss and optimizer, ``parallel.DataParallelStep``) for the
training config ``--config`` (default: the ``dsb2018`` recipe) on one CPU context, on a
synthetic batch of ``--batch`` x ``--size`` px, with the norm layer after each
convolution swapped for each kind. Kinds are timed in turn, ``--rounds`` times, so a
load change hits all; each round reports the median images/s of ``--repeats`` timed
repetitions after ``--warmup`` steps (``gluon_unet.training.benchmark.measure``), and the ratio
to BatchNorm is the median of the rounds' ratios. Each measurement runs in a fresh
process: nine networks built in turn in one process held 19.6 GB at width 16 (the memory
of the finished ones was not given back), one per process 4.4 GB.

    python benchmarks/bench_norm.py [--kinds batch,instance,group4] [--size 256] [--batch 16]
"""
import argparse
import multiprocessing
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# As bin/train: all the physical cores for OpenMP (set before mxnet loads), unless the
# environment says otherwise; MXNet's own default would use half of them.
from gluon_unet.machine.runtime import apply_runtime_defaults  # noqa: E402

apply_runtime_defaults()

from mxnet.gluon import nn  # noqa: E402

from gluon_unet import model, recipes  # noqa: E402
from gluon_unet.training.benchmark import make_training_step, measure, synthetic_batch  # noqa: E402
from gluon_unet.config import TrainConfig  # noqa: E402
from gluon_unet.machine.devices import make_contexts  # noqa: E402
from gluon_unet.errors import UserError  # noqa: E402


def norm_factory(kind):
    """A constructor for the norm layer ``kind``: batch, instance, or groupN (N groups)."""
    if kind == 'batch':
        return nn.BatchNorm
    if kind == 'instance':
        return lambda **_: nn.InstanceNorm()
    if kind.startswith('group') and kind[5:].isdigit() and int(kind[5:]) > 0:
        return lambda **_: nn.GroupNorm(num_groups=int(kind[5:]))
    raise SystemExit('error: --kinds: %r is not batch, instance or groupN (e.g. group4)' % kind)


def load_config(path, size, batch):
    """The training config of ``path`` on one CPU context, at ``batch`` x ``size`` px."""
    try:
        with open(path) as f:
            cfg = TrainConfig.from_json(f.read())
    except (OSError, ValueError, UserError, TypeError) as e:
        raise SystemExit('error: --config %s: %s' % (path, e))
    cfg.gpus, cfg.cpus, cfg.batch_size = '', 1, batch
    cfg.crop, cfg.size = size, size
    cfg.model.in_channels = cfg.model.in_channels or 1
    try:
        cfg.validate()  # the trainer's own checks, e.g. the crop against 2**depth
    except UserError as e:
        raise SystemExit('error: --config %s at --size %d --batch %d: %s' % (path, size, batch, e))
    if not cfg.model.batch_norm:
        raise SystemExit('error: --config %s: the model has no norm layers to swap' % path)
    return cfg


def training_step(cfg, kind):
    """The trainer's step for ``cfg`` on one CPU context, with the norm layer ``kind``."""
    # UNet builds its norm layers from nn.BatchNorm (one context: no SyncBatchNorm);
    # swap the name while the trainer's step builds it.
    with mock.patch.object(model.nn, 'BatchNorm', norm_factory(kind)):
        return make_training_step(cfg, make_contexts('', 1))


def images_per_second(cfg, kind, warmup, repeats):
    """Median images/s of the trainer's step for ``cfg`` with the norm layer ``kind``."""
    step = training_step(cfg, kind)
    return measure(step, synthetic_batch(cfg), warmup=warmup, repeats=repeats)['images_per_s']


def images_per_second_in_child(cfg, kind, warmup, repeats):
    """:func:`images_per_second` in a fresh process, whose memory goes when it ends."""
    # spawn, not fork: MXNet's engine threads and OpenMP pool do not carry into a fork.
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context('spawn')) as pool:
        return pool.submit(images_per_second, cfg, kind, warmup, repeats).result()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--config', default=recipes.path('dsb2018'),
                   help='training config whose model, loss and optimizer are timed (default: the dsb2018 recipe)')
    p.add_argument('--kinds', default='batch,instance,group4')
    p.add_argument('--size', type=int, default=256)
    p.add_argument('--batch', type=int, default=16)
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--repeats', type=int, default=3, help='timed repetitions per kind and round; the median is kept')
    p.add_argument('--warmup', type=int, default=2, help='untimed steps before them')
    args = p.parse_args(argv)
    kinds = args.kinds.split(',')
    for k in kinds:
        norm_factory(k)  # a bad name fails before anything is timed
    if min(args.size, args.batch, args.rounds, args.repeats) < 1 or args.warmup < 0:
        raise SystemExit('error: --size, --batch, --rounds, --repeats must be >= 1; --warmup >= 0')
    cfg = load_config(args.config, args.size, args.batch)
    print('width %d, depth %d, loss %s, %s, %d x %d px, one CPU context'
          % (cfg.model.width, cfg.model.depth, cfg.loss, cfg.optimizer, args.batch, args.size))
    rates = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k in kinds:
            rates[k].append(images_per_second_in_child(cfg, k, args.warmup, args.repeats))
    print('%-10s %s' % ('norm', ' '.join('round %d' % (i + 1) for i in range(args.rounds))) + '  vs batch')
    for k in kinds:
        # Each round times the kinds back to back, so its ratio pairs them under the same
        # load; the median over rounds drops a round that a load change hit.
        ratio = ('%.2fx' % statistics.median(r / b for r, b in zip(rates[k], rates['batch']))
                 if 'batch' in rates else '-')
        print('%-10s %s  %s' % (k, ' '.join('%5.2f img/s' % r for r in rates[k]), ratio))


if __name__ == '__main__':
    main()
