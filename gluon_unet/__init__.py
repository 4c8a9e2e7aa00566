"""gluon_unet: data-parallel U-Net training on all the GPUs of a machine with MXNet Gluon.

The Python API in one import::

    import gluon_unet
    gluon_unet.use_all_cores(contexts=1)   # optional, before mxnet loads: all physical cores
    from gluon_unet import TrainConfig, ModelConfig, fit, synthetic_dataset

Importing the package changes nothing in the process (no environment variable, no
logging setup) and does not load mxnet.
"""
import importlib

__version__ = '0.1.0'

# The public names, imported on first use (PEP 562) rather than here: most of them load
# mxnet, and use_all_cores() (like bin/train after reading --cpus) must run first to choose
# the thread count and scratch buffers, which libmxnet reads once, when it loads.
_EXPORTS = {'ModelConfig': 'config', 'TrainConfig': 'config', 'SegmentationDataset': 'data',
            'synthetic_dataset': 'data', 'fit': 'engine', 'UNet': 'model', 'build_model': 'model',
            'DataParallelStep': 'parallel', 'use_all_cores': 'runtime'}

__all__ = ['ModelConfig', 'TrainConfig', 'SegmentationDataset', 'synthetic_dataset', 'fit', 'UNet',
           'build_model', 'DataParallelStep', 'use_all_cores', '__version__']


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError('module %r has no attribute %r' % (__name__, name))
    value = getattr(importlib.import_module('.' + _EXPORTS[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
