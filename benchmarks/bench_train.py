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
with ``torch.autocast('cpu', torch.bfloat16)``.

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
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEAK_SIDE = 2048  # the matmul of the peak measurement: 2048 x 2048 by 2048 x 2048 (17 GFLOP)


def _busy_seconds():
    """CPU-seconds all processes (and the hypervisor: steal) used so far, machine-wide."""
    with open('/proc/stat') as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    # user nice system idle iowait irq softirq steal; guest time is inside user
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf('SC_CLK_TCK')


def _thread_ticks():
    """{thread id: (name, CPU ticks so far)} of this process's threads (``/proc/self/task``).
    A thread that ends between the listing and the read is skipped."""
    out = {}
    for tid in os.listdir('/proc/self/task'):
        try:
            with open('/proc/self/task/%s/stat' % tid) as f:
                stat = f.read()
        except OSError:
            continue
        # The name is in parentheses and may hold spaces; utime, stime are fields 14, 15.
        name = stat[stat.index('(') + 1:stat.rindex(')')]
        fields = stat[stat.rindex(')') + 2:].split()
        out[tid] = (name, int(fields[11]) + int(fields[12]))
    return out


def thread_busy(before, after, wall):
    """Each thread's CPU time between two :func:`_thread_ticks` snapshots as a share of
    ``wall`` seconds, busiest first: [(share, name), ...] (threads below 1 % left out)."""
    tck = os.sysconf('SC_CLK_TCK')
    busy = [((ticks - before.get(tid, (name, 0))[1]) / tck / wall, name) for tid, (name, ticks) in after.items()]
    return sorted((b for b in busy if b[0] >= 0.01), reverse=True)


def _rss_kib(field):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field + ':'):
                return int(line.split()[1])
    return 0


# -- workers (run in their own process; import frameworks lazily) ---------------------------

def _mx_train(spec):
    sys.path.insert(0, spec.get('root') or ROOT)  # --old: that tree's gluon_unet
    # As bin/train --cpus N --memory M: OpenMP threads and MXNet scratch buffers per
    # context (runtime.apply_runtime_defaults) unless --env sets them.
    from gluon_unet.machine.runtime import apply_runtime_defaults
    apply_runtime_defaults(contexts=spec['cpus'], memory=spec.get('memory', 'speed'))
    from gluon_unet.training.benchmark import make_training_step, synthetic_batch, time_steps
    from gluon_unet.config import ModelConfig, TrainConfig
    from gluon_unet.machine.devices import make_contexts
    from gluon_unet.machine.runtime import configure_runtime
    from gluon_unet.training.step import init_amp
    cfg = TrainConfig(model=ModelConfig(in_channels=spec['channels'], width=spec['width'],
                                        depth=spec['depth']),
                      size=spec['size'], batch_size=spec['batch'], cpus=spec['cpus'],
                      amp=spec['amp'], optimizer='adam', loss='bce', lr=1e-3, progress=False,
                      memory=spec.get('memory', 'speed'))
    ctxs = make_contexts('', cfg.cpus)
    configure_runtime(len(ctxs))
    init_amp(cfg, ctxs)
    base = _rss_kib('VmRSS')
    step = make_training_step(cfg, ctxs)
    batch = synthetic_batch(cfg)
    return base, lambda k: time_steps(step, batch, k)


def _torch_train(spec):
    import torch
    sys.path.insert(0, HERE)
    from torch_unet import TorchUNet
    torch.manual_seed(0)
    if spec.get('threads'):
        torch.set_num_threads(spec['threads'])
    base = _rss_kib('VmRSS')
    net = TorchUNet(spec['channels'], 1, spec['width'], spec['depth'])
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    n, s = spec['batch'], spec['size']
    x = torch.rand(n, spec['channels'], s, s)
    y = (torch.rand(n, 1, s, s) > 0.5).float()

    def one():
        opt.zero_grad(set_to_none=True)
        if spec['amp']:
            with torch.autocast('cpu', dtype=torch.bfloat16):
                logits = net(x)
            loss = loss_fn(logits.float(), y)
        else:
            loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()

    def run(k):
        t0 = time.perf_counter()
        for _ in range(k):
            one()
        return time.perf_counter() - t0
    return base, run


def _mx_infer(spec):
    sys.path.insert(0, ROOT)
    # As bin/predict: all the physical cores unless --env sets OMP_NUM_THREADS.
    from gluon_unet.machine.runtime import apply_runtime_defaults
    apply_runtime_defaults()
    import mxnet as mx
    from gluon_unet.config import ModelConfig
    from gluon_unet.inference.batched import load_exported
    from gluon_unet.model import build_model
    from gluon_unet.machine.runtime import configure_runtime
    configure_runtime(1)
    base = _rss_kib('VmRSS')
    net = build_model(ModelConfig(in_channels=spec['channels'], width=spec['width'], depth=spec['depth']))
    net.initialize(mx.init.Xavier(magnitude=2))
    x = mx.nd.random.uniform(shape=(spec['batch'], spec['channels'], spec['size'], spec['size']))
    net.hybridize(static_alloc=True, static_shape=True)
    net(x)
    folder = tempfile.mkdtemp(prefix='bench-export-')
    net.export(os.path.join(folder, 'model'), epoch=0)
    exported, _ = load_exported(folder)
    exported.hybridize(static_alloc=True, static_shape=True)

    def run(k):
        mx.nd.waitall()
        t0 = time.perf_counter()
        for _ in range(k):
            with mx.autograd.predict_mode():
                out = exported(x)
        out.wait_to_read()
        return time.perf_counter() - t0
    return base, run


