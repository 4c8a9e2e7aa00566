"""Speed of the per-image CPU work that runs beside training: the DSB score of an image
with many objects (validation) and the U-Net weight map (a loader worker, per sample).

These figures were wall-clock assertions in the tests (tests/test_metrics.py,
tests/test_weights.py), which fail on a loaded machine; the tests keep the correctness
checks, and this script reports the times against the budgets they asserted.

    python benchmarks/bench_metrics.py [--repeats 5]
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from gluon_unet.data.synthetic import synthetic_nuclei  # noqa: E402
from gluon_unet.data.weights import unet_weight_map  # noqa: E402
from gluon_unet.metrics import dsb_image_score  # noqa: E402

DSB_BUDGET_S = 2.0        # one 200x200 image with 400 objects
WEIGHT_BUDGET_S = 0.1     # one 256x256 image with up to 60 nuclei (typically ~10 ms)


def many_squares():
    """400 squares of 64 px, and the same shifted by one pixel (IoU 56/72)."""
    cell = np.zeros((10, 10), np.int32)
    cell[:8, :8] = 1                              # an 8x8 object in each 10x10 cell
    t = np.kron(np.arange(1, 401, dtype=np.int32).reshape(20, 20), cell)
    return np.roll(t, 1, axis=1), t


def time_once(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--repeats', type=int, default=5, help='timed runs; the median is reported')
    args = parser.parse_args(argv)
    pred, truth = many_squares()
    dsb_image_score(pred, truth)  # warm-up
    dsb = statistics.median(time_once(dsb_image_score, pred, truth) for _ in range(args.repeats))
    _, _, inst = synthetic_nuclei(4, size=256, seed=3, max_nuclei=60)
    unet_weight_map(inst[0])  # warm-up
    weight = statistics.median(
        sum(time_once(unet_weight_map, labels) for labels in inst) / len(inst) for _ in range(args.repeats))
    rows = [('dsb_image_score, 400 objects, 200x200', dsb, DSB_BUDGET_S),
            ('unet_weight_map, 256x256, <= 60 nuclei', weight, WEIGHT_BUDGET_S)]
    print('%-42s %10s %10s' % ('work', 'seconds', 'budget'))
    for name, seconds, budget in rows:
        print('%-42s %10.4f %10.2f%s' % (name, seconds, budget, '' if seconds < budget else '  OVER'))
    return 0 if all(seconds < budget for _, seconds, budget in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
