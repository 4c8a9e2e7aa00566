"""Step by step: do several CPU contexts run side by side, or take turns?

Times each training step on its own (a host wait after every step) and samples the CPU
time of every thread of this process around it (``/proc/self/task/*/stat``, and
``schedstat`` for the time a thread was runnable but not running). One engine worker per
context does the work (``OMP_NUM_THREADS`` = cores / contexts), so on 2 cores and 2
contexts a step where the workers' shares add up to well under 2 is a step where they
waited for each other - a *stalled* step - unless the rest of the machine was busy
(``other``, from ``/proc/stat``). This is what found finding 8 (experiments/performance/findings.md), where
the wall-clock speed of the VM moved too much to see it in images/s alone.

    python benchmarks/bench_step_stalls.py --cpus 2 --steps 60
    python benchmarks/bench_step_stalls.py --cpus 2 --steps 60 --root /tmp/prefix   # another tree's package

Same step as ``bench_train.py`` (``gluon_unet.training.benchmark.make_training_step``), width 16 @128,
batch 16, 1 input channel unless told otherwise.
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HZ = os.sysconf('SC_CLK_TCK')
sys.path.insert(0, HERE)
from procstat import busy_seconds, thread_ticks  # noqa: E402  (the same /proc readings)


def runnable_waiting_ns(tids):
    """{tid: ns spent runnable but not running} (``schedstat``; 0 where unavailable)."""
    out = {}
    for t in tids:
        try:
            with open('/proc/self/task/%s/schedstat' % t) as f:
                out[t] = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            out[t] = 0
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--cpus', type=int, default=2, help='CPU contexts (default 2)')
    p.add_argument('--steps', type=int, default=60, help='timed steps (default 60)')
    p.add_argument('--config', default='16:128:16', help='WIDTH:SIZE:BATCH (default 16:128:16)')
    p.add_argument('--channels', type=int, default=1)
    p.add_argument('--root', metavar='DIR', help="import gluon_unet from DIR (another commit's package)")
    p.add_argument('--stall-below', type=float, default=None,
                   help='a step is stalled when the engine workers add up to less than this many cores '
                        '(default: contexts - 0.6)')
    p.add_argument('--verbose', action='store_true', help='one line per step')
    args = p.parse_args(argv)
    if args.root and not os.path.isfile(os.path.join(args.root, 'gluon_unet', '__init__.py')):
        p.error('--root %s: no gluon_unet/__init__.py there' % args.root)
    width, size, batch = (int(v) for v in args.config.split(':'))
    sys.path.insert(0, os.path.abspath(args.root) if args.root else ROOT)
    from gluon_unet.machine.runtime import apply_runtime_defaults
    apply_runtime_defaults(contexts=args.cpus, memory='speed')  # as bin/train --cpus N
    import mxnet as mx
    from gluon_unet.training.benchmark import make_training_step, synthetic_batch
    from gluon_unet.config import ModelConfig, TrainConfig
    from gluon_unet.machine.devices import make_contexts
    from gluon_unet.machine.cpu import cpu_description
    from gluon_unet.machine.runtime import configure_runtime
    cfg = TrainConfig(model=ModelConfig(in_channels=args.channels, width=width, depth=4), size=size,
                      batch_size=batch, cpus=args.cpus, optimizer='adam', loss='bce', lr=1e-3, progress=False)
    ctxs = make_contexts('', args.cpus)
    configure_runtime(len(ctxs))
    step = make_training_step(cfg, ctxs)
    data = synthetic_batch(cfg)
    for _ in range(3):
        step(*data)
    mx.nd.waitall()
    # The engine workers are the busiest threads other than this (the Python) one.
    before = thread_ticks()
    for _ in range(3):
        step(*data)
    mx.nd.waitall()
    after = thread_ticks()
    me = str(os.getpid())
    workers = sorted((t for t in after if t != me),
                     key=lambda t: before.get(t, ('', 0))[1] - after[t][1])[:args.cpus]
    stall_below = args.cpus - 0.6 if args.stall_below is None else args.stall_below
    print('machine: %s, %d CPUs; package %s; %d context(s), OMP_NUM_THREADS=%s, MXNET_CPU_TEMP_COPY=%s'
          % (cpu_description(), os.cpu_count(), os.path.dirname(sys.modules['gluon_unet'].__file__), args.cpus,
             os.environ.get('OMP_NUM_THREADS'), os.environ.get('MXNET_CPU_TEMP_COPY', '4 (MXNet default)')),
          flush=True)
    rows = []
    for i in range(args.steps):
        t0, w0, m0 = thread_ticks(), runnable_waiting_ns(workers), busy_seconds()
        c0 = time.perf_counter()
        step(*data)
        mx.nd.waitall()
        wall = time.perf_counter() - c0
        t1, w1, m1 = thread_ticks(), runnable_waiting_ns(workers), busy_seconds()
        ticks = {t: t1[t][1] - t0.get(t, ('', 0))[1] for t in t1}
        shares = [ticks.get(t, 0) / HZ / wall for t in workers]
        other = max(0.0, (m1 - m0) - sum(ticks.values()) / HZ) / wall
        waiting = sum(w1[t] - w0[t] for t in workers) / 1e9 / wall
        rows.append((wall, sum(shares), other))
        if args.verbose:
            print('step %3d  %.2f s  workers %s  (runnable, not running: %.2f)  other %.2f'
                  % (i + 1, wall, ' '.join('%.2f' % s for s in shares), waiting, other), flush=True)
    walls = [r[0] for r in rows]
    stalled = [r for r in rows if r[1] < stall_below and r[2] < 0.2]
    print('%d steps: %.2f images/s; median step %.2f s; engine workers busy %.2f cores on average; '
          'stalled steps (workers < %.1f cores, other < 0.2): %d, %.1f s of %.1f s; other %.2f cores'
          % (len(rows), batch * len(rows) / sum(walls), statistics.median(walls),
             statistics.mean(r[1] for r in rows), stall_below, len(stalled), sum(r[0] for r in stalled),
             sum(walls), statistics.median(r[2] for r in rows)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
