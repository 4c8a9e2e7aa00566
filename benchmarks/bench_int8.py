"""float32 against int8 (``bin/export --int8``, ``bin/predict --precision int8``), in one run.

Two parts:

* **network** - images/s of the export's float32 network, of the same network with MXNet's
  oneDNN float32 fusion (``optimize_for(backend='MKLDNN')``: Convolution + BatchNorm + ReLU
  in one operator, still float32) and of its int8 variant, on random inputs of each
  ``--sizes`` x ``--batches``, interleaved rep by rep (the median of ``--reps``), in one
  child process per ``--threads`` value (OpenMP's thread count is fixed when mxnet loads);
* **DSB** - ``bin/predict`` (float32, then ``--precision int8``, ``--rounds`` times,
  alternating which goes first) on ``--images`` samples of ``--data`` (a DSB root), chosen
  with ``--seed`` among those the int8 variant was not calibrated on; images/s from
  predict's summary line (model loading excluded), and the mean DSB score / IoU / objects
  of each against the truth (bin/evaluate's scoring), plus the pixels whose mask differs.

The model: ``--model EXPORT`` with an int8 variant, or ``--run RUN`` (exported here with
``--int8`` into a temporary folder). Inputs are linked from ``--data``, never copied.

    python benchmarks/bench_int8.py --run runs/dsb --data /path/to/stage1_train [--images 24]
        [--threads 1,2] [--sizes 256,512] [--batches 1,4] [--reps 3] [--rounds 1]
"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)


def network_rows(export, sizes, batches, reps):
    """Median images/s per (size, batch) of float32, float32 + oneDNN fusion and int8."""
    # As bin/predict starts: AMX where the CPU has it, unless DNNL_MAX_CPU_ISA says otherwise.
    from gluon_unet.machine.runtime import apply_runtime_defaults
    apply_runtime_defaults()
    import mxnet as mx

    from gluon_unet.inference.batched import load_exported
    nets = {'float32': load_exported(export)[0], 'float32+fusion': load_exported(export)[0],
            'int8': load_exported(export, precision='int8')[0]}
    channels = json.load(open(os.path.join(export, 'model.json')))['in_channels']
    rng, rows = np.random.default_rng(0), []
    for side in sizes:
        for batch in batches:
            x = mx.nd.array(rng.random((batch, channels, side, side), dtype=np.float32))
            nets['float32'].hybridize(static_alloc=True, static_shape=True)
            nets['int8'].hybridize(static_alloc=True, static_shape=True)
            nets['float32+fusion'].optimize_for(x, backend='MKLDNN', clear=True, static_alloc=True,
                                                static_shape=True)
            times = {k: [] for k in nets}
            with mx.autograd.predict_mode():
                for net in nets.values():  # warm-up: memory plan, weight reorders
                    net(x).wait_to_read()
                for _ in range(reps):
                    for name, net in nets.items():
                        t0 = time.perf_counter()
                        net(x).wait_to_read()
                        times[name].append(time.perf_counter() - t0)
            rows.append({'side': side, 'batch': batch,
                         **{k: batch / statistics.median(v) for k, v in times.items()}})
    return rows


def amx_env(amx):
    """The environment for a child with AMX on (gluon_unet's default where the CPU has it)
    or off (``DNNL_MAX_CPU_ISA`` capped below AMX)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop('DNNL_MAX_CPU_ISA', None)
    if amx == 'off':
        env['DNNL_MAX_CPU_ISA'] = 'AVX512_CORE_BF16'
    return env


def predict_once(export, inputs, out, precision, threads, amx='on'):
    """``bin/predict`` into ``out``; its images/s."""
    env = dict(amx_env(amx), OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'predict'), '--model', export, '--input',
                           inputs, '--output', out, '--precision', precision, '--overwrite'],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit('bin/predict --precision %s failed: %s' % (precision, done.stderr.strip()[-500:]))
    return float(re.search(r'([\d.]+) images/s', done.stdout).group(1))


def mask_difference(a_dir, b_dir):
    """Fraction of the pixels whose foreground differs between two prediction folders."""
    import cv2
    differ = total = 0
    for name in sorted(os.listdir(a_dir)):
        if name.endswith('_mask.png'):
            a = cv2.imread(os.path.join(a_dir, name), 0) > 0
            b = cv2.imread(os.path.join(b_dir, name), 0) > 0
            differ, total = differ + int((a != b).sum()), total + a.size
    return differ / max(total, 1)


def dsb_part(export, data, count, seed, rounds, threads, work):
    from gluon_unet.inference.evaluate import evaluate, mean_row
    calibrated = set(json.load(open(os.path.join(export, 'model.json')))['int8']['calibration']['images'])
    ids = sorted(d for d in os.listdir(data) if os.path.isdir(os.path.join(data, d, 'images')) and d not in calibrated)
    random.Random(seed).shuffle(ids)
    sample = os.path.join(work, 'sample')
    os.makedirs(sample)
    for d in ids[:count]:
        os.symlink(os.path.join(os.path.abspath(data), d), os.path.join(sample, d))
    speed = {'float32': [], 'int8': []}
    for r in range(rounds):
        for precision in (('float32', 'int8') if r % 2 == 0 else ('int8', 'float32')):
            speed[precision].append(predict_once(export, sample, os.path.join(work, precision), precision, threads))
    result = {}
    for precision in speed:
        rows, _ = evaluate(os.path.join(work, precision), sample)
        result[precision] = dict(mean_row(rows), images_s=statistics.median(speed[precision]))
    result['mask_difference'] = mask_difference(os.path.join(work, 'float32'), os.path.join(work, 'int8'))
    return result