def _torch_infer(spec):
    import torch
    sys.path.insert(0, HERE)
    from torch_unet import TorchUNet
    base = _rss_kib('VmRSS')
    net = TorchUNet(spec['channels'], 1, spec['width'], spec['depth']).eval()
    x = torch.rand(spec['batch'], spec['channels'], spec['size'], spec['size'])

    def run(k):
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(k):
                net(x)
        return time.perf_counter() - t0
    return base, run


WORKERS = {'mx': _mx_train, 'torch': _torch_train, 'mx_infer': _mx_infer, 'torch_infer': _torch_infer}


def _peak_worker(amp, conn):
    """GFLOP/s of a large matmul in MXNet on this CPU, in the dtype measured (bfloat16 with
    ``amp``: on AMX where gluon_unet turns it on, as for our workers): the practical peak
    the rows' GFLOP/s are compared with, measured here rather than assumed for a CPU."""
    sys.path.insert(0, ROOT)
    from gluon_unet.machine.runtime import apply_runtime_defaults
    apply_runtime_defaults()
    import mxnet as mx
    import numpy as np
    n = PEAK_SIDE
    a, b = mx.nd.random.uniform(shape=(n, n)), mx.nd.random.uniform(shape=(n, n))
    if amp:
        bf16 = np.dtype([('bfloat16', np.uint16)])  # how MXNet 1.9 names bfloat16 to numpy
        a, b = mx.nd.amp_cast(a, dtype=bf16), mx.nd.amp_cast(b, dtype=bf16)
    times, start = [], time.perf_counter()
    # The first two create the oneDNN primitive and reorder the weights. Then the fastest
    # of at least 5 and up to 1 s of calls: with 5 alone, this 2-core Xeon's figure ranged
    # 690-1980 GFLOP/s between runs (a neighbour's load, the clock), and rows read >100 %.
    for i in range(200):
        t0 = time.perf_counter()
        mx.nd.FullyConnected(a, b, num_hidden=n, no_bias=True).wait_to_read()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        if len(times) >= 5 and time.perf_counter() - start > 1.0:
            break
    conn.send(2.0 * n ** 3 / min(times) / 1e9)


def measure_peak(amp):
    """:func:`_peak_worker` in a child process (threads and AMX chosen as for a worker)."""
    ctx = mp.get_context('spawn')
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peak_worker, args=(amp, child))
    proc.start()
    peak = parent.recv()
    proc.join()
    return peak


def _worker(kind, spec, env, conn):
    # Before any framework import: some settings are read at load. A --env/--variant value
    # is the user's: gluon_unet's defaults (applied by the mx workers) never replace it.
    os.environ.update(env)
    sys.path.insert(0, spec.get('root') or ROOT)
    conn.recv()  # 'setup': the parent warms workers up one at a time
    try:
        base, run = WORKERS[kind](spec)
        run(spec['warmup'])
        per = max(1e-4, run(1))
        k = int(min(20, max(1, round(spec['min_seconds'] / per))))
        conn.send(('ready', k))
        while True:
            cmd = conn.recv()
            if cmd == 'stop':
                break
            if cmd == 'run':
                busy0, cpu0, threads0 = _busy_seconds(), time.process_time(), _thread_ticks()
                wall = run(k)
                cpu = time.process_time() - cpu0
                threads = thread_busy(threads0, _thread_ticks(), wall)
                # Cores' worth of CPU that something other than this worker used meanwhile
                # (other users, idle workers, the parent, steal): the repetition was not alone.
                foreign = max(0.0, _busy_seconds() - busy0 - cpu) / wall
                conn.send((k * spec['batch'] / wall, k * spec['batch'] / max(cpu, 1e-9), foreign, threads))
            elif cmd == 'mem':
                conn.send({'base_kib': base, 'peak_kib': _rss_kib('VmHWM')})
    except Exception as exc:  # reported in the parent
        import traceback
        conn.send(('error', '%s\n%s' % (exc, traceback.format_exc())))


# -- parent ----------------------------------------------------------------------------------

class Worker:
    def __init__(self, name, kind, spec, env):
        ctx = mp.get_context('spawn')
        self.name, self.kind, self.spec = name, kind, spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(kind, spec, env, child), daemon=True)
        self.proc.start()
        self.rates, self.cpu_rates, self.foreign, self.threads, self.retried = [], [], [], [], 0

    def setup(self):
        self.conn.send('setup')
        msg = self.conn.recv()
        if msg[0] == 'error':
            raise RuntimeError('%s failed: %s' % (self.name, msg[1]))
        self.steps = msg[1]

    def run(self, max_foreign=0.15, retries=3):
        """One timed repetition; repeated (up to ``retries`` times, after a pause) while
        other processes used more than ``max_foreign`` of a core meanwhile."""
        for attempt in range(retries + 1):
            self.conn.send('run')
            msg = self.conn.recv()
            if msg[0] == 'error':
                raise RuntimeError('%s failed: %s' % (self.name, msg[1]))
            if msg[2] <= max_foreign or attempt == retries:
                break
            self.retried += 1
            time.sleep(2.0)
        self.rates.append(msg[0])
        self.cpu_rates.append(msg[1])
        self.foreign.append(msg[2])
        self.threads.append(msg[3])

    def stop(self):
        self.conn.send('mem')
        self.mem = self.conn.recv()
        self.conn.send('stop')
        self.proc.join(30)

    @property
    def median(self):
        return statistics.median(self.rates)

    @property
    def cpu_median(self):
        return statistics.median(self.cpu_rates)


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
