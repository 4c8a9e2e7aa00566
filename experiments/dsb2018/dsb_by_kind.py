"""Mean hold-out scores per image kind, from ``bin/evaluate --csv`` files.

    python experiments/dsb2018/dsb_by_kind.py /tmp/gu7/otsu.csv /tmp/gu7/seed.csv /tmp/gu7/best.csv
    python experiments/dsb2018/dsb_by_kind.py /tmp/gu7/seed.csv /tmp/gu7/best.csv --bootstrap 10000

Kinds come from the ``kinds.tsv`` written by ``experiments/dsb2018/dsb_split.py``.

``--bootstrap N`` also says how far the 67 hold-out images can be trusted: the mean DSB
score of each file over N resamplings of its images with replacement, each kind keeping
its count (54 / 2 / 11), as a 95 % interval - what another draw of images like these
could have scored - and, for each file after the first, the paired difference to the
first on the same resampled images (both models err on the same hard images, so a
difference is known much better than either score).
"""
import argparse
import csv
import os
import sys

import numpy as np

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


def bootstrap_means(scores, kinds, n, seed=0):
    """Means of ``scores`` (per image) over ``n`` stratified resamplings.

    Parameters
    ----------
    scores : (F, I) array
        One row per file, one column per image (the same images in every row).
    kinds : sequence of str
        Each image's kind: every resampling draws, within each kind, as many images as it
        has, with replacement.
    n : int
    seed : int

    Returns
    -------
    (F, n) array
    """
    scores, kinds = np.asarray(scores, np.float64), np.asarray(kinds)
    rng = np.random.default_rng(seed)
    picks = [rng.choice(np.flatnonzero(kinds == k), size=((kinds == k).sum(), n)) for k in np.unique(kinds)]
    index = np.concatenate(picks)  # (I, n): the images of each resampling
    return scores[:, index].mean(axis=1)


def interval(values, level=0.95):
    """The central ``level`` percentile interval of ``values``."""
    tail = (1 - level) / 2 * 100
    return tuple(float(v) for v in np.percentile(values, [tail, 100 - tail]))


def _bootstrap_table(tables, kind, n):
    """Lines of the ``--bootstrap`` table; every file must score the same images."""
    first_path, first = tables[0]
    ids = sorted(r['image_id'] for r in first)
    for path, rows in tables[1:]:
        if sorted(r['image_id'] for r in rows) != ids:
            raise SystemExit('error: --bootstrap: %s and %s score different images; the paired difference '
                             'needs the same ones' % (first_path, path))
    scores = [[float(r['dsb']) for r in sorted(rows, key=lambda r: r['image_id'])] for _, rows in tables]
    means = bootstrap_means(scores, [kind[i] for i in ids], n)
    lines = ['', '%d stratified resamplings of the %d images (95 %% intervals):' % (n, len(ids)), '',
             '| scores | all DSB | 95 %% interval | minus %s | 95 %% interval | share above 0 |'
             % os.path.basename(first_path), '|---|---|---|---|---|---|']
    for i, ((path, _), row, m) in enumerate(zip(tables, scores, means)):
        cells = ['%.3f' % np.mean(row), '%.3f - %.3f' % interval(m)]
        if i == 0:
            cells += ['', '', '']
        else:
            diff = m - means[0]
            cells += ['%+.3f' % (np.mean(row) - np.mean(scores[0])), '%+.3f - %+.3f' % interval(diff),
                      '%.2f' % float(np.mean(diff > 0))]
        lines.append('| %s | %s |' % (os.path.basename(path), ' | '.join(cells)))
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('csv', nargs='+', help='per-image CSVs from bin/evaluate --csv')
    p.add_argument('--kinds', default='/tmp/dsb/kinds.tsv')
    p.add_argument('--bootstrap', type=int, default=0, metavar='N',
                   help='also print 95%% intervals of each mean over N stratified resamplings of the images, '
                        'and of each file\'s paired difference to the first (e.g. 10000; default 0 = off)')
    args = p.parse_args(argv)
    if args.bootstrap < 0 or 0 < args.bootstrap < 100:
        raise SystemExit('error: --bootstrap must be 0 (off) or at least 100 resamplings (got %d)' % args.bootstrap)
    if not os.path.isfile(args.kinds):
        raise SystemExit('error: --kinds %s: no such file (experiments/dsb2018/dsb_split.py writes it)' % args.kinds)
    with open(args.kinds) as f:
        fields = [(n, line.split()) for n, line in enumerate(f, 1) if line.strip()]
    short = [n for n, cols in fields if len(cols) < 2]
    if short:
        raise SystemExit('error: --kinds %s: line %d has no kind (want "<image id> <kind>" per line, '
                         'as experiments/dsb2018/dsb_split.py writes)' % (args.kinds, short[0]))
    kind = {cols[0]: cols[1] for _, cols in fields}
    # Read every file before printing, so a bad one stops the table instead of cutting it short.
    tables = [(path, _read_scores(path, kind)) for path in args.csv]
    extra = _bootstrap_table(tables, kind, args.bootstrap) if args.bootstrap else []
    print('| scores | ' + ' | '.join('%s DSB (n)' % k for k in KINDS) + ' | all DSB | all IoU |')
    print('|---' * (len(KINDS) + 3) + '|')
    for path, rows in tables:
        cells = []
        for k in KINDS + (None,):
            sel = [float(r['dsb']) for r in rows if k is None or kind[r['image_id']] == k]
            cells.append('%.3f (%d)' % (sum(sel) / len(sel), len(sel)) if sel else '-')
        iou = [float(r['iou']) for r in rows]
        print('| %s | %s | %.3f |' % (os.path.basename(path), ' | '.join(cells), sum(iou) / len(iou)))
    for line in extra:
        print(line)
    return 0


if __name__ == '__main__':
    sys.exit(main())
