"""Threads and scratch buffers per CPU context: chosen before mxnet loads by the CLI entry
points or an explicit use_all_cores() call - never by import gluon_unet - and the user's
value always wins."""
import logging
import os
import subprocess
import sys

import mxnet  # noqa: F401  (loaded, as in any process that trains from Python)
import pytest

from gluon_unet.machine import runtime
from gluon_unet.machine.devices import cpu_context_count
from gluon_unet.reporting import LOGGER_NAME
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(runtime, 'physical_cores', lambda: 8)


@pytest.fixture
def nothing_applied(monkeypatch):
    """This process has chosen no value yet (as a fresh bin/train before its flags)."""
    monkeypatch.setattr(runtime, '_applied', {})


def test_runtime_defaults_divide_the_cores_among_cpu_contexts(eight_cores):
    assert runtime.recommended_settings(1, {}) == {'OMP_NUM_THREADS': '8'}
    env = {}
    assert runtime.apply_runtime_defaults(env) == {'OMP_NUM_THREADS': '8'}
    assert 'MXNET_CPU_TEMP_COPY' not in env
    env = {}
    assert runtime.apply_runtime_defaults(env, contexts=4) == {
        'OMP_NUM_THREADS': '2', 'MXNET_CPU_TEMP_COPY': '128'}
    assert runtime.apply_runtime_defaults({}, contexts=3)['OMP_NUM_THREADS'] == '2'
    env = {}
    assert runtime.apply_runtime_defaults(env, contexts=16) == {
        'OMP_NUM_THREADS': '1', 'MXNET_CPU_TEMP_COPY': '512'}
    assert env == {'OMP_NUM_THREADS': '1', 'MXNET_CPU_TEMP_COPY': '512'}


def test_runtime_defaults_never_override_the_user(eight_cores, nothing_applied, monkeypatch):
    env = {'OMP_NUM_THREADS': '3', 'MXNET_CPU_TEMP_COPY': '4'}
    assert runtime.apply_runtime_defaults(env, contexts=4) == {}
    assert env == {'OMP_NUM_THREADS': '3', 'MXNET_CPU_TEMP_COPY': '4'}
    # Only what is missing is set.
    env = {'OMP_NUM_THREADS': '3'}
    assert runtime.apply_runtime_defaults(env, contexts=4) == {'MXNET_CPU_TEMP_COPY': '128'}
    assert env['OMP_NUM_THREADS'] == '3'
    # A value in another environment (a child process's) is the user's, even one equal to
    # gluon_unet's choice: only this process's own os.environ values are ours.
    env = {'OMP_NUM_THREADS': '8'}
    assert runtime.apply_runtime_defaults(env, contexts=4) == {'MXNET_CPU_TEMP_COPY': '128'}
    assert env['OMP_NUM_THREADS'] == '8'
    # Who chose os.environ's value, as the runtime log line says.
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    assert runtime.thread_source() == 'mxnet default'
    monkeypatch.setenv('OMP_NUM_THREADS', '8')
    assert runtime.thread_source() == 'user' and not runtime.is_default('OMP_NUM_THREADS')
    monkeypatch.setattr(runtime, '_applied', {'OMP_NUM_THREADS': '8'})
    assert runtime.thread_source() == 'gluon_unet' and runtime.is_default('OMP_NUM_THREADS')
    monkeypatch.setenv('OMP_NUM_THREADS', '3')  # changed by the user after we set it
    assert runtime.thread_source() == 'user'


def test_user_environ_leaves_out_only_what_this_process_chose(monkeypatch):
    # What bin/launch's processes and the export subprocess get.
    monkeypatch.setenv('OMP_NUM_THREADS', '8')
    monkeypatch.setenv('MXNET_CPU_TEMP_COPY', '64')
    monkeypatch.setattr(runtime, '_applied', {'OMP_NUM_THREADS': '8', 'MXNET_CPU_TEMP_COPY': '128'})
    env = runtime.user_environ()
    assert 'OMP_NUM_THREADS' not in env and env['MXNET_CPU_TEMP_COPY'] == '64'
    assert env['PATH'] == os.environ['PATH']


def test_runtime_defaults_leave_the_process_alone_once_mxnet_is_loaded(monkeypatch, eight_cores):
    # Too late to take effect; changing os.environ would only make the log lie.
    monkeypatch.setenv('OMP_NUM_THREADS', '8')
    monkeypatch.setattr(runtime, '_applied', {'OMP_NUM_THREADS': '8'})
    monkeypatch.delenv('MXNET_CPU_TEMP_COPY', raising=False)
    assert runtime.apply_runtime_defaults(contexts=4) == {}
    with pytest.warns(RuntimeWarning, match='after mxnet was imported'):
        assert runtime.use_all_cores(contexts=4) == {}
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
    # Listen on the package logger itself (whatever the root logger's configuration).
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
    env.pop('MXNET_CPU_TEMP_COPY', None)
    return env


