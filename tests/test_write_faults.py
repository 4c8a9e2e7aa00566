"""Every write path under faults (issue 45, observation 6): a short train + export +
predict + evaluate is run once to count its writes, then once per write N with the Nth
write failing (ENOSPC, EACCES, EROFS in turn, as the disk would fail it). Each time: one
line naming the file and the cause, a non-zero exit, no temporary file anywhere, and
what was there before intact and loadable. Like SQLite's I/O-error tests, the list of
writes is taken from the run itself, so a new write path is covered as soon as it exists.

Plus the same failures for real where this machine allows it (a full or read-only
tmpfs for root, chmod for other users), and the run-start lock on a full disk.
"""
import errno
import os
import shutil
import subprocess

import cv2
import numpy as np
import pytest

from gluon_unet.checkpoint import list_checkpoints, load_checkpoint
from gluon_unet.cli import evaluate_main, export_main, predict_main, train_main
from gluon_unet.data.synthetic import synthetic_nuclei
from gluon_unet.inference.batched import load_exported
from gluon_unet.utils import WriteFaults

from conftest import run_cli
from hang import HANG_SECONDS

CAUSES = {errno.ENOSPC: 'no space left on device (ENOSPC)', errno.EACCES: 'permission denied (EACCES)',
          errno.EROFS: 'read-only file system (EROFS)'}
CODES = list(CAUSES)


def _paired_data(folder, count=6, size=32):
    """``count`` image/mask pairs (paired layout: name.png + name_mask.png)."""
    os.makedirs(folder)
    images, masks, _ = synthetic_nuclei(count, size=size, channels=1, seed=3)
    for i in range(count):
        cv2.imwrite(os.path.join(folder, 'n%d.png' % i), images[i])
        cv2.imwrite(os.path.join(folder, 'n%d_mask.png' % i), (masks[i] > 0).astype(np.uint8) * 255)
    return folder


class Pipeline:
    """The commands a user runs, in order, each writing into its own folder under ``root``."""

    def __init__(self, root, data):
        self.root, self.data = str(root), data
        self.run, self.cache = os.path.join(self.root, 'run'), os.path.join(self.root, 'cache')
        self.model, self.pred = os.path.join(self.root, 'model'), os.path.join(self.root, 'pred')
        self.csv = os.path.join(self.root, 'scores.csv')

    def stages(self):
        return [
            ('train', train_main, ['--data', self.data, '--cache-dir', self.cache, '--output', self.run,
                                   '--width', '4', '--depth', '2', '--size', '32', '--epochs', '2',
                                   '--batch-size', '4', '--val-split', '0.34', '--workers', '0',
                                   '--no-progress', '--patience', '0', '--no-hybridize']),
            ('export', export_main, [self.run, '--output', self.model]),
            ('predict', predict_main, ['--model', self.model, '--input', self.data, '--output', self.pred,
                                       '--rle', os.path.join(self.pred, 'submission.csv'), '--no-progress']),
            ('evaluate', evaluate_main, ['--pred', self.pred, '--truth', self.pred, '--csv', self.csv]),
        ]


def _run_pipeline(pipe, capsys, caplog, faults=None, start=0):
    """Run the stages from ``start``; returns ``(stage, exit code, stderr, warnings)``
    of the first that fails (or of the last), with ``faults`` active; ``warnings``: the
    lines logged at WARNING (on stderr in a terminal; pytest captures the log)."""
    warned = []
    for name, main, argv in pipe.stages()[start:]:
        capsys.readouterr()
        caplog.clear()
        with faults or WriteFaults():
            code = run_cli(main, argv)
        err = capsys.readouterr().err
        warned += [r.getMessage() for r in caplog.records if r.levelname == 'WARNING']
        if code != 0:
            break
    return name, code, err, warned


def _temporary_files(root):
    return [os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files if n.startswith('.tmp')]


def _check_intact(pipe):
    """Everything that exists was written whole: checkpoints and exports load (their
    digests are checked), the cache entry is intact."""
    folder = os.path.join(pipe.run, 'checkpoints')
    for path in (list_checkpoints(folder) if os.path.isdir(folder) else []) + \
            [p for p in [os.path.join(folder, 'best.ckpt')] if os.path.exists(p)]:
        load_checkpoint(path)
    for export in (os.path.join(pipe.run, 'export'), pipe.model):
        if os.path.exists(os.path.join(export, 'model.json')):
            load_exported(export)


@pytest.fixture(scope='module')
def good(tmp_path_factory):
    """One fault-free run of the pipeline: ``(data folder, Pipeline)``."""
    root = tmp_path_factory.mktemp('good')
    data = _paired_data(str(root / 'data'))
    pipe = Pipeline(root / 'p', data)
    for name, main, argv in pipe.stages():
        assert run_cli(main, argv) == 0, name
    return data, pipe


