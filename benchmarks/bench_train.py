"""Training (and inference) speed of gluon_unet's U-Net against the same U-Net in PyTorch.

Each measured setup runs in its own worker process (MXNet and PyTorch ship different
OpenMP runtimes, and peak memory must be per setup); the parent alternates the timed
repetitions between the workers - ours on 1 context, ours on N contexts, PyTorch - so
that load from other users of this machine hits all of them alike. Reported: the
median images/s over the repetitions (steady state: after warm-up steps), the ratio
ours/PyTorch, achieved GFLOP/s (``gluon_unet.model.flops_per_image``, training = 3
forward passes) against a peak measured on the CPU at hand (a 2048 x 2048 matmul in
MXNet in the same dtype, on AMX for bfloat16 where gluon_unet turns it on), the
data-parallel overhead (N contexts against 1 at the same global batch) and the peak
resident memory per training image and per device.

Alternating is not enough on a 2-core machine: while another process holds one core, a
worker with 2 threads (ours with ``OMP_NUM_THREADS=2``, PyTorch by default) stalls at
every OpenMP barrier and runs at a fraction of its speed, whereas a 1-thread worker
does not notice. So each timed repetition also records the CPU that other processes
used meanwhile (column "other", in cores; ``/proc/stat``), a repetition is repeated
after a pause when that exceeds ``--max-foreign``, and a reduced CPU affinity mask is
reported. Idle workers block on their pipe and use no CPU.

Ours is the trainer's own step (``gluon_unet.training.benchmark.make_training_step``: the
network of ``step.build_network``, ``SegmentationLoss('bce')``, Adam via
``optim.make_trainer``, ``parallel.DataParallelStep``). PyTorch (``benchmarks/torch_unet.py``,
benchmark-only: ``pip install torch``) trains the same architecture eagerly with
``BCEWithLogitsLoss`` and ``torch.optim.Adam``; ``--amp`` compares MXNet's bfloat16 AMP
with ``torch.autocast('cpu', torch.bfloat16)``. The workers are in ``train_workers.py``; this
file is the parent: flags, alternation, the tables.

    python benchmarks/bench_train.py                         # both seed configs, float32
    python benchmarks/bench_train.py --amp                   # bfloat16 rows
    python benchmarks/bench_train.py --inference             # exported model vs eval()+no_grad()
    python benchmarks/bench_train.py --configs 16:128:16 --cpus 1,2,4 --reps 7
    python benchmarks/bench_train.py --memory speed,balanced,low  # bin/train --memory, side by side
    python benchmarks/bench_train.py --old /tmp/old --cpus 1,2     # another commit's package, alongside
    python benchmarks/bench_train.py --configs 8:256:16 --cpus 1 --no-torch \
        --variant WIDTH=16,AMP=1 --variant WIDTH=8,AMP=1   # wider in bfloat16 vs width 8 float32

``--configs`` is a comma list of WIDTH:SIZE:BATCH (depth 4, 3 input channels).
"""
import argparse
import json
import os
import statistics
import sys
import time

from train_workers import PEAK_SIDE, ROOT, Worker, measure_peak


def parse_env(items, flag='--env'):
    """``{KEY: VALUE}`` of ``KEY=VALUE`` items; ValueError naming ``flag`` on another shape."""
    env = {}
    for item in items or []:
        key, eq, value = item.partition('=')
        if not key or not eq:
            raise ValueError('%s: expected KEY=VALUE, got %r' % (flag, item))
        env[key] = value
    return env


def positive_ints(text, flag, sep=','):
    """The ``sep``-separated positive integers of ``text`` (one when ``sep`` is None); ValueError
    naming ``flag``."""
    try:
        values = [int(v) for v in (text.split(sep) if sep else [text])]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError('%s: expected %s, got %r' % (
            flag, 'positive integers separated by %r' % sep if sep else 'a positive integer', text))
    return values