def _python(code, env=None):
    done = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env or _child_env(), capture_output=True,
                          text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_gluon_unet_leaves_the_environment_alone():
    code = ('import os; before = dict(os.environ); import gluon_unet; '
            'from gluon_unet import TrainConfig, cli; from gluon_unet.machine import runtime; assert dict(os.environ) == before; print("ok")')
    assert _python(code) == 'ok'
    assert _python(code, env=dict(_child_env(), OMP_NUM_THREADS='3')) == 'ok'


def test_use_all_cores_before_mxnet_loads(tmp_path):
    # The Python API's explicit call: all physical cores for one context, divided among
    # several, replacing its own earlier choice but never the user's.
    code = ('import os, sys, gluon_unet; from gluon_unet.machine import runtime; '
            'runtime.physical_cores = lambda: 8; '
            'print(gluon_unet.use_all_cores(), gluon_unet.use_all_cores(contexts=4), '
            'os.environ["OMP_NUM_THREADS"], os.environ["MXNET_CPU_TEMP_COPY"], runtime.thread_source(), '
            '"mxnet" in sys.modules)')
    assert _python(code) == ("{'OMP_NUM_THREADS': '8'} {'OMP_NUM_THREADS': '2', 'MXNET_CPU_TEMP_COPY': '128'} "
                             "2 128 gluon_unet False")
    assert _python(code, env=dict(_child_env(), OMP_NUM_THREADS='3')) == (
        "{} {'MXNET_CPU_TEMP_COPY': '128'} 3 128 user False")


@pytest.mark.parametrize('entry', ['predict_main', 'evaluate_main', 'export_main'])
def test_other_cli_entry_points_use_all_the_cores(entry):
    # As import gluon_unet used to: all physical cores (one context), before mxnet loads.
    code = ('import os, sys; from gluon_unet import cli; from gluon_unet.machine import runtime\n'
            'try:\n    cli.%s(["--help"])\nexcept SystemExit:\n    pass\n'
            'print(os.environ.get("OMP_NUM_THREADS"), runtime.physical_cores())' % entry)
    omp, cores = _python(code).splitlines()[-1].split()
    assert omp == cores


def test_importing_the_cli_does_not_load_mxnet():
    code = ('import sys, gluon_unet.cli; assert "mxnet" not in sys.modules; '
            'from gluon_unet import TrainConfig, use_all_cores; assert "mxnet" not in sys.modules; '
            'from gluon_unet import fit, DataParallelStep; import gluon_unet; '
            'print(all(hasattr(gluon_unet, name) for name in gluon_unet.__all__))')
    assert _python(code) == 'True'


