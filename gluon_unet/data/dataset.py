"""In-memory segmentation datasets and the seeded train/validation split.

Every source of data (generated nuclei, user folders, the DSB layout, a CSV) ends up as
a :class:`SegmentationDataset`: arrays of images, class masks and instance labels, with
an optional augmentation applied to all three together. Augmentation randomness comes
from a seed derived from ``(run seed, epoch, sample index)``, carried to the dataset by
the sampler (:mod:`gluon_unet.data.loader`), so the same seed gives the same batches
with any number of loader workers.
"""
import numpy as np
from mxnet import gluon

from ..errors import UserError
from .targets import make_target, separate_touching


class SegmentationDataset(gluon.data.Dataset):
    """Images with masks and instance labels.

    Parameters
    ----------
    images : array-like, (N, H, W, C) uint8 or float32
        uint8 is scaled by 1/255; float32 is used as is (already normalized).
        May be a ``np.memmap`` or a list of arrays of different sizes (with ``transform``
        cropping them to one size).
    masks : array-like, (N, H, W) uint8
        Class per pixel (binary: 0/1).
    instances : array-like, (N, H, W) int32, optional
        Instance labels (0 = background); needed by the DSB metric and ``wbce``.
        When omitted, connected components of ``masks > 0`` are used.
    names : list of str, optional
        Sample names (file stems) for logs and predictions.
    transform : callable, optional
        ``transform(image, mask, instances, rng) -> (image, mask, instances)``; see
        :mod:`gluon_unet.data.augment`.
    weight_fn : callable, optional
        ``weight_fn(instances) -> (H, W) float32`` per-pixel loss weights (``wbce``).
    target : {'mask', 'mask-gap', 'mask+border', 'mask+centre', 'mask+contact', 'mask+touching', 'mask+flow'}
        What the network learns (:func:`gluon_unet.data.targets.make_target`).
    groups : list of str, optional
        Each sample's appearance group (``--balance groups``); None = unknown.
    colour : list, optional
        Per sample, the image as read (RGB uint8) when it has colour, else None: what
        ``stain`` jitters (:class:`~.augment.StainJitter`).
    stain : callable, optional
        ``stain(rgb, rng) -> image``, replacing a colour sample's cached image before its
        transform (drawn from the same generator, first); grey samples are left alone.

    ``dataset[i]`` or ``dataset[(i, seed)]`` returns ``(image (C,H,W) float32,
    target (K,H,W) float32)`` (K = 1 for ``mask`` and ``mask-gap``, 2 for the targets with
    a second map), plus ``weight (1,H,W) float32`` when ``weight_fn`` is set.
    """

    def __init__(self, images, masks, instances=None, names=None, transform=None, weight_fn=None,
                 original_sizes=None, target='mask', groups=None, colour=None, stain=None):
        if len(images) != len(masks):
            raise ValueError('images and masks differ in length: %d vs %d' % (len(images), len(masks)))
        if instances is not None and len(instances) != len(images):
            raise ValueError('instances and images differ in length')
        self.images, self.masks, self._instances = images, masks, instances
        self.names = list(names) if names is not None else ['%05d' % i for i in range(len(images))]
        self.transform, self.weight_fn, self.target = transform, weight_fn, target
        self.original_sizes = original_sizes
        self.groups = None if groups is None else list(groups)
        self.colour, self.stain = colour, stain

    def __len__(self):
        return len(self.images)

    def instances(self, i):
        """Instance labels of sample ``i`` (connected components if none were given)."""
        if self._instances is not None:
            return np.asarray(self._instances[i])
        from skimage.measure import label
        return label(np.asarray(self.masks[i]) > 0, connectivity=1).astype(np.int32)

    def raw(self, i):
        """``(image HWC, mask HW, instances HW)`` of sample ``i`` before augmentation."""
        return np.asarray(self.images[i]), np.asarray(self.masks[i]), self.instances(i)

    def subset(self, indices, transform=None, weight_fn=None):
        """A view on some samples (used for the train/validation split)."""
        indices = np.asarray(indices, dtype=np.int64)
        pick = _Picker(indices)
        sub = SegmentationDataset(
            pick(self.images), pick(self.masks),
            None if self._instances is None else pick(self._instances),
            [self.names[i] for i in indices], transform, weight_fn,
            None if self.original_sizes is None else [self.original_sizes[i] for i in indices], self.target,
            None if self.groups is None else [self.groups[i] for i in indices],
            None if self.colour is None else pick(self.colour))
        if getattr(self, 'kinds', None) is not None:  # set by the readers: the nucleus sizes per kind need it
            sub.kinds = [self.kinds[i] for i in indices]
        return sub

    def sample(self, i, seed=None):
        """``(image HWC, mask HW, instances HW)`` of sample ``i`` after its transform with
        ``seed``: the instance labels follow every crop and flip (nearest neighbour), so
        touching nuclei stay apart for the DSB metric."""
        image, mask, inst = self.raw(i)
        rng = np.random.default_rng(seed)
        if self.stain is not None and self.colour is not None and self.colour[i] is not None:
            image = self.stain(self.colour[i], rng)
        if self.transform is not None:
            image, mask, inst = self.transform(image, mask, inst, rng)
        return image, mask, inst

    def __getitem__(self, idx):
        i, seed = idx if isinstance(idx, tuple) else (idx, None)
        image, mask, inst = self.sample(i, seed)
        if image.dtype == np.uint8:
            image = image.astype(np.float32) * (1.0 / 255)
        image = np.ascontiguousarray(image.transpose(2, 0, 1), dtype=np.float32)
        target = make_target(mask, inst, self.target)
        if self.weight_fn is None:
            # No all-ones weight map: it would be batched, copied to every device and
            # multiplied in for nothing.
            return image, target
        if self.target in ('mask-gap', 'mask+contact', 'mask+touching'):
            # The weight map's border term lives on background pixels between nuclei:
            # with the contacts cleared it lands on the gaps the target asks for (the
            # cut line of mask-gap, the contact line of mask+contact).
            inst = separate_touching(inst)
        return image, target, self.weight_fn(inst).astype(np.float32)[None]


class _Picker:
    """Index an array (or list, or memmap) lazily so subsets do not copy the data."""

    def __init__(self, indices):
        self.indices = indices

    def __call__(self, arr):
        return _Subset(arr, self.indices)


class _Subset:
    def __init__(self, arr, indices):
        self.arr, self.indices = arr, indices

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        return self.arr[int(self.indices[i])]


def split_indices(n, val_fraction, seed):
    """Seeded train/validation split (not Keras' 'last N %').

    Returns
    -------
    (train_idx, val_idx) : tuple of np.ndarray
        Disjoint, together covering ``range(n)``; at least one validation sample when
        ``val_fraction > 0``.
    """
    order = np.random.default_rng([seed, 12345]).permutation(n)
    n_val = int(round(n * val_fraction))
    if val_fraction > 0:
        n_val = max(1, n_val)
    if n - n_val < 1:
        raise UserError('--val-split %.3g leaves no training images (%d images in all)'
                        % (val_fraction, n))
    return np.sort(order[n_val:]), np.sort(order[:n_val])

