"""Feeding a GPU from host memory three ways (GPU lane; issue 47 item 5).

MXNet 1.9.1 does not pool pinned memory: every ``cpu_pinned`` array is a
``cudaHostAlloc`` and its end a ``cudaFreeHost`` (``src/storage/pinned_memory_storage.h``).
Gluon's ``DataLoader(pin_memory=True)`` makes a new pinned batch every step; gluon_unet
now copies each batch into a small ring of pinned buffers (``gluon_unet.data.pinned``).
This times, per batch of ``--batch`` x ``--channels`` x ``--side`` x ``--side`` float32
images plus a 1-channel target, what the training loop does with it: make the host batch
(a fresh array, as the loader's workers deliver it), bring it to pinned memory (or not),
copy it to the GPU, and wait for the copy, with a small kernel on the GPU in between.

    pageable    the host batch is copied to the GPU as it is (staged by the driver)
    per-batch   as_in_context(cpu_pinned): cudaHostAlloc + memcpy + cudaFreeHost each batch
    ring        PinnedRing: memcpy into one of 3 buffers allocated once

The three are alternated ``--rounds`` times; medians of ms per batch are printed, then
one JSON line. Without a GPU it prints why and exits 0 (``skipped: ...``).

    python benchmarks/bench_pinned.py [--gpu 0] [--batch 64] [--side 256] [--channels 3]
                                      [--batches 20] [--rounds 3]
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def time_feeding(mode, gpu, shape, batches):
    """Seconds per batch of feeding ``gpu`` ``batches`` times in ``mode``."""
    import mxnet as mx
    import numpy as np

    from gluon_unet.data.pinned import PinnedRing

    ctx = mx.gpu(gpu)
    target_shape = (shape[0], 1) + shape[2:]
    host = [np.random.RandomState(i).rand(*shape).astype(np.float32) for i in range(2)]
    ring = PinnedRing(gpu)
    acc = mx.nd.zeros((1,), ctx=ctx)
    mx.nd.waitall()
    t0 = time.perf_counter()
    for k in range(batches):
        batch = (mx.nd.array(host[k % 2]), mx.nd.zeros(target_shape))  # as a loader delivers it
        if mode == 'per-batch':
            batch = tuple(a.as_in_context(mx.Context('cpu_pinned', gpu)) for a in batch)
        elif mode == 'ring':
            batch = ring(batch)
        on_gpu = [a.as_in_context(ctx) for a in batch]
        acc += on_gpu[0].mean() + on_gpu[1].mean()  # a kernel that needs the copy
        del batch, on_gpu
    acc.wait_to_read()
    return (time.perf_counter() - t0) / batches


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--gpu', type=int, default=0)
    parser.add_argument('--batch', type=int, default=64)
    parser.add_argument('--side', type=int, default=256)
    parser.add_argument('--channels', type=int, default=3)
    parser.add_argument('--batches', type=int, default=20)
    parser.add_argument('--rounds', type=int, default=3)
    args = parser.parse_args(argv)
    from gluon_unet.machine.gpus import gpu_status, probe_gpu
    count, reason = gpu_status()
    if count <= args.gpu:
        print('skipped: no GPU %d: %s' % (args.gpu, reason or 'this machine has %d GPU(s)' % count))
        return 0
    problem = probe_gpu(args.gpu)
    if problem:
        print('skipped: %s' % problem)
        return 0
    shape = (args.batch, args.channels, args.side, args.side)
    modes = ('pageable', 'per-batch', 'ring')
    for mode in modes:  # warm-up: CUDA context, kernels, the ring's buffers
        time_feeding(mode, args.gpu, shape, 2)
    times = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            times[mode].append(time_feeding(mode, args.gpu, shape, args.batches))
    mb = 4.0 * args.batch * (args.channels + 1) * args.side ** 2 / 2 ** 20
    print('batch %s float32 + target: %.0f MB per batch, %d batches x %d rounds on gpu(%d)'
          % ('x'.join(map(str, shape)), mb, args.batches, args.rounds, args.gpu))
    record = {'batch_mb': mb}
    for mode in modes:
        ms = 1000 * statistics.median(times[mode])
        record[mode + '_ms'] = ms
        print('%-10s %8.2f ms per batch  (%.0f MB/s; rounds %s)' % (
            mode, ms, mb / (ms / 1000), ' '.join('%.2f' % (1000 * t) for t in times[mode])))
    print(json.dumps(record))
    return 0


if __name__ == '__main__':
    sys.exit(main())
