"""The fixed validation protocol for DSB 2018 stage1_train: a seeded, stratified 10 % hold-out.

Every image is given a *kind* from its pixels (no labels needed), by the package's
:func:`gluon_unet.data.io.image_kind` (the groups of ``bin/train --balance groups``):

* ``he``           colour image (the three channels differ): H&E / stained tissue
                   (the package calls it ``colour``);
* ``brightfield``  grey image whose median is above 127 (bright background, dark nuclei);
* ``fluorescence`` grey image with a dark background (bright nuclei).

Within each kind the ids are sorted, shuffled with ``numpy.random.RandomState(seed)`` and
the first ``round(fraction * n)`` (at least 1) go to the hold-out. The result is written
to ``experiments/dsb2018/dsb_holdout_ids.txt`` (one id per line; ids only, no data) and
materialized as two symlink trees, so training never sees the hold-out::

    <out>/train/<id>   -> <data>/<id>     (bin/train --data <out>/train)
    <out>/holdout/<id> -> <data>/<id>     (bin/predict --input / bin/evaluate --truth)

    python experiments/dsb2018/dsb_split.py [--data ../shared/data/dsb2018/stage1_train] [--out /tmp/dsb]
                                   [--fraction 0.1] [--seed 2018] [--check]

``--check`` recomputes the split and fails unless it equals the committed id list.
"""
import argparse
import os
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository
sys.path.insert(0, ROOT)
# noqa: E402 below: the repository root is on the path now
from gluon_unet.data import io  # noqa: E402
from gluon_unet.errors import UserError  # noqa: E402
from gluon_unet.utils import atomic_open  # noqa: E402
DEFAULT_DATA = os.path.join(ROOT, '..', 'shared', 'data', 'dsb2018', 'stage1_train')
IDS_FILE = os.path.join(HERE, 'dsb_holdout_ids.txt')
KINDS = ('fluorescence', 'brightfield', 'he')
#: The package's kind names -> the names in this protocol's files (kinds.tsv).
_NAMES = {'colour': 'he'}


def image_kind(path):
    """'he', 'brightfield' or 'fluorescence' for one DSB image file (see module doc)."""
    try:
        kind = io.image_kind(io.read_image(path))
    except UserError as e:
        raise SystemExit('error: %s' % e) from None
    return _NAMES.get(kind, kind)


def kinds_of(data):
    """{id: kind} for every ``<data>/<id>/images/<id>.png``."""
    out = {}
    for image_id in sorted(os.listdir(data)):
        path = os.path.join(data, image_id, 'images', image_id + '.png')
        if os.path.isfile(path):
            out[image_id] = image_kind(path)
    if not out:
        raise SystemExit('error: --data %s: no <id>/images/<id>.png found' % data)
    return out


def split(kinds, fraction=0.1, seed=2018):
    """Stratified hold-out: sorted list of hold-out ids (``round(fraction*n)`` >= 1 per kind)."""
    rng = np.random.RandomState(seed)
    hold = []
    for kind in KINDS:
        ids = sorted(i for i, k in kinds.items() if k == kind)
        if not ids:
            continue
        order = rng.permutation(len(ids))
        n = max(1, int(round(fraction * len(ids))))
        hold += [ids[j] for j in order[:n]]
    return sorted(hold)


def materialize(data, out, kinds, hold):
    """Symlink trees ``out/train/<id>`` and ``out/holdout/<id>`` (rebuilt from scratch)."""
    hold = set(hold)
    for part in ('train', 'holdout'):
        folder = os.path.join(out, part)
        if os.path.isdir(folder):
            shutil.rmtree(folder)  # only symlinks live here; the data is never touched
        os.makedirs(folder)
    data = os.path.abspath(data)
    for image_id in kinds:
        part = 'holdout' if image_id in hold else 'train'
        os.symlink(os.path.join(data, image_id), os.path.join(out, part, image_id))
    with open(os.path.join(out, 'kinds.tsv'), 'w') as f:
        for image_id, kind in sorted(kinds.items()):
            f.write('%s\t%s\t%s\n' % (image_id, kind, 'holdout' if image_id in hold else 'train'))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--data', default=DEFAULT_DATA, help='DSB stage1_train root (read only)')
    p.add_argument('--out', default='/tmp/dsb', help='where the train/ and holdout/ symlink trees go')
    p.add_argument('--fraction', type=float, default=0.1)
    p.add_argument('--seed', type=int, default=2018)
    p.add_argument('--ids', default=IDS_FILE, help='hold-out id list to write (or compare with --check)')
    p.add_argument('--check', action='store_true', help='fail unless the split equals --ids')
    args = p.parse_args(argv)
    if not os.path.isdir(args.data):
        raise SystemExit('error: --data %s: no such folder (the DSB 2018 stage1_train root)' % args.data)
    kinds = kinds_of(args.data)
    hold = split(kinds, args.fraction, args.seed)
    if args.check:
        with open(args.ids) as f:
            committed = sorted(line.strip() for line in f if line.strip() and not line.startswith('#'))
        if committed != hold:
            raise SystemExit('error: recomputed hold-out differs from %s' % args.ids)
    else:
        with atomic_open(args.ids) as f:
            f.write('\n'.join(hold) + '\n')
    materialize(args.data, args.out, kinds, hold)
    for kind in KINDS:
        n = sum(1 for k in kinds.values() if k == kind)
        h = sum(1 for i in hold if kinds[i] == kind)
        print('%-12s %4d images: %3d train, %3d hold-out' % (kind, n, n - h, h))
    print('total        %4d images: %3d train, %3d hold-out -> %s/{train,holdout}'
          % (len(kinds), len(kinds) - len(hold), len(hold), args.out))
    return 0


if __name__ == '__main__':
    sys.exit(main())