def variant_spec(variant, base, env):
    """``(spec, env)`` of a ``--variant KEY=VALUE,...`` worker: ``CONTEXTS``, ``WIDTH`` and
    ``AMP`` change the setup (``base``), any other key is an environment variable."""
    venv = dict(env, **parse_env(variant.split(','), '--variant'))
    spec = dict(base, memory='speed')
    # Another network or precision beside the same batches: the capacity a faster
    # precision buys is a ratio of two setups, so they are measured in one run.
    spec['cpus'] = positive_ints(venv.pop('CONTEXTS', '1'), '--variant CONTEXTS', sep=None)[0]
    spec['width'] = positive_ints(venv.pop('WIDTH', str(base['width'])), '--variant WIDTH', sep=None)[0]
    amp = venv.pop('AMP', str(int(base['amp'])))
    if amp not in ('0', '1'):
        raise ValueError('--variant AMP: expected 0 (float32) or 1 (bfloat16), got %r' % amp)
    spec['amp'] = amp == '1'
    return spec, venv


def run_config(width, size, batch, args):
    """Measure one WIDTH:SIZE:BATCH setup; returns a list of result rows."""
    sys.path.insert(0, ROOT)
    from gluon_unet.config import ModelConfig
    from gluon_unet.model import flops_per_image
    base = dict(width=width, size=size, batch=batch, channels=args.channels, depth=args.depth,
                amp=args.amp, warmup=args.warmup, min_seconds=args.min_seconds)
    env = parse_env(args.env)
    workers = []
    if args.inference:
        workers.append(Worker('ours', 'mx_infer', dict(base, cpus=1), env))
        if not args.no_torch:
            workers.append(Worker('pytorch', 'torch_infer', dict(base, cpus=1), {}))
    else:
        for memory in args.memory:
            for n in args.cpus:
                if n <= batch:
                    name = 'ours x%d' % n + ('' if memory == 'speed' else ' ' + memory)
                    workers.append(Worker(name, 'mx', dict(base, cpus=n, memory=memory), env))
        if args.old:
            for n in args.cpus:
                if n <= batch:
                    workers.append(Worker('old x%d' % n, 'mx', dict(base, cpus=n, root=args.old), env))
        for i, variant in enumerate(args.variant or []):
            spec, venv = variant_spec(variant, base, env)
            workers.append(Worker('ours v%d' % (i + 1), 'mx', spec, venv))
        if not args.no_torch:
            for t in args.torch_threads or [0]:
                workers.append(Worker('pytorch t%d' % t if t else 'pytorch', 'torch',
                                      dict(base, cpus=1, threads=t), {}))
    # Warm up one at a time: warm-up is not timed, but two warm-ups at once would
    # fight for the cores and pick too few steps per repetition.
    for w in workers:
        w.setup()
    for _ in range(args.reps):
        for w in workers:
            w.run(args.max_foreign)
    for w in workers:
        w.stop()
    def flops(w):
        net = ModelConfig(in_channels=args.channels, width=w.spec['width'], depth=args.depth)
        return flops_per_image(net, size) * (1 if args.inference else 3)

    # The ratio is against PyTorch at its best thread count among those measured.
    torch_w = max((w for w in workers if w.name.startswith('pytorch')), key=lambda w: w.median,
                  default=None)
    # Data-parallel overhead: against one context with the same --memory setting (and tree).
    ones = {(w.spec.get('memory'), w.spec.get('root')): w for w in workers
            if w.kind == 'mx' and w.spec['cpus'] == 1 and not w.name.startswith('ours v')}
    rows = []
    for w in workers:
        n = w.spec['cpus']
        used_kib = max(0, w.mem['peak_kib'] - w.mem['base_kib'])
        row = {'setup': w.name, 'memory': w.spec.get('memory', '-'), 'width': w.spec['width'], 'size': size,
               'batch': batch, 'contexts': n, 'dtype': 'bfloat16' if w.spec['amp'] else 'float32',
               'mode': 'inference' if args.inference else 'training',
               'images_per_s': w.median, 'all': w.rates, 'steps_per_rep': w.steps,
               'images_per_cpu_s': w.cpu_median, 'all_cpu': w.cpu_rates,
               'gflops': w.median * flops(w) / 1e9, 'peak_fraction': w.median * flops(w) / 1e9 / args.peak,
               'peak_rss_mib': w.mem['peak_kib'] / 1024,
               'foreign_cores': statistics.median(w.foreign), 'all_foreign': w.foreign,
               'retried_reps': w.retried, 'threads_busy': busiest_threads(w.threads),
               'mib_per_image': used_kib / 1024 / batch, 'mib_per_device': used_kib / 1024 / n}
        if torch_w and not w.name.startswith('pytorch'):
            row['vs_pytorch'] = w.median / torch_w.median
            row['vs_pytorch_cpu'] = w.cpu_median / torch_w.cpu_median
        one = ones.get((w.spec.get('memory'), w.spec.get('root')))
        if one and w.kind == 'mx' and n > 1:
            row['dp_overhead'] = 1.0 - w.median / one.median
            row['dp_overhead_cpu'] = 1.0 - w.cpu_median / one.cpu_median
            row['dp_overhead_paired'] = 1.0 - paired_ratio(w.rates, one.rates)
        base_one = ones.get(('speed', None))
        if w.name.startswith('ours v') and base_one:
            row['vs_ours_x1_paired'] = paired_ratio(w.rates, base_one.rates)
        mine = [o for o in workers if o.name == w.name.replace('old ', 'ours ')]
        if w.name.startswith('old ') and mine:
            row['new_vs_old_paired'] = paired_ratio(mine[0].rates, w.rates)
        rows.append(row)
    return rows


