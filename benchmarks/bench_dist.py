"""ps-lite (``--kvstore dist_sync``) against Horovod (``--kvstore horovod``), side by side.

Two worker processes with one CPU context each, on loopback: ps-lite started by
``bin/launch -n 2 -s 1`` (one parameter server), Horovod by ``horovodrun -np 2 --gloo``.
Each worker runs the trainer's own step (``step.make_step`` over the strategy of
``distributed.make_strategy``, as ``fit()`` builds them) on a synthetic batch; rank 0
reports:

* images/s of the job (global batch / step time), steady state after warm-up steps;
* communication per step: the gradient reduce alone (``trainer.allreduce_grads()`` and a
  wait, what every step does between backward and update), timed over repetitions;
* for reference, one process alone at the same per-worker batch (no reduce at all).

The variants alternate round by round (ps-lite, Horovod, alone, ps-lite, ...) so that load
from other users of the machine hits them alike; medians over the rounds are reported.
Every worker runs one OpenMP thread (``OMP_NUM_THREADS``, unless set). On a 2-core
machine the two workers (and ps-lite's server) share the cores, so the job's images/s
cannot beat one process by much; the communication column is the comparison.

    python benchmarks/bench_dist.py                          # both default configs, 3 rounds
    python benchmarks/bench_dist.py --configs 16:4:128:4 --rounds 5
    python benchmarks/bench_dist.py --json results.json

``--configs`` is a comma list of WIDTH:DEPTH:SIZE:BATCH (per worker; 1 input channel).
The defaults: 16:4:128:4 (the keras-seed recipe's network, 1.9 M parameters) and
32:5:64:2 (the dsb2018-gpu recipe's, 31.1 M parameters = 119 MiB of float32 gradients per
step, on small images so that the reduce dominates).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

DEFAULT_CONFIGS = '16:4:128:4,32:5:64:2'
WARMUP, STEPS, REDUCES = 3, 8, 8


def parse_configs(text):
    """``'16:4:128:4,...'`` -> ``[(width, depth, size, batch), ...]``."""
    out = []
    for part in text.split(','):
        try:
            width, depth, size, batch = (int(v) for v in part.split(':'))
        except ValueError:
            raise SystemExit('error: --configs: %r is not WIDTH:DEPTH:SIZE:BATCH' % part)
        out.append((width, depth, size, batch))
    return out


# -- one worker -------------------------------------------------------------------------------

def worker(kvstore, width, depth, size, batch):
    """Run in every process of a job: measure, and print rank 0's record as ``BENCH {json}``."""
    if os.environ.get('DMLC_ROLE') in ('server', 'scheduler'):
        import mxnet  # noqa: F401  (ps-lite: importing mxnet serves the job and exits)
        return 0
    from gluon_unet.machine.runtime import apply_runtime_defaults
    apply_runtime_defaults(contexts=1)  # before mxnet loads; divides the cores by the host's workers
    import mxnet as mx
    from gluon_unet.training import distributed
    from gluon_unet.training.benchmark import synthetic_batch
    from gluon_unet.config import ModelConfig, TrainConfig
    from gluon_unet.training.step import build_network, make_step
    cfg = TrainConfig(model=ModelConfig(in_channels=1, width=width, depth=depth, batch_norm=True), size=size,
                      batch_size=batch, optimizer='adam', lr=1e-3, kvstore=kvstore, cpus=1, output='-')
    ctxs = [mx.cpu(0)]
    strategy = distributed.make_strategy(kvstore)
    net = build_network(cfg, ctxs)
    strategy.prepare_network(net, ctxs)
    step = make_step(cfg, net, ctxs, strategy=strategy)
    strategy.join(step.trainer)
    params = sum(p.data().size for p in net.collect_params().values() if p.grad_req != 'null')
    data = synthetic_batch(cfg, seed=strategy.rank)
    for _ in range(WARMUP):
        step(*data)
    mx.nd.waitall()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step(*data)
    mx.nd.waitall()
    step_s = (time.perf_counter() - t0) / STEPS
    reduces = []
    for _ in range(REDUCES):  # every worker calls it: a collective, so they start together
        mx.nd.waitall()
        t0 = time.perf_counter()
        step.trainer.allreduce_grads()
        mx.nd.waitall()
        reduces.append(time.perf_counter() - t0)
    if strategy.is_main:
        print('BENCH ' + json.dumps({'kvstore': kvstore, 'workers': strategy.num_workers, 'params': params,
                                     'step_s': step_s, 'images_per_s': batch * strategy.num_workers / step_s,
                                     'reduce_s': statistics.median(reduces)}))
        sys.stdout.flush()
    return 0


