"""Data: datasets, sampling, loaders, generated nuclei and readers for user layouts."""
from .. import _lazy

# The names are imported on first use (PEP 562), not here: the datasets import mxnet, and
# bin/predict on an ONNX export reads images through .io where mxnet is not installed.
_EXPORTS = {'SegmentationDataset': 'dataset', 'EpochSampler': 'sampler', 'make_loader': 'loader',
            'set_loader_epoch': 'loader', 'split_indices': 'dataset', 'synthetic_dataset': 'synthetic',
            'synthetic_nuclei': 'synthetic', 'read_image': 'io', 'read_mask': 'io', 'read_binary_mask': 'io',
            'discover': 'layouts', 'detect_layout': 'layouts', 'Augment': 'augment', 'make_transform': 'augment',
            'LoadOptions': 'readers', 'load_dataset': 'readers'}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
