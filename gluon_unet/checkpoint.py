"""Resumable checkpoints: one file each, written atomically.

A checkpoint is a single ``mx.nd.save`` file holding the parameters (by structural
name, so a SyncBatchNorm model loads into a plain one), the trainer state (optimizer
moments, update counts and the LR scheduler's position, pickled by MXNet itself) and a
JSON record (config, epoch, step, best value, history). It is written to a temporary
file in the same folder and ``os.replace``-d into place, so a crash at any moment leaves
either the old checkpoint or the new one - never half of one.
"""
import glob
import json
import os
import re
import tempfile

import mxnet as mx
import numpy as np

from .errors import UserError
from .utils import atomic_path

_EPOCH_FILE = re.compile(r'epoch(\d+)(?:-step(\d+))?\.ckpt$')


def save_checkpoint(path, net, trainer, meta):
    """Write ``net`` parameters, ``trainer`` states and ``meta`` (JSON-able) to ``path``."""
    arrays = {'param:' + name: p._reduce() for name, p in net._collect_params_with_prefix().items()}
    if trainer is not None:
        arrays['trainer_states'] = _bytes_array(_trainer_state_bytes(trainer))
    arrays['meta'] = _bytes_array(json.dumps(meta).encode())
    with atomic_path(path) as tmp:
        mx.nd.save(tmp, arrays)


def load_checkpoint(path, net=None, trainer=None, ctx=None):
    """Read a checkpoint; load it into ``net`` / ``trainer`` when given.

    Returns
    -------
    meta : dict
        The JSON record (``config``, ``epoch``, ``step``, ...).
    """
    if not os.path.isfile(path):
        raise UserError('checkpoint %s does not exist' % path)
    try:
        arrays = mx.nd.load(path)
        meta = json.loads(arrays['meta'].asnumpy().tobytes().decode())
    except (mx.MXNetError, KeyError, ValueError) as exc:
        raise UserError('checkpoint %s is not a gluon_unet checkpoint or is damaged (%s)'
                        % (path, _last_line(exc))) from None
    if net is not None:
        params = net._collect_params_with_prefix()
        saved = {k[len('param:'):]: v for k, v in arrays.items() if k.startswith('param:')}
        missing, extra = set(params) - set(saved), set(saved) - set(params)
        if missing or extra:
            raise UserError('checkpoint %s does not fit this model (missing %s, unexpected %s): was it '
                            'trained with another --width/--depth/--channels?'
                            % (path, sorted(missing)[:3], sorted(extra)[:3]))
        for name, p in params.items():
            if p.shape != saved[name].shape:
                raise UserError('checkpoint %s: parameter %s has shape %s, the model wants %s'
                                % (path, name, saved[name].shape, p.shape))
            if p._data is None:
                p.initialize(ctx=ctx or [mx.cpu()])
            p.set_data(saved[name])
    if trainer is not None and 'trainer_states' in arrays:
        _load_trainer_state_bytes(trainer, arrays['trainer_states'].asnumpy().tobytes())
    return meta


class CheckpointSaver:
    """Keeps the last ``keep_last`` checkpoints and a copy of the best one.

    Parameters
    ----------
    folder : str
        ``<run>/checkpoints``.
    monitor : str
        Metric name in the per-epoch record, e.g. ``'val_iou'``.
    mode : {'max', 'min'}
    keep_last : int
        Recent epoch checkpoints to keep (the best is kept separately as ``best.ckpt``).
    """

    def __init__(self, folder, monitor='val_iou', mode='max', keep_last=2):
        self.folder, self.monitor, self.mode, self.keep_last = folder, monitor, mode, keep_last
        os.makedirs(folder, exist_ok=True)

    def is_better(self, value, best, min_delta=0.0):
        if value is None or not np.isfinite(value):
            return False
        if best is None:
            return True
        return bool(value > best + min_delta if self.mode == 'max' else value < best - min_delta)

    def save(self, net, trainer, meta, is_best, step_in_epoch=0):
        """Write the epoch checkpoint, update ``best.ckpt``, prune old ones; returns the path."""
        name = 'epoch%04d.ckpt' % meta['epoch']
        if step_in_epoch:
            name = 'epoch%04d-step%06d.ckpt' % (meta['epoch'], step_in_epoch)
        path = os.path.join(self.folder, name)
        save_checkpoint(path, net, trainer, meta)
        if is_best:
            # A hard link is an atomic, free copy; fall back to writing it again.
            tmp = os.path.join(self.folder, '.tmp-best.ckpt')
            try:
                if os.path.exists(tmp):
                    os.remove(tmp)
                os.link(path, tmp)
                os.replace(tmp, os.path.join(self.folder, 'best.ckpt'))
            except OSError:
                save_checkpoint(os.path.join(self.folder, 'best.ckpt'), net, trainer, meta)
        self._prune()
        return path

    def _prune(self):
        # At least the newest one survives: it is what --resume auto continues from.
        found = list_checkpoints(self.folder)
        for old in found[:max(0, len(found) - max(1, self.keep_last))]:
            os.remove(old)


def list_checkpoints(folder):
    """Epoch checkpoints in ``folder``, oldest first (``best.ckpt`` excluded)."""
    found = []
    for path in glob.glob(os.path.join(folder, 'epoch*.ckpt')):
        m = _EPOCH_FILE.search(os.path.basename(path))
        if m:
            found.append(((int(m.group(1)), int(m.group(2) or 0)), path))
    return [p for _, p in sorted(found)]


def resolve_resume(resume, output):
    """``--resume auto`` -> latest checkpoint of the run (or None); a path is checked."""
    if resume is None:
        return None
    if resume == 'auto':
        found = list_checkpoints(os.path.join(output, 'checkpoints'))
        return found[-1] if found else None
    if os.path.isdir(resume):
        found = list_checkpoints(os.path.join(resume, 'checkpoints')) or list_checkpoints(resume)
        if not found:
            raise UserError('--resume %s: no checkpoint in that folder' % resume)
        return found[-1]
    if not os.path.isfile(resume):
        raise UserError('--resume %s: no such checkpoint file' % resume)
    return resume


def _last_line(exc):
    # MXNet errors begin with 'Traceback ...'; the cause is on the last line.
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return lines[-1].replace('MXNetError: ', '')[:120]


def _bytes_array(b):
    return mx.nd.array(np.frombuffer(b, dtype=np.uint8), dtype=np.uint8)


def _trainer_state_bytes(trainer):
    fd, tmp = tempfile.mkstemp(suffix='.states')
    os.close(fd)
    try:
        trainer.save_states(tmp)
        with open(tmp, 'rb') as f:
            return f.read()
    finally:
        os.remove(tmp)


def _load_trainer_state_bytes(trainer, data):
    fd, tmp = tempfile.mkstemp(suffix='.states')
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
        trainer.load_states(tmp)
    finally:
        os.remove(tmp)
