"""A small picture of predictions: a grid of ``bin/predict --overlay`` images.

Picks the first ``--per-kind`` hold-out ids of every image kind (sorted, from the
``kinds.tsv`` that ``benchmarks/dsb_split.py`` writes), takes the central square of each
``<id>_overlay.png``, scales it to ``--cell`` pixels and writes one PNG::

    python benchmarks/overlay_grid.py --pred /tmp/gu7/best_pred --out docs/dsb_holdout_overlays.png
"""
import argparse
import os
import sys

import cv2
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gluon_unet.utils import atomic_path  # noqa: E402  (the repository root is on the path now)


def central_square(img):
    h, w = img.shape[:2]
    s = min(h, w)
    y, x = (h - s) // 2, (w - s) // 2
    return img[y:y + s, x:x + s]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--pred', required=True, help='bin/predict output folder (with --overlay)')
    p.add_argument('--kinds', default='/tmp/dsb/kinds.tsv', help='written by benchmarks/dsb_split.py')
    p.add_argument('--out', required=True, help='PNG to write')
    p.add_argument('--per-kind', type=int, default=2)
    p.add_argument('--cell', type=int, default=256)
    args = p.parse_args(argv)
    picks = {}
    with open(args.kinds) as f:
        for line in sorted(f):
            image_id, kind, part = line.split()
            if part == 'holdout' and len(picks.setdefault(kind, [])) < args.per_kind:
                picks[kind].append(image_id)
    cells = []
    for kind in sorted(picks):
        for image_id in picks[kind]:
            img = cv2.imread(os.path.join(args.pred, image_id + '_overlay.png'), cv2.IMREAD_COLOR)
            if img is None:
                raise SystemExit('error: no overlay for %s in %s (run bin/predict with --overlay)'
                                 % (image_id, args.pred))
            cell = cv2.resize(central_square(img), (args.cell, args.cell), interpolation=cv2.INTER_AREA)
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
