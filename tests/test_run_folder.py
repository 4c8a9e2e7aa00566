"""Run folders: a new run never writes into another run's folder; one process per folder;
resume refuses what it cannot continue exactly; bad --output/--config values are one line."""
import os
import subprocess
import sys

import numpy as np
import pytest

from gluon_unet.checkpoint import list_checkpoints
from gluon_unet.data import synthetic_dataset
from gluon_unet.training.loop import fit
from gluon_unet.errors import UserError
from gluon_unet.training.run_folder import claim_run_folder
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(*argv, cwd=None):
    cmd = [sys.executable, os.path.join(ROOT, 'bin', 'train'), '--width', '4', '--depth', '2', '--size', '32',
           '--synthetic-count', '24', '--batch-size', '8', '--workers', '0', '--no-progress',
           '--lr-schedule', 'constant'] + list(argv)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_SECONDS, cwd=cwd)


def _one_line(stderr):
    lines = [l for l in stderr.strip().splitlines() if l.strip() and 'runtime:' not in l]
    assert 'Traceback' not in stderr, stderr
    assert len(lines) == 1, stderr
    return lines[0]


def _snapshot(folder):
    out = {}
    for base, _, files in os.walk(folder):
        for name in files:
            p = os.path.join(base, name)
            with open(p, 'rb') as f:
                out[os.path.relpath(p, folder)] = f.read()
    return out


def test_a_new_run_into_a_folder_holding_a_run_is_refused_and_the_old_run_is_untouched(tmp_path):
    out = tmp_path / 'R'
    assert _train('--output', str(out), '--epochs', '3').returncode == 0
    before = _snapshot(out)
    done = _train('--output', str(out), '--epochs', '1')
    assert done.returncode == 2
    line = _one_line(done.stderr)
    assert '--output' in line and 'already holds a run' in line and '--resume auto' in line and '--overwrite' in line
    after = _snapshot(out)
    assert after == before
    with open(out / 'metrics.csv') as f:
        assert len(f.read().strip().splitlines()) == 4


def test_overwrite_starts_over_and_keeps_the_users_own_files(tmp_path):
    out = tmp_path / 'R'
    assert _train('--output', str(out), '--epochs', '3').returncode == 0
    (out / 'notes.txt').write_text('mine')
    done = _train('--output', str(out), '--epochs', '1', '--overwrite')
    assert done.returncode == 0, done.stderr
    assert (out / 'notes.txt').read_text() == 'mine'
    assert [os.path.basename(p) for p in list_checkpoints(str(out / 'checkpoints'))] == ['epoch0001.ckpt']
    with open(out / 'metrics.csv') as f:
        assert len(f.read().strip().splitlines()) == 2
    done = _train('--output', str(out), '--resume', 'auto', '--overwrite')
    assert done.returncode == 2 and '--overwrite' in _one_line(done.stderr)