# -- the parent ------------------------------------------------------------------------------

def job_command(variant, config):
    me = [sys.executable, os.path.abspath(__file__), '--worker', variant['kvstore']] + [str(v) for v in config]
    if variant['name'] == 'ps-lite':
        return [sys.executable, os.path.join(ROOT, 'bin', 'launch'), '-n', '2', '-s', '1', '--'] + me
    if variant['name'] == 'horovod':
        return [shutil.which('horovodrun'), '-np', '2', '-H', 'localhost:2', '--gloo'] + me
    return me


VARIANTS = ({'name': 'ps-lite', 'kvstore': 'dist_sync', 'what': 'dist_sync, 2 workers x 1 CPU, 1 server'},
            {'name': 'horovod', 'kvstore': 'horovod', 'what': 'horovod (Gloo), 2 processes x 1 CPU'},
            {'name': 'alone', 'kvstore': 'device', 'what': '1 process x 1 CPU (no reduce)'})


def run_job(variant, config, timeout=900):
    # One OpenMP thread per worker, alone too: what each of 2 workers gets on 2 cores, and a
    # 2-thread worker would stall at every barrier while another job holds a core.
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get('OMP_NUM_THREADS', '1'))
    done = subprocess.run(job_command(variant, config), capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)
    found = re.search(r'BENCH (\{.*\})', done.stdout)
    if done.returncode or not found:
        raise SystemExit('error: %s %s failed (exit %d):\n%s' % (variant['name'], config, done.returncode,
                                                                (done.stdout + done.stderr)[-3000:]))
    return json.loads(found.group(1))


def cpu_model():
    from gluon_unet.machine.cpu import cpu_description
    return '%s, %d cores' % (cpu_description(), os.cpu_count())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--configs', default=DEFAULT_CONFIGS, help='WIDTH:DEPTH:SIZE:BATCH,... (default %(default)s)')
    parser.add_argument('--rounds', type=int, default=3, help='alternating rounds; medians reported')
    parser.add_argument('--json', help='also write every measurement here')
    parser.add_argument('--worker', nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker[0], *(int(v) for v in args.worker[1:]))
    if not shutil.which('horovodrun'):
        raise SystemExit('error: horovodrun not found: install Horovod (requirements-horovod.txt)')
    print('machine: %s' % cpu_model())
    results = []
    for config in parse_configs(args.configs):
        runs = {v['name']: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for variant in VARIANTS:
                runs[variant['name']].append(run_job(variant, config))
        width, depth, size, batch = config
        params = runs['alone'][0]['params']
        print('\nU-Net width %d depth %d (%.1f M parameters, %.0f MiB of float32 gradients), %d px, batch %d per '
              'worker; medians of %d rounds' % (width, depth, params / 1e6, params * 4 / 2 ** 20, size, batch,
                                               args.rounds))
        print('| variant | images/s (job) | step ms | gradient reduce ms/step | reduce share of the step |')
        print('|---|---|---|---|---|')
        for variant in VARIANTS:
            rows = runs[variant['name']]
            ips = statistics.median(r['images_per_s'] for r in rows)
            step_ms = 1e3 * statistics.median(r['step_s'] for r in rows)
            reduce_ms = 1e3 * statistics.median(r['reduce_s'] for r in rows)
            share = '-' if variant['name'] == 'alone' else '%.0f %%' % (100 * reduce_ms / step_ms)
            print('| %s | %.2f | %.0f | %s | %s |' % (variant['what'], ips, step_ms,
                                                     '-' if variant['name'] == 'alone' else '%.1f' % reduce_ms,
                                                     share))
            results.append(dict(variant=variant['name'], config=config, runs=rows))
        sys.stdout.flush()
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'machine': cpu_model(), 'results': results}, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