def paired_ratio(a, b):
    """Median over repetitions of ``a[i] / b[i]``. Repetition i of every worker runs back to
    back, so a machine whose speed drifts (a VM whose neighbours come and go: +-25 % within
    seconds on the Zen 3 VM) slows both alike; the ratio of the medians does not pair them."""
    return statistics.median(x / y for x, y in zip(a, b))


def format_paired(rows):
    """The paired ratios (see :func:`paired_ratio`), where there are any."""
    lines = []
    for r in rows:
        if 'dp_overhead_paired' in r:
            lines.append('%-16s %4d  data-parallel overhead, paired by repetition: %+.1f%%'
                         % (r['setup'], r['width'], 100 * r['dp_overhead_paired']))
        if 'vs_ours_x1_paired' in r:
            lines.append('%-16s %4d  %s / ours x1, paired by repetition: %.3fx'
                         % (r['setup'], r['width'], r['dtype'], r['vs_ours_x1_paired']))
        if 'new_vs_old_paired' in r:
            lines.append('%-16s %4d  this tree / --old, paired by repetition: %.3fx'
                         % (r['setup'].replace('old', 'ours'), r['width'], r['new_vs_old_paired']))
    return '\n'.join(lines)


def busiest_threads(reps, keep=6):
    """Per rank (busiest thread first), the median share of wall time over repetitions."""
    ranks = min(keep, max((len(r) for r in reps), default=0))
    return [statistics.median(r[i][0] if i < len(r) else 0.0 for r in reps) for i in range(ranks)]


def format_threads(rows):
    """Where the CPU time goes inside each worker: its busiest threads' shares of the wall
    time. Two contexts that run side by side show two threads near 1.0; contexts that wait
    for each other show their busy shares summing to about one core."""
    lines = ['%-16s %4s  %s' % ('setup', 'w', 'busiest threads (CPU s per wall s, median over repetitions)')]
    for r in rows:
        shares = r.get('threads_busy') or []
        lines.append('%-16s %4d  %s   sum %.2f' % (r['setup'], r['width'], ' '.join('%.2f' % b for b in shares),
                                                 sum(shares)))
    return '\n'.join(lines)


def _fmt(row, key, fmt, scale=1):
    return fmt % (scale * row[key]) if key in row else '-'


