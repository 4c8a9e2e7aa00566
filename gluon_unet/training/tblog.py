"""TensorBoard logs of a run (``--tensorboard``), in ``<run>/tb/``.

Written with tensorboardX (an optional extra: ``pip install gluon_unet[tensorboard]`` or
``pip install tensorboardX``), which needs neither TensorFlow nor PyTorch. Per step: the
training loss and the learning rate; per epoch: every number of the epoch's record
(losses, IoU, Dice, DSB score, images/s) and a few validation images with the true
outlines in green and the predicted ones in red.
"""
import contextlib
import sys

import numpy as np

from ..errors import UserError

INSTALL_HINT = 'pip install tensorboardX (or pip install "gluon_unet[tensorboard]")'


@contextlib.contextmanager
def _torch_hidden():
    """``import torch`` fails with ImportError inside, unless torch is already loaded.

    tensorboardX's writer does ``try: import torch`` when it is imported, only to accept
    torch tensors. Where PyTorch is installed, loading it into a process that has already
    loaded MXNet (each ships its own OpenMP runtime) can abort the process ("Fatal Python
    error: Aborted", seen with torch 2.13 and mxnet 1.9.1), so a user with PyTorch
    installed lost the run at --tensorboard. We log numpy values only, so tensorboardX does
    not need it: it takes its no-torch path. Afterwards ``import torch`` works as before.
    """
    if 'torch' in sys.modules:
        yield
        return
    sys.modules['torch'] = None  # the import system's "not importable" marker
    try:
        yield
    finally:
        if sys.modules.get('torch', 0) is None:
            del sys.modules['torch']


def _tensorboardx():
    """The tensorboardX module, imported without PyTorch (:func:`_torch_hidden`)."""
    with _torch_hidden():
        import tensorboardX
    return tensorboardX


def require_tensorboardx():
    """Raise a one-line :class:`UserError` when tensorboardX is missing."""
    try:
        _tensorboardx()
    except ImportError:
        raise UserError('--tensorboard needs tensorboardX, which is not installed: %s' % INSTALL_HINT) from None


class TensorBoardLog:
    """A tensorboardX ``SummaryWriter`` on ``folder`` with the run's tags."""

    def __init__(self, folder):
        require_tensorboardx()
        self.writer = _tensorboardx().SummaryWriter(folder)

    def step(self, global_step, loss=None, lr=None):
        """One training step's loss (read back a few steps late) or learning rate."""
        if loss is not None:
            self.writer.add_scalar('train/loss', loss, global_step)
        if lr is not None:
            self.writer.add_scalar('train/lr', lr, global_step)

    def epoch(self, row, global_step, samples=()):
        """An epoch's record (numbers only) and validation overlays ``(image, truth, prob)``."""
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != 'epoch':
                group = 'val' if key.startswith('val_') else 'epoch'
                self.writer.add_scalar('%s/%s' % (group, key[4:] if group == 'val' else key), value,
                                       row['epoch'])
        for k, (image, truth, prob) in enumerate(samples):
            self.writer.add_image('val/overlay_%d' % k, overlay(image, truth, prob), row['epoch'],
                                  dataformats='HWC')
        self.writer.flush()

    def close(self):
        self.writer.close()


def overlay(image, truth, prob, threshold=0.5):
    """``image`` (C, H, W) in [0, 1] as RGB uint8 with the outlines of ``truth > 0`` in
    green and of ``prob > threshold`` in red."""
    from skimage.segmentation import find_boundaries
    grey = np.asarray(image, np.float32).mean(axis=0)
    rgb = np.repeat((np.clip(grey, 0, 1) * 255).astype(np.uint8)[..., None], 3, axis=2)
    rgb[find_boundaries(np.asarray(truth) > 0, mode='inner')] = (0, 255, 0)
    rgb[find_boundaries(np.asarray(prob) > threshold, mode='inner')] = (255, 0, 0)
    return rgb