@pytest.fixture(scope='module')
def counted(tmp_path_factory):
    """One fault-free run with its writes counted: its writes in order (stage, path), and
    its folders to start the later stages from."""
    root = tmp_path_factory.mktemp('counted')
    data = _paired_data(str(root / 'data'))
    pipe = Pipeline(root / 'p', data)
    writes = []
    for name, main, argv in pipe.stages():
        with WriteFaults() as faults:
            assert run_cli(main, argv) == 0, name
        writes += [(name, p) for p in faults.paths]
    return data, pipe, writes


def _kind(path):
    """The write path a file belongs to, for the tally in the report."""
    name = os.path.basename(path)
    if name.endswith('.ckpt'):
        return 'checkpoint ' + ('best.ckpt' if name == 'best.ckpt' else 'epochN.ckpt')
    if '/cache/' in path:
        return 'cache ' + name
    if name.endswith('.png') and '/pred/' in path:
        return 'prediction ' + name.split('_')[-1]
    return name


def test_the_pipeline_passes_every_write_path(counted):
    _, _, writes = counted
    kinds = {_kind(p) for _, p in writes}
    # Every kind of file the package writes is in the count (a new one joins by itself).
    for kind in ('cache images.bin', 'cache masks.bin', 'cache instances.bin', 'cache meta.json', '.lock',
                 'train.log', 'config.json', 'checkpoint epochN.ckpt', 'checkpoint best.ckpt', 'metrics.csv',
                 'curves.png', 'model-0000.params', 'model.json', 'prediction mask.png',
                 'prediction labels.png', 'submission.csv', 'scores.csv'):
        assert kind in kinds, (kind, sorted(kinds))


def test_every_write_failing_is_one_line_and_loses_nothing(counted, tmp_path, capsys, caplog):
    data, good, writes = counted
    stage_index = {name: i for i, (name, _, _) in enumerate(good.stages())}
    survived = {}
    for n, (stage, path) in enumerate(writes, 1):
        # Where this write's stage begins, start from a copy of the good run's folders:
        # a fault in predict does not need training again.
        pipe = Pipeline(tmp_path / ('n%d' % n), data)
        os.makedirs(pipe.root)
        start = stage_index[stage]
        if start > 0:
            shutil.copytree(good.run, pipe.run)
            if start > 1:
                shutil.copytree(good.model, pipe.model)
            if start > 2:
                shutil.copytree(good.pred, pipe.pred)
        # Faults count from the stage's start: the Nth write overall is this stage's kth.
        k = n - sum(1 for s, _ in writes if stage_index[s] < start)
        code = CODES[n % 3]
        failed, exit_code, err, warned = _run_pipeline(pipe, capsys, caplog, WriteFaults(k, code), start)
        expected = path.replace(good.root, pipe.root)
        lines = [line for line in err.splitlines() if line.strip()]
        where = 'write %d (%s, %s): %s' % (n, stage, expected, err[-2000:])
        assert 'Traceback' not in err, where
        assert not _temporary_files(pipe.root), (where, _temporary_files(pipe.root))
        _check_intact(pipe)
        if '/cache/' in expected:
            # The cache is optional: a full cache disk costs speed, not the run.
            assert exit_code == 0 and failed == 'evaluate', where
            warned = [line for line in warned if 'without a cache' in line]
            assert len(warned) == 1 and expected in warned[0] and CAUSES[code] in warned[0], (where, warned)
        elif expected.endswith('train.log') and stage == 'train':
            assert exit_code == 1 and failed == 'train', where
            assert len(lines) == 1 and expected in lines[0] and CAUSES[code] in lines[0], where
        else:
            assert failed == stage and exit_code != 0, where
            errors = [line for line in lines if line.startswith('error:')]
            # Per-image failures name the file within --output.
            named = expected if '/pred/' not in expected or expected.endswith('.csv') else os.path.basename(expected)
            assert len(errors) == 1 and named in errors[0] and CAUSES[code] in errors[0], where
            if stage == 'train' and '/checkpoints/' in expected or expected.endswith(('metrics.csv', 'curves.png')):
                # The one line names the last good checkpoint, which loads.
                found = list_checkpoints(os.path.join(pipe.run, 'checkpoints'))
                if found:
                    assert 'last good checkpoint %s is intact' % found[-1] in errors[0], where
                    assert '--resume auto' in errors[0], where
                else:
                    assert 'no checkpoint had been written yet' in errors[0], where
        survived.setdefault(_kind(path), []).append(errno.errorcode[code])
    print('\nwrite paths and the injected faults each survived:')
    for kind, codes in sorted(survived.items()):
        print('  %-28s %d (%s)' % (kind, len(codes), ', '.join(codes)))


