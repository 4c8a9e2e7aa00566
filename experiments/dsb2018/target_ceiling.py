"""A target's ceiling: how far gluon_unet's instance step goes given perfect maps.

The `dsb2018` recipe predicts one map, the foreground probability, and parts touching nuclei
by a watershed on the distance transform of its thresholded foreground (h-maxima markers).
Given the true foreground (every nucleus pixel 1, the rest 0), that step's labels are the
best the recipe's representation can do: nuclei it merges or splits here it merges or splits
whatever its network learns. ``TARGET=mask+touching`` (any ``--target``) gives the step that
target's true maps instead (``gluon_unet.data.targets.make_target``, the training target
itself) and the markers its export uses. The counterpart of benchmarks/peers/star_ceiling.py
(StarDist's polygons drawn from the truth). Writes ``<id>_labels.png`` for ``bin/evaluate``.

    for k in 1 2 3; do
      python experiments/dsb2018/target_ceiling.py /tmp/peers/dsbgroups/fold$k/heldout /tmp/fg-ceiling-g$k
      python bin/evaluate --pred /tmp/fg-ceiling-g$k --truth /tmp/peers/dsbgroups/fold$k/heldout \
          --csv /tmp/fg-ceiling-g$k.csv
    done

Settings: h 0.5 and min size 16, as the fold runs' searches chose them (threshold and min
score do nothing on 0/1 maps); ``H=1`` or ``MIN_SIZE=0`` in the environment to try the
search's other values.
"""
import glob
import os
import sys

import cv2
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
from gluon_unet.data.io import merge_object_masks  # noqa: E402
from gluon_unet.data.targets import OUTPUTS, make_target, second_map_of  # noqa: E402
from gluon_unet.inference.postprocess import instances_from_maps  # noqa: E402


def fail(message):
    sys.stderr.write('error: %s\n' % message)
    raise SystemExit(2)


def main(held, out):
    try:
        h, min_size = float(os.environ.get('H', 0.5)), int(os.environ.get('MIN_SIZE', 16))
    except ValueError as e:
        fail('H / MIN_SIZE: %s' % e)
    target = os.environ.get('TARGET', 'mask')
    if target not in OUTPUTS:
        fail('TARGET=%s: one of %s' % (target, ', '.join(OUTPUTS)))
    markers = second_map_of(OUTPUTS[target]) or 'distance'
    if not os.path.isdir(held):
        fail('%s: no such directory' % held)
    if os.path.isdir(out) and any(n.endswith('_labels.png') for n in os.listdir(out)):
        fail('%s already holds labels; choose another folder' % out)
    ids = sorted(n for n in os.listdir(held) if os.path.isdir(os.path.join(held, n, 'masks')))
    if not ids:
        fail('%s holds no <id>/masks/' % held)
    os.makedirs(out, exist_ok=True)
    for i in ids:
        truth = merge_object_masks(sorted(glob.glob(os.path.join(held, i, 'masks', '*.png'))))
        maps = make_target((truth > 0).astype(np.uint8), truth, target)
        found = instances_from_maps(maps if len(maps) > 1 else maps[0], threshold=0.5, min_size=min_size, h=h,
                                    markers=markers)
        if not cv2.imwrite(os.path.join(out, i + '_labels.png'), found.astype(np.uint16)):
            fail('cannot write %s' % out)
    print('%d images: %s (%s, markers %s, h %g, min size %d)' % (len(ids), out, target, markers, h, min_size))


if __name__ == '__main__':
    if len(sys.argv) != 3:
        fail('usage: target_ceiling.py HELD_OUT_DSB_FOLDER OUTPUT_FOLDER')
    main(*sys.argv[1:])
