"""``bin/predict --mode whole`` over images of varied sizes: the code of another commit
against this one, on 1 and on several CPU contexts (issue 17 item 2).

Exports a U-Net with random weights (depth 4, width ``--width``, 1 channel), writes
``--images`` grey images whose sides are drawn from [``--min``, ``--max``] px (each of
its own shape, as in the DSB test sets), copies the package as it was at ``--base``
(``git archive``) into a temporary folder, then runs ``bin/predict`` of both trees - and
of this one with ``--buckets`` - alternately, ``--rounds`` times each, in fresh processes
(MXNet reads its thread settings at import). The figure is the images/s of predict's own
summary line (timed after the model is loaded); the median over rounds is reported with
the inputs each device computed (this tree's summary line; the base's send every
whole-mode input to the first device). On a shared machine the spread (min-max) says
how much the load of others moved the figures.

    python benchmarks/bench_predict_devices.py [--base c77e56e~1] [--images 24] [--cpus 1,2]
                                               [--rounds 3] [--tta] [--width 16]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SUMMARY = re.compile(r'([\d.]+) images/s on \d+ devices? \[([^\]]*)\]')


def make_model(folder, width):
    import json

    import mxnet as mx

    from gluon_unet.config import ModelConfig
    from gluon_unet.model import build_model

    mx.random.seed(0)
    net = build_model(ModelConfig(in_channels=1, width=width, depth=4, batch_norm=True))
    net.initialize(mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2))
    net.hybridize()
    net(mx.nd.zeros((1, 1, 64, 64)))
    net.export(os.path.join(folder, 'model'), epoch=0)
    with open(os.path.join(folder, 'model.json'), 'w') as f:
        json.dump({'in_channels': 1, 'classes': 1, 'multiple': 16, 'train_size': 256, 'resize_mode': 'crop',
                   'threshold': 0.5}, f)


def make_images(folder, count, low, high):
    import cv2

    from gluon_unet.data.synthetic import synthetic_nuclei

    rng = np.random.default_rng(0)
    shapes = set()
    while len(shapes) < count:
        shapes.add(tuple(int(v) for v in rng.integers(low, high + 1, 2)))
    big = synthetic_nuclei(1, size=high, channels=1, seed=1)[0][0]
    for i, (h, w) in enumerate(sorted(shapes, key=lambda s: rng.random())):
        cv2.imwrite(os.path.join(folder, 'img%02d.png' % i), big[:h, :w])
    return sorted(shapes)


def run(tree, model, images, out, cpus, extra):
    cmd = [sys.executable, os.path.join(tree, 'bin', 'predict'), '--model', model, '--input', images,
           '--output', out, '--mode', 'whole', '--cpus', str(cpus)] + extra
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit('%s failed:\n%s' % (' '.join(cmd), done.stderr))
    m = SUMMARY.search(done.stdout)
    return float(m.group(1)), m.group(2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--base', default='c77e56e~1', help='commit whose gluon_unet is "before"')
    p.add_argument('--images', type=int, default=24)
    p.add_argument('--min', type=int, default=128)
    p.add_argument('--max', type=int, default=320)
    p.add_argument('--cpus', default='1,2')
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--width', type=int, default=16)
    p.add_argument('--tta', action='store_true')
    args = p.parse_args(argv)
    extra = ['--tta'] if args.tta else []
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, 'base')
        os.makedirs(base)
        subprocess.run('git -C %s archive %s gluon_unet bin | tar -x -C %s' % (ROOT, args.base, base),
                       shell=True, check=True)
        model, images = os.path.join(tmp, 'model'), os.path.join(tmp, 'images')
        os.makedirs(model)
        os.makedirs(images)
        make_model(model, args.width)
        shapes = make_images(images, args.images, args.min, args.max)
        variants = [('before (%s)' % args.base, base, []), ('after', ROOT, []), ('after --buckets', ROOT, ['--buckets'])]
        results = {}
        for _ in range(args.rounds):
            for cpus in [int(c) for c in args.cpus.split(',')]:
                for k, (name, tree, flags) in enumerate(variants):
                    # A folder per variant: bin/predict refuses to mix predictions made with other
                    # settings (--buckets) or without its manifest (the older tree) in one folder.
                    out = os.path.join(tmp, 'out-%d-%d' % (cpus, k))
                    rate, devices = run(tree, model, images, out, cpus, extra + flags)
                    results.setdefault((cpus, name), []).append((rate, devices))
                    print('%d cpus, %s: %.2f images/s [%s]' % (cpus, name, rate, devices), file=sys.stderr)
    print('%d images, sides %d-%d px (%d distinct shapes), U-Net depth 4 width %d, --mode whole%s, '
          'median of %d alternated runs; %d cores (%s)\n'
          % (args.images, args.min, args.max, len(shapes), args.width, ' --tta' if args.tta else '', args.rounds,
             os.cpu_count(), _cpu_model()))
    print('| --cpus | variant | images/s (median) | min-max | inputs per device (last run) |')
    print('|---|---|---|---|---|')
    for (cpus, name), rows in results.items():
        rates = [r for r, _ in rows]
        print('| %d | %s | %.2f | %.2f-%.2f | %s |' % (cpus, name, statistics.median(rates), min(rates), max(rates),
                                                    rows[-1][1]))


def _cpu_model():
    from gluon_unet.machine.cpu import cpu_description
    return cpu_description()


if __name__ == '__main__':
    main()
