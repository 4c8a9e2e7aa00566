"""Where a training step's time goes: per operator and per oneDNN primitive, ours against PyTorch.

For one WIDTH:SIZE:BATCH setup (depth 4, 3 channels, Adam, BCE: the step of
``bench_train.py``), each measured in its own child process after warm-up steps:

* **ours** (``gluon_unet.training.benchmark.make_training_step``, bfloat16 AMP with ``--amp``), with
  AMX on and off where the CPU has it (off: ``DNNL_MAX_CPU_ISA=AVX512_CORE_BF16``):
  milliseconds per step of each MXNet operator (MXNet's profiler, with bulk execution off
  so that every operator is timed on its own), and of each oneDNN primitive kind and
  implementation (``DNNL_VERBOSE=1``: which kernels run on which ISA, and the reorders
  between layouts);
* **PyTorch** (``torch_unet.py``, ``torch.autocast`` bfloat16): the same two views, from
  ``torch.profiler`` (self CPU time per operator) and ``ONEDNN_VERBOSE=1``.

Profiling and verbose output slow a step down; each table gives the step's wall time with
and without them, and the share of the unprofiled step that each row is.

    python benchmarks/bench_breakdown.py --config 16:128:16 --amp [--steps 5] [--top 15]
    python benchmarks/bench_breakdown.py --config 64:256:4 --amp --amx on --no-torch

PyTorch is for comparison only (``pip install torch``); without it, ours alone.
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# -- child: one framework, one view ------------------------------------------------------------

def _steps(kind, spec):
    sys.path.insert(0, HERE)
    sys.path.insert(0, ROOT)
    import train_workers
    return (train_workers.mx_train if kind == 'mx' else train_workers.torch_train)(spec)[1]


def child(kind, view, spec):
    """Run warm-up steps, then ``spec['steps']`` steps under ``view`` ('plain', 'profile' or
    'verbose'); print one JSON line: milliseconds per step, and per-row totals."""
    run = _steps(kind, spec)
    run(spec['warmup'])
    n, rows = spec['steps'], {}
    if view == 'profile' and kind == 'mx':
        import mxnet as mx
        mx.profiler.set_config(profile_all=True, aggregate_stats=True,
                               filename=os.path.join(spec['work'], 'mx-profile.json'))
        mx.profiler.set_state('run')
        wall = run(n)
        mx.profiler.set_state('stop')
        stats = json.loads(mx.profiler.dumps(format='json'))
        for name, st in stats['Time'].get('operator', {}).items():
            rows[name] = (st['Total'] / n, st['Count'] / n)
    elif view == 'profile':
        import torch
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            wall = run(n)
        for ev in prof.key_averages():
            if ev.self_cpu_time_total > 0:
                rows[ev.key] = (ev.self_cpu_time_total / 1000.0 / n, ev.count / n)
    else:
        sys.stdout.flush()
        print('### timed', flush=True)  # verbose lines before this are warm-up
        wall = run(n)
        sys.stdout.flush()
    print('RESULT ' + json.dumps({'ms_per_step': 1000.0 * wall / n, 'rows': rows}), flush=True)


# -- parent ------------------------------------------------------------------------------------

def onednn_rows(stdout, steps):
    """(kind, implementation, propagation) -> (ms per step, calls per step) from oneDNN's
    verbose lines after the '### timed' mark (oneDNN 2.x ``dnnl_verbose,exec,cpu,...`` and
    3.x ``onednn_verbose,v1,primitive,exec,cpu,...``)."""
    total, count = collections.Counter(), collections.Counter()
    timed = False
    for line in stdout.splitlines():
        if line.startswith('### timed'):
            timed = True
            continue
        if not timed:
            continue
        parts = line.split(',')
        if line.startswith('dnnl_verbose,exec,cpu,'):
            kind, impl, prop = parts[3:6]
        elif line.startswith('onednn_verbose,') and ',primitive,exec,cpu,' in line:
            i = parts.index('cpu')
            kind, impl, prop = parts[i + 1:i + 4]
        else:
            continue
        try:
            ms = float(parts[-1])
        except ValueError:
            continue
        total[(kind, impl, prop)] += ms
        count[(kind, impl, prop)] += 1
    return {'%s %s %s' % k: (total[k] / steps, count[k] / steps) for k in total}


def run_child(kind, view, spec, env):
    full = dict(os.environ, **env)
    for key, value in env.items():
        if value is None:
            full.pop(key)
    cmd = [sys.executable, os.path.abspath(__file__), '--child', kind, view, json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=full)
    if done.returncode != 0:
        sys.exit('%s %s child failed (rc %d): %s' % (kind, view, done.returncode, done.stderr[-1500:]))
    result = json.loads([l for l in done.stdout.splitlines() if l.startswith('RESULT ')][-1][len('RESULT '):])
    if view == 'verbose':
        result['rows'] = onednn_rows(done.stdout, spec['steps'])
    return result


def table(title, rows, plain_ms, view_ms, top):
    """Markdown: the ``top`` rows by time, then the rest and the total, with shares of the
    unprofiled step."""
    ordered = sorted(rows.items(), key=lambda kv: -kv[1][0])
    shown, rest = ordered[:top], ordered[top:]
    total = sum(ms for ms, _ in rows.values())
    out = ['', '%s: step %.1f ms (%.1f ms under this view); the rows sum to %.1f ms' % (
        title, plain_ms, view_ms, total), '',
        '| | ms / step | calls / step | share of the step |', '|---|---:|---:|---:|']
    for name, (ms, calls) in shown:
        out.append('| %s | %.1f | %.0f | %.0f %% |' % (name, ms, calls, 100 * ms / view_ms))
    if rest:
        ms = sum(v[0] for _, v in rest)
        out.append('| (%d more) | %.1f | | %.0f %% |' % (len(rest), ms, 100 * ms / view_ms))
    return '\n'.join(out)


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == '--child':
        child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--config', default='16:128:16', help='WIDTH:SIZE:BATCH')
    ap.add_argument('--amp', action='store_true', help='bfloat16 (MXNet AMP, torch.autocast)')
    ap.add_argument('--steps', type=int, default=5)
    ap.add_argument('--warmup', type=int, default=3)
    ap.add_argument('--top', type=int, default=15)
    ap.add_argument('--amx', default='auto', help='auto: ours with AMX on and off where the CPU has it; on; off')
    ap.add_argument('--torch-threads', type=int, default=2)
    ap.add_argument('--no-torch', action='store_true')
    args = ap.parse_args(argv)
    try:
        width, size, batch = (int(v) for v in args.config.split(':'))
    except ValueError:
        ap.error('--config must be WIDTH:SIZE:BATCH, e.g. 16:128:16 (got %r)' % args.config)
    sys.path.insert(0, ROOT)
    from gluon_unet.machine.cpu import cpu_description, cpu_has_amx
    import tempfile
    from importlib.metadata import PackageNotFoundError, version
    spec = dict(width=width, size=size, batch=batch, channels=3, depth=4, amp=args.amp, cpus=1,
                warmup=args.warmup, steps=args.steps, threads=args.torch_threads)
    modes = (['on', 'off'] if cpu_has_amx() else ['default']) if args.amx == 'auto' else args.amx.split(',')
    print('CPU: %s; %s; width %d, %d px, batch %d, %s; %d steps after %d warm-up' % (
        cpu_description(), 'AMX' if cpu_has_amx() else 'no AMX', width, size, batch,
        'bfloat16' if args.amp else 'float32', args.steps, args.warmup))
    started = time.time()
    setups = [('ours, AMX %s' % m if m != 'default' else 'ours', 'mx',
               {'DNNL_MAX_CPU_ISA': 'AVX512_CORE_BF16' if m == 'off' else None}) for m in modes]
    if not args.no_torch:
        try:
            setups.append(('PyTorch %s, %d threads' % (version('torch'), args.torch_threads), 'torch', {}))
        except PackageNotFoundError:
            print('PyTorch is not installed (pip install torch): ours alone')
    with tempfile.TemporaryDirectory(prefix='bench-breakdown-') as work:  # MXNet's profile file
        spec['work'] = work
        for title, kind, env in setups:
            plain = run_child(kind, 'plain', spec, env)['ms_per_step']
            bulk_off = {'MXNET_EXEC_BULK_EXEC_TRAIN': '0'} if kind == 'mx' else {}
            prof = run_child(kind, 'profile', spec, dict(env, **bulk_off))
            verbose_var = 'DNNL_VERBOSE' if kind == 'mx' else 'ONEDNN_VERBOSE'
            verb = run_child(kind, 'verbose', spec, dict(env, **{verbose_var: '1'}))
            print(table('%s, per operator' % title, prof['rows'], plain, prof['ms_per_step'], args.top))
            print(table('%s, per oneDNN primitive (kind, implementation, pass)' % title, verb['rows'], plain,
                        verb['ms_per_step'], args.top))
    print('\n(%.0f s)' % (time.time() - started))
    return 0


if __name__ == '__main__':
    sys.exit(main())
