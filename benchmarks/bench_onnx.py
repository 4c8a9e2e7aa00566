"""bin/predict via MXNet against bin/predict via onnxruntime, on the same DSB images.

Two parts, in one run:

* **export cost** - for U-Nets of the DSB recipe's shape (depth 5, BatchNorm; widths
  ``--export-widths``), the seconds of a plain export (hybridize, forward, symbol + params +
  model.json) and of :func:`gluon_unet.inference.export_onnx.add_onnx` on it (conversion + the
  numpy parity check on 3 shapes), and the sizes of ``model-0000.params`` and ``model.onnx``;
* **prediction** - ``bin/predict`` on ``--images`` DSB stage1_train samples, once with this
  Python (MXNet) and once with ``--onnx-python`` (an environment with requirements-onnx.txt
  and no mxnet: the export's model.onnx on onnxruntime), per ``--modes``, interleaved round
  by round (``--rounds``; the order alternates) so a load change on a shared machine hits
  both; the median images/s of bin/predict's summary line (model loading excluded), the
  median wall time of the whole command, and each command's peak resident memory (the
  child's ``ru_maxrss``). The first round's outputs are compared: identical label images,
  and the per-image DSB score of each against the ground truth (bin/evaluate's scoring).

The model: ``--model RUN|EXPORT`` (its model.onnx is written when missing), else one trained
here by ``bin/train`` on ``--train-images`` other samples (crop 128, width 8, depth 5,
``--train-epochs``). Both runtimes use the threads bin/predict chooses (OMP_NUM_THREADS:
the physical cores / --cpus), onnxruntime through the same variable.

    python benchmarks/bench_onnx.py --data /path/to/stage1_train --onnx-python ~/venvs/onnx/bin/python
        [--model RUN] [--images 24] [--modes whole,tile] [--rounds 3] [--export-widths 8,32]
"""
import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)


def cpu_model():
    from gluon_unet.machine.cpu import cpu_description
    return '%s (%d logical CPUs)' % (cpu_description(), os.cpu_count())


# -- export cost ---------------------------------------------------------------------------

def export_cost(widths, folder):
    import mxnet as mx

    from gluon_unet.config import ModelConfig, TrainConfig
    from gluon_unet.inference.export import export_block
    from gluon_unet.model import build_model
    from gluon_unet.inference.export_onnx import add_onnx
    rows = []
    for width in widths:
        cfg = TrainConfig(model=ModelConfig(in_channels=1, width=width, depth=5, batch_norm=True), crop=256)
        net = build_model(cfg.model)
        net.initialize(mx.init.Xavier())
        out = os.path.join(folder, 'w%d' % width)
        start = time.perf_counter()
        export_block(net, cfg, out)
        plain = time.perf_counter() - start
        _, record, seconds = add_onnx(out)
        rows.append({'width': width, 'export_s': plain, 'onnx_s': seconds,
                     'params_mb': os.path.getsize(os.path.join(out, 'model-0000.params')) / 2 ** 20,
                     'onnx_mb': os.path.getsize(os.path.join(out, 'model.onnx')) / 2 ** 20,
                     'max_abs_diff': record['parity']['max_abs_diff'], 'scale': record['parity']['scale']})
    return rows


# -- prediction ----------------------------------------------------------------------------

def sample(data, count, seed, exclude=()):
    ids = sorted(d for d in os.listdir(data) if os.path.isdir(os.path.join(data, d, 'images')) and d not in exclude)
    return sorted(random.Random(seed).sample(ids, count))


def link_sample(data, ids, folder):
    """A DSB root of symbolic links to ``ids`` (nothing copied)."""
    os.makedirs(folder)
    for i in ids:
        os.symlink(os.path.join(os.path.abspath(data), i), os.path.join(folder, i))
    return folder


