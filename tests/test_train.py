"""End-to-end training: it learns, it resumes exactly, it stops cleanly, bad input writes nothing."""
import json
import os
import signal
import subprocess
import sys
import time

import mxnet as mx
import numpy as np
import pytest

from gluon_unet.checkpoint import list_checkpoints, load_checkpoint
from gluon_unet.data import synthetic_dataset
from gluon_unet.training.loop import fit
from gluon_unet.training.step import Diverged
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_data_training_raises_validation_iou(tiny):
    cfg = tiny(width=8, depth=3, size=64, synthetic_count=160, epochs=16, batch_size=16, lr=3e-3,
               loss='bce_dice', cpus=2, batch_norm=True)
    history = fit(cfg, verbose=False)
    ious = [r['val_iou'] for r in history]
    assert len(history) == 16
    assert ious[0] < 0.5 and max(ious) > 0.7, ious
    assert all(np.isfinite(r['train_loss']) for r in history)
    assert history[-1]['train_loss'] < history[0]['train_loss'] / 2
    out = cfg.output
    for name in ('config.json', 'metrics.csv', 'train.log', 'curves.png', 'checkpoints/best.ckpt',
                 'export/model-symbol.json', 'export/model-0000.params', 'export/model.json'):
        assert os.path.isfile(os.path.join(out, name)), name
    with open(os.path.join(out, 'metrics.csv')) as f:
        assert len(f.read().strip().splitlines()) == 17
    best = load_checkpoint(os.path.join(out, 'checkpoints', 'best.ckpt'))
    assert best['epoch'] == int(np.argmax(ious)) + 1
    assert best['config']['model']['width'] == 8  # the checkpoint can rebuild its model
    assert len(list_checkpoints(os.path.join(out, 'checkpoints'))) == cfg.keep_last


def _params(path):
    arrays = mx.nd.load(path)
    return {k: v.asnumpy() for k, v in arrays.items() if k.startswith('param:')}


def test_resume_matches_an_unbroken_run(tiny, tmp_path):
    common = dict(epochs=4, cpus=2, optimizer='adam', lr_schedule='cosine', warmup_epochs=1,
                  augment=True, batch_norm=True, synthetic_count=20, batch_size=6)
    fit(tiny(output=str(tmp_path / 'a'), **common), verbose=False)
    # Stop the same 4-epoch run after epoch 2 (its LR schedule spans 4 epochs).
    fit(tiny(output=str(tmp_path / 'b'), **common), verbose=False, callbacks=[lambda r: r['epoch'] == 2])
    assert list_checkpoints(str(tmp_path / 'b' / 'checkpoints'))[-1].endswith('epoch0002.ckpt')
    history = fit(tiny(output=str(tmp_path / 'b'), resume='auto', **common), verbose=False)
    assert [r['epoch'] for r in history] == [1, 2, 3, 4]
    a = _params(str(tmp_path / 'a' / 'checkpoints' / 'epoch0004.ckpt'))
    b = _params(str(tmp_path / 'b' / 'checkpoints' / 'epoch0004.ckpt'))
    diff = max(np.abs(a[k] - b[k]).max() for k in a if 'running' not in k)
    assert diff <= 1e-5, diff
    # The schedule resumed at the right position: same final learning rate.
    assert history[-1]['lr'] == pytest.approx(
        load_checkpoint(str(tmp_path / 'a' / 'checkpoints' / 'epoch0004.ckpt'))['history'][-1]['lr'])


def test_nan_loss_stops_with_a_clear_message_and_keeps_good_checkpoints(tiny):
    ds = synthetic_dataset(16, size=32, seed=0)
    poisoned = ds.subset(range(16))
    # NaN targets make the loss NaN (NaN images would not: ReLU maps NaN to 0).
    poisoned.masks = np.full(np.asarray(ds.masks).shape, np.nan, np.float32)
    cfg = tiny(epochs=2, val_split=0.0)
    with pytest.raises(Diverged, match=r'loss is nan at epoch 1, step \d'):
        fit(cfg, train_ds=poisoned, verbose=False)
    assert not list_checkpoints(os.path.join(cfg.output, 'checkpoints'))


