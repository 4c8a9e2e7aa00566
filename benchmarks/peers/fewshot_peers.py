#!/usr/bin/env python3
"""The peers' own fine-tuning on gluon_unet's few-shot protocol (issue 71).

For one held-out group and each k, the peer's from-scratch model of the fold that holds the
group out (``$OUT/models/<peer>-g<fold>``, as ``run_all.sh`` names it) is fine-tuned with
the peer script's ``train --init`` on the k images of ``experiments/dsb2018/fewshot.py``'s
tree (``$FEWSHOT/<group>/k<k>/train``, the same nested seeded picks gluon_unet's fine-tunes
used), predicts the group's other images (``.../k<k>/test``) and is scored by
``bin/evaluate`` into ``$OUT/fewshot/<name>/<group>/k<k>.csv``; the wall time of each
command goes to ``$OUT/fewshot/<name>/<group>/runs.json``. A k whose scores exist is
skipped, a fine-tuned model that finished is reused. Run from the repository root with the
project's venv (the group -> fold map is ``dsb_grouped.GROUPS``)::

    .venv/bin/python benchmarks/peers/fewshot_peers.py run --peer stardist --group brightfield
    .venv/bin/python benchmarks/peers/fewshot_peers.py run --peer cellpose --group brightfield --k 1 3
    .venv/bin/python benchmarks/peers/fewshot_peers.py summary

``summary`` prints, per group, k and peer, the mean DSB score of the fold model as it is
(zero-shot: its fold scores, ``$OUT/scores/<peer>-g<fold>.csv``, on the same images), of the
fine-tune, their paired difference with a 95 % interval and the fine-tune's wall time, with
gluon_unet's own few-shot rows from ``$FEWSHOT/<group>/runs.json`` beside them.

Environment as ``run_all.sh``: OUT (default /tmp/peers), FEWSHOT (default
/work/runs/fewshot), SD_PY, CP_PY (the peers' venv pythons); the threads the peers use come
from OMP_NUM_THREADS / TF_NUM_INTRAOP_THREADS as there.
"""
import argparse
import json
import os
import shlex
import shutil
import sys

from peer_flags import fail

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, '..', '..'))
EXPERIMENT = os.path.join(ROOT, 'experiments', 'dsb2018')

#: peer -> (the venv python's environment variable and default, the script)
PEERS = {'stardist': ('SD_PY', '/tmp/venv-stardist/bin/python', 'stardist_peer.py'),
         'stardist-inv': ('SD_PY', '/tmp/venv-stardist/bin/python', 'stardist_peer.py'),
         'cellpose': ('CP_PY', '/tmp/venv-cellpose/bin/python', 'cellpose_peer.py')}
GLUON_METHODS = (('zero', 'gluon_unet fold model'), ('fold', 'gluon_unet fold model fine-tuned'),
                 ('scratch', 'gluon_unet from scratch'), ('shipped', 'gluon_unet shipped nuclei fine-tuned'))


def fold_of(group):
    sys.path.insert(0, EXPERIMENT)
    from dsb_grouped import GROUPS  # the project's venv: dsb_grouped imports gluon_unet
    if group not in GROUPS:
        fail('--group %s: the groups are %s' % (group, ', '.join(GROUPS)))
    return GROUPS[group][0]


def ids_of(folder):
    return sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n)))


def write_json(path, obj):
    with open(path + '.tmp', 'w') as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write('\n')
    os.replace(path + '.tmp', path)