def test_the_demo_writes_its_inputs_through_the_same_place(tmp_path, capsys):
    # Without --data, bin/train ends by writing demo_inputs/ and predicting them.
    argv = ['--output', str(tmp_path / 'demo'), '--width', '4', '--depth', '2', '--size', '32', '--epochs', '1',
            '--batch-size', '8', '--synthetic-count', '16', '--workers', '0', '--no-progress', '--no-hybridize']
    with WriteFaults() as faults:
        assert run_cli(train_main, argv) == 0
    demo = [n for n, p in enumerate(faults.paths, 1) if '/demo_inputs/' in p]
    assert demo, faults.paths
    shutil.rmtree(tmp_path / 'demo')
    capsys.readouterr()
    with WriteFaults(demo[0], errno.ENOSPC):
        assert run_cli(train_main, argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'demo00.png' in err and CAUSES[errno.ENOSPC] in err, err
    assert 'Traceback' not in err and not _temporary_files(str(tmp_path))
    load_exported(str(tmp_path / 'demo'))  # the model itself was exported whole


def test_the_fault_variable_fails_the_nth_write_of_a_child_process(tmp_path):
    # GLUON_UNET_FAIL_WRITE: the same injection for a command run as its own process.
    masks = tmp_path / 'masks'  # read as --pred and --truth; the CSV goes beside it, not into it
    masks.mkdir()
    cmd = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'bin', 'evaluate'),
           '--pred', str(masks), '--truth', str(masks), '--csv', str(tmp_path / 's.csv')]
    cv2.imwrite(str(masks / 'a.png'), np.full((8, 8), 255, np.uint8))
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, GLUON_UNET_FAIL_WRITE='1:EROFS'),
                          timeout=HANG_SECONDS)
    assert done.returncode == 1 and done.stderr.strip() == 'error: cannot write %s: %s' % (
        tmp_path / 's.csv', CAUSES[errno.EROFS]), done.stderr
    assert sorted(os.listdir(tmp_path)) == ['masks'] and sorted(os.listdir(masks)) == ['a.png']


# -- the same failures for real, where this machine lets a test make them ------------------------

def _mount(*args):
    return subprocess.run(['mount'] + list(args), capture_output=True, timeout=HANG_SECONDS).returncode == 0


def _fill(path):
    """Write zeros to ``path`` until its file system is full."""
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b'\0' * 1024)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


@pytest.fixture
def tmpfs(tmp_path):
    """``make(size)`` -> a fresh folder on a tmpfs of ``size`` (root only: skips elsewhere)."""
    mounted = []

    def make(size='4m', name='fs'):
        folder = tmp_path / name
        folder.mkdir()
        if os.geteuid() != 0 or not _mount('-t', 'tmpfs', '-o', 'size=%s' % size, 'tmpfs', str(folder)):
            pytest.skip('needs root and mount to make a small file system')
        mounted.append(str(folder))
        return folder
    yield make
    for folder in reversed(mounted):
        subprocess.run(['umount', '-l', folder], capture_output=True, timeout=HANG_SECONDS)


@pytest.fixture
def read_only():
    """``freeze(folder)``: make ``folder`` unwritable from now on - a read-only bind mount
    of it for root (EROFS), write permission taken away for other users (EACCES)."""
    undo = []

    def freeze(folder):
        folder = str(folder)
        if os.geteuid() == 0:
            if not (_mount('--bind', folder, folder) and _mount('-o', 'remount,bind,ro', folder)):
                pytest.skip('needs mount to make a folder read-only for root')
            undo.append(lambda: subprocess.run(['umount', '-l', folder], capture_output=True, timeout=HANG_SECONDS))
            return errno.EROFS
        for d, _, _ in os.walk(folder):
            os.chmod(d, 0o555)
            undo.append(lambda d=d: os.chmod(d, 0o755))
        return errno.EACCES
    yield freeze
    for step in reversed(undo):
        step()


def test_the_run_folder_turning_read_only_mid_run_is_one_line_naming_the_last_good_checkpoint(
        tiny, tmp_path, read_only):
    from gluon_unet.training.loop import fit
    from gluon_unet.errors import WriteError
    cfg = tiny(epochs=3, output=str(tmp_path / 'run'))
    causes = []
    with pytest.raises(WriteError) as info:
        fit(cfg, verbose=False, callbacks=[lambda r: causes.append(read_only(cfg.output)) if r['epoch'] == 1
                                           else None])
    message = str(info.value)
    last = os.path.join(cfg.output, 'checkpoints', 'epoch0001.ckpt')
    assert message.startswith('cannot write %s' % os.path.join(cfg.output, 'checkpoints', 'epoch0002.ckpt'))
    assert CAUSES[causes[0]] in message and 'last good checkpoint %s is intact' % last in message
    assert '\n' not in message and info.value.exit_code == 1
    assert load_checkpoint(last)['epoch'] == 1 and not _temporary_files(cfg.output)


