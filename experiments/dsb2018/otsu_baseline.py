"""The no-learning baseline: Otsu threshold + connected components, per image.

Each image is converted to grey (ITU-R 601 luma); an image whose background is bright
(median above ``gluon_unet.data.io.BRIGHT_BACKGROUND``: brightfield, H&E) is inverted
so nuclei are the bright class; ``skimage.filters.threshold_otsu`` splits it and the
4-connected components are the nuclei. Writes ``<id>_labels.png`` (16-bit ids) like
``bin/predict``, so ``bin/evaluate`` scores it the same way::

    python experiments/dsb2018/otsu_baseline.py --input /tmp/dsb/holdout --output /tmp/gu7/otsu
    python bin/evaluate --pred /tmp/gu7/otsu --truth /tmp/dsb/holdout --csv /tmp/gu7/otsu.csv
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))

from gluon_unet.data.io import BRIGHT_BACKGROUND, read_image  # noqa: E402
from gluon_unet.inference.predict import find_inputs  # noqa: E402
from gluon_unet.inference.predict_outputs import write_png  # noqa: E402


def otsu_labels(image):
    """Instance labels (H, W) int32 of an (H, W, C) uint8 image by Otsu + components."""
    from skimage.filters import threshold_otsu
    from skimage.measure import label

    grey = image[..., 0] if image.shape[2] == 1 else read_grey(image)
    if np.median(grey) > BRIGHT_BACKGROUND:
        grey = 255 - grey
    if grey.min() == grey.max():
        return np.zeros(grey.shape, np.int32)
    return label(grey > threshold_otsu(grey), connectivity=1).astype(np.int32)


def read_grey(image):
    import cv2
    return cv2.cvtColor(np.ascontiguousarray(image[..., :3]), cv2.COLOR_RGB2GRAY)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--input', required=True, help='image, folder or DSB root (as bin/predict)')
    p.add_argument('--output', required=True, help='folder for <id>_labels.png')
    args = p.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    t0 = time.time()
    files = find_inputs(args.input)
    for image_id, path in files:
        labels = otsu_labels(read_image(path))
        write_png(os.path.join(args.output, image_id + '_labels.png'), labels.astype(np.uint16))
    print('otsu: %d images in %.1f s -> %s' % (len(files), time.time() - t0, args.output))
    return 0


if __name__ == '__main__':
    sys.exit(main())
