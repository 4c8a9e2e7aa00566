"""Mean hold-out scores per image kind, from ``bin/evaluate --csv`` files.

    python benchmarks/dsb_by_kind.py /tmp/gu7/otsu.csv /tmp/gu7/seed.csv /tmp/gu7/best.csv

Kinds come from the ``kinds.tsv`` written by ``benchmarks/dsb_split.py``.
"""
import argparse
import csv
import os
import sys

KINDS = ('fluorescence', 'brightfield', 'he')


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('csv', nargs='+', help='per-image CSVs from bin/evaluate --csv')
    p.add_argument('--kinds', default='/tmp/dsb/kinds.tsv')
    args = p.parse_args(argv)
    with open(args.kinds) as f:
        kind = {line.split()[0]: line.split()[1] for line in f if line.strip()}
    print('| scores | ' + ' | '.join('%s DSB (n)' % k for k in KINDS) + ' | all DSB | all IoU |')
    print('|---' * (len(KINDS) + 3) + '|')
    for path in args.csv:
        with open(path) as f:
            rows = [r for r in csv.DictReader(f) if r['image_id'] in kind]
        cells = []
        for k in KINDS + (None,):
            sel = [float(r['dsb']) for r in rows if k is None or kind[r['image_id']] == k]
            cells.append('%.3f (%d)' % (sum(sel) / len(sel), len(sel)) if sel else '-')
        iou = [float(r['iou']) for r in rows]
        print('| %s | %s | %.3f |' % (os.path.basename(path), ' | '.join(cells), sum(iou) / len(iou)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
