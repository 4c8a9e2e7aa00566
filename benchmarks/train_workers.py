"""The worker side of ``bench_train.py``: one measured setup per process.

Each worker builds one setup (ours or PyTorch, training or inference) in a process of its
own, then times ``k`` steps whenever the parent asks, recording the CPU other processes
used meanwhile; :class:`Worker` is the parent's handle on one. ``bench_breakdown.py`` reuses
the training steps (:func:`mx_train`, :func:`torch_train`).
"""
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

from procstat import busy_seconds, rss_kib, thread_busy, thread_ticks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEAK_SIDE = 2048  # the matmul of the peak measurement: 2048 x 2048 by 2048 x 2048 (17 GFLOP)


def mx_train(spec):
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
    base = rss_kib('VmRSS')
    step = make_training_step(cfg, ctxs)
    batch = synthetic_batch(cfg)
    return base, lambda k: time_steps(step, batch, k)


def torch_train(spec):
    import torch
    sys.path.insert(0, HERE)
    from torch_unet import TorchUNet
    torch.manual_seed(0)
    if spec.get('threads'):
        torch.set_num_threads(spec['threads'])
    base = rss_kib('VmRSS')
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


def mx_infer(spec):
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
    base = rss_kib('VmRSS')
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


def torch_infer(spec):
    import torch
    sys.path.insert(0, HERE)
    from torch_unet import TorchUNet
    base = rss_kib('VmRSS')
    net = TorchUNet(spec['channels'], 1, spec['width'], spec['depth']).eval()
    x = torch.rand(spec['batch'], spec['channels'], spec['size'], spec['size'])

    def run(k):
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(k):
                net(x)
        return time.perf_counter() - t0
    return base, run


WORKERS = {'mx': mx_train, 'torch': torch_train, 'mx_infer': mx_infer, 'torch_infer': torch_infer}


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
                busy0, cpu0, threads0 = busy_seconds(), time.process_time(), thread_ticks()
                wall = run(k)
                cpu = time.process_time() - cpu0
                threads = thread_busy(threads0, thread_ticks(), wall)
                # Cores' worth of CPU that something other than this worker used meanwhile
                # (other users, idle workers, the parent, steal): the repetition was not alone.
                foreign = max(0.0, busy_seconds() - busy0 - cpu) / wall
                conn.send((k * spec['batch'] / wall, k * spec['batch'] / max(cpu, 1e-9), foreign, threads))
            elif cmd == 'mem':
                conn.send({'base_kib': base, 'peak_kib': rss_kib('VmHWM')})
    except Exception as exc:  # reported in the parent
        import traceback
        conn.send(('error', '%s\n%s' % (exc, traceback.format_exc())))


# -- in the parent -----------------------------------------------------------------------------

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
