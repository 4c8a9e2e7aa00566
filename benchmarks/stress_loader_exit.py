"""Does a process with loader workers always exit? Many short runs, counted.

Each run is a fresh Python process. By default it makes a loader with 2 worker processes
three times over synthetic nuclei, reads every batch, drops the first two loaders (ended
when collected) and exits with the third alive (ended at exit). With ``--train`` it is a
whole short ``bin/train`` instead (the demo data, 1 epoch, 2 loader workers, the search,
the export and the demo's predictions), as CI ran it when it hung. A run still alive after
``--timeout`` seconds is counted as hung: it is asked for its Python stacks
(``faulthandler`` on SIGUSR1, so they show where it is at the limit, not where it was some
seconds before), then killed with its workers, and the stacks are kept. A run that exits
with another code than 0 is counted as failed. With ``--old DIR`` the runs alternate
between this tree's package and DIR's, so both see the same machine.

This is how the hang at exit that CI met on Zen 3 was reproduced (parent joining in
``Pool._terminate_pool``, a worker waiting for the queue lock the pool holds):

    git archive a1a16ee gluon_unet | tar -x -C /tmp/old_pkg     # before the fix
    python benchmarks/stress_loader_exit.py --runs 40 --old /tmp/old_pkg

and how issue 45's 50 short training runs are made (each ~10-20 s on 2 cores):

    python benchmarks/stress_loader_exit.py --train --runs 50 --timeout 300
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

RUN = '''
import faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)
sys.path.insert(0, sys.argv[1])
import mxnet as mx
from gluon_unet.data import make_loader, synthetic_dataset
ds = synthetic_dataset(16, 32)
for k in range(3):
    loader = make_loader(ds, batch_size=2, shuffle=True, seed=k, workers=2)
    for x in loader:
        mx.nd.array(x[0]).sum().asscalar()
    if k < 2:
        del loader
print('ok')
'''

TRAIN = '''
import faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)
sys.path.insert(0, sys.argv[1])
from gluon_unet.cli import train_main
sys.exit(train_main(sys.argv[2:]))
'''
TRAIN_FLAGS = ['--width', '4', '--depth', '2', '--size', '32', '--synthetic-count', '24', '--batch-size', '4',
               '--epochs', '1', '--workers', '2', '--no-progress']


def _wait_for_output(f, after, seconds):
    """Until the file ``f`` has grown past ``after`` bytes and then stopped (0.2 s unchanged),
    or ``seconds`` have passed."""
    deadline, last = time.monotonic() + seconds, -1
    while time.monotonic() < deadline:
        size = os.fstat(f.fileno()).st_size
        if size > after and size == last:
            return
        last = size
        time.sleep(0.2)


def run_once(root, timeout, train=False):
    """Run one process importing gluon_unet from ``root``: ``(hung, exit code, stderr)``
    (the exit code is None for a hung run, -1 for one that exited 0 but left processes
    of its group alive)."""
    with tempfile.TemporaryFile('w+') as err, tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, '-c', RUN, root]
        if train:
            argv = [sys.executable, '-c', TRAIN, root, '--output', os.path.join(out, 'run')] + TRAIN_FLAGS
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, cwd=out)
        try:
            proc.wait(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
            # A timer set at start dumped the stacks a fixed time after launch, so on a
            # loaded machine it could catch a run still importing; ask at the limit instead.
            # faulthandler's handler is C code and writes at once, even in a blocked thread.
            printed = os.fstat(err.fileno()).st_size  # warnings it wrote before are not the stacks
            os.kill(proc.pid, signal.SIGUSR1)
            _wait_for_output(err, printed, seconds=3.0)
        left = False
        try:
            if not hung:  # a run that ended must leave none of its processes behind
                time.sleep(0.5)
                os.killpg(proc.pid, 0)
                left = True
            os.killpg(proc.pid, signal.SIGKILL)  # a hung run with its workers, or what a run left
        except ProcessLookupError:
            pass
        proc.wait()
        err.seek(0)
        text = err.read()
        if left:
            text += '\n(processes of the run were still alive after it ended: killed)'
        return hung, None if hung else (proc.returncode or (-1 if left else 0)), text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--runs', type=int, default=40, help='runs per package (default 40)')
    p.add_argument('--timeout', type=float, default=60.0,
                   help='seconds after which a run counts as hung (default 60; a run takes ~5)')
    p.add_argument('--old', metavar='DIR', help="also run DIR's gluon_unet (another commit's package)")
    p.add_argument('--keep', metavar='DIR', help='write the stacks of hung runs (and the errors of failed ones) here')
    p.add_argument('--train', action='store_true', help='each run is a short bin/train (see above)')
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error('--runs %d: must be at least 1' % args.runs)
    if args.timeout <= 5:
        p.error('--timeout %g: must be more than 5 seconds' % args.timeout)
    if args.old and not os.path.isfile(os.path.join(args.old, 'gluon_unet', '__init__.py')):
        p.error('--old %s: no gluon_unet/__init__.py there' % args.old)
    sys.path.insert(0, ROOT)
    from gluon_unet.machine.cpu import cpu_description
    print('CPU: %s, %d cores' % (cpu_description(), os.cpu_count() or 1))
    roots = {'this tree': ROOT}
    if args.old:
        roots['--old'] = os.path.abspath(args.old)
    hung = {name: 0 for name in roots}
    failed = {name: 0 for name in roots}
    seconds = {name: [] for name in roots}
    for i in range(1, args.runs + 1):
        for name, root in roots.items():
            t0 = time.monotonic()
            was_hung, code, err = run_once(root, args.timeout, train=args.train)
            seconds[name].append(time.monotonic() - t0)
            if was_hung:
                hung[name] += 1
                last = [l for l in err.splitlines() if l.strip().startswith('File')][:4]
                print('run %d (%s) hung; its main thread, innermost first:\n    %s'
                      % (i, name, '\n    '.join(last) or '(no stack printed)'), flush=True)
            elif code != 0:
                failed[name] += 1
                print('run %d (%s) failed with exit code %s: %s' % (i, name, code, (err.strip().splitlines()
                                                                                   or ['(no output)'])[-1]),
                      flush=True)
            if (was_hung or code != 0) and args.keep:
                os.makedirs(args.keep, exist_ok=True)
                kind = 'hung' if was_hung else 'failed'
                with open(os.path.join(args.keep, '%s-%s-%d.txt' % (kind, name.strip('-').replace(' ', '_'), i)),
                          'w') as f:
                    f.write(err)
    what = 'bin/train runs' if args.train else 'runs'
    for name in roots:
        times = sorted(seconds[name])
        print('%-9s (%s): %d of %d %s hung (> %g s), %d failed; seconds per run: median %.1f, max %.1f'
              % (name, roots[name], hung[name], args.runs, what, args.timeout, failed[name],
                 times[len(times) // 2], times[-1]))
    return 0


if __name__ == '__main__':
    sys.exit(main())