def format_rows(rows):
    head = ('%-16s %-9s %-8s %4s %5s %4s %9s %8s %8s %7s %8s %9s %8s %8s %8s %8s'
            % ('setup', 'mode', 'dtype', 'w', 'px', 'bs', 'images/s', 'vs torch', 'GFLOP/s',
               '% peak', 'dp ovh', 'img/CPU-s', 'vs torch', 'dp ovh', 'MiB/img', 'peak MiB'))
    head += ' %6s' % "other"
    lines = [head, '-' * len(head)]
    for r in rows:
        lines.append('%-16s %-9s %-8s %4d %5d %4d %9.2f %8s %8.1f %6.0f%% %8s %9.2f %8s %8s %8.0f %8.0f'
                     % (r['setup'], r['mode'], r['dtype'], r['width'], r['size'], r['batch'],
                        r['images_per_s'], _fmt(r, 'vs_pytorch', '%.2fx'),
                        r['gflops'], 100 * r['peak_fraction'], _fmt(r, 'dp_overhead', '%+.1f%%', 100),
                        r['images_per_cpu_s'], _fmt(r, 'vs_pytorch_cpu', '%.2fx'),
                        _fmt(r, 'dp_overhead_cpu', '%+.1f%%', 100), r['mib_per_image'], r['peak_rss_mib'])
                     + ' %6.2f' % r.get('foreign_cores', 0.0))
    return '\n'.join(lines)


