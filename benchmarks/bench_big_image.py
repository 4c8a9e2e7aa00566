"""Peak memory and wall time of ``bin/predict`` on one large grey image (issue 16, item 3).

Makes a synthetic nuclei image of ``--sizes`` px (the nuclei
mask of a 128 px :func:`synthetic_nuclei` image, blurred and tiled: ~60 % foreground in
clusters of touching nuclei) and an export whose network costs
what a width-16 depth-4 U-Net costs (``--width``/``--depth``; random weights) but whose
output is a fixed brightness rule (a 1x1 convolution, as tests/conftest.py's
``export_brightness_model``), so the post-processing meets realistic nuclei and touching
clusters instead of the noise of an untrained net. Each measurement runs
``python bin/predict --mode tile`` in a fresh child process and reads the child's peak
RSS from ``os.wait4`` (that child's own maximum resident set size). With ``--old DIR`` (a copy of an older gluon_unet package, e.g.
``git show <base>:gluon_unet/...``) the old and the new code run alternately, one fresh
process each, ``--repeats`` times, and their label images are compared.

    python benchmarks/bench_big_image.py [--sizes 2000,4000] [--repeats 2] [--old /tmp/old]
                                         [--json out.json]

Every output line and the JSON carry the CPU model and its vector extensions.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, '..')
sys.path.insert(0, ROOT)


def cpu_info():
    """``{'model': ..., 'vector': 'avx2 avx512f ...'}`` from /proc/cpuinfo."""
    model, flags = platform.processor() or 'unknown', set()
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                key, _, value = line.partition(':')
                if key.strip() == 'model name' and model in ('unknown', '', platform.processor()):
                    model = value.strip()
                elif key.strip() == 'flags':
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    vector = sorted(f for f in flags if f.startswith(('avx', 'sse4', 'fma', 'amx')))
    return {'model': model, 'vector': ' '.join(vector)}


def make_image(size, path):
    import cv2
    from gluon_unet.data.synthetic import synthetic_nuclei
    # The nuclei mask of a 128 px synthetic image (touching clusters included), drawn as a
    # blurred bright-on-dark image the brightness rule segments back.
    mask = synthetic_nuclei(1, size=128, channels=1, seed=3)[1][0] > 0
    base = cv2.GaussianBlur(np.where(mask, 210, 40).astype(np.uint8), (0, 0), 1.5)
    reps = -(-size // 128)
    image = np.tile(base, (reps, reps))[:size, :size]
    cv2.imwrite(path, np.ascontiguousarray(image))
    return image.nbytes


def make_export(folder, width, depth):
    """A U-Net's cost, a brightness rule's output (see the module doc)."""
    import mxnet as mx
    from gluon_unet.config import ModelConfig
    from gluon_unet.model import build_model

    class Costly(mx.gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.unet = build_model(ModelConfig(in_channels=1, classes=1, width=width, depth=depth))
                self.bright = mx.gluon.nn.Conv2D(1, 1, in_channels=1)

        def hybrid_forward(self, F, x):
            return self.bright(x) + 0 * self.unet(x)

    os.makedirs(folder, exist_ok=True)
    mx.random.seed(0)
    net = Costly()
    net.initialize(mx.init.Xavier())
    net.bright.weight.set_data(mx.nd.full((1, 1, 1, 1), 20.0))
    net.bright.bias.set_data(mx.nd.array([-10.0]))
    net.hybridize()
    with mx.autograd.predict_mode():
        net(mx.nd.zeros((1, 1, 256, 256)))
    net.export(os.path.join(folder, 'model'), epoch=0)
    with open(os.path.join(folder, 'model.json'), 'w') as f:
        json.dump({'in_channels': 1, 'classes': 1, 'multiple': 2 ** depth, 'train_size': 256,
                   'resize_mode': 'resize', 'threshold': 0.5}, f)


def run_predict(code_root, model, image, out):
    """Wall seconds and peak RSS (MB) of one ``bin/predict`` child running ``code_root``'s package."""
    env = dict(os.environ, PYTHONPATH=code_root, OMP_NUM_THREADS=os.environ.get('OMP_NUM_THREADS', '2'))
    cmd = [sys.executable, '-c', 'import sys; from gluon_unet.cli import predict_main; sys.exit(predict_main())',
           '--model', model, '--input', image, '--output', out, '--mode', 'tile', '--no-progress']
    return _child(cmd, env, code_root)