def test_bin_train_gives_each_cpu_context_its_share_of_the_cores(tmp_path):
    out = tmp_path / 'run'
    cmd = [sys.executable, os.path.join(ROOT, 'bin', 'train'), '--cpus', '2', '--output', str(out),
           '--width', '4', '--depth', '2', '--size', '32', '--synthetic-count', '24', '--batch-size', '4',
           '--epochs', '1', '--workers', '0', '--no-progress']
    done = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    expected = max(1, runtime.physical_cores() // 2)
    line = [l for l in (out / 'train.log').read_text().splitlines() if ' runtime: ' in l]
    assert len(line) == 1 and '2 cpu context(s), OMP_NUM_THREADS=%d (gluon_unet)' % expected in line[0], line
    assert 'MXNET_CPU_TEMP_COPY=64,' in line[0], line
    assert 'train slower' not in done.stderr


# -- GPU runs: CUDA_VISIBLE_DEVICES and the threads MXNet keeps for feeding the GPUs --------

def _gpu_child_env(**extra):
    env = _child_env()
    env.pop('CUDA_VISIBLE_DEVICES', None)
    env.update(extra)
    return env


PREPARE = ('import os, sys; from gluon_unet.machine import runtime\n'
           'before = runtime.use_all_cores() if "--use-all-cores" in sys.argv else None\n'
           'print(runtime.prepare_training_process(sys.argv[1], 1))\n'
           'print(os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("OMP_NUM_THREADS"), '
           'runtime.gpu_renumbering(), "CUDA_VISIBLE_DEVICES" in runtime.user_environ(), "mxnet" in sys.modules)\n')


def _prepare(spec, env, *flags):
    done = subprocess.run([sys.executable, '-c', PREPARE, spec] + list(flags), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()


def test_gpus_4_7_show_mxnet_only_gpus_4_7_renumbered_from_0():
    # Without it, the kvstore's cpu_pinned(0) staging buffers create a CUDA context on GPU 0.
    assert _prepare('4-7', _gpu_child_env()) == ['{0: 4, 1: 5, 2: 6, 3: 7}', '4,5,6,7 None [4, 5, 6, 7] False False']
    assert _prepare('0,2,5', _gpu_child_env()) == ['{0: 0, 1: 2, 2: 5}', '0,2,5 None [0, 2, 5] False False']


def test_a_users_cuda_visible_devices_wins():
    # --gpus then counts within the user's list, as CUDA does.
    assert _prepare('0-1', _gpu_child_env(CUDA_VISIBLE_DEVICES='4,6')) == ['{}', '4,6 None None True False']


@pytest.mark.parametrize('spec', ['all', '', 'x-y'])
def test_gpus_all_cpu_runs_and_bad_specs_leave_cuda_visible_devices_alone(spec):
    omp = str(runtime.physical_cores()) if spec == '' else 'None'
    assert _prepare(spec, _gpu_child_env()) == ['{}', 'None %s None False False' % omp]


def test_gpu_runs_leave_omp_num_threads_to_mxnet(eight_cores, nothing_applied):
    # MXNet keeps 1-2 cores for the GPU feeder threads only when OMP_NUM_THREADS is unset
    # (src/engine/openmp.cc: GetRecommendedOMPThreadCount returns the variable as is).
    assert runtime.recommended_settings(1, {}, gpus=True) == {}
    env = {}
    assert runtime.apply_runtime_defaults(env, contexts=1, gpus=True) == {} and env == {}
    # A value this process chose earlier is taken back; the user's stays.
    assert _prepare('0', _gpu_child_env(), '--use-all-cores')[1] == '0 None [0] False False'
    assert _prepare('0', _gpu_child_env(OMP_NUM_THREADS='3'), '--use-all-cores')[1] == '0 3 [0] False False'


def test_restrict_visible_gpus_changes_nothing_once_mxnet_is_loaded(monkeypatch):
    monkeypatch.delenv('CUDA_VISIBLE_DEVICES', raising=False)
    assert runtime.restrict_visible_gpus('4-7') == {}
    assert 'CUDA_VISIBLE_DEVICES' not in os.environ and runtime.gpu_renumbering() is None


def test_the_runtime_line_of_a_gpu_run_says_cores_are_kept_for_feeding(monkeypatch, log_lines):
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    monkeypatch.setattr(runtime, 'cpu_cores', lambda: 32)
    settings = runtime.configure_runtime(8, 'gpu')
    assert settings['omp_threads'] == 14  # 32 / 2, less 2 kept (16 >= 8 threads)
    assert any('OMP_NUM_THREADS=14 (mxnet default, 2 core(s) kept for feeding the GPUs)' in m for _, m in log_lines)


def test_bin_train_restricts_the_gpus_before_mxnet_loads():
    # On this CPU build --gpus stops with one line; what matters is what was set first.
    code = ('import os, sys; from gluon_unet import cli\n'
            'code = cli.train_main(["--gpus", "4-7", "--benchmark", "--no-progress"])\n'
            'print(code, os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("OMP_NUM_THREADS"))\n')
    out = _python(code, env=_gpu_child_env()).splitlines()[-1]
    assert out.split()[1:] == ['4,5,6,7', 'None'], out


def test_bin_predict_sets_its_devices_and_whole_mode_knobs_before_mxnet_loads():
    code = ('import os, sys; from gluon_unet import cli\n'
            'try:\n    cli.predict_main(sys.argv[1:] + ["--help"])\nexcept SystemExit:\n    pass\n'
            'print(os.environ.get("MXNET_CUDNN_AUTOTUNE_DEFAULT"), os.environ.get("MXNET_CPU_TEMP_COPY"), '
            'os.environ.get("OMP_NUM_THREADS"))')
    env = {k: v for k, v in os.environ.items() if not k.startswith(('OMP_', 'MXNET_'))}
    whole = subprocess.run([sys.executable, '-c', code, '--mode', 'whole', '--cpus', '2'], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=HANG_SECONDS)
    cores = runtime.physical_cores()
    assert whole.stdout.split()[-3:] == ['0', '64', str(max(1, cores // 2))], whole.stdout + whole.stderr
    tiles = subprocess.run([sys.executable, '-c', code, '--mode', 'tile'], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=HANG_SECONDS)
    assert tiles.stdout.split()[-3:-1] == ['None', 'None'], tiles.stdout + tiles.stderr
    mine = subprocess.run([sys.executable, '-c', code, '--mode', 'whole'], cwd=ROOT,
                          env=dict(env, MXNET_CUDNN_AUTOTUNE_DEFAULT='2'), capture_output=True, text=True,
                          timeout=HANG_SECONDS)
    assert mine.stdout.split()[-3] == '2'  # the user's value wins
