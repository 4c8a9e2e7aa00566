"""Threads and scratch buffers per CPU context: chosen before mxnet loads, the user's value
always wins."""
import logging
import os
import subprocess
import sys

import mxnet  # noqa: F401  (loaded, as in any process that trains from Python)
import pytest

from gluon_unet import runtime
from gluon_unet.devices import cpu_context_count
from gluon_unet.runlog import LOGGER_NAME

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(runtime, 'physical_cores', lambda: 8)


def test_runtime_defaults_divide_the_cores_among_cpu_contexts(eight_cores):
    env = {}
    assert runtime.apply_runtime_defaults(env) == {'OMP_NUM_THREADS': '8'}
    assert runtime.thread_source(env) == 'gluon_unet' and 'MXNET_CPU_TEMP_COPY' not in env
    # Our own earlier value (import gluon_unet) is overridden once the contexts are known.
    assert runtime.apply_runtime_defaults(env, contexts=4) == {
        'OMP_NUM_THREADS': '2', 'MXNET_CPU_TEMP_COPY': '128'}
    assert runtime.apply_runtime_defaults(env, contexts=3)['OMP_NUM_THREADS'] == '2'
    assert runtime.apply_runtime_defaults(env, contexts=16) == {
        'OMP_NUM_THREADS': '1', 'MXNET_CPU_TEMP_COPY': '512'}
    assert env['MXNET_CPU_TEMP_COPY'] == '512'


def test_runtime_defaults_never_override_the_user(eight_cores):
    env = {'OMP_NUM_THREADS': '3', 'MXNET_CPU_TEMP_COPY': '4'}
    assert runtime.apply_runtime_defaults(env, contexts=4) == {}
    assert env == {'OMP_NUM_THREADS': '3', 'MXNET_CPU_TEMP_COPY': '4'}
    assert runtime.thread_source(env) == 'user'
    # The user changed it after gluon_unet had set it (e.g. in a child process's env).
    env = {'OMP_NUM_THREADS': '3', runtime._OURS + 'OMP_NUM_THREADS': '8'}
    assert runtime.apply_runtime_defaults(env, contexts=4) == {'MXNET_CPU_TEMP_COPY': '128'}
    assert env['OMP_NUM_THREADS'] == '3'
    # A value equal to gluon_unet's own becomes the user's once disowned.
    env = {'OMP_NUM_THREADS': '8'}
    runtime.apply_runtime_defaults(env)
    runtime.disown_defaults(['OMP_NUM_THREADS'], env)
    assert runtime.apply_runtime_defaults(env, contexts=4) == {'MXNET_CPU_TEMP_COPY': '128'}
    assert env['OMP_NUM_THREADS'] == '8' and runtime.thread_source(env) == 'user'
    assert runtime.thread_source({}) == 'mxnet default'


def test_runtime_defaults_leave_the_process_alone_once_mxnet_is_loaded(monkeypatch, eight_cores):
    # Too late to take effect; changing os.environ would only make the log lie.
    monkeypatch.setenv('OMP_NUM_THREADS', '8')
    monkeypatch.setenv(runtime._OURS + 'OMP_NUM_THREADS', '8')
    monkeypatch.delenv('MXNET_CPU_TEMP_COPY', raising=False)
    assert runtime.apply_runtime_defaults(contexts=4) == {}
    assert os.environ['OMP_NUM_THREADS'] == '8' and 'MXNET_CPU_TEMP_COPY' not in os.environ


def test_cpu_context_count_needs_no_mxnet():
    assert cpu_context_count('', 4) == 4 and cpu_context_count('none', 3) == 3
    assert cpu_context_count(' CPU ', 2) == 2 and cpu_context_count(None, 1) == 1
    assert cpu_context_count('0-3', 4) == 0 and cpu_context_count('all', 1) == 0


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelno, record.getMessage()))


@pytest.fixture
def log_lines():
    # fit() turns propagation off for the package logger, so listen on it directly.
    log, handler = logging.getLogger(LOGGER_NAME), _Lines()
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    yield handler.lines
    log.removeHandler(handler)
    log.setLevel(level)


def _warnings(lines):
    return [msg for level, msg in lines if level >= logging.WARNING]


@pytest.mark.parametrize('omp, copies, contexts, device, fix', [
    ('8', '128', 4, 'cpu', 'OMP_NUM_THREADS=2'),
    ('2', '4', 4, 'cpu', 'MXNET_CPU_TEMP_COPY=128'),
    ('8', '4', 4, 'cpu', 'OMP_NUM_THREADS=2 MXNET_CPU_TEMP_COPY=128'),
    ('2', '128', 4, 'cpu', None), ('1', '512', 16, 'cpu', None),
    ('8', '4', 1, 'cpu', None), ('8', '4', 4, 'gpu', None),
    ('4', '64', 2, 'cpu', 'OMP_NUM_THREADS=2')])  # 2 bin/launch workers share the host (below)
def test_configure_runtime_warns_when_cpu_contexts_would_train_slower(
        monkeypatch, eight_cores, log_lines, omp, copies, contexts, device, fix):
    monkeypatch.setenv('OMP_NUM_THREADS', omp)
    monkeypatch.setenv('MXNET_CPU_TEMP_COPY', copies)
    if (omp, copies, contexts) == ('4', '64', 2):
        monkeypatch.setenv(runtime.LOCAL_WORKERS, '2')  # 8 cores / (2 workers x 2 contexts)
    settings = runtime.configure_runtime(contexts, device)
    assert settings['omp_threads'] == int(omp) and settings['contexts'] == contexts
    assert settings['cpu_temp_copy'] == int(copies)
    assert any(msg.startswith('runtime: ') and 'OMP_NUM_THREADS=%s' % omp in msg for _, msg in log_lines)
    found = _warnings(log_lines)
    if fix:
        assert len(found) == 1 and 'export %s before importing' % fix in found[0], found
    else:
        assert not found


def _child_env():
    env = dict(os.environ)
    env.pop('OMP_NUM_THREADS', None)  # conftest pins it; here gluon_unet must choose
    for key in ('OMP_NUM_THREADS', 'MXNET_CPU_TEMP_COPY'):
        env.pop(runtime._OURS + key, None)
    env.pop('MXNET_CPU_TEMP_COPY', None)
    return env


def test_importing_the_cli_does_not_load_mxnet():
    code = ('import sys, gluon_unet.cli; assert "mxnet" not in sys.modules; '
            'from gluon_unet import TrainConfig; assert "mxnet" not in sys.modules; '
            'from gluon_unet import fit, DataParallelStep; import gluon_unet; '
            'print(all(hasattr(gluon_unet, name) for name in gluon_unet.__all__))')
    done = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=_child_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == 'True', done.stderr


def test_bin_train_gives_each_cpu_context_its_share_of_the_cores(tmp_path):
    out = tmp_path / 'run'
    cmd = [sys.executable, os.path.join(ROOT, 'bin', 'train'), '--cpus', '2', '--output', str(out),
           '--width', '4', '--depth', '2', '--size', '32', '--synthetic-count', '24', '--batch-size', '4',
           '--epochs', '1', '--workers', '0', '--no-progress']
    done = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    expected = max(1, runtime.physical_cores() // 2)
    line = [l for l in (out / 'train.log').read_text().splitlines() if ' runtime: ' in l]
    assert len(line) == 1 and '2 cpu context(s), OMP_NUM_THREADS=%d (gluon_unet)' % expected in line[0], line
    assert 'MXNET_CPU_TEMP_COPY=64,' in line[0], line
    assert 'train slower' not in done.stderr