def cmd_run(args):
    env_name, default_py, script = PEERS[args.peer]
    py = os.environ.get(env_name, default_py)
    fold = fold_of(args.group)
    from fewshot import read_scores, run as call  # beside dsb_grouped, on the path fold_of set
    source = os.path.join(args.out, 'models', '%s-g%d' % (args.peer, fold))
    if not os.path.isfile(os.path.join(source, 'budget.json')):
        fail('%s: no finished from-scratch model of fold %d (train it first: bash benchmarks/peers/run_all.sh %s g%d)'
             % (source, fold, args.peer, fold))
    if not os.path.isfile(py):
        fail('%s: no such python (%s; benchmarks/peers/README.md says how to install it)' % (py, env_name))
    for k in sorted(set(args.k)):  # every tree before anything is made
        kdir = os.path.join(args.fewshot, args.group, 'k%d' % k)
        if not all(os.path.isdir(os.path.join(kdir, d)) for d in ('train', 'test')):
            fail('%s: no few-shot tree (train/, test/): make it with experiments/dsb2018/fewshot.py run --group %s'
                 % (kdir, args.group))
    name = args.name or args.peer
    base = os.path.join(args.out, 'fewshot', name, args.group)
    os.makedirs(base, exist_ok=True)
    record_path = os.path.join(base, 'runs.json')
    records = json.load(open(record_path)) if os.path.exists(record_path) else {}
    for k in sorted(set(args.k)):
        kdir = os.path.join(args.fewshot, args.group, 'k%d' % k)
        train, test = os.path.join(kdir, 'train'), os.path.join(kdir, 'test')
        csv = os.path.join(base, 'k%d.csv' % k)
        key = 'k%d' % k
        if os.path.isfile(csv) and key in records:
            print('== %s %s k=%d: %s exists, skipped' % (name, args.group, k, csv), flush=True)
            continue
        work = os.path.join(base, key)
        model, pred = os.path.join(work, 'model'), os.path.join(work, 'pred')
        os.makedirs(work, exist_ok=True)
        train_log, predict_log = os.path.join(work, 'train.log'), os.path.join(work, 'predict.log')
        train_seconds = None
        if not os.path.isfile(os.path.join(model, 'budget.json')):
            shutil.rmtree(model, ignore_errors=True)  # a fine-tune cut short
            print('== %s %s k=%d: fine-tune %s on %s' % (name, args.group, k, source, train), flush=True)
            train_seconds = call([py, os.path.join(HERE, script), 'train', '--init', source, '--data', train,
                                  '--out', model] + shlex.split(args.train_args), train_log)
        shutil.rmtree(pred, ignore_errors=True)
        predict_seconds = call([py, os.path.join(HERE, script), 'predict', '--model', model, '--input', test,
                                '--output', pred] + shlex.split(args.predict_args), predict_log)
        call([sys.executable, os.path.join(ROOT, 'bin', 'evaluate'), '--pred', pred, '--truth', test, '--csv', csv],
             predict_log)
        budget = json.load(open(os.path.join(model, 'budget.json')))
        scores = read_scores(csv)
        records[key] = dict(
            k=k, peer=args.peer, name=name, group=args.group, fold=fold, train_ids=ids_of(train),
            scored=len(scores), scores=csv, model=model, init=budget.get('init'),
            train_seconds=round(train_seconds, 1) if train_seconds is not None else records.get(key, {}).get(
                'train_seconds'),
            train_seconds_note='wall time of the peer\'s train --init command, as measured here (None: a model '
                               'of an earlier run was reused; its own wall_seconds is peer_wall_seconds)',
            peer_wall_seconds=budget.get('wall_seconds'), images_seen=budget.get('images_seen'),
            predict_seconds=round(predict_seconds, 1), train_args=args.train_args, predict_args=args.predict_args,
            machine_busy_seconds=budget.get('machine_busy_seconds'))
        write_json(record_path, records)
        print('%s %s k=%d: fine-tune %.0f s, mean DSB %.3f on %d images (%s)'
              % (name, args.group, k, budget.get('wall_seconds', float('nan')),
                 sum(scores.values()) / max(1, len(scores)), len(scores), csv), flush=True)


