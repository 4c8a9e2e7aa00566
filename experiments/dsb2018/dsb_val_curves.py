"""How much a run's validation numbers swing from epoch to epoch (what ``--ema`` is for).

Reads each run folder's ``metrics.csv`` and prints, per run: the largest drop of
``val_iou`` from one epoch to the next after the first ``--skip`` epochs, the standard
deviation of ``val_iou`` and ``val_dsb`` over the last ``--last`` epochs, and the best
``val_dsb`` (its epoch) against the last one. No training, no hold-out: seconds.

    python experiments/dsb2018/dsb_val_curves.py RUN [RUN ...]
"""
import argparse
import csv
import os
import sys

import numpy as np


def curve_stats(rows, skip=4, last=15):
    """The swing figures of one run's per-epoch records (dicts with ``val_iou``, ``val_dsb``)."""
    iou = np.array([float(r['val_iou']) for r in rows])
    dsb = np.array([float(r['val_dsb']) for r in rows])
    drops = -np.diff(iou[skip:])
    return {'epochs': len(rows), 'max_iou_drop': float(drops.max()) if drops.size else 0.0,
            'iou_std': float(iou[-last:].std()), 'dsb_std': float(dsb[-last:].std()),
            'best_dsb': float(dsb.max()), 'best_epoch': int(dsb.argmax()) + 1, 'last_dsb': float(dsb[-1])}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('runs', nargs='+', metavar='RUN', help='run folders (each with metrics.csv)')
    parser.add_argument('--skip', type=int, default=4, help='epochs left out of the largest drop (default 4)')
    parser.add_argument('--last', type=int, default=15, help='epochs the spreads are taken over (default 15)')
    args = parser.parse_args(argv)
    table = []
    for run in args.runs:
        path = os.path.join(run, 'metrics.csv')
        try:
            with open(path, newline='') as f:
                table.append((run, curve_stats(list(csv.DictReader(f)), args.skip, args.last)))
        except (OSError, KeyError, ValueError) as exc:
            sys.exit('error: %s: not a run folder with validation metrics (%s)' % (path, exc))
    print('| run | epochs | largest val_iou drop (after epoch %d) | val_iou std, last %d | val_dsb std, last %d '
          '| best val_dsb (epoch) | last val_dsb |' % (args.skip, args.last, args.last))
    print('|---|---:|---:|---:|---:|---:|---:|')
    for run, st in table:
        print('| %s | %d | %.3f | %.4f | %.4f | %.4f (%d) | %.4f |' % (
            os.path.basename(os.path.normpath(run)), st['epochs'], st['max_iou_drop'], st['iou_std'],
            st['dsb_std'], st['best_dsb'], st['best_epoch'], st['last_dsb']))


if __name__ == '__main__':
    main()
