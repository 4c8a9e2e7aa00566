"""How far StarDist's shape model can go on each kind of nucleus: every true nucleus of a
DSB-layout folder replaced by the star-convex polygon StarDist would draw for it, written as
``<id>_labels.png`` for ``bin/evaluate`` to score against the truth.

StarDist predicts, for a pixel, its distances to the object's edge along ``n_rays`` rays,
and draws the polygon through those points: an object it can only draw as such a polygon
around one point. The truth drawn so (``stardist.geometry.relabel_image_stardist``: the
rays from each nucleus's centroid, as StarDist's own notebooks check a dataset before
training) is what a perfect StarDist network would output, so its score is StarDist's
ceiling on the images: where a group's ceiling is low, its nuclei are not star-convex
around their centre, and StarDist's polygons cannot follow them whatever it learns.
The truth is read as the peers' training reads it (the masks merged, holes filled as
``stardist_peer.py`` fills them).

Install as ``stardist_peer.py`` (its venv). Run on each grouped fold's held-out images (the
folders ``run_all.sh`` makes), score, and set beside the recipe and StarDist per group (from
the repository root)::

    for k in 1 2 3; do
      /tmp/venv-stardist/bin/python benchmarks/peers/star_ceiling.py \
          --data /tmp/peers/dsbgroups/fold$k/heldout --output /tmp/peers/star-ceiling-g$k
      .venv/bin/python bin/evaluate --pred /tmp/peers/star-ceiling-g$k --truth /tmp/peers/dsbgroups/fold$k/heldout \
          --csv /tmp/peers/scores/star-ceiling-g$k.csv
    done
    S=experiments/dsb2018/scores
    .venv/bin/python experiments/dsb2018/dsb_grouped.py score \
        RECIPE=$S/g1-full-range.csv,$S/g2-full-range.csv,$S/g3-full-range.csv \
        STARDIST=$S/peers/stardist-g1.csv,$S/peers/stardist-g2.csv,$S/peers/stardist-g3.csv \
        CEILING=/tmp/peers/scores/star-ceiling-g1.csv,/tmp/peers/scores/star-ceiling-g2.csv,\
/tmp/peers/scores/star-ceiling-g3.csv --bootstrap 0
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build_parser():
    from peer_flags import AT_LEAST_1, COUNT, OneLineParser
    p = OneLineParser(prog='star_ceiling.py', description=__doc__.split('\n\n')[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--data', required=True, help='DSB-layout folder: <id>/images/<id>.png + <id>/masks/*.png')
    p.add_argument('--output', required=True, help='folder for <id>_labels.png (created; must not hold labels)')
    p.add_argument('--rays', type=AT_LEAST_1, default=32, help='rays per polygon (default 32, StarDist\'s example)')
    p.add_argument('--limit', type=COUNT, default=0, help='only the first N samples (smoke tests; 0: all)')
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from peer_flags import fail
    if not os.path.isdir(args.data):
        fail('--data %s: no such directory' % args.data)
    if os.path.isdir(args.output) and any(n.endswith('_labels.png') for n in os.listdir(args.output)):
        fail('--output %s already holds labels; choose another folder' % args.output)
    import numpy as np
    from peer_common import list_dsb, read_labels, write_labels
    from stardist import fill_label_holes
    from stardist.geometry import relabel_image_stardist
    samples = list_dsb(args.data)
    if args.limit:
        samples = samples[:args.limit]
    if not samples:
        fail('--data %s: no <id>/images/<id>.png with <id>/masks/ in it' % args.data)
    os.makedirs(args.output, exist_ok=True)
    t0, kept, total = time.time(), 0, 0
    for sid, _img, mask_paths in samples:
        truth = fill_label_holes(read_labels(mask_paths))
        drawn = relabel_image_stardist(truth, n_rays=args.rays)
        write_labels(os.path.join(args.output, sid + '_labels.png'), drawn)
        total += len(np.unique(truth[truth > 0]))
        kept += len(np.unique(drawn[drawn > 0]))
    print('%d images, %d nuclei drawn as %d-ray polygons (%d still visible) in %.1f s: %s'
          % (len(samples), total, args.rays, kept, time.time() - t0, args.output))


if __name__ == '__main__':
    main()
