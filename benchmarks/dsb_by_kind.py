"""Mean hold-out scores per image kind, from ``bin/evaluate --csv`` files.

    python benchmarks/dsb_by_kind.py /tmp/gu7/otsu.csv /tmp/gu7/seed.csv /tmp/gu7/best.csv

Kinds come from the ``kinds.tsv`` written by ``benchmarks/dsb_split.py``.
"""
import argparse
import csv
import os
import sys

KINDS = ('fluorescence', 'brightfield', 'he')


def _read_scores(path, kind):
    """The rows of one ``bin/evaluate --csv`` file whose image has a kind; one-line errors."""
    if not os.path.isfile(path):
        raise SystemExit('error: %s: no such file (bin/evaluate --csv writes it)' % path)
    with open(path, newline='') as f:
        reader = csv.DictReader(f)
        missing = {'image_id', 'dsb', 'iou'} - set(reader.fieldnames or ())
        if missing:
            raise SystemExit('error: %s: not a bin/evaluate --csv file (no column %s)'
                             % (path, ', '.join(sorted(missing))))
        rows = [r for r in reader if r['image_id'] in kind]
    if not rows:
        raise SystemExit('error: %s: none of its images is in the kinds file' % path)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('csv', nargs='+', help='per-image CSVs from bin/evaluate --csv')
    p.add_argument('--kinds', default='/tmp/dsb/kinds.tsv')
    args = p.parse_args(argv)
    if not os.path.isfile(args.kinds):
        raise SystemExit('error: --kinds %s: no such file (benchmarks/dsb_split.py writes it)' % args.kinds)
    with open(args.kinds) as f:
        fields = [(n, line.split()) for n, line in enumerate(f, 1) if line.strip()]
    short = [n for n, cols in fields if len(cols) < 2]
    if short:
        raise SystemExit('error: --kinds %s: line %d has no kind (want "<image id> <kind>" per line, '
                         'as benchmarks/dsb_split.py writes)' % (args.kinds, short[0]))
    kind = {cols[0]: cols[1] for _, cols in fields}
    # Read every file before printing, so a bad one stops the table instead of cutting it short.
    tables = [(path, _read_scores(path, kind)) for path in args.csv]
    print('| scores | ' + ' | '.join('%s DSB (n)' % k for k in KINDS) + ' | all DSB | all IoU |')
    print('|---' * (len(KINDS) + 3) + '|')
    for path, rows in tables:
        cells = []
        for k in KINDS + (None,):
            sel = [float(r['dsb']) for r in rows if k is None or kind[r['image_id']] == k]
            cells.append('%.3f (%d)' % (sum(sel) / len(sel), len(sel)) if sel else '-')
        iou = [float(r['iou']) for r in rows]
        print('| %s | %s | %.3f |' % (os.path.basename(path), ' | '.join(cells), sum(iou) / len(iou)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
