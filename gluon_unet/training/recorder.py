"""What a training run keeps: its progress (`RunState`), its checkpoints (`CheckpointSaver`:
the best and the last few) and its folder (`RunRecorder`).

The recorder writes everything a run leaves behind - ``config.json``, ``train.log``,
checkpoints, ``metrics.csv``, ``curves.png``, the export - and logs the epoch lines and
the summary. On the workers of a multi-machine job other than rank 0 it is built with
``enabled=False``: it keeps score and logs to the console, and writes nothing, so the
training loop calls it the same way everywhere.
"""
import csv
import errno
import os
from dataclasses import dataclass, field

import numpy as np

from .. import models
from ..checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from ..errors import WriteError
from ..inference.export import export_block, export_checkpoint, export_in_subprocess
from ..inference.sidecar import update_sidecar
from ..reporting import setup_logging
from ..utils import atomic_open, atomic_path, write_errors, write_point
from .tblog import TensorBoardLog


@dataclass
class RunState:
    """Where a run is: what a checkpoint must hold, beyond the weights, the optimizer and
    the best-so-far bookkeeping (:class:`CheckpointSaver`), to
    continue it exactly."""
    epoch: int = 0               # last completed epoch
    step: int = 0                # optimizer updates so far
    step_in_epoch: int = 0       # batches done in an interrupted epoch
    history: list = field(default_factory=list)
    # For --time-budget: the wall seconds of each completed epoch, and of all epochs so
    # far including an interrupted one's part; a resumed run goes on counting.
    epoch_seconds: list = field(default_factory=list)
    train_seconds: float = 0.0
    # A fine-tune's --init model on the validation images before the first step (its
    # val_* metrics), what the best epoch is compared with; {} without --init or validation.
    init_scores: dict = field(default_factory=dict)

    def to_meta(self, cfg, data_id=None):
        """The checkpoint's JSON record (the saver adds the best value and epoch)."""
        # cwd: where the config's relative paths (--data, ...) were given, for bin/export
        # run from another folder.
        return {'config': cfg.to_dict(), 'data': data_id, 'cwd': os.getcwd(), 'epoch': self.epoch, 'step': self.step,
                'step_in_epoch': self.step_in_epoch, 'history': self.history, 'seed': cfg.seed,
                'metrics': self.history[-1] if self.history else {},
                'epoch_seconds': self.epoch_seconds, 'train_seconds': self.train_seconds,
                'init_scores': self.init_scores}

    @classmethod
    def from_meta(cls, meta):
        return cls(epoch=meta['epoch'], step=meta['step'], step_in_epoch=meta.get('step_in_epoch', 0),
                   history=meta.get('history', []), epoch_seconds=meta.get('epoch_seconds', []),
                   train_seconds=meta.get('train_seconds', 0.0), init_scores=meta.get('init_scores') or {})


