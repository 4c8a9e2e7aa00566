"""SIGTERM and SIGINT at random moments of whole commands: is every stop honoured, in one line, and
is nothing ever an interpreter abort? Many short runs, counted.

Each run is a fresh ``bin/train`` (tiny, 2 epochs, the post-processing search and the export:
every phase), or with ``--export`` a fresh ``bin/export RUN --tune-postprocess`` (``--int8``
too where the CPU runs int8) of a run trained once at the start. A signal, SIGTERM or SIGINT
at random, is sent at a random moment between ``--start`` seconds and the command's usual
length. A run passes when:

- it ends by itself, with exit 0 (the signal came after the work) or 128 + the signal (130,
  143), or killed by that signal once its work was done (what a signal during the
  interpreter's exit does); never by SIGABRT or SIGSEGV, never hung;
- stderr has no traceback and no "Fatal Python error", and a stop ends in one line
  (``error: ...``, ``interrupted ...``, or ``SIGTERM ...`` saying what is kept);
- nothing half-written is left (no ``.tmp*`` file) and whatever the folder holds loads:
  every checkpoint, and the export when there is one.

    python benchmarks/stress_signals.py --runs 40
    python benchmarks/stress_signals.py --export --runs 40
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAIN = ['--width', '4', '--depth', '2', '--size', '32', '--synthetic-count', '24', '--batch-size', '8',
         '--epochs', '2', '--workers', '0', '--no-progress']
CHECK = r'''
import json, os, sys
sys.path.insert(0, sys.argv[1])
from gluon_unet.checkpoint import list_checkpoints, load_checkpoint
from gluon_unet.inference import load_exported
run, problems = sys.argv[2], []
for folder, dirs, files in os.walk(run):
    problems += ['left %s' % os.path.join(folder, n) for n in dirs + files if n.startswith('.tmp')]
folder = os.path.join(run, 'checkpoints')
for path in (list_checkpoints(folder) if os.path.isdir(folder) else []):
    try:
        load_checkpoint(path)
    except Exception as exc:
        problems.append('%s: %s' % (path, exc))
if os.path.isfile(os.path.join(run, 'export', 'model.json')):
    try:
        load_exported(os.path.join(run, 'export'))
    except Exception as exc:
        problems.append('export: %s' % exc)
print(json.dumps(problems))
'''


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    env.pop('GLUON_UNET_DEBUG', None)
    return env


def run_once(argv, delay, signum, timeout):
    """Start ``argv``, send ``signum`` after ``delay`` s; ``(returncode, stderr, seconds)``."""
    start = time.time()
    proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, err, time.time() - start
    return proc.returncode, err, time.time() - start


def judge(code, err, signum, folder):
    """What is wrong with one run ('' when nothing)."""
    if code is None:
        return 'hung'
    if code < 0 and -code != signum:
        return 'killed by %s' % signal.Signals(-code).name
    if code > 0 and code not in (128 + signum, 128 + signal.SIGINT, 128 + signal.SIGTERM):
        return 'exit %d: %s' % (code, err.strip().splitlines()[-1:] if err.strip() else '')
    if 'Traceback' in err or 'Fatal Python error' in err:
        return 'traceback: %s' % err.strip()[-300:]
    lines = [line for line in err.splitlines() if line.strip() and 'runtime:' not in line]
    if code and code > 0 and not (lines and lines[-1].startswith(('error:', 'interrupted', 'SIGINT', 'SIGTERM'))):
        return 'no one-line reason: %r' % lines[-3:]
    done = subprocess.run([sys.executable, '-c', CHECK, ROOT, folder], capture_output=True, text=True, env=_env())
    problems = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else [done.stderr[-300:]]
    return '; '.join(problems)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--runs', type=int, default=20)
    parser.add_argument('--export', action='store_true', help='stop bin/export --tune-postprocess instead')
    parser.add_argument('--start', type=float, default=1.0, help='earliest moment of the signal (s)')
    parser.add_argument('--timeout', type=float, default=300)
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix='stress-signals-')
    train = [sys.executable, os.path.join(ROOT, 'bin', 'train')] + TRAIN
    if args.export:
        base = os.path.join(work, 'base')
        subprocess.run(train + ['--output', base], check=True, cwd=ROOT, env=_env(), capture_output=True)
        from gluon_unet.machine.cpu import cpu_int8_support
        int8 = ['--int8'] if cpu_int8_support()[0] else []
        command = [sys.executable, os.path.join(ROOT, 'bin', 'export'), base, '--tune-postprocess'] + int8
    # The usual length of the command, for the random moments.
    t0 = time.time()
    first = os.path.join(work, 'run-0')
    subprocess.run(command if args.export else train + ['--output', first], cwd=ROOT, env=_env(),
                   capture_output=True)
    length = time.time() - t0
    shown = (command if args.export else train)[1:]
    print('%s, about %.1f s a run; %d runs' % (' '.join([os.path.relpath(shown[0], ROOT)] + shown[1:]), length,
                                               args.runs))
    failures, codes = [], {}
    for i in range(args.runs):
        signum = rng.choice([signal.SIGINT, signal.SIGTERM])
        delay = rng.uniform(args.start, length * 1.1)
        folder = base if args.export else os.path.join(work, 'run-%d' % (i + 1))
        argv = command if args.export else train + ['--output', folder]
        code, err, seconds = run_once(argv, delay, signum, args.timeout)
        problem = judge(code, err, signum, folder)
        codes[code] = codes.get(code, 0) + 1
        print('%3d %s at %5.1f s: exit %s in %.1f s%s' % (i + 1, signal.Signals(signum).name, delay, code, seconds,
                                                        ' - ' + problem if problem else ''))
        if problem:
            failures.append(problem)
    print('%d runs, %d failed; exit codes %s' % (args.runs, len(failures), dict(sorted(codes.items(), key=str))))
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
