"""What a run leaves behind for people: ``train.log``, ``metrics.csv``, ``curves.png``."""
import csv
import logging
import os
import sys

from .utils import atomic_open, atomic_path

LOGGER_NAME = 'gluon_unet'


def setup_logging(run_dir=None, verbose=True):
    """Log to stderr and (when ``run_dir`` is given) append to ``run_dir/train.log``."""
    log = logging.getLogger(LOGGER_NAME)
    log.setLevel(logging.INFO)
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    fmt = logging.Formatter('%(asctime)s %(message)s', '%H:%M:%S')
    if verbose:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(fmt)
        log.addHandler(console)
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
        fh = logging.FileHandler(os.path.join(run_dir, 'train.log'))
        fh.setFormatter(fmt)
        log.addHandler(fh)
    log.propagate = False
    return log


def get_logger():
    return logging.getLogger(LOGGER_NAME)


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
