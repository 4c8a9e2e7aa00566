"""Training: :func:`fit` and what only it uses.

The loop and its stages (``fit``), the step on the devices (``step``, ``parallel``: all
multi-device logic), validation, checkpoints kept and the run folder (``recorder``,
``run_folder``), ``--resume`` and stops, optimizers and losses, ``--ema``,
``--time-budget``, TensorBoard, the distributed strategies and ``bin/launch``'s job.

The top layer of the library: it may import :mod:`gluon_unet.inference` (a run ends in a
post-processing search and an export), the shared modules and :mod:`gluon_unet.machine`;
only :mod:`gluon_unet.cli` imports it (``tests/test_architecture.py``).
"""
from .. import _lazy

_EXPORTS = {'fit': 'loop', 'FitResult': 'loop', 'EpochContext': 'loop', 'DataParallelStep': 'parallel'}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
