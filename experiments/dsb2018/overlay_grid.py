"""A small picture of predictions: a grid of ``bin/predict --overlay`` images.

Picks the first ``--per-kind`` hold-out ids of every image kind (sorted, from the
``kinds.tsv`` that ``experiments/dsb2018/dsb_split.py`` writes), takes the central square of each
``<id>_overlay.png``, scales it to ``--cell`` pixels and writes one PNG::

    python experiments/dsb2018/overlay_grid.py --pred /tmp/gu7/best_pred --out experiments/dsb2018/dsb_holdout_overlays.png

With ``--touching TRUTH`` (the DSB hold-out root) it picks instead, per kind, the images
whose true nuclei touch most often, and shows the square around where they touch,
zoomed in: the case that separating instances is about.
"""
import argparse
import os
import sys

import cv2
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
from gluon_unet.utils import atomic_path  # noqa: E402  (the repository root is on the path now)


def central_square(img):
    h, w = img.shape[:2]
    s = min(h, w)
    y, x = (h - s) // 2, (w - s) // 2
    return img[y:y + s, x:x + s]


def contacts(labels):
    """Pixels where two different true nuclei are 4-neighbours."""
    a, b = labels[:, :-1], labels[:, 1:]
    h = (a > 0) & (b > 0) & (a != b)
    c, d = labels[:-1], labels[1:]
    v = (c > 0) & (d > 0) & (c != d)
    out = np.zeros(labels.shape, bool)
    out[:, :-1] |= h
    out[:-1] |= v
    return out


def touching_square(img, touch, side):
    """The ``side`` square (at most the image) centred on the median contact pixel."""
    h, w = img.shape[:2]
    side = min(side, h, w)
    ys, xs = np.nonzero(touch)
    cy, cx = (int(np.median(ys)), int(np.median(xs))) if len(ys) else (h // 2, w // 2)
    y, x = min(max(0, cy - side // 2), h - side), min(max(0, cx - side // 2), w - side)
    return img[y:y + side, x:x + side]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--pred', required=True, help='bin/predict output folder (with --overlay)')
    p.add_argument('--kinds', default='/tmp/dsb/kinds.tsv', help='written by experiments/dsb2018/dsb_split.py')
    p.add_argument('--out', required=True, help='PNG to write')
    p.add_argument('--per-kind', type=int, default=2)
    p.add_argument('--cell', type=int, default=256)
    p.add_argument('--touching', metavar='TRUTH', help='DSB root of the truth: show where true nuclei touch')
    p.add_argument('--zoom', type=int, default=160, help='--touching: side of the square shown (image pixels)')
    args = p.parse_args(argv)
    ids = {}
    with open(args.kinds) as f:
        for line in sorted(f):
            image_id, kind, part = line.split()
            if part == 'holdout':
                ids.setdefault(kind, []).append(image_id)
    truth = {}
    if args.touching:
        from gluon_unet.inference.evaluate import load_truth
        loaders = load_truth(args.touching)
        truth = {i: contacts(loaders[i]()) for kind in ids for i in ids[kind]}
        picks = {kind: sorted(found, key=lambda i: -truth[i].sum())[:args.per_kind] for kind, found in ids.items()}
    else:
        picks = {kind: found[:args.per_kind] for kind, found in ids.items()}
    cells = []
    for kind in sorted(picks):
        for image_id in picks[kind]:
            img = cv2.imread(os.path.join(args.pred, image_id + '_overlay.png'), cv2.IMREAD_COLOR)
            if img is None:
                raise SystemExit('error: no overlay for %s in %s (run bin/predict with --overlay)'
                                 % (image_id, args.pred))
            square = touching_square(img, truth[image_id], args.zoom) if truth else central_square(img)
            cell = cv2.resize(square, (args.cell, args.cell),
                              interpolation=cv2.INTER_AREA if square.shape[0] > args.cell else cv2.INTER_NEAREST)
            cv2.putText(cell, kind, (6, 18), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (255, 255, 255), 1, cv2.LINE_AA)
            cells.append(cell)
    cols = len(cells) // 2 if len(cells) > 3 else len(cells)
    while len(cells) % cols:
        cells.append(np.zeros_like(cells[0]))
    rows = [np.concatenate(cells[i:i + cols], axis=1) for i in range(0, len(cells), cols)]
    grid = np.concatenate(rows, axis=0)
    with atomic_path(args.out) as tmp:
        if not cv2.imwrite(tmp, grid, [cv2.IMWRITE_PNG_COMPRESSION, 9]):
            raise SystemExit('error: %s: cannot write the image' % args.out)
    print('%s: %d images, %dx%d px, %.0f KB' % (args.out, len(cells), grid.shape[1], grid.shape[0],
                                               os.path.getsize(args.out) / 1024))
    return 0


if __name__ == '__main__':
    sys.exit(main())