class CheckpointSaver:
    """Keeps the last ``keep_last`` checkpoints and a copy of the best one, and knows
    which is best: the monitored value, its epoch and the epochs since it improved.

    Parameters
    ----------
    folder : str or None
        ``<run>/checkpoints``; None keeps score but writes nothing (the workers of a
        multi-machine job other than rank 0).
    monitor : str
        Metric name in the per-epoch record, e.g. ``'val_iou'``.
    mode : {'max', 'min'}
    keep_last : int
        Recent epoch checkpoints to keep (the best is kept separately as ``best.ckpt``).
    min_delta : float
        Smallest change that counts as an improvement.
    """

    def __init__(self, folder, monitor='val_iou', mode='max', keep_last=2, min_delta=0.0):
        self.folder, self.monitor, self.mode = folder, monitor, mode
        self.keep_last, self.min_delta = keep_last, min_delta
        self.best, self.best_epoch, self.bad_epochs = None, 0, 0
        if folder is not None:
            with write_errors(folder):
                os.makedirs(folder, exist_ok=True)

    def is_better(self, value):
        """Whether ``value`` beats the best so far by more than ``min_delta``."""
        if value is None or not np.isfinite(value):
            return False
        if self.best is None:
            return True
        if self.mode == 'max':
            return bool(value > self.best + self.min_delta)
        return bool(value < self.best - self.min_delta)

    def state(self):
        """The bookkeeping a checkpoint stores, so a resumed run knows its best."""
        return {'best': self.best, 'best_epoch': self.best_epoch, 'bad_epochs': self.bad_epochs}

    def restore(self, meta):
        """Take the bookkeeping back from a checkpoint's record."""
        self.best, self.best_epoch = meta.get('best'), meta.get('best_epoch', 0)
        self.bad_epochs = meta.get('bad_epochs', 0)

    def end_epoch(self, net, trainer, meta, value, average=None):
        """Score the epoch's ``value``, write its checkpoint (and ``best.ckpt`` when it is
        the best so far), prune old ones. Returns whether it was the best."""
        is_best = self.is_better(value)
        if is_best:
            self.best, self.best_epoch, self.bad_epochs = value, meta['epoch'], 0
        else:
            self.bad_epochs += 1
        self.save(net, trainer, meta, is_best, average=average)
        return is_best

    def save(self, net, trainer, meta, is_best=False, step_in_epoch=0, average=None):
        """Write a checkpoint (mid-epoch when ``step_in_epoch``); returns its path, or
        None when this saver writes nothing."""
        if self.folder is None:
            return None
        meta = dict(meta, **self.state())
        name = 'epoch%04d.ckpt' % meta['epoch']
        if step_in_epoch:
            name = 'epoch%04d-step%06d.ckpt' % (meta['epoch'], step_in_epoch)
        path = os.path.join(self.folder, name)
        save_checkpoint(path, net, trainer, meta, average)
        if is_best:
            # A hard link is an atomic, free copy; fall back to writing it again where the
            # file system has no hard links. Any other failure (full, read-only) is one.
            best = os.path.join(self.folder, 'best.ckpt')
            tmp = os.path.join(self.folder, '.tmp-best.ckpt')
            try:
                with write_errors(best):
                    try:
                        if os.path.lexists(tmp):
                            os.remove(tmp)
                        write_point(best)
                        os.link(path, tmp)
                        os.replace(tmp, best)
                    except OSError as exc:
                        if exc.errno not in _NO_HARD_LINKS:
                            raise
                        save_checkpoint(best, net, trainer, meta, average)
            finally:
                if os.path.lexists(tmp):
                    try:
                        os.remove(tmp)
                    except OSError:
                        pass
        self._prune()
        return path

    def _prune(self):
        # At least the newest one survives: it is what --resume auto continues from.
        found = list_checkpoints(self.folder)
        for old in found[:max(0, len(found) - max(1, self.keep_last))]:
            os.remove(old)


