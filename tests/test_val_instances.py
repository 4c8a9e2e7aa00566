"""Model selection on true instances: validation crops keep touching nuclei apart."""
import numpy as np

from gluon_unet.data.augment import make_transform
from gluon_unet.data.dataset import SegmentationDataset
from gluon_unet.data.loader import make_loader
from gluon_unet.metrics import DSBMetric
from gluon_unet.training.validation import val_instances


def _touching_pair(n=4, size=48):
    """Images with two touching square nuclei: one connected blob, two instances."""
    images = np.zeros((n, size, size, 1), np.uint8)
    inst = np.zeros((n, size, size), np.int32)
    for k in range(n):
        inst[k, 10:30, 8:20] = 1
        inst[k, 10:30, 20:32] = 2  # shares an edge with nucleus 1
        images[k][inst[k] > 0] = 200
    return SegmentationDataset(images, (inst > 0).astype(np.uint8), inst)


def test_cropped_validation_scores_against_the_true_instances():
    ds = _touching_pair()
    ds.transform = make_transform(augment=False, crop=32)
    loader = make_loader(ds, 2, shuffle=False, seed=0)
    seeds = loader.epoch_sampler.seeds()
    batches = list(loader)
    targets = np.concatenate([b[1].asnumpy()[:, 0] for b in batches])
    for i in range(len(ds)):
        labels = val_instances(ds, i, seeds[i])
        assert labels.shape == targets[i].shape
        np.testing.assert_array_equal(labels > 0, targets[i] > 0)  # the same crop as the loader's
        assert len(np.unique(labels[labels > 0])) == 2  # two nuclei, though one blob
    # A prediction that merges the pair scores 0 against the truth; the old connected-
    # components truth would have called the merge perfect.
    merged = (targets[0] > 0).astype(np.int32)
    metric = DSBMetric()
    metric.update(merged, val_instances(ds, 0, seeds[0]))
    assert metric.result() == 0.0
