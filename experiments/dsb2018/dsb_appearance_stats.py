"""Cheap statistics behind ``--normalize`` choices on DSB 2018 stage1_train (no training).

An Otsu threshold of the network's input (``gluon_unet.data.io.input_image``) is a
proxy for how a normalization presents the nuclei: a nucleus cut into several
components, or specks off the nuclei, are what a stretch that amplifies noise produces.

* ``--kind fluorescence``: the dimmest quarter of the fluorescence images (by their
  99.8th percentile), the percentile stretch without and with the denoise
  (``--normalize percentile``, Gaussian sigma 0 vs :data:`~gluon_unet.data.io.DENOISE_SIGMA`).
* ``--kind colour``: every colour (H&E) image, ``auto`` (inverted grey) vs ``stain``
  (hematoxylin): the threshold's mean IoU with the truth and the nuclei it touches.

    python experiments/dsb2018/dsb_appearance_stats.py [--data ../shared/data/dsb2018/stage1_train] [--kind fluorescence]
"""
import argparse
import glob
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository
sys.path.insert(0, ROOT)
# noqa: E402 below: the repository root is on the path now
from gluon_unet.data.io import DENOISE_SIGMA, image_kind, input_image, merge_object_masks, read_image  # noqa: E402

DEFAULT_DATA = os.path.join(ROOT, '..', 'shared', 'data', 'dsb2018', 'stage1_train')


def images_of_kind(data, kind):
    """``[(id, image)]`` of every ``<data>/<id>/images/<id>.png`` of ``kind``."""
    out = []
    for sid in sorted(os.listdir(data)):
        path = os.path.join(data, sid, 'images', sid + '.png')
        if os.path.isfile(path):
            img = read_image(path)
            if image_kind(img) == kind:
                out.append((sid, img))
    return out


def otsu_stats(x, inst):
    """Otsu components of the input ``x`` (H, W) against the instance labels ``inst``:
    (components, nuclei touched, nuclei in > 1 piece, components off the nuclei, IoU)."""
    from skimage.filters import threshold_otsu
    from skimage.measure import label

    fg = x > threshold_otsu(x)
    lab = label(fg, connectivity=2)
    pairs = np.unique(np.stack([inst[fg], lab[fg]], 1), axis=0)
    inside = pairs[pairs[:, 0] > 0]
    per_nucleus = np.bincount(inside[:, 0], minlength=int(inst.max()) + 1)[1:]
    truth = inst > 0
    iou = (fg & truth).sum() / max(1, (fg | truth).sum())
    return np.array([lab.max(), (per_nucleus > 0).sum(), (per_nucleus > 1).sum(),
                     lab.max() - len(np.unique(inside[:, 1])), iou], float)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--data', default=DEFAULT_DATA, help='DSB stage1_train root (read only)')
    p.add_argument('--kind', choices=('fluorescence', 'colour'), default='fluorescence')
    args = p.parse_args(argv)
    images = images_of_kind(args.data, args.kind)
    if args.kind == 'fluorescence':
        images.sort(key=lambda item: np.percentile(item[1], 99.8))
        images = images[:len(images) // 4]
        variants = {'percentile, no denoise': lambda img: input_image(img, 1, 'percentile', denoise=0),
                    'percentile, denoise %g' % DENOISE_SIGMA: lambda img: input_image(img, 1, 'percentile')}
    else:
        variants = {'auto (inverted grey)': lambda img: input_image(img, 1, 'auto'),
                    'stain (hematoxylin)': lambda img: input_image(img, 1, 'stain')}
    totals = {name: np.zeros(5) for name in variants}
    nuclei = 0
    for sid, img in images:
        masks = sorted(glob.glob(os.path.join(args.data, sid, 'masks', '*.png')))
        inst = merge_object_masks(masks, img.shape[:2])
        nuclei += len(masks)
        for name, fn in variants.items():
            totals[name] += otsu_stats(fn(img)[..., 0], inst)
    print('%d %s images, %d true nuclei' % (len(images), args.kind, nuclei))
    for name, (comps, hit, split, off, iou) in totals.items():
        print('%-24s components %5d  nuclei touched %5d  in >1 piece %4d  components off nuclei %4d  '
              'mean IoU %.3f' % (name, comps, hit, split, off, iou / len(images)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
