"""Inference speed: the exported, hybridized model against the imperative U-Net block.

For each width, one U-Net (depth 4, BatchNorm, 3 input channels, random weights) is
timed two ways with the same weights, in one process:

* imperative - the Gluon ``UNet`` block, not hybridized (Python runs every layer);
* exported   - the same block hybridized, exported to ``model-symbol.json`` +
  ``model-0000.params`` and loaded back with ``SymbolBlock.imports`` (what
  ``bin/predict`` runs), hybridized with ``static_alloc``.

Each timed run is one forward of a batch of ``--batch`` images at ``--size`` px, read back
to the host; the two are interleaved run by run so a load change on a shared machine
hits both, and the median of ``--runs`` is reported. Then a ``--big`` x ``--big`` image is
predicted by ``predict_image(mode='tile')`` at tile size ``--size`` (the training size),
and once with ``tta=True``.

    python benchmarks/bench_inference.py [--widths 16,32] [--size 256] [--batch 8]
                                         [--runs 5] [--big 1024] [--cpus 1]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

import mxnet as mx  # noqa: E402

from gluon_unet.config import ModelConfig  # noqa: E402
from gluon_unet.inference.batched import InputJob, image_jobs, predict_image  # noqa: E402
from gluon_unet.model import build_model, flops_per_image  # noqa: E402


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_width(width, size, batch, runs, ctx, folder):
    cfg = ModelConfig(in_channels=3, width=width, depth=4, batch_norm=True)
    mx.random.seed(0)
    net = build_model(cfg)
    net.initialize(mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2), ctx=ctx)
    x = mx.nd.array(np.random.default_rng(0).random((batch, 3, size, size)), ctx=ctx)

    def imperative():
        with mx.autograd.predict_mode():
            net(x).asnumpy()

    imperative()  # resolves deferred shapes
    # Export a copy of the same weights, then load it as bin/predict does.
    net.hybridize(static_alloc=True, static_shape=True)
    net(x).wait_to_read()
    prefix = os.path.join(folder, 'w%d' % width)
    net.export(prefix, epoch=0)
    net.hybridize(active=False)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        exported = mx.gluon.SymbolBlock.imports(prefix + '-symbol.json', ['data'], prefix + '-0000.params', ctx=ctx)
    exported.hybridize(static_alloc=True)

    def compiled():
        exported(x).asnumpy()

    diff = float(np.abs(exported(x).asnumpy() - _predict(net, x)).max())
    for fn in (imperative, compiled):  # warm-up
        fn()
    t_imp, t_exp = [], []
    for _ in range(runs):
        t_imp.append(_timed(imperative))
        t_exp.append(_timed(compiled))
    gflop = flops_per_image(cfg, size) / 1e9
    return {'width': width, 'imperative': batch / statistics.median(t_imp),
            'exported': batch / statistics.median(t_exp), 'gflop': gflop, 'max_diff': diff}, exported


def _predict(net, x):
    with mx.autograd.predict_mode():
        return net(x).asnumpy()


def bench_tiled(net, size, big, batch, ctxs, runs):
    image = (np.random.default_rng(1).random((big, big, 3)) * 255).astype(np.uint8)
    meta = {'train_size': size, 'multiple': 16, 'resize_mode': 'resize'}
    rows = []
    for tta, n in ((False, runs), (True, 1)):
        predict_image(net, meta, image[:size + 64, :size + 64], ctxs, mode='tile', tta=tta, batch_size=batch)
        times = [_timed(lambda: predict_image(net, meta, image, ctxs, mode='tile', tta=tta, batch_size=batch))
                 for _ in range(n)]
        rows.append((tta, statistics.median(times), n))
    tiles = sum(isinstance(j, InputJob) for j in image_jobs(image, meta, 'tile', on_done=lambda *a: None))
    return rows, tiles


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--widths', default='16,32')
    p.add_argument('--size', type=int, default=256)
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--runs', type=int, default=5)
    p.add_argument('--big', type=int, default=1024)
    p.add_argument('--cpus', type=int, default=1, help='CPU contexts for the tiled prediction')
    args = p.parse_args(argv)
    ctx = mx.cpu(0)
    results, exported = [], None
    with tempfile.TemporaryDirectory() as folder:
        for w in [int(v) for v in args.widths.split(',')]:
            row, exported = bench_width(w, args.size, args.batch, args.runs, ctx, folder)
            results.append(row)
            print('width %d done' % w, file=sys.stderr)
        ctxs = [mx.cpu(i) for i in range(args.cpus)]
        if args.cpus > 1:
            exported.reset_ctx(ctxs)
        tiled, n_tiles = bench_tiled(exported, args.size, args.big, args.batch, ctxs, max(1, args.runs // 2))
    print('mxnet %s, %d CPU thread(s) (OMP_NUM_THREADS=%s), batch %d at %d px, median of %d runs\n'
          % (mx.__version__, os.cpu_count(), os.environ.get('OMP_NUM_THREADS', 'unset'), args.batch, args.size,
             args.runs))
    print('| width | GFLOP/image | imperative block (img/s) | exported SymbolBlock (img/s) | speed-up | max abs diff |')
    print('|---|---|---|---|---|---|')
    for r in results:
        print('| %d | %.1f | %.2f | %.2f | %.2fx | %.1e |' % (r['width'], r['gflop'], r['imperative'], r['exported'],
                                                          r['exported'] / r['imperative'], r['max_diff']))
    print('\n| tiled %dx%d image (tile %d, overlap 0.25, width %d, %d device%s) | tiles | seconds |'
          % (args.big, args.big, args.size, results[-1]['width'], args.cpus, 's' if args.cpus > 1 else ''))
    print('|---|---|---|')
    for tta, sec, n in tiled:
        print('| %s | %d | %.2f |' % ('with --tta (8 variants)' if tta else 'plain', n_tiles * (8 if tta else 1),
                                      sec))


if __name__ == '__main__':
    main()
