"""gluon_unet: data-parallel U-Net training on all the GPUs of a machine with MXNet Gluon.

The Python API in one import::

    import gluon_unet
    gluon_unet.use_all_cores(contexts=1)   # optional, before mxnet loads: all physical cores
    from gluon_unet import TrainConfig, ModelConfig, fit, synthetic_dataset

Importing the package changes nothing in the process (no environment variable, no
logging setup) and does not load mxnet.
"""
import importlib

__version__ = '0.2.0'


def version_string():
    """``'gluon_unet 0.2.0 (mxnet 1.9.1, Python 3.11.7)'``, what ``--version`` prints.

    Reads mxnet's version from the installed distribution's metadata (``mxnet``,
    ``mxnet-cu117``, ...) instead of importing it, so ``--version`` answers at once and
    changes nothing in the process.
    """
    import platform
    return '%s %s (%s, Python %s)' % (__name__, __version__, mxnet_distribution(), platform.python_version())


def mxnet_distribution():
    """``'mxnet 1.9.1'`` / ``'mxnet-cu117 1.9.1'``: the installed MXNet build, from package
    metadata (mxnet is not imported); ``'mxnet not installed'`` when there is none."""
    from importlib import metadata
    try:
        return 'mxnet %s' % metadata.version('mxnet')
    except metadata.PackageNotFoundError:
        pass
    found = sorted('%s %s' % (d.metadata['Name'], d.version) for d in metadata.distributions()
                   if (d.metadata['Name'] or '').lower().startswith('mxnet'))
    return ', '.join(found) or 'mxnet not installed'


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