def train_model(data, ids, folder, epochs):
    root = link_sample(data, ids, os.path.join(folder, 'train-data'))
    run = os.path.join(folder, 'run')
    cmd = [sys.executable, os.path.join(ROOT, 'bin', 'train'), '--data', root, '--crop', '128', '--width', '8',
           '--depth', '5', '--epochs', str(epochs), '--batch-size', '16', '--lr', '0.003', '--loss', 'bce_dice',
           '--normalize', 'auto', '--monitor', 'val_dsb', '--output', run, '--no-progress']
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit('training failed: %s' % done.stderr[-2000:])
    return run


# Linux carries a forking process's peak RSS into its child's ru_maxrss (exec keeps the old
# address space's high-water mark), and this process grows in the export part: a small
# Python forks the measured command and reports its children's peak, so the figure is the
# command's own.
_PEAK = ('import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); '
         'print("peak-rss-kib %d" % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); '
         'sys.exit(r.returncode)')


def run_predict(python, model, images, out, mode):
    """One bin/predict: (images/s of its summary line, wall seconds, peak RSS MiB, stderr)."""
    cmd = [sys.executable, '-c', _PEAK, python, os.path.join(ROOT, 'bin', 'predict'), '--model', model, '--input', images, '--output', out,
           '--mode', mode, '--overwrite']  # the summary line (stdout) comes with --progress
    start = time.perf_counter()
    with tempfile.TemporaryFile('w+') as so, tempfile.TemporaryFile('w+') as se:
        returncode = subprocess.run(cmd, stdout=so, stderr=se, text=True).returncode
        wall = time.perf_counter() - start
        so.seek(0)
        se.seek(0)
        stdout, stderr = so.read(), se.read()
    if returncode:
        sys.exit('%s failed: %s' % (' '.join(cmd[3:]), stderr[-2000:]))
    peak = re.search(r'^peak-rss-kib (\d+)\n?', stderr, re.M)
    stderr = stderr[:peak.start()] + stderr[peak.end():]
    speed = re.search(r'in [0-9.]+ s: ([0-9.]+) images/s', stdout)
    # bin/predict's images/s counts from the first image to the last: model loading excluded.
    return float(speed.group(1)), wall, int(peak.group(1)) / 1024, stderr.strip()


