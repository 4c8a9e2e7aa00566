"""A stop is recorded and leaves nothing behind (issue 70, rule 3), generated over the
commands and the signals: SIGHUP is a stop like SIGTERM, a prediction's manifest says what
stopped it and its lock goes, the leftovers of a write killed half way are removed by the
next command that owns the folder (and nothing else is), ``launch``'s children die with it
even on ``kill -9``, and a Python warning is one line for every command. The stop line of
``train`` in train.log: tests/test_stop_signals.py, which runs every stage over the signals."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from gluon_unet import cli
from gluon_unet.cli import export_main, predict_main, train_main
from gluon_unet.cli.common import reports_errors
from gluon_unet.errors import stop_signals
from gluon_unet.outputs import LOCK_NAME
from gluon_unet.paths import MANIFEST, leftovers

from conftest import ROOT, export_brightness_model, nuclei_png, pids_with, run_cli
from hang import HANG_SECONDS

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
TRAIN = ['--width', '4', '--depth', '2', '--size', '32', '--batch-size', '8', '--synthetic-count', '16',
         '--workers', '0', '--no-progress', '--patience', '0', '--epochs', '1', '--lr-schedule', 'constant',
         '--no-hybridize', '--no-tune-postprocess']


pytestmark = pytest.mark.usefixtures('guarded_signals')  # conftest: an unhandled stop fails the test


def test_sighup_is_a_stop_unless_the_process_ignores_it():
    assert stop_signals() == (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    assert stop_signals(signal.SIGTERM) == (signal.SIGTERM, signal.SIGHUP)
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup: asked to outlive the terminal
    try:
        assert signal.SIGHUP not in stop_signals()
    finally:
        signal.signal(signal.SIGHUP, old)


@pytest.fixture
def images(tmp_path):
    folder = tmp_path / 'images'
    folder.mkdir()
    for i in range(6):
        (folder / ('i%d.png' % i)).write_bytes(nuclei_png(i, 32))
    return str(folder)


@pytest.mark.parametrize('signum', SIGNALS, ids=lambda s: s.name)
def test_a_stopped_prediction_records_why_and_releases_its_lock(tmp_path, images, monkeypatch, capsys, signum):
    from gluon_unet.inference import predict
    model = export_brightness_model(str(tmp_path / 'export'))
    out = tmp_path / 'out'
    real, written = predict.write_image_outputs, []

    def write_then_stop(*args, **kwargs):
        result = real(*args, **kwargs)
        written.append(True)
        if len(written) == 2:
            os.kill(os.getpid(), signum)
        return result
    monkeypatch.setattr(predict, 'write_image_outputs', write_then_stop)
    argv = ['--model', model, '--input', images, '--output', str(out), '--no-progress', '--batch-size', '1']
    # Whatever handler the process had for the signal (here one that does nothing), the
    # command stops: bin/predict installs its own.
    previous = signal.signal(signum, lambda *args: None)
    try:
        assert run_cli(predict_main, argv) == 128 + signum
    finally:
        signal.signal(signum, previous)
    err = capsys.readouterr().err.strip()
    assert err == ('interrupted' if signum == signal.SIGINT else 'interrupted by %s' % signum.name), err
    with open(out / MANIFEST) as f:
        manifest = json.load(f)
    done = len([n for n in manifest['files'] if n.endswith('_mask.png')])
    assert manifest['complete'] is False and manifest['stopped'] == '%s after %d of 6 images' % (signum.name, done)
    assert not (out / LOCK_NAME).exists()  # released: the next command may lock it at once
    assert not [n for n in os.listdir(out) if n.startswith('.tmp')]


# -- leftovers ---------------------------------------------------------------------------------

#: What writes killed half way leave (utils.atomic_path, the best link, staged_export) ...
OURS = ['.tmp-a1b2c3d4.ckpt', '.tmp-best.ckpt', '.tmp-k9_x0q2z.png', '.tmp-zz00yy11.json', '.tmp-export-q1w2e3r4/']
#: ... and what only looks like it: the user's, which stays.
THEIRS = ['.tmp-notes.txt', '.tmp-export-mine/', '.tmp-export-a1b2c3d4/notes.txt', 'tmp-a1b2c3d4.ckpt',
          '.tmp-A1B2C3D4.png']


def _plant(folder, names):
    for name in names:
        path = os.path.join(folder, name.rstrip('/'))
        if name.endswith('/'):
            os.makedirs(path, exist_ok=True)
            if name.startswith('.tmp-export-q'):  # a staged export: export files and a temporary one
                for inside in ('model-symbol.json', 'model.json', '.tmp-abcdefgh.json'):
                    open(os.path.join(path, inside), 'w').close()
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, 'w') as f:
                f.write('x')


def _state(folder, names):
    return {n: os.path.exists(os.path.join(folder, n.rstrip('/'))) for n in names}


def test_leftovers_are_exactly_our_temporary_names(tmp_path):
    _plant(str(tmp_path), OURS + THEIRS)
    os.symlink(str(tmp_path / '.tmp-notes.txt'), str(tmp_path / '.tmp-11111111.ckpt'))  # a link is never ours
    assert sorted(leftovers(str(tmp_path))) == sorted(n.rstrip('/') for n in OURS)


def _train_resume(tmp_path, images):
    """A run stopped after its checkpoint, its folders seeded with leftovers, resumed."""
    out = str(tmp_path / 'run')
    assert run_cli(train_main, TRAIN + ['--output', out]) == 0
    folders = [out, os.path.join(out, 'checkpoints'), os.path.join(out, 'export')]
    return folders, lambda: run_cli(train_main, TRAIN + ['--output', out, '--resume', 'auto', '--epochs', '2'])


def _export(tmp_path, images):
    out = str(tmp_path / 'run')
    assert run_cli(train_main, TRAIN + ['--output', out]) == 0
    return [os.path.join(out, 'export')], lambda: run_cli(export_main, [out])


def _predict(tmp_path, images):
    model = export_brightness_model(str(tmp_path / 'export'))
    out = str(tmp_path / 'out')
    argv = ['--model', model, '--input', images, '--output', out, '--no-progress']
    assert run_cli(predict_main, argv) == 0
    return [out], lambda: run_cli(predict_main, argv)


@pytest.mark.parametrize('command', [_train_resume, _export, _predict], ids=['train', 'export', 'predict'])
def test_the_next_command_that_owns_a_folder_removes_our_leftovers_and_nothing_else(tmp_path, images, command):
    folders, again = command(tmp_path, images)
    for folder in folders:
        _plant(folder, OURS + THEIRS)
    assert again() == 0
    for folder in folders:
        assert not any(_state(folder, OURS).values()), (folder, _state(folder, OURS))
        assert all(_state(folder, THEIRS).values()), (folder, _state(folder, THEIRS))


def test_a_folder_another_process_holds_keeps_what_it_is_writing(tmp_path):
    # A run training holds its folder: bin/export into its export/ leaves the run's staging alone.
    from gluon_unet.outputs import held_elsewhere, lock_folder
    run = tmp_path / 'run'
    holder = subprocess.Popen([sys.executable, '-c', textwrap.dedent('''
        import fcntl, os, sys, time
        os.makedirs(sys.argv[1], exist_ok=True)
        fd = os.open(os.path.join(sys.argv[1], '.lock'), os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print('locked', flush=True)
        time.sleep(60)
    '''), str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'locked'
        assert held_elsewhere(str(run)) and not held_elsewhere(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    assert not held_elsewhere(str(run))
    with lock_folder(str(run)):  # flock tells open files apart: another lock of this process counts
        assert held_elsewhere(str(run))


# -- launch ------------------------------------------------------------------------------------

def test_launchs_children_die_with_it_even_on_kill_9(tmp_path):
    marker = 'launch-orphan-%d' % os.getpid()
    script = textwrap.dedent('''
        import subprocess, sys
        from gluon_unet.training.launcher import Job, job_plan
        plan = job_plan(2, 1, ['127.0.0.1'], '127.0.0.1', 1, {})
        child = [sys.executable, '-c', 'import time; time.sleep(60)', %r]
        print('started', flush=True)
        Job(plan, lambda p: (child, None, subprocess.DEVNULL), grace=1).run()
    ''' % marker)
    launcher = subprocess.Popen([sys.executable, '-c', script], cwd=ROOT, stdout=subprocess.PIPE,
                                start_new_session=True)
    children = lambda: [p for p in pids_with(marker) if p != launcher.pid]  # noqa: E731
    try:
        deadline = time.time() + 60
        while len(children()) < 4 and time.time() < deadline:  # scheduler, server, 2 workers
            time.sleep(0.1)
        assert len(children()) == 4
        launcher.kill()  # SIGKILL: no handler of the launcher runs
        launcher.wait()
        deadline = time.time() + 30
        while pids_with(marker) and time.time() < deadline:
            time.sleep(0.1)
        assert not pids_with(marker)
    finally:
        for pid in pids_with(marker):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


# -- warnings ----------------------------------------------------------------------------------

ENTRY_POINTS = sorted(n for n in dir(cli) if n.endswith('_main') and callable(getattr(cli, n)))


@pytest.mark.parametrize('name', ENTRY_POINTS)
def test_every_command_goes_through_the_boundary_that_prints_warnings_in_one_line(name):
    # reports_errors: the one place a command's process-wide knobs are set (warnings included).
    fn, chain = getattr(cli, name), []
    while fn is not None:
        chain.append(fn.__code__)
        fn = getattr(fn, '__wrapped__', None)
    boundary = reports_errors(lambda argv=None: 0)
    assert boundary.__code__ in chain and boundary.__wrapped__.__code__ in chain, name


@pytest.mark.parametrize('category', [UserWarning, DeprecationWarning, RuntimeWarning])
def test_a_warning_is_one_line_naming_no_source_file(category):
    code = textwrap.dedent('''
        import warnings
        from gluon_unet.cli.common import reports_errors

        @reports_errors
        def demo_main(argv=None):
            warnings.simplefilter('always')
            warnings.warn('the thing\\n  you should know', %s)
            return 0
        raise SystemExit(demo_main())
    ''' % category.__name__)
    done = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    expected = 'warning: the thing you should know' + ('' if category is UserWarning else ' (%s)' % category.__name__)
    assert done.stderr.splitlines() == [expected], done.stderr
    with warnings.catch_warnings():  # the format is the command's only while it runs
        assert warnings.formatwarning.__name__ == 'formatwarning'
