"""Data: datasets, sampling, loaders, generated nuclei and readers for user layouts."""
from .dataset import SegmentationDataset, EpochSampler, make_loader, set_loader_epoch, split_indices
from .synthetic import synthetic_dataset, synthetic_nuclei
from .io import read_image, read_mask, read_binary_mask
from .layouts import discover, detect_layout
from .augment import Augment, make_transform
from .readers import LoadOptions, load_dataset