def compare(mx_out, ort_out, truth):
    """Label images equal, and per-image DSB scores of both against the truth."""
    import cv2

    from gluon_unet.inference.evaluate import evaluate
    names = sorted(n for n in os.listdir(mx_out) if n.endswith('_labels.png'))
    same = sum(np.array_equal(cv2.imread(os.path.join(mx_out, n), cv2.IMREAD_UNCHANGED),
                              cv2.imread(os.path.join(ort_out, n), cv2.IMREAD_UNCHANGED)) for n in names)
    a = {r['image_id']: r['dsb'] for r in evaluate(mx_out, truth)[0]}
    b = {r['image_id']: r['dsb'] for r in evaluate(ort_out, truth)[0]}
    diffs = [abs(a[k] - b[k]) for k in a]
    return {'images': len(names), 'identical_labels': int(same), 'max_dsb_diff': max(diffs),
            'dsb_mxnet': statistics.mean(a.values()), 'dsb_onnx': statistics.mean(b.values())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--data', default='/work/shared/data/dsb2018/stage1_train', help='DSB stage1_train root')
    p.add_argument('--onnx-python', default=os.environ.get('GLUON_UNET_ONNX_PYTHON'),
                   help='Python of the environment without mxnet (default $GLUON_UNET_ONNX_PYTHON)')
    p.add_argument('--model', help='run or export folder (default: train one here)')
    p.add_argument('--images', type=int, default=24)
    p.add_argument('--train-images', type=int, default=64)
    p.add_argument('--train-epochs', type=int, default=8)
    p.add_argument('--modes', default='whole,tile')
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--export-widths', default='8,32', help="'' skips the export part")
    p.add_argument('--keep', help='keep the work folder here')
    args = p.parse_args(argv)
    if not args.onnx_python:
        sys.exit('--onnx-python: give the Python of an environment with requirements-onnx.txt')
    folder = args.keep or tempfile.mkdtemp(prefix='bench_onnx-')
    os.makedirs(folder, exist_ok=True)
    print('CPU: %s' % cpu_model())
    versions = subprocess.run([args.onnx_python, '-c', 'import sys, numpy, onnxruntime; print("Python %s, numpy %s, '
                               'onnxruntime %s" % (sys.version.split()[0], numpy.__version__, onnxruntime.__version__))'],
                              capture_output=True, text=True).stdout.strip()
    import mxnet as mx
    print('MXNet side: Python %s, numpy %s, mxnet %s; ONNX side: %s; OMP_NUM_THREADS=%s'
          % (sys.version.split()[0], np.__version__, mx.__version__, versions, os.environ.get('OMP_NUM_THREADS')))
    try:
        widths = [int(w) for w in args.export_widths.split(',') if w]
        if widths:
            print('\nexport cost (depth 5, BatchNorm, 1 channel):')
            print('| width | export s | + model.onnx s | params MB | model.onnx MB | parity max diff |')
            print('|---|---|---|---|---|---|')
            for r in export_cost(widths, os.path.join(folder, 'export-cost')):
                print('| %d | %.2f | %.2f | %.1f | %.1f | %.1e (outputs up to %.1f) |' % (
                    r['width'], r['export_s'], r['onnx_s'], r['params_mb'], r['onnx_mb'], r['max_abs_diff'], r['scale']))
        ids = sample(args.data, args.images, args.seed)
        truth = link_sample(args.data, ids, os.path.join(folder, 'images'))
        model = args.model
        if model is None:
            t = time.perf_counter()
            model = train_model(args.data, sample(args.data, args.train_images, args.seed + 1, exclude=ids), folder,
                                args.train_epochs)
            print('\ntrained %s in %.0f s' % (model, time.perf_counter() - t))
        from gluon_unet.inference.export_onnx import add_onnx
        from gluon_unet.inference.sidecar import find_export, read_sidecar
        export = os.path.dirname(find_export(model))
        if 'onnx' not in read_sidecar(os.path.join(export, 'model.json')):
            add_onnx(export)
        print('\n%d DSB stage1_train images (seed %d), %d rounds, median:' % (len(ids), args.seed, args.rounds))
        print('| mode | runtime | images/s | whole command s | peak RSS MiB |')
        print('|---|---|---|---|---|')
        results, checks = {}, {}
        for mode in args.modes.split(','):
            for round_ in range(args.rounds):
                order = [('mxnet', sys.executable), ('onnxruntime', args.onnx_python)]
                for name, python in order if round_ % 2 == 0 else order[::-1]:
                    out = os.path.join(folder, 'out-%s-%s' % (mode, name))
                    results.setdefault((mode, name), []).append(run_predict(python, model, truth, out, mode))
            checks[mode] = compare(os.path.join(folder, 'out-%s-mxnet' % mode),
                                   os.path.join(folder, 'out-%s-onnxruntime' % mode), truth)
            for name in ('mxnet', 'onnxruntime'):
                runs = results[(mode, name)]
                print('| %s | %s | %.2f | %.1f | %.0f |' % (
                    mode, name, statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                    max(r[2] for r in runs)))
        said = [line for line in results[(mode, 'onnxruntime')][0][3].splitlines() if 'predicting with' in line]
        print('\nonnxruntime side said: %s' % (said[0] if said else '(nothing)'))
        for mode, c in checks.items():
            print('%s: %d/%d label images identical; per-image DSB score difference max %.4f; mean DSB mxnet %.4f, '
                  'onnxruntime %.4f' % (mode, c['identical_labels'], c['images'], c['max_dsb_diff'], c['dsb_mxnet'],
                                       c['dsb_onnx']))
        print(json.dumps({'%s/%s' % k: v for k, v in {k: [r[:3] for r in v] for k, v in results.items()}.items()}))
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == '__main__':
    main()