def test_a_disk_filling_up_during_a_checkpoint_is_one_line_naming_the_last_good_checkpoint(tiny, tmpfs):
    # MXNet writes checkpoints in C++: "FileStream.Write incomplete", no errno; the cause is
    # read off the file system.
    from gluon_unet.training.loop import fit
    from gluon_unet.errors import WriteError
    fs = tmpfs('4m')
    cfg = tiny(epochs=3, output=str(fs / 'run'), optimizer='adam')

    def fill_the_disk(row):
        if row['epoch'] == 1:
            _fill(fs / 'filler')
    with pytest.raises(WriteError) as info:
        fit(cfg, verbose=False, callbacks=[fill_the_disk])
    message = str(info.value)
    last = os.path.join(cfg.output, 'checkpoints', 'epoch0001.ckpt')
    assert 'cannot write %s/checkpoints/epoch0002.ckpt: no space left on device (ENOSPC)' % cfg.output in message
    assert 'last good checkpoint %s is intact' % last in message, message
    assert load_checkpoint(last)['epoch'] == 1 and not _temporary_files(cfg.output)


def test_a_full_disk_when_the_run_starts_is_one_line_and_leaves_no_lock(tmpfs, capsys):
    fs = tmpfs('64k')
    _fill(fs / 'filler')
    out = fs / 'run'
    code = run_cli(train_main, ['--output', str(out), '--width', '4', '--depth', '2', '--size', '32',
                                '--epochs', '1', '--synthetic-count', '8', '--workers', '0', '--no-progress'])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.splitlines() == [err], err
    assert err.startswith('error: cannot write %s: no space left on device (ENOSPC)' % (out / '.lock')), err
    assert not out.exists()


@pytest.mark.parametrize('command', ['predict --rle', 'predict --output', 'export --output', 'evaluate --csv'])
def test_an_output_in_an_unwritable_folder_is_one_line_before_any_work(good, tmp_path, read_only, capsys,
                                                                       command):
    data, good = good
    locked = tmp_path / 'locked'
    locked.mkdir()
    code = read_only(locked)
    target = str(locked / 'out')
    main, argv = {
        'predict --rle': (predict_main, ['--model', good.model, '--input', data, '--output', str(tmp_path / 'p'),
                                         '--rle', target + '.csv', '--no-progress']),
        'predict --output': (predict_main, ['--model', good.model, '--input', data, '--output', target,
                                            '--no-progress']),
        'export --output': (export_main, [good.run, '--output', target]),
        'evaluate --csv': (evaluate_main, ['--pred', good.pred, '--truth', good.pred, '--csv', target + '.csv']),
    }[command]
    capsys.readouterr()
    assert run_cli(main, argv) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.splitlines() == [err] and command.split()[1] in err and str(locked) in err, err
    assert CAUSES[code] in err and 'Traceback' not in err
    assert not captured.out and not os.path.exists(tmp_path / 'p')  # nothing was done first


def test_a_disk_full_during_an_export_is_one_line_and_keeps_nothing_half_written(good, tmpfs, capsys):
    # MXNet writes the symbol and the params in C++ ("FileStream.Write incomplete").
    _, good = good
    fs = tmpfs('256k')
    _fill(fs / 'filler')
    capsys.readouterr()
    assert run_cli(export_main, [good.run, '--output', str(fs / 'model')]) == 1
    err = _one_error(capsys)
    assert err.startswith('error: cannot write %s/model/model-' % fs) and CAUSES[errno.ENOSPC] in err, err
    assert sorted(os.listdir(fs)) == ['filler']


def _one_error(capsys):
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and 'Traceback' not in err, err
    return err


def test_train_log_lines_that_cannot_be_written_are_said_once_not_a_traceback_each(tmp_path, capfd):
    # logging's own handler prints "--- Logging error ---" and a traceback for every line.
    from gluon_unet.reporting import setup_logging
    log = setup_logging(str(tmp_path), verbose=False)
    handler = next(h for h in log.handlers if getattr(h, 'baseFilename', None))

    def full(text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    handler.stream.write = full
    try:
        for k in range(3):
            log.info('epoch %d', k)
    finally:
        setup_logging(None, verbose=False)
    err = capfd.readouterr().err.strip()
    assert err == 'warning: cannot write %s: %s; its lines are not saved until it can be written again' % (
        tmp_path / 'train.log', CAUSES[errno.ENOSPC]), err