def _train_cmd(out, *extra):
    return [sys.executable, os.path.join(ROOT, 'bin', 'train'), '--output', str(out), '--width', '4',
            '--depth', '2', '--size', '32', '--synthetic-count', '64', '--batch-size', '4', '--workers', '0',
            '--no-progress'] + list(extra)


@pytest.mark.parametrize('argv, flag', [(['--batch-size', '0'], '--batch-size'),
                                        (['--gpus', '0'], '--gpus'),
                                        (['--optimizer', 'foo'], '--optimizer'),
                                        (['--data', '/nonexistent/x'], '--data'),
                                        (['--size', '30'], '--size'),
                                        (['--bogus-flag'], '--bogus-flag')])
def test_cli_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, argv, flag):
    out = tmp_path / 'run'
    done = subprocess.run(_train_cmd(out, *argv), capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 2
    lines = [l for l in done.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and flag in lines[0] and 'Traceback' not in done.stderr, done.stderr
    assert not out.exists()


def test_sigterm_to_the_whole_process_group_with_loader_workers_exits_after_its_checkpoint(tmp_path):
    # kill -- -PGID, Slurm's scancel and pkill -f signal the loader's worker processes
    # too. A worker killed while waiting for a task holds the pool's queue lock, and the
    # main process used to hang forever at exit after saving its checkpoint.
    out = tmp_path / 'run'
    cmd = _train_cmd(out, '--epochs', '40')
    cmd[cmd.index('--workers') + 1] = '2'
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = out / 'train.log'
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and 'epoch 1 |' in log.read_text()):
        time.sleep(0.2)
    workers = subprocess.run(['pgrep', '-g', str(proc.pid)], capture_output=True, text=True,
                             timeout=HANG_SECONDS).stdout.split()
    assert len(workers) >= 3  # the main process and its two loader workers
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError('still running 60 s after SIGTERM to its process group')
    assert proc.returncode == 143 and 'SIGTERM' in err and 'Traceback' not in err, err
    assert load_checkpoint(list_checkpoints(str(out / 'checkpoints'))[-1])['epoch'] >= 1
    time.sleep(1)
    assert not subprocess.run(['pgrep', '-g', str(proc.pid)], capture_output=True, text=True,
                              timeout=HANG_SECONDS).stdout.split()


def test_sigterm_saves_a_resumable_checkpoint_then_resume_finishes(tmp_path):
    out = tmp_path / 'run'
    # A constant LR: resume may then lengthen the run (other schedules are shaped by --epochs).
    proc = subprocess.Popen(_train_cmd(out, '--epochs', '40', '--lr-schedule', 'constant'),
                            stderr=subprocess.PIPE, text=True)
    log = out / 'train.log'
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and 'epoch 1 |' in log.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert 'SIGTERM' in err and '--resume' in err and 'Traceback' not in err
    saved = list_checkpoints(str(out / 'checkpoints'))
    meta = load_checkpoint(saved[-1])
    assert meta['epoch'] >= 1
    done = subprocess.run(_train_cmd(out, '--epochs', str(meta['epoch'] + 2), '--lr-schedule', 'constant',
                                     '--resume', 'auto'),
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    assert 'resumed from' in done.stderr
    with open(out / 'metrics.csv') as f:
        epochs = [int(line.split(',')[0]) for line in f.read().strip().splitlines()[1:]]
    assert epochs == list(range(1, meta['epoch'] + 3))
    assert json.load(open(out / 'export' / 'model.json'))['in_channels'] == 1


def test_without_validation_the_log_says_what_picks_the_checkpoint(tiny):
    cfg = tiny(val_split=0.0, epochs=1, monitor='val_dsb')
    history = fit(cfg, verbose=False)
    assert 'val_iou' not in history[0]
    with open(os.path.join(cfg.output, 'train.log')) as f:
        text = f.read()
    assert 'no validation images' in text and 'lowest train_loss, not val_dsb' in text
    assert 'default post-processing' in text
    assert load_checkpoint(os.path.join(cfg.output, 'checkpoints', 'best.ckpt'))['epoch'] == 1
