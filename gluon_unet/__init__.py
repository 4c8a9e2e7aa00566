"""gluon_unet: data-parallel U-Net training on all the GPUs of a machine with MXNet Gluon.

The Python API in one import::

    import gluon_unet
    gluon_unet.use_all_cores(contexts=1)   # optional, before mxnet loads: all physical cores
    from gluon_unet import TrainConfig, ModelConfig, fit, synthetic_dataset

Importing the package changes nothing in the process (no environment variable, no
logging setup) and does not load mxnet.
"""
import importlib
import os
import sys

__version__ = '0.3.0'

# gluon_unet 0.2's module paths (gluon_unet.engine, ...) for one more release: see _moved/.
__path__.append(os.path.join(os.path.dirname(__file__), '_moved'))


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


def _lazy(package, exports):
    """``(__getattr__, __dir__)`` for a package whose public names (``exports``: name ->
    submodule) are imported on first use (PEP 562), not when the package is: most of them
    load mxnet, which the ONNX environment does not have and which must not load before
    :func:`use_all_cores` (or ``bin/train`` after reading ``--cpus``) has chosen the
    thread count and scratch buffers libmxnet reads once, when it loads."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name):
        if name not in exports:
            raise AttributeError('module %r has no attribute %r' % (package, name))
        value = getattr(importlib.import_module('.' + exports[name], package), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))
    return __getattr__, __dir__


_EXPORTS = {'ModelConfig': 'config', 'TrainConfig': 'config', 'SegmentationDataset': 'data',
            'synthetic_dataset': 'data', 'fit': 'training', 'UNet': 'model', 'build_model': 'model',
            'DataParallelStep': 'training', 'use_all_cores': 'machine.runtime'}

__all__ = ['ModelConfig', 'TrainConfig', 'SegmentationDataset', 'synthetic_dataset', 'fit', 'UNet',
           'build_model', 'DataParallelStep', 'use_all_cores', '__version__']

__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