def check_args(p, args):
    """Every flag's value checked before the first measurement: ``p.error`` (one line
    naming the flag, exit 2) on a bad one; ``args.cpus``, ``args.torch_threads`` and
    ``args.memory`` become lists, ``args.old`` an absolute path."""
    try:
        args.cpus = positive_ints(args.cpus, '--cpus')
        for item in args.configs.split(','):
            if len(positive_ints(item, '--configs', ':')) != 3:
                raise ValueError('--configs: expected WIDTH:SIZE:BATCH, got %r' % item)
        parse_env(args.env)
        for variant in args.variant or []:
            variant_spec(variant, dict(width=8, amp=False), {})
        args.torch_threads = positive_ints(args.torch_threads, '--torch-threads') if args.torch_threads else []
    except ValueError as e:
        p.error(str(e))
    for flag, value, least in (('--reps', args.reps, 1), ('--warmup', args.warmup, 0),
                               ('--min-seconds', args.min_seconds, 0), ('--max-foreign', args.max_foreign, 0)):
        if not value >= least or value == float('inf'):
            p.error('%s: expected a number of at least %s, got %s' % (flag, least, value))
    for flag, value in (('--channels', args.channels), ('--depth', args.depth)):
        if value < 1:
            p.error('%s: expected a positive integer, got %s' % (flag, value))
    if args.old:
        if not os.path.isfile(os.path.join(args.old, 'gluon_unet', '__init__.py')):
            p.error('--old %s: no gluon_unet/__init__.py there' % args.old)
        args.old = os.path.abspath(args.old)
    args.memory = [m for m in args.memory.split(',') if m]
    bad = [m for m in args.memory if m not in ('speed', 'balanced', 'low')]
    if bad or not args.memory:
        p.error('--memory: choose from speed, balanced, low (got %r)' % ','.join(bad))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--configs', default='16:128:16,64:256:4', help='WIDTH:SIZE:BATCH,...')
    p.add_argument('--cpus', default='1,4', help='CPU context counts for ours, e.g. 1,2,4')
    p.add_argument('--reps', type=int, default=5, help='timed repetitions (median reported)')
    p.add_argument('--warmup', type=int, default=2, help='untimed steps first')
    p.add_argument('--min-seconds', type=float, default=1.0, help='least time of one repetition')
    p.add_argument('--channels', type=int, default=3)
    p.add_argument('--depth', type=int, default=4)
    p.add_argument('--amp', action='store_true', help='bfloat16: MXNet AMP vs torch.autocast')
    p.add_argument('--memory', default='speed',
                   help="comma list of bin/train --memory settings (speed, balanced, low): one worker of "
                        "ours per setting and --cpus count, measured alongside; rows 'ours x1 low', ...")
    p.add_argument('--inference', action='store_true', help='exported model vs eval()+no_grad()')
    p.add_argument('--no-torch', action='store_true', help='ours only')
    p.add_argument('--torch-threads', help='e.g. 1,2: one PyTorch worker per thread count '
                   '(torch.set_num_threads); ratios are against the fastest')
    p.add_argument('--env', action='append', help='KEY=VALUE for our workers (e.g. a knob to try)')
    p.add_argument('--variant', action='append',
                   help='KEY=VALUE[,KEY=VALUE]: an extra worker of ours on 1 context with these '
                        'settings, measured alongside (to try a knob); rows "ours v1", "ours v2"...; '
                        'CONTEXTS=N runs the variant on N CPU contexts, WIDTH=N with another width, AMP=0/1 '
                        'in float32/bfloat16 (the %% peak column stays the run\'s own dtype\'s)')
    p.add_argument('--old', metavar='DIR',
                   help='another version of the package, measured alongside on the same --cpus counts '
                        '(rows "old x1", ...): a folder holding gluon_unet/, e.g. from '
                        '`git archive <commit> gluon_unet | tar -x -C DIR`')
    p.add_argument('--max-foreign', type=float, default=0.15,
                   help='repeat a timed repetition (up to 3 times) when other processes used more '
                        'than this many cores meanwhile; column "other" = their median share')
    p.add_argument('--json', help='also write the rows here')
    args = p.parse_args(argv)
    check_args(p, args)
    if hasattr(os, 'sched_getaffinity') and len(os.sched_getaffinity(0)) < (os.cpu_count() or 1):
        # Workers inherit the mask: multi-threaded setups would be measured on too few cores.
        print('warning: this process may run on %d of %d CPUs (taskset/cgroup); multi-threaded '
              'rows will be distorted' % (len(os.sched_getaffinity(0)), os.cpu_count()), flush=True)
    sys.path.insert(0, ROOT)
    from gluon_unet.machine.cpu import cpu_description
    machine = cpu_description()
    print('machine: %s, %d CPUs' % (machine, os.cpu_count()), flush=True)
    print('load average at start: %s' % ' '.join(open('/proc/loadavg').read().split()[:3]), flush=True)
    if args.inference:
        args.cpus = [1]
    args.peak = measure_peak(args.amp)
    print('peak: a %d x %d matmul in MXNet runs at %.0f GFLOP/s in %s here' % (
        PEAK_SIDE, PEAK_SIDE, args.peak, 'bfloat16' if args.amp else 'float32'), flush=True)
    rows = []
    t0 = time.time()
    for item in args.configs.split(','):
        width, size, batch = (int(v) for v in item.split(':'))
        rows += run_config(width, size, batch, args)
        print(format_rows(rows), flush=True)
    print('\nall (%.0f s; median of %d repetitions; %%peak against %.0f GFLOP/s, a large %s matmul here):'
          % (time.time() - t0, args.reps, args.peak, 'bfloat16' if args.amp else 'float32'))
    print(format_rows(rows))
    print()
    print(format_threads(rows))
    paired = format_paired(rows)
    if paired:
        print()
        print(paired)
    for r in rows:
        if r['foreign_cores'] > args.max_foreign:
            print('warning: %s (width %d) ran while other processes used %.2f cores (median, after '
                  'retries): not a fair figure, measure again on a quiet machine'
                  % (r['setup'], r['width'], r['foreign_cores']), flush=True)
    if args.json:
        sys.path.insert(0, ROOT)
        from gluon_unet.utils import atomic_open
        with atomic_open(args.json) as f:
            json.dump([dict(r, cpu=machine, peak_gflops=args.peak) for r in rows], f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
