"""Data: datasets, sampling, loaders, generated nuclei and readers for user layouts."""
from .dataset import SegmentationDataset, EpochSampler, make_loader, set_loader_epoch, split_indices
from .synthetic import synthetic_dataset, synthetic_nuclei