def cpu_line():
    from gluon_unet.machine.cpu import cpu_description, cpu_flags
    flags = cpu_flags()
    return '%s; %s' % (cpu_description(), ', '.join('%s %s' % (f, 'yes' if f in flags else 'no')
                                                     for f in ('avx512_vnni', 'avx_vnni', 'amx_int8')))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--model', help='export folder with an int8 variant')
    ap.add_argument('--run', help='run folder: exported here with --int8')
    ap.add_argument('--data', help='DSB root (<id>/images, <id>/masks) for the DSB part; absent: network part only')
    ap.add_argument('--images', type=int, default=24)
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--rounds', type=int, default=1)
    ap.add_argument('--threads', default='1,2')
    ap.add_argument('--sizes', default='256,512')
    ap.add_argument('--batches', default='1,4')
    ap.add_argument('--reps', type=int, default=3)
    ap.add_argument('--amx', default='auto', help='auto: rows with AMX on and off where the CPU has AMX (else '
                                                   'on only, which is then off); on; off; on,off')
    ap.add_argument('--network-only', action='store_true', help=argparse.SUPPRESS)  # the child of the network part
    args = ap.parse_args(argv)
    ints = lambda text: [int(v) for v in text.split(',')]  # noqa: E731
    if args.network_only:
        print(json.dumps(network_rows(args.model, ints(args.sizes), ints(args.batches), args.reps)))
        return 0
    with tempfile.TemporaryDirectory(prefix='bench-int8-') as work:
        export = args.model
        if export is None:
            if args.run is None:
                sys.exit('give --model EXPORT (with an int8 variant) or --run RUN')
            export = os.path.join(work, 'export')
            subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'export'), args.run, '--int8', '--output',
                            export], check=True, stdout=subprocess.DEVNULL)
        record = json.load(open(os.path.join(export, 'model.json')))['int8']
        print('CPU: %s' % cpu_line())
        check = record.get('check') or {}  # exports from before the check have none
        print('model: %s; int8 calibrated on %d inputs of %d images (%s); checked on %s (%d) at threshold %s: '
              'foreground IoU with float32 %s, masks differ on %s of the pixels, %s'
              % (export, record['calibration']['inputs'], len(record['calibration']['images']),
                 record['calibration']['calib_mode'], check.get('on'), len(check.get('images', [])),
                 check.get('threshold'), check.get('foreground_iou'), check.get('mask_disagreement'),
                 check.get('verdict', 'never checked')))
        from gluon_unet.machine.cpu import cpu_has_amx
        amx_modes = (['on', 'off'] if cpu_has_amx() else ['on']) if args.amx == 'auto' else args.amx.split(',')
        print('\n| AMX | threads | input | float32 img/s | float32+fusion | int8 | int8 / float32 | fusion / float32 |')
        print('|---|---|---|---|---|---|---|---|')
        for threads in ints(args.threads):
            for amx in amx_modes:
                env = dict(amx_env(amx), OMP_NUM_THREADS=str(threads))
                done = subprocess.run([sys.executable, os.path.abspath(__file__), '--network-only', '--model',
                                       export, '--sizes', args.sizes, '--batches', args.batches, '--reps',
                                       str(args.reps)], capture_output=True, text=True, env=env, check=True)
                for row in json.loads(done.stdout.strip().splitlines()[-1]):
                    print('| %s | %d | %d px x %d | %.1f | %.1f | %.1f | %.2fx | %.2fx |'
                          % (amx if cpu_has_amx() else 'none', threads, row['side'], row['batch'], row['float32'],
                             row['float32+fusion'], row['int8'], row['int8'] / row['float32'],
                             row['float32+fusion'] / row['float32']))
        if args.data:
            threads = ints(args.threads)[-1]
            res = dsb_part(export, args.data, args.images, args.seed, args.rounds, threads, work)
            print('\nbin/predict on %d %s images not used for calibration (seed %d, %d thread(s), %d round(s)):'
                  % (args.images, os.path.basename(os.path.normpath(args.data)), args.seed, threads, args.rounds))
            print('| precision | images/s | DSB | IoU | objects (truth %d) |' % res['float32']['true_objects'])
            print('|---|---|---|---|---|')
            for precision in ('float32', 'int8'):
                r = res[precision]
                print('| %s | %.2f | %.4f | %.4f | %d |' % (precision, r['images_s'], r['dsb'], r['iou'],
                                                           r['pred_objects']))
            print('int8 - float32: DSB %+.4f, IoU %+.4f; mask pixels that differ: %.3f %%'
                  % (res['int8']['dsb'] - res['float32']['dsb'], res['int8']['iou'] - res['float32']['iou'],
                     100 * res['mask_difference']))
    return 0


if __name__ == '__main__':
    sys.exit(main())
