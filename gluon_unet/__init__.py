"""gluon_unet: data-parallel U-Net training on all the GPUs of a machine with MXNet Gluon.

The Python API in one import::

    from gluon_unet import TrainConfig, ModelConfig, fit, synthetic_dataset
"""
import importlib

# Before anything imports mxnet: MXNet 1.9 assumes two hyper-threads per core and runs on
# half the cores of a machine without SMT. Measured side by side on 2 cores: 1.8x faster
# training (docs/performance.md). The user's own OMP_NUM_THREADS always wins.
from .runtime import apply_runtime_defaults

apply_runtime_defaults()

__version__ = '0.1.0'

# The public names, imported on first use (PEP 562) rather than here: most of them load
# mxnet, and bin/train must read --cpus first to choose the thread count and scratch
# buffers, which libmxnet reads once, when it loads (runtime.apply_runtime_defaults).
_EXPORTS = {'ModelConfig': 'config', 'TrainConfig': 'config', 'SegmentationDataset': 'data',
            'synthetic_dataset': 'data', 'fit': 'engine', 'UNet': 'model', 'build_model': 'model',
            'DataParallelStep': 'parallel'}

__all__ = ['ModelConfig', 'TrainConfig', 'SegmentationDataset', 'synthetic_dataset', 'fit', 'UNet',
           'build_model', 'DataParallelStep', '__version__']


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError('module %r has no attribute %r' % (__name__, name))
    value = getattr(importlib.import_module('.' + _EXPORTS[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
