#!/usr/bin/env python3
"""A fine-tune variant on fewshot.py's trees, paired with the default fine-tune (issue 69).

Trains ``bin/train --init FOLD_RUN --data OUT/<group>/k<k>/train`` plus the variant's flags,
predicts and scores the group's other images as ``fewshot.py`` does, and prints the mean
DSB score beside the default fine-tune's (``k<k>/fold.csv``) and the fold model's zero-shot
(``k<k>/zero.csv``), with paired 95 % intervals. Results append to VARIANTS/results.jsonl::

    python experiments/dsb2018/fewshot_variant.py --fewshot /work/runs/fewshot --group fluo-crowded --k 3 \\
        --fold-run runs/g1 --name lr1.25e-4 --out /tmp/variants -- --lr 1.25e-4
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, '..', '..'))
sys.path.insert(0, HERE)
from fewshot import paired_interval, predict_and_score, read_scores  # noqa: E402


def paired(a, b, ids):
    """:func:`fewshot.paired_interval` of two ``{id: score}`` on ``ids``, as floats."""
    return tuple(float(x) for x in paired_interval([a[i] for i in ids], [b[i] for i in ids]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--fewshot', required=True)
    p.add_argument('--group', required=True)
    p.add_argument('--k', type=int, required=True)
    p.add_argument('--fold-run', required=True)
    p.add_argument('--name', required=True)
    p.add_argument('--out', required=True)
    p.add_argument('--trainer', default='bin/train', help='the training script (bin/train, or a variant of it)')
    p.add_argument('train_args', nargs='*')
    args = p.parse_args()
    base = os.path.join(args.fewshot, args.group, 'k%d' % args.k)
    out = os.path.join(args.out, '%s-k%d-%s' % (args.group, args.k, args.name))
    if os.path.exists(out + '.csv'):
        print('%s exists: skipped' % out)
        return
    py = sys.executable
    log = open(out + '.log', 'a')
    started = time.time()
    subprocess.run([py, args.trainer, '--init', args.fold_run, '--data', os.path.join(base, 'train'), '--output',
                    out, '--no-progress'] + args.train_args, cwd=ROOT, check=True, stdout=log, stderr=log)
    seconds = time.time() - started
    log.close()
    predict_and_score(out, os.path.join(base, 'test'), out + '-pred', out + '.csv.tmp', out + '.log')
    os.replace(out + '.csv.tmp', out + '.csv')
    mine, fold, zero = (read_scores(out + '.csv'), read_scores(os.path.join(base, 'fold.csv')),
                        read_scores(os.path.join(base, 'zero.csv')))
    ids = sorted(zero)
    rec = dict(group=args.group, k=args.k, name=args.name, trainer=args.trainer, flags=args.train_args, train_seconds=round(seconds, 1),
               scored=len(ids), zero=float(np.mean([zero[i] for i in ids])),
               default=float(np.mean([fold[i] for i in ids])), variant=float(np.mean([mine[i] for i in ids])),
               vs_default=paired(fold, mine, ids), vs_zero=paired(zero, mine, ids))
    print(json.dumps(rec), flush=True)
    with open(os.path.join(args.out, 'results.jsonl'), 'a') as f:
        f.write(json.dumps(rec) + '\n')


if __name__ == '__main__':
    main()