def test_without_output_every_run_gets_a_new_folder_and_resume_auto_finds_the_newest(tiny, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    ds = synthetic_dataset(16, size=32, seed=0)
    first = fit(tiny(output=None, epochs=1), train_ds=ds, verbose=False)
    second = fit(tiny(output=None, epochs=1), train_ds=ds, verbose=False)
    assert first.output == os.path.join('runs', 'unet') and second.output == os.path.join('runs', 'unet-2')
    assert os.path.isfile('runs/unet/checkpoints/epoch0001.ckpt')
    # The demo (no data given) has its own name; --resume auto continues the newest demo run.
    demo = fit(tiny(output=None, epochs=1, lr_schedule='constant'), verbose=False)
    assert demo.output == os.path.join('runs', 'demo')
    resumed = fit(tiny(output=None, epochs=2, lr_schedule='constant', resume='auto'), verbose=False)
    assert resumed.output == os.path.join('runs', 'demo') and [r['epoch'] for r in resumed] == [1, 2]
    # A checkpoint path resumes into the run it belongs to.
    again = fit(tiny(output=None, epochs=3, lr_schedule='constant',
                     resume='runs/demo/checkpoints/epoch0002.ckpt'), verbose=False)
    assert again.output == os.path.join('runs', 'demo') and len(again) == 3
    assert sorted(os.listdir('runs')) == ['demo', 'unet', 'unet-2']


_HOLDER = '''
import sys, time
sys.path.insert(0, %r)
from gluon_unet.training.run_folder import claim_run_folder
folder = claim_run_folder(sys.argv[1], 'unused')
print('locked', flush=True)
time.sleep(120)
'''


def test_a_second_process_on_a_folder_in_use_stops_with_one_line_naming_the_holder(tmp_path):
    out = tmp_path / 'R'
    holder = subprocess.Popen([sys.executable, '-c', _HOLDER % ROOT, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'locked'
        done = _train('--output', str(out), '--epochs', '1')
        assert done.returncode == 2
        line = _one_line(done.stderr)
        assert 'in use by another run' in line and 'pid %d' % holder.pid in line
        assert not (out / 'config.json').exists()
    finally:
        holder.kill()  # SIGKILL: the OS drops the lock with the process
        holder.wait(timeout=30)
    # ... so the folder is free again, for a new run as for a resume.
    with claim_run_folder(str(out), 'unused') as folder:
        assert folder.path == str(out)


def test_two_runs_started_at_once_on_one_folder_do_not_interleave(tmp_path):
    out = tmp_path / 'R'
    cmd = lambda: subprocess.Popen(  # noqa: E731
        [sys.executable, os.path.join(ROOT, 'bin', 'train'), '--width', '4', '--depth', '2', '--size', '32',
         '--synthetic-count', '24', '--batch-size', '8', '--workers', '0', '--no-progress', '--epochs', '2',
         '--output', str(out)], stderr=subprocess.PIPE, text=True)
    a, b = cmd(), cmd()
    results = sorted([(p.wait(timeout=HANG_SECONDS), p.stderr.read()) for p in (a, b)])
    assert [rc for rc, _ in results] == [0, 2], results
    assert 'in use by another run' in results[1][1] or 'already holds a run' in results[1][1]
    with open(out / 'metrics.csv') as f:
        assert len(f.read().strip().splitlines()) == 3


def _bad_output_cases(tmp_path):
    a_file = tmp_path / 'a_file'
    a_file.write_text('x')
    return {'is a file': str(a_file), 'under a file': str(a_file / 'run'), 'unwritable': '/sys/gluon_unet_run'}


@pytest.mark.parametrize('case', ['is a file', 'under a file', 'unwritable'])
def test_bad_output_is_one_line_exit_2_and_writes_nothing(tmp_path, case):
    target = _bad_output_cases(tmp_path)[case]
    done = _train('--output', target, '--epochs', '1')
    assert done.returncode == 2
    assert '--output' in _one_line(done.stderr)
    assert not os.path.isdir(target)


@pytest.mark.parametrize('content, expected', [
    ('[1, 2]', 'JSON object'),
    ('{"model": 5}', '"model" must be an object'),
    ('{"lr": "0.1"}', 'lr must be a number'),
    ('{"gpus": 0}', 'gpus must be a string'),
    ('{"model": {"width": 2.5}}', 'width must be an integer'),
    ('{"augment": "yes"}', 'augment must be true or false'),
    ('{"lr": 0.1', 'not valid JSON'),
])
def test_bad_config_file_is_one_line_exit_2_and_writes_nothing(tmp_path, content, expected):
    config = tmp_path / 'cfg.json'
    config.write_text(content)
    out = tmp_path / 'run'
    done = _train('--config', str(config), '--output', str(out), '--epochs', '1')
    assert done.returncode == 2
    line = _one_line(done.stderr)
    assert expected in line and str(config) in line
    assert not out.exists()


def test_resume_refuses_a_changed_batch_size_or_data_and_follows_a_changed_device_count(tiny, tmp_path):
    ds = synthetic_dataset(20, size=32, seed=0)
    common = dict(epochs=3, lr_schedule='constant', batch_size=6, optimizer='adam', lr=3e-3)
    unbroken = fit(tiny(output=str(tmp_path / 'a'), cpus=2, **common), train_ds=ds, verbose=False)
    out = str(tmp_path / 'b')
    fit(tiny(output=out, cpus=2, **common), train_ds=ds, verbose=False, callbacks=[lambda r: r['epoch'] == 1])
    with pytest.raises(UserError, match=r'--batch-size 6 \(now 4\)'):
        fit(tiny(output=out, cpus=2, resume='auto', **dict(common, batch_size=4)), train_ds=ds, verbose=False)
    with pytest.raises(UserError, match='the data changed'):
        fit(tiny(output=out, cpus=2, resume='auto', **common), train_ds=synthetic_dataset(24, size=32, seed=0),
            verbose=False)
    # One device instead of two: the same mean gradient over the same global batch.
    resumed = fit(tiny(output=out, cpus=1, resume='auto', **common), train_ds=ds, verbose=False)
    assert [r['epoch'] for r in resumed] == [1, 2, 3]
    assert [r['train_loss'] for r in resumed] == pytest.approx([r['train_loss'] for r in unbroken], rel=1e-4)


def test_resume_of_another_runs_checkpoint_into_a_folder_holding_a_run_is_refused(tiny, tmp_path):
    ds = synthetic_dataset(16, size=32, seed=0)
    fit(tiny(output=str(tmp_path / 'a'), epochs=1), train_ds=ds, verbose=False)
    fit(tiny(output=str(tmp_path / 'b'), epochs=1), train_ds=ds, verbose=False)
    with pytest.raises(UserError, match='not from the run'):
        fit(tiny(output=str(tmp_path / 'b'), epochs=2, resume=str(tmp_path / 'a' / 'checkpoints' / 'epoch0001.ckpt')),
            train_ds=ds, verbose=False)


def test_resume_refuses_data_whose_pixels_changed(tiny, tmp_path):
    ds = synthetic_dataset(16, size=32, seed=0)
    common = dict(epochs=2, lr_schedule='constant', output=str(tmp_path / 'r'))
    fit(tiny(**common), train_ds=ds, verbose=False, callbacks=[lambda r: r['epoch'] == 1])
    changed = synthetic_dataset(16, size=32, seed=0)
    changed.images = np.array(changed.images)
    changed.images[3] = 255 - changed.images[3]  # same names and count, other pixels
    with pytest.raises(UserError, match='the data changed'):
        fit(tiny(resume='auto', **common), train_ds=changed, verbose=False)
    assert len(fit(tiny(resume='auto', **common), train_ds=ds, verbose=False)) == 2


def test_bad_input_found_after_the_folder_was_claimed_leaves_no_folder_behind(tmp_path):
    # Without --output the run claims a new runs/demo before --resume is checked; the
    # failure must remove it, and the runs/ made for it.
    done = _train('--epochs', '1', '--resume', 'nosuch.ckpt', cwd=str(tmp_path))
    assert done.returncode == 2 and '--resume nosuch.ckpt' in _one_line(done.stderr)
    assert os.listdir(str(tmp_path)) == []
    (tmp_path / 'runs').mkdir()
    (tmp_path / 'runs' / 'mine.txt').write_text('x')
    done = _train('--epochs', '1', '--resume', 'nosuch.ckpt', cwd=str(tmp_path))
    assert done.returncode == 2 and os.listdir(str(tmp_path / 'runs')) == ['mine.txt']
