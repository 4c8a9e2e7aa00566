"""gluon_unet: data-parallel U-Net training on all the GPUs of a machine with MXNet Gluon.

The Python API in one import::

    from gluon_unet import TrainConfig, ModelConfig, fit, synthetic_dataset
"""
from .config import ModelConfig, TrainConfig
from .data import SegmentationDataset, synthetic_dataset
from .engine import fit
from .model import UNet, build_model
from .parallel import DataParallelStep

__version__ = '0.1.0'

__all__ = ['ModelConfig', 'TrainConfig', 'SegmentationDataset', 'synthetic_dataset', 'fit', 'UNet',
           'build_model', 'DataParallelStep', '__version__']
