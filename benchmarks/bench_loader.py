"""Data loading benchmark: gluon_unet's cached loader against the seed's loop.

Loads the DSB 2018 stage1_train set (read-only; the cache goes to a fresh folder under
/tmp) at SIZE px three ways, in one run:

* seed  - the original script's loop: skimage ``imread`` + ``resize(..., mode='constant',
  preserve_range=True)`` one file at a time, object masks merged with ``np.maximum``;
* cold  - ``load_dataset`` with an empty cache (decode + resize in worker processes,
  write the cache);
* warm  - ``load_dataset`` again (cache hit: list files, stat them, memory-map).

All image/mask files are read once before timing, so every method finds them in the
OS page cache and the comparison is about decoding, not the disk. Then it checks that
the arrays agree and measures a Gluon DataLoader (augmentation on, batch 16) over the
loaded dataset.

    python benchmarks/bench_loader.py [--data ../shared/data/dsb2018/stage1_train]
                                      [--size 256] [--workers 2] [--limit N]
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

import gluon_unet  # noqa: E402

gluon_unet.use_all_cores()  # as bin/train, before gluon_unet.data loads mxnet
from gluon_unet.data import load_dataset, make_loader, make_transform  # noqa: E402
from gluon_unet.data.layouts import discover  # noqa: E402


def seed_loop(samples, size):
    """The seed's loader, as written in the original script (kaggle U-Net starter style)."""
    from skimage.io import imread
    from skimage.transform import resize
    X = np.zeros((len(samples), size, size, 3), np.uint8)
    Y = np.zeros((len(samples), size, size, 1), bool)
    for n, s in enumerate(samples):
        img = imread(s.image)[:, :, :3]
        X[n] = resize(img, (size, size), mode='constant', preserve_range=True)
        mask = np.zeros((size, size, 1), bool)
        for f in s.masks:
            m = imread(f)
            m = np.expand_dims(resize(m, (size, size), mode='constant', preserve_range=True), axis=-1)
            mask = np.maximum(mask, m)
        Y[n] = mask
    return X, Y[..., 0]


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--data', default=os.path.normpath(os.path.join(here, '..', '..', 'shared', 'data',
                                                                    'dsb2018', 'stage1_train')))
    p.add_argument('--size', type=int, default=256)
    p.add_argument('--workers', type=int, default=2)
    p.add_argument('--limit', type=int, default=0, help='only the first N samples (quick check)')
    p.add_argument('--loader-epochs', type=int, default=1)
    args = p.parse_args(argv)

    _, samples = discover(args.data, layout='dsb')
    if args.limit:
        samples = samples[:args.limit]
    n_files = sum(1 + len(s.masks) for s in samples)
    from gluon_unet.machine.cpu import cpu_description
    print('machine: %s, %d CPUs' % (cpu_description(), os.cpu_count()))
    print('%d samples, %d files, %d px, %d workers' % (len(samples), n_files, args.size, args.workers))
    for s in samples:  # page cache: time decoding, not the disk
        for f in s.files():
            with open(f, 'rb') as fh:
                fh.read()

    t = time.perf_counter()
    X, Y = seed_loop(samples, args.size)
    t_seed = time.perf_counter() - t

    # The loader reads the whole folder; with --limit, point it at a subset via a CSV-free trick:
    # a temporary folder of symlinks to the chosen sample folders (the data stays read-only).
    tmp = tempfile.mkdtemp(prefix='bench_loader_')
    data = args.data
    if args.limit:
        data = os.path.join(tmp, 'subset')
        os.makedirs(data)
        for s in samples:
            os.symlink(os.path.join(args.data, s.name), os.path.join(data, s.name))
    cache_dir = os.path.join(tmp, 'cache')
    try:
        t = time.perf_counter()
        ds = load_dataset(data, layout='dsb', size=args.size, channels=3, cache_dir=cache_dir,
                          workers=args.workers, progress=False)
        t_cold = time.perf_counter() - t
        t = time.perf_counter()
        ds = load_dataset(data, layout='dsb', size=args.size, channels=3, cache_dir=cache_dir,
                          workers=args.workers, progress=False)
        t_warm = time.perf_counter() - t
        assert isinstance(ds.images, np.memmap), type(ds.images)

        # -- same arrays? ------------------------------------------------------------
        assert ds.names == [s.name for s in samples]
        masks = np.asarray(ds.masks).astype(bool)
        eq_masks = float((masks == Y).mean())
        # skimage resizes each 0/255 object mask bilinearly with anti-aliasing and the
        # seed keeps every pixel > 0, which grows objects by a pixel where it shrinks
        # images; thresholding the same blurred masks at half height is what nearest does.
        same_size = np.array([s == (args.size, args.size) for s in ds.original_sizes])
        imgs = np.asarray(ds.images).astype(np.int16)
        diff = np.abs(imgs - X.astype(np.int16))
        eq_masks_same = float((masks[same_size] == Y[same_size]).mean()) if same_size.any() else float('nan')
        max_diff_same = int(diff[same_size].max()) if same_size.any() else -1
        mean_diff_resized = float(diff[~same_size].mean()) if (~same_size).any() else 0.0
        within1_resized = float((diff[~same_size] <= 1).mean()) if (~same_size).any() else 1.0
        inst_ok = all(np.array_equal(np.asarray(ds.instances(i)) > 0, masks[i]) for i in range(len(ds)))

        # -- loader throughput ------------------------------------------------------
        ds.transform = make_transform(augment=True)
        loader = make_loader(ds, 16, shuffle=True, seed=0, workers=args.workers)
        seen = 0
        t = time.perf_counter()
        for _ in range(args.loader_epochs):
            for batch in loader:
                seen += batch[0].shape[0]
        t_loader = time.perf_counter() - t
        del loader
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    n = len(samples)
    print()
    print('| method | time (s) | images/s | speed-up vs seed |')
    print('| --- | ---: | ---: | ---: |')
    print('| seed loop (skimage, 1 process) | %.1f | %.1f | 1.0x |' % (t_seed, n / t_seed))
    print('| load_dataset cold (decode + cache, %d workers) | %.1f | %.1f | %.1fx |'
          % (args.workers, t_cold, n / t_cold, t_seed / t_cold))
    print('| load_dataset warm (cache hit, memmap) | %.2f | %.0f | %.0fx |' % (t_warm, n / t_warm, t_seed / t_warm))
    print('| DataLoader, augment on, batch 16, %d workers | %.1f | %.0f | - |' % (args.workers, t_loader, seen / t_loader))
    print()
    print('masks equal to the seed\'s: %.4f of pixels (%.4f on the %d images already %d px: no resize)'
          % (eq_masks, eq_masks_same, int(same_size.sum()), args.size))
    print('images: max |diff| %d on not-resized images; resized ones: mean |diff| %.2f, %.3f of values within 1'
          % (max_diff_same, mean_diff_resized, within1_resized))
    print('instances > 0 == masks for every image: %s' % inst_ok)


if __name__ == '__main__':
    main()
