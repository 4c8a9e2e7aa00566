#!/usr/bin/env python3
"""Does a fine-tune need its own post-processing? (issue 69, after fluo-crowded)

A fine-tune without validation keeps its source's searched post-processing (threshold,
h, min size, min score). On fluo-crowded the fine-tuned maps grow fat and the inherited
threshold 0.6 merges nuclei. This searches the post-processing again *on the k training
images themselves* (the only annotations a few-shot user has; in-sample, so optimistic),
then predicts the group's other images with it and scores them beside the inherited
setting. Run from the repository root after ``fewshot.py run`` made OUT/<group>/k<k>/fold::

    python experiments/dsb2018/fewshot_insample.py --fewshot /work/runs/fewshot --group fluo-crowded --k 3 \\
        --out /tmp/insample
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, '..', '..'))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from fewshot import paired_interval, predict_and_score, read_scores  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--fewshot', required=True)
    p.add_argument('--group', required=True)
    p.add_argument('--k', type=int, required=True)
    p.add_argument('--method', default='fold')
    p.add_argument('--out', required=True)
    args = p.parse_args()
    import mxnet as mx
    import numpy as np
    from gluon_unet.data.io import input_image, read_image
    from gluon_unet.inference.batched import load_model, match_channels, predict_image
    from gluon_unet.inference.evaluate import load_truth
    from gluon_unet.inference.postprocess_search import tune_on_maps

    base = os.path.join(args.fewshot, args.group, 'k%d' % args.k)
    model_dir = os.path.join(base, args.method)
    train = os.path.join(base, 'train')
    lm = load_model(model_dir, [mx.cpu()])
    truth = load_truth(train)
    pairs = []
    for image_id, labels in truth.items():
        path = os.path.join(train, image_id, 'images', image_id + '.png')
        img = input_image(read_image(path), lm.channels, lm.normalize, lm.denoise,
                          convert=lambda im, c: match_channels(im, c, path))
        pairs.append((predict_image(lm.net, lm.meta, img, lm.ctxs, 'tile', maps=True), labels()))
    inherited = {k: getattr(lm, k) for k in ('threshold', 'h', 'min_size', 'min_score')}
    t0 = time.time()
    chosen = tune_on_maps(pairs, base=dict(inherited))
    search_s = time.time() - t0
    key = '%s-k%d-%s' % (args.group, args.k, args.method)
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, key)
    flags = ['--threshold', str(chosen['threshold']), '--min-size', str(chosen['min_size']),
             '--min-score', str(chosen['min_score'])]
    if 'h' in chosen:
        flags += ['--h', str(chosen['h'])]
    if chosen.get('split'):
        flags += ['--split', chosen['split']]
    predict_and_score(model_dir, os.path.join(base, 'test'), out, out + '.csv', os.path.join(args.out, key + '.log'),
                      flags)
    mine, old = read_scores(out + '.csv'), read_scores(os.path.join(base, args.method + '.csv'))
    ids = sorted(old)
    diff, lo, hi = (float(x) for x in paired_interval([old[i] for i in ids], [mine[i] for i in ids]))
    rec = dict(group=args.group, k=args.k, method=args.method, inherited=inherited,
               chosen={k: v for k, v in chosen.items()}, search_seconds=round(search_s, 1),
               inherited_dsb=float(np.mean([old[i] for i in ids])), insample_dsb=float(np.mean([mine[i] for i in ids])),
               diff=diff, lo=lo, hi=hi, scored=len(ids))
    print(json.dumps(rec))
    with open(os.path.join(args.out, 'results.jsonl'), 'a') as f:
        f.write(json.dumps(rec) + '\n')


if __name__ == '__main__':
    main()
