"""What the content digests cost (issue 45): load time of a checkpoint with and without
its CRC-32 check, save time with and without computing it, and the opening of a data
cache entry with and without checking its arrays - measured side by side, alternating,
median of --repeat.

    python benchmarks/bench_digest.py --width 64 --data /path/to/stage1_train --size 256 \\
        --cache-dir /tmp/digest-cache

The cache entry is built first if needed (a one-time decode); both timings then read it
from the page cache (warm): the check's extra cost is reading and hashing every byte,
which training pays anyway in its first epoch when it pages the arrays in.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

import mxnet as mx  # noqa: E402

from gluon_unet import checkpoint
from gluon_unet.inference import export, batched as inference, sidecar  # noqa: E402
from gluon_unet.config import ModelConfig, TrainConfig  # noqa: E402
from gluon_unet.data import cache, load_dataset  # noqa: E402
from gluon_unet.model import build_model  # noqa: E402


def _timed(fn):
    mx.nd.waitall()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _alternate(with_check, without_check, repeat):
    on, off = [], []
    for _ in range(repeat):
        on.append(_timed(with_check))
        off.append(_timed(without_check))
    return statistics.median(on), statistics.median(off)


def bench_checkpoint(width, repeat, folder):
    net = build_model(ModelConfig(in_channels=3, width=width))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    trainer = mx.gluon.Trainer(net.collect_params(), 'adam')
    with mx.autograd.record():
        loss = net(mx.nd.random.uniform(shape=(1, 3, 64, 64))).mean()
    loss.backward()
    trainer.step(1)  # Adam's moments exist: a real checkpoint's size
    path = os.path.join(folder, 'w%d.ckpt' % width)
    meta = {'epoch': 1, 'config': {}}
    real_crc = checkpoint.arrays_crc32

    def save_with():
        checkpoint.save_checkpoint(path, net, trainer, meta)

    def save_without():
        checkpoint.arrays_crc32 = lambda arrays: 0
        try:
            checkpoint.save_checkpoint(path, net, trainer, meta)
        finally:
            checkpoint.arrays_crc32 = real_crc
    save_on, save_off = _alternate(save_with, save_without, repeat)
    save_with()
    size = os.path.getsize(path)
    real_verify = checkpoint.verify_checkpoint

    def load_with():
        checkpoint.forget_verified()
        checkpoint.load_checkpoint(path, net, trainer)

    def load_without():
        checkpoint.verify_checkpoint = lambda p, arrays: None
        try:
            checkpoint.load_checkpoint(path, net, trainer)
        finally:
            checkpoint.verify_checkpoint = real_verify
    load_on, load_off = _alternate(load_with, load_without, repeat)
    print('checkpoint width %d (Adam): %.1f MB; load %.3f s with the check, %.3f s without (x%.2f); '
          'save %.3f s with the digest, %.3f s without (x%.2f)'
          % (width, size / 2 ** 20, load_on, load_off, load_on / load_off, save_on, save_off, save_on / save_off))
    # The export of the same network: bin/predict's load, checked against model.json's digest.
    cfg = TrainConfig(model=ModelConfig(in_channels=3, width=width), size=256)
    out = os.path.join(folder, 'export')
    export.export_block(net, cfg, out)
    real_export_check = inference.verify_export

    def without_export_check():
        inference.verify_export = lambda *a: None
        try:
            inference.load_exported(out)
        finally:
            inference.verify_export = real_export_check
    on, off = _alternate(lambda: inference.load_exported(out), without_export_check, repeat)
    print('export width %d: %.1f MB of params; load %.3f s with the check, %.3f s without (x%.2f)'
          % (width, os.path.getsize(os.path.join(out, sidecar.PARAMS)) / 2 ** 20, on, off, on / off))


def bench_cache(data, size, cache_dir, repeat):
    def load(verify):
        real = cache.intact
        if not verify:
            cache.intact = lambda *a, **k: True
        try:
            return load_dataset(data, size=size, cache_dir=cache_dir, workers=2, progress=False)
        finally:
            cache.intact = real
    t0 = time.perf_counter()
    ds = load(True)  # builds the entry the first time
    first = time.perf_counter() - t0
    nbytes = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(cache_dir)
                 for f in files if f.endswith('.bin'))
    on, off = _alternate(lambda: load(True), lambda: load(False), repeat)
    print('cache of %s at %d px: %d images, %.1f MB of arrays (first call %.1f s); open %.3f s with the check, '
          '%.3f s without (+%.3f s)' % (data, size, len(ds), nbytes / 2 ** 20, first, on, off, on - off))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--width', type=int, default=64)
    parser.add_argument('--data', help='a dataset to cache (e.g. DSB stage1_train); omitted: checkpoint only')
    parser.add_argument('--size', type=int, default=256)
    parser.add_argument('--cache-dir', default=None)
    parser.add_argument('--repeat', type=int, default=5)
    parser.add_argument('--folder', default='/dev/shm' if os.path.isdir('/dev/shm') else None,
                        help='where the checkpoint is written (default /dev/shm: memory, so that the disk '
                             'writing back dirty pages does not blur the figures)')
    args = parser.parse_args()
    print(open('/proc/cpuinfo').read().split('model name')[1].split('\n')[0].strip(': \t'))
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        bench_checkpoint(args.width, args.repeat, folder)
        if args.data:
            bench_cache(args.data, args.size, args.cache_dir or os.path.join(folder, 'cache'), args.repeat)


if __name__ == '__main__':
    main()