def baseline_rss(code_root):
    """Peak RSS (MB) of a child that only imports the package and mxnet: the fixed cost."""
    env = dict(os.environ, PYTHONPATH=code_root)
    return _child([sys.executable, '-c', 'import gluon_unet.inference.predict, mxnet, skimage.segmentation'], env, None)[1]


def _child(cmd, env, cwd):
    """Run ``cmd``; its wall seconds and its own peak RSS in MB (``os.wait4``: that child's
    maximum resident set size, where RUSAGE_CHILDREN would give the largest of all)."""
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, cwd=cwd)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t0
    if child.returncode:
        raise SystemExit('%s failed with exit code %d' % (' '.join(cmd[:3]), child.returncode))
    return seconds, usage.ru_maxrss / 1024.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--sizes', default='2000,4000')
    parser.add_argument('--repeats', type=int, default=1)
    parser.add_argument('--width', type=int, default=16)
    parser.add_argument('--depth', type=int, default=4)
    parser.add_argument('--old', help='folder holding an older gluon_unet package to compare with')
    parser.add_argument('--only', choices=('old', 'new'), help='measure one code version only')
    parser.add_argument('--json', help='also write the results here')
    args = parser.parse_args()
    cpu = cpu_info()
    tag = 'cpu=%r vector=%r' % (cpu['model'], cpu['vector'])
    work = tempfile.mkdtemp(prefix='bench_big_')
    model = os.path.join(work, 'export')
    make_export(model, args.width, args.depth)
    codes = [('new', os.path.abspath(ROOT))]
    if args.old:
        codes = [('old', os.path.abspath(args.old))] + codes
    if args.only:
        codes = [c for c in codes if c[0] == args.only]
    base = baseline_rss(codes[-1][1])
    results = []
    for size in (int(s) for s in args.sizes.split(',')):
        image = os.path.join(work, 'img%d' % size, 'big.png')
        os.makedirs(os.path.dirname(image))
        nbytes = make_image(size, image)
        labels = {}
        for rep in range(args.repeats):
            for name, root in codes:
                out = os.path.join(work, 'out_%s_%d' % (name, size))
                seconds, peak = run_predict(root, model, image, out)
                rec = {'code': name, 'size': size, 'repeat': rep, 'seconds': round(seconds, 2),
                       'peak_mb': round(peak, 1), 'image_mb': round(nbytes / 2 ** 20, 1),
                       'import_mb': round(base, 1), 'cpu': cpu['model'], 'vector': cpu['vector']}
                results.append(rec)
                print('%-3s %5d px  %6.2f s  peak %7.1f MB (%.1fx the uint8 image above the %.0f MB of '
                      'imports)  %s' % (name, size, seconds, peak, (peak - base) * 2 ** 20 / nbytes, base, tag),
                      flush=True)
                import cv2
                labels[name] = cv2.imread(os.path.join(out, 'big_labels.png'), cv2.IMREAD_UNCHANGED)
        if len(labels) == 2:
            same = np.array_equal(labels['old'], labels['new'])
            print('%5d px: labels old == new: %s (%d objects)  %s' % (size, same, labels['new'].max(), tag))
            results.append({'size': size, 'labels_identical': bool(same), 'cpu': cpu['model'], 'vector': cpu['vector']})
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'cpu': cpu, 'results': results}, f, indent=1)


if __name__ == '__main__':
    main()
