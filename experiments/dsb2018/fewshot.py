#!/usr/bin/env python3
"""Few-shot adaptation on the grouped validation: fine-tune a fold's model on k images of a
group it never saw, score the group's other images.

For one held-out group and each k (a seeded pick, nested: the k = 1 image is among the
k = 3, those among the k = 10, the same images for every method), it trains and predicts:

- ``zero``: the fold's model as it is (k = 0), on the same images the others are scored on;
- ``fold``: ``bin/train --init FOLD_RUN`` on the k images (the fine-tune defaults);
- ``scratch``: ``bin/train --config dsb2018`` on the same k images from random weights,
  for the same steps (the fine-tune's epochs x --epoch-samples), at the recipe's rate;
- ``shipped``: ``bin/train --init nuclei`` (the shipped model; it trained on most of
  stage1_train, so on images of every group: not an unseen-kind figure, said beside it).

Everything is predicted as the recipe is scored (``--mode tile``, no TTA, the export's
--diameter), scored by ``bin/evaluate --csv``; ``summary`` prints per (k, method) the mean
DSB score, its paired difference to ``zero`` with a 95 % interval (10,000 resamplings of
the scored images) and the training wall time. Run from the repository root::

    python experiments/dsb2018/fewshot.py run --group brightfield --fold-run runs/g3 \\
        --data ../shared/data/dsb2018/stage1_train --out /tmp/fewshot
    python experiments/dsb2018/fewshot.py summary --out /tmp/fewshot
"""
import argparse
import csv
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, '..', '..'))
sys.path.insert(0, HERE)
from dsb_grouped import read_groups  # noqa: E402

METHODS = ('zero', 'fold', 'scratch', 'shipped')


def pick(ids, ks, seed):
    """Nested seeded picks: ``{k: the first k of one seeded order of ids}``."""
    order = list(np.random.default_rng([seed, 69]).permutation(sorted(ids)))
    return {k: sorted(order[:k]) for k in ks}


def link_tree(data, ids, folder):
    """A DSB-layout folder of symlinks to ``ids`` in ``data``."""
    os.makedirs(folder)
    for i in ids:
        os.symlink(os.path.abspath(os.path.join(data, i)), os.path.join(folder, i))


def run(cmd, log):
    """Run ``cmd`` (a list), its output appended to ``log``; its wall time in seconds. A
    failure prints the log's last lines, then one error line, and stops."""
    started = time.time()
    with open(log, 'a') as f:
        f.write('+ %s\n' % ' '.join(shlex.quote(c) for c in cmd))
        f.flush()
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if code:
        with open(log) as f:
            sys.stderr.write(''.join(f.readlines()[-15:]))
        raise SystemExit('error: %s failed (exit %d); its log: %s'
                         % (' '.join(shlex.quote(c) for c in cmd[:3]), code, log))
    return time.time() - started


def predict_and_score(model, test, preds, scores, log, flags=()):
    """``model`` on the ``test`` folder as the recipe is scored (``--mode tile``, no TTA, the
    export's --diameter, plus ``flags``) into ``preds``, then ``bin/evaluate`` into the CSV
    ``scores``; the prediction's wall time in seconds."""
    seconds = run([sys.executable, 'bin/predict', '--model', model, '--input', test, '--output', preds,
                   '--mode', 'tile', '--no-progress'] + list(flags), log)
    run([sys.executable, 'bin/evaluate', '--pred', preds, '--truth', test, '--csv', scores], log)
    return seconds


def train_command(method, train, out, fold_run, shipped, steps):
    py = sys.executable
    if method == 'fold':
        return [py, 'bin/train', '--init', fold_run, '--data', train, '--output', out, '--no-progress']
    if method == 'shipped':
        return [py, 'bin/train', '--init', shipped, '--data', train, '--output', out, '--no-progress']
    epochs, samples = steps
    return [py, 'bin/train', '--config', 'dsb2018', '--data', train, '--output', out, '--no-progress',
            '--val-split', '0', '--time-budget', '0', '--epochs', str(epochs), '--epoch-samples', str(samples),
            '--warmup-epochs', '1']


def cmd_run(args):
    groups = read_groups(args.groups)
    members = sorted(i for i, r in groups.items() if r['group'] == args.group)
    if not members:
        raise SystemExit('error: --group %s: no image of that group in %s' % (args.group, args.groups))
    ks = sorted(set(args.k))
    if ks[-1] >= len(members):
        raise SystemExit('error: --k %d: the group has %d images, none would be left to score'
                         % (ks[-1], len(members)))
    picks = pick(members, ks, args.seed)
    from gluon_unet.training.finetune import FINE_TUNE_DEFAULTS
    steps = (FINE_TUNE_DEFAULTS['epochs'], FINE_TUNE_DEFAULTS['epoch_samples'])
    base = os.path.join(args.out, args.group)
    os.makedirs(base, exist_ok=True)
    log = os.path.join(base, 'commands.log')
    record_path = os.path.join(base, 'runs.json')
    records = json.load(open(record_path)) if os.path.exists(record_path) else {}
    for k in ks:
        test_ids = [i for i in members if i not in picks[k]]
        kdir = os.path.join(base, 'k%d' % k)
        train, test = os.path.join(kdir, 'train'), os.path.join(kdir, 'test')
        if not os.path.isdir(train):
            link_tree(args.data, picks[k], train)
            link_tree(args.data, test_ids, test)
        for method in args.methods:
            key = 'k%d/%s' % (k, method)
            if key in records:
                continue
            out = os.path.join(kdir, method)
            model = args.fold_run
            seconds = 0.0
            if method != 'zero':
                shutil.rmtree(out, ignore_errors=True)
                seconds = run(train_command(method, train, out, args.fold_run, args.shipped, steps), log)
                model = out
            preds = os.path.join(kdir, 'pred-' + method)
            shutil.rmtree(preds, ignore_errors=True)
            scores = os.path.join(kdir, '%s.csv' % method)
            predict_s = predict_and_score(model, test, preds, scores, log)
            records[key] = {'k': k, 'method': method, 'train_ids': picks[k], 'train_seconds': round(seconds, 1),
                            'predict_seconds': round(predict_s, 1), 'scored': len(test_ids), 'scores': scores}
            with open(record_path + '.tmp', 'w') as f:
                json.dump(records, f, indent=1)
            os.replace(record_path + '.tmp', record_path)
            print('%s %s: train %.0f s, mean DSB %.3f on %d images' % (args.group, key, seconds,
                                                                         np.mean(list(read_scores(scores).values())),
                                                                         len(test_ids)), flush=True)


