"""gluon_unet: data-parallel U-Net training on all the GPUs of a machine with MXNet Gluon.

The Python API in one import::

    from gluon_unet import TrainConfig, ModelConfig, fit, synthetic_dataset
"""
# Before anything imports mxnet: MXNet 1.9 assumes two hyper-threads per core and runs on
# half the cores of a machine without SMT. Measured side by side on 2 cores: 1.8x faster
# training (docs/performance.md). The user's own OMP_NUM_THREADS always wins.
from .runtime import apply_thread_defaults

apply_thread_defaults()

from .config import ModelConfig, TrainConfig  # noqa: E402
from .data import SegmentationDataset, synthetic_dataset  # noqa: E402
from .engine import fit  # noqa: E402
from .model import UNet, build_model  # noqa: E402
from .parallel import DataParallelStep  # noqa: E402

__version__ = '0.1.0'

__all__ = ['ModelConfig', 'TrainConfig', 'SegmentationDataset', 'synthetic_dataset', 'fit', 'UNet',
           'build_model', 'DataParallelStep', '__version__']