def cmd_summary(args):
    import numpy as np
    sys.path.insert(0, EXPERIMENT)
    from fewshot import paired_interval, read_scores
    root = os.path.join(args.out, 'fewshot')
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    rows = {}  # (group, k) -> [(label, scores, minutes, source)]
    for name in names:
        for group in sorted(os.listdir(os.path.join(root, name))):
            path = os.path.join(root, name, group, 'runs.json')
            if not os.path.isfile(path):
                continue
            for r in json.load(open(path)).values():
                rows.setdefault((group, r['k']), []).append(r)
    if not rows:
        print('no peer fine-tune under %s yet' % root)
        return
    print('| group | k | scored | method | zero-shot | fine-tuned (difference, 95 % interval) | fine-tune wall |')
    print('|---|---|---|---|---|---|---|')
    for (group, k) in sorted(rows):
        ours = os.path.join(args.fewshot, group, 'runs.json')
        ours = json.load(open(ours)) if os.path.isfile(ours) else {}
        zero_ours = ours.get('k%d/zero' % k)
        for r in sorted(rows[(group, k)], key=lambda r: r['name']):
            tuned = read_scores(r['scores'])
            ids = sorted(tuned)
            fold_csv = os.path.join(args.out, 'scores', '%s-g%d.csv' % (r['peer'], r['fold']))
            zero = read_scores(fold_csv) if os.path.isfile(fold_csv) else {}
            minutes = r.get('peer_wall_seconds') or r.get('train_seconds') or float('nan')
            cell = '%.3f' % np.mean([tuned[i] for i in ids])
            if all(i in zero for i in ids):
                d, lo, hi = paired_interval([zero[i] for i in ids], [tuned[i] for i in ids])
                z = '%.3f' % np.mean([zero[i] for i in ids])
                cell += ' (%+.3f, %+.3f to %+.3f)' % (d, lo, hi)
            else:
                z = '(no %s)' % os.path.basename(fold_csv)
            print('| %s | %d | %d | %s | %s | %s | %.1f min |' % (group, k, len(ids), r['name'], z, cell,
                                                                  minutes / 60))
        if zero_ours:
            zero = read_scores(zero_ours['scores'])
            ids = sorted(zero)
            for method, label in GLUON_METHODS[1:]:
                got = ours.get('k%d/%s' % (k, method))
                if not got:
                    continue
                s = read_scores(got['scores'])
                d, lo, hi = paired_interval([zero[i] for i in ids], [s[i] for i in ids])
                print('| %s | %d | %d | %s | %.3f | %.3f (%+.3f, %+.3f to %+.3f) | %.1f min |'
                      % (group, k, len(ids), label, np.mean([zero[i] for i in ids]), np.mean([s[i] for i in ids]),
                         d, lo, hi, got['train_seconds'] / 60))
    print('\nzero-shot: each fold model as it is, on the same images (the peers\' from their fold scores). '
          'gluon_unet\'s wall times were measured beside other trainings (docs/quality.md); each peer\'s '
          'machine_busy_seconds is in its runs.json.')


def build_parser():
    from peer_flags import AT_LEAST_1, OneLineParser
    p = OneLineParser(prog='fewshot_peers.py', description=__doc__.split('\n\n')[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='command', required=True)
    r = sub.add_parser('run', help='fine-tune, predict and score one peer on one group, each k')
    r.add_argument('--peer', required=True, choices=sorted(PEERS))
    r.add_argument('--group', required=True, help='a group of experiments/dsb2018/dsb_grouped.py, e.g. brightfield')
    r.add_argument('--k', type=AT_LEAST_1, nargs='+', default=[1, 3, 10])
    r.add_argument('--name', default=None,
                   help='the results\' folder under $OUT/fewshot (default: the peer; another name for a variant '
                        'made with --train-args / --predict-args)')
    r.add_argument('--train-args', default='',
                   help='more flags for the peer\'s train --init, one string (e.g. "--learning-rate 3e-4")')
    r.add_argument('--predict-args', default='', help='more flags for the peer\'s predict (e.g. "--diameter 0")')
    s = sub.add_parser('summary', help='the table of every peer fine-tune under $OUT/fewshot, with gluon_unet\'s')
    for q in (r, s):
        q.add_argument('--out', default=os.environ.get('OUT', '/tmp/peers'),
                       help='run_all.sh\'s $OUT: models/, scores/, and fewshot/ for these (default: %(default)s)')
        q.add_argument('--fewshot', default=os.environ.get('FEWSHOT', '/work/runs/fewshot'),
                       help='experiments/dsb2018/fewshot.py\'s --out: <group>/k<k>/train, test (default: %(default)s)')
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    return cmd_run(args) if args.command == 'run' else cmd_summary(args)


if __name__ == '__main__':
    main()