def read_scores(path):
    with open(path, newline='') as f:
        return {r['image_id']: float(r['dsb']) for r in csv.DictReader(f)}


def paired_interval(a, b, n=10000, seed=0):
    """Mean of b - a and its 95 % interval over resamplings of the images."""
    d = np.asarray(b) - np.asarray(a)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(n, len(d)))].mean(axis=1)
    return d.mean(), np.percentile(means, 2.5), np.percentile(means, 97.5)


def macro_interval(pairs, n=10000, seed=0):
    """Macro (mean over groups of each group's mean) of a, of b, of b - a and the 95 %
    interval of the last, each group's images resampled on their own (a group of 6 images
    weighs as much as one of 218, as in the grouped validation's macro)."""
    rng = np.random.default_rng(seed)
    draws = []
    for a, b in pairs:
        d = np.asarray(b) - np.asarray(a)
        draws.append(d[rng.integers(0, len(d), size=(n, len(d)))].mean(axis=1))
    means = np.mean(draws, axis=0)
    return (np.mean([np.mean(a) for a, _ in pairs]), np.mean([np.mean(b) for _, b in pairs]),
            np.mean([np.mean(np.asarray(b) - np.asarray(a)) for a, b in pairs]),
            np.percentile(means, 2.5), np.percentile(means, 97.5))


def cmd_summary(args):
    print('| group | k | scored | zero-shot | fold model fine-tuned | from scratch | shipped `nuclei` fine-tuned |')
    print('|---|---|---|---|---|---|---|')
    per_k = {}  # k -> method -> group -> (zero scores, method scores), for the macro rows
    for group in sorted(os.listdir(args.out)):
        record_path = os.path.join(args.out, group, 'runs.json')
        if not os.path.isfile(record_path):
            continue
        records = json.load(open(record_path))
        for k in sorted({r['k'] for r in records.values()}):
            got = {r['method']: r for r in records.values() if r['k'] == k}
            if 'zero' not in got:
                continue
            zero = read_scores(got['zero']['scores'])
            ids = sorted(zero)
            cells = ['%.3f' % np.mean([zero[i] for i in ids])]
            for method in METHODS[1:]:
                if method not in got:
                    cells.append('')
                    continue
                s = read_scores(got[method]['scores'])
                pair = ([zero[i] for i in ids], [s[i] for i in ids])
                per_k.setdefault(k, {}).setdefault(method, {})[group] = pair
                d, lo, hi = paired_interval(*pair)
                cells.append('%.3f (%+.3f, %+.3f to %+.3f; %.1f min)' % (np.mean(pair[1]), d, lo, hi,
                                                                        got[method]['train_seconds'] / 60))
            print('| %s | %d | %d | %s |' % (group, k, len(ids), ' | '.join(cells)))
    # The macro over the groups every method of a k has, so each column averages the same groups.
    for k in sorted(per_k):
        for method, groups in sorted(per_k[k].items()):
            za, mb, d, lo, hi = macro_interval([groups[g] for g in sorted(groups)])
            print('macro k=%d %s over %d groups (%s): zero-shot %.3f, %s %.3f (%+.3f, %+.3f to %+.3f)'
                  % (k, method, len(groups), ', '.join(sorted(groups)), za, method, mb, d, lo, hi))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = p.add_subparsers(dest='command', required=True)
    r = sub.add_parser('run', help='pick, train, predict and score one group')
    r.add_argument('--group', required=True, help='a group of dsb_groups.tsv, e.g. brightfield')
    r.add_argument('--fold-run', required=True, help='the run (or export) of the fold that holds the group out')
    r.add_argument('--data', required=True, help='stage1_train')
    r.add_argument('--out', required=True, help='where the picks, runs, predictions and scores go')
    r.add_argument('--groups', default=os.path.join(HERE, 'dsb_groups.tsv'))
    r.add_argument('--k', type=int, nargs='+', default=[1, 3, 10])
    r.add_argument('--methods', nargs='+', default=list(METHODS), choices=METHODS)
    r.add_argument('--shipped', default='nuclei', help='the model of the "shipped" method')
    r.add_argument('--seed', type=int, default=0)
    s = sub.add_parser('summary', help='the table of every group run into --out')
    s.add_argument('--out', required=True)
    args = p.parse_args(argv)
    return {'run': cmd_run, 'summary': cmd_summary}[args.command](args)


if __name__ == '__main__':
    main()