# What os.link raises where a file system cannot make hard links (FAT, some FUSE and
# network mounts): best.ckpt is then written as a second copy.
_NO_HARD_LINKS = {errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


class RunRecorder:
    """The run folder's writer and the run's log.

    Parameters
    ----------
    cfg : TrainConfig
        With ``output`` resolved.
    monitor : str
        The metric that picks the best checkpoint (``train_loss`` without validation).
    data_id : dict
        The data fingerprint stored in every checkpoint (see ``data.prepare.data_fingerprint``).
    enabled : bool
        False: write nothing (keep score, log to the console only).
    verbose : bool
        Log to stderr.
    user_net : HybridBlock, optional
        The network passed to ``fit``, exported from its best weights.
    """

    def __init__(self, cfg, monitor, data_id, enabled=True, verbose=True, user_net=None):
        self.cfg, self.monitor, self.data_id, self.enabled = cfg, monitor, data_id, enabled
        self.user_net = user_net
        self.saver = CheckpointSaver(os.path.join(cfg.output, 'checkpoints') if enabled else None, monitor,
                                     'min' if monitor.endswith('loss') else 'max', cfg.keep_last,
                                     cfg.min_delta)
        self.table = MetricsTable(os.path.join(cfg.output, 'metrics.csv'))
        self.log = setup_logging(cfg.output if enabled else None, verbose=verbose and enabled)
        self.tb = TensorBoardLog(os.path.join(cfg.output, 'tb')) if enabled and cfg.tensorboard else None

    def start(self):
        """Write ``config.json`` (the input was good: from here on the run leaves files)."""
        if self.enabled:
            with atomic_open(os.path.join(self.cfg.output, 'config.json')) as f:
                f.write(self.cfg.to_json())

    def step(self, global_step, loss=None, lr=None):
        """A training step's loss or learning rate (TensorBoard only)."""
        if self.tb is not None:
            self.tb.step(global_step, loss=loss, lr=lr)

    def end_epoch(self, net, trainer, state, row, ndev, samples=(), average=None):
        """Checkpoint, metrics table, curves and the epoch's log line; marks ``row['best']``.
        ``samples``: validation ``(image, truth, probability)`` for TensorBoard overlays;
        ``average``: the ``--ema`` weight average (the checkpoint's model)."""
        row['best'] = self.saver.end_epoch(net, trainer, state.to_meta(self.cfg, self.data_id),
                                           row.get(self.monitor), average)
        if self.enabled:
            self.table.write(state.history)
            self._plot(state.history)
        if self.tb is not None:
            self.tb.epoch(row, state.step, samples)
        self.log.info(epoch_line(row, self.monitor, ndev))

    def interrupted(self, net, trainer, state, average=None):
        """Save a mid-epoch checkpoint; returns its path (None when not writing)."""
        return self.saver.save(net, trainer, state.to_meta(self.cfg, self.data_id),
                               step_in_epoch=state.step_in_epoch, average=average)

    def should_stop_early(self):
        """``--patience`` epochs without improvement (0 = never)."""
        return bool(self.cfg.patience and self.saver.bad_epochs >= self.cfg.patience)

    def close(self):
        """Flush and close what stays open during a run (the TensorBoard writer)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    def best_checkpoint(self):
        """Path of ``best.ckpt`` (None when this recorder writes nothing)."""
        return None if self.saver.folder is None else os.path.join(self.saver.folder, 'best.ckpt')

    def finish(self, state, amp_dtype, postprocess=None):
        """Export the best checkpoint (with the tuned ``postprocess`` settings in its
        sidecar) and log the summary."""
        self.close()
        if not (self.enabled and state.history):
            return
        best_ckpt = self.best_checkpoint()
        out = os.path.join(self.cfg.output, 'export')
        # The searched settings go into the export as it is written, not after it.
        extra = {'postprocess': postprocess} if postprocess else None
        if self.user_net is not None:
            # Your own network cannot be rebuilt from the config: the best weights go
            # back into it, and it is exported as it is.
            meta = load_checkpoint(best_ckpt, net=self.user_net)
            prefix = export_block(self.user_net, self.cfg, out, meta, extra)
        elif amp_dtype:
            # An AMP run's process has AMP switched on for good (amp.init is
            # process-wide), so its float32 export is built in a fresh process.
            prefix = export_in_subprocess(best_ckpt, out)
            if postprocess:
                update_sidecar(out, {'postprocess': postprocess})
        else:
            prefix = export_checkpoint(best_ckpt, out, extra)
        self.log.info('exported %s-symbol.json / -0000.params', prefix)
        best = next((r for r in state.history if r['epoch'] == self.saver.best_epoch), state.history[-1])
        metrics = val_metrics_text(best)
        self.log.info('done: %d epochs; best %s at epoch %d (%s); run folder %s; model %s',
                      state.epoch, self.monitor, self.saver.best_epoch,
                      metrics or 'train_loss %.4f' % best['train_loss'], self.cfg.output, out)
        line = init_comparison(state.init_scores, best, self.monitor, self.saver.mode, self.cfg.init)
        if line:
            self.log.warning(line)

    def _plot(self, history):
        path = os.path.join(self.cfg.output, 'curves.png')
        try:
            plot_curves(history, path)
        except WriteError:  # the run folder cannot be written: the run stops (engine says what is kept)
            raise
        except Exception as exc:  # a plotting problem must never cost a training run
            self.log.info('could not draw %s: %s', path, exc)


def val_metrics_text(row):
    """``val_iou 0.8123, val_dice ..., val_dsb ..., val_loss ...``: those of ``row`` it has."""
    return ', '.join('%s %.4f' % (k, row[k]) for k in ('val_iou', 'val_dice', 'val_dsb', 'val_loss') if k in row)


def init_comparison(init_scores, best, monitor, mode, init):
    """The warning when a fine-tune's best epoch does not beat, on the validation images,
    the --init model it started from (``init_scores``, measured before the first step);
    None when it does, or when there is nothing to compare."""
    if monitor not in init_scores or monitor not in best:
        return None
    before, after = init_scores[monitor], best[monitor]
    if (after > before) if mode == 'max' else (after < before):
        return None
    label = models.split_reference(init)[0] if init else 'the --init model'
    return ('the fine-tune does not beat %s on the validation images (%s %.4f at its best epoch, %.4f before '
            'fine-tuning): keep %s, or fine-tune on more images like the ones you will segment'
            % (label, monitor, after, before, label))


def epoch_line(row, monitor, ndev):
    """The one log line of an epoch."""
    parts = ['epoch %d' % row['epoch'], 'loss %.4f' % row['train_loss']]
    for key in ('val_loss', 'val_iou', 'val_dice', 'val_dsb'):
        if key in row:
            parts.append('%s %.4f' % (key, row[key]))
    parts.append('lr %.2e' % row['lr'])
    parts.append('%.1f img/s' % row['images_per_s'])
    if ndev > 1:
        parts.append('per device [%s]' % ' '.join('%.1f' % row['dev%d_images_per_s' % i]
                                                  for i in range(ndev)))
    parts.append('%.1fs' % row['seconds'])
    if row.get('best'):
        parts.append('* best %s' % monitor)
    return ' | '.join(parts)


class MetricsTable:
    """``metrics.csv``, one row per epoch; rewritten atomically so it matches a resume."""

    def __init__(self, path):
        self.path = path

    def write(self, history):
        if not history:
            return
        columns = []
        for row in history:
            columns += [k for k in row if k not in columns and not isinstance(row[k], (list, dict))]
        with atomic_open(self.path, 'w', newline='') as f:
            writer = csv.DictWriter(f, columns, extrasaction='ignore')
            writer.writeheader()
            for row in history:
                writer.writerow({k: _fmt(row.get(k)) for k in columns})


def plot_curves(history, path):
    """Loss and validation metrics per epoch, redrawn after every epoch."""
    if not history:
        return
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    epochs = [r['epoch'] for r in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key in ('train_loss', 'val_loss'):
        if any(key in r for r in history):
            ax1.plot(epochs, [r.get(key, float('nan')) for r in history], marker='.', label=key)
    ax1.set_xlabel('epoch')
    ax1.set_ylabel('loss')
    ax1.set_yscale('log')
    ax1.legend()
    for key in ('val_iou', 'val_dice', 'val_dsb'):
        if any(key in r for r in history):
            ax2.plot(epochs, [r.get(key, float('nan')) for r in history], marker='.', label=key)
    ax2.set_xlabel('epoch')
    ax2.set_ylim(0, 1)
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend()
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=80, format='png')
    finally:
        plt.close(fig)


def _fmt(v):
    if isinstance(v, float):
        return '%.6g' % v
    return v
