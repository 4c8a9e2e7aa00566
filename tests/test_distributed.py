"""Distributed training on MXNet's ps-lite kvstore and bin/launch, on loopback only.

Every test that starts processes tags their command lines with a unique marker, bounds
its waits, and kills whatever still carries the marker at teardown.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import load_dump, pids_with, reaped_tag, run_in_own_group, tiny_config, write_config
from gluon_unet.training import distributed, launcher as launch
from gluon_unet.cli import launch_main
from gluon_unet.data.sampler import EpochSampler
from gluon_unet.errors import UserError

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))
LAUNCH = [sys.executable, os.path.join(ROOT, 'bin', 'launch')]
HELPER = [sys.executable, os.path.join(ROOT, 'tests', 'dist_helper.py')]
TRAIN = [sys.executable, os.path.join(ROOT, 'bin', 'train')]


def role_of(pid):
    try:
        with open('/proc/%d/environ' % pid, 'rb') as f:
            env = dict(kv.split(b'=', 1) for kv in f.read().split(b'\0') if b'=' in kv)
    except OSError:  # gone meanwhile
        return ''
    return env.get(b'DMLC_ROLE', b'').decode()


@pytest.fixture
def marker():
    """A unique tag for this test's processes; leftovers are killed (and reported)."""
    yield from reaped_tag('distjob')


def max_diff(a, b, replica_b=0):
    names = sorted({k.rsplit('@', 1)[0] for k in a})
    return max(float(np.abs(a[n + '@0'] - b['%s@%d' % (n, replica_b)]).max()) for n in names)


# -- pieces ------------------------------------------------------------------------------

def test_shards_deal_whole_batches_so_a_step_is_one_global_batch():
    # 2 workers x batch 3 over 13 samples: 3 steps each, padded by wrapping around.
    shards = [EpochSampler(13, seed=4, num_shards=2, shard=r, block=3) for r in range(2)]
    single = EpochSampler(13, seed=4).order()
    assert len(shards[0]) == len(shards[1]) == 9
    orders = [s.order() for s in shards]
    for k in range(2):  # full global batches: worker r's batch k is block r of batch k
        assert np.array_equal(np.concatenate([o[3 * k:3 * k + 3] for o in orders]), single[6 * k:6 * k + 6])
    assert set(np.concatenate(orders)) == set(range(13))
    assert np.array_equal(np.concatenate([o[6:9] for o in orders]), np.resize(single, 18)[12:18])
    assert np.array_equal(EpochSampler(13, seed=4, block=3).order(), single)  # one process: no padding


class _FakeServerJob(distributed.ParameterServer):
    """A ParameterServer strategy's rules without a parameter server behind it."""

    def __init__(self, kvstore, rank=0, num_workers=4):
        distributed.Strategy.__init__(self, 'device', rank, num_workers)
        self.sync = kvstore != 'dist_async'

    def broadcast(self, values):
        return [float(v) for v in values]


def test_gradient_normalization_and_update_placement():
    assert _FakeServerJob('dist_sync', num_workers=4).grad_workers == 4
    assert _FakeServerJob('dist_device_sync', num_workers=3).grad_workers == 3
    assert _FakeServerJob('dist_async', num_workers=4).grad_workers == 1  # each push is its own update
    assert distributed.Strategy('device').grad_workers == 1
    assert _FakeServerJob('dist_sync').update_on_kvstore(None) is False
    assert _FakeServerJob('dist_sync').update_on_kvstore(True) is True
    assert _FakeServerJob('dist_async').update_on_kvstore(None) is True
    assert distributed.Strategy('device').update_on_kvstore(None) is None
    # nccl would otherwise keep every merge buffer and optimizer state on the first GPU
    assert distributed.Strategy('nccl').update_on_kvstore(None) is False
    assert distributed.Strategy('nccl').update_on_kvstore(True) is True
    with pytest.raises(UserError, match='dist_async'):
        _FakeServerJob('dist_async').update_on_kvstore(False)
    assert distributed.Strategy('device').broadcast([3, 1.5]) == [3.0, 1.5]
    assert isinstance(distributed.make_strategy('device'), distributed.Strategy)
    assert not isinstance(distributed.make_strategy('nccl'), distributed.ParameterServer)


def test_a_nonzero_rank_writes_nothing(tiny, tmp_path, monkeypatch):
    # Rank 1 of 2 without a parameter server: the job's rules, a local kvstore under them.
    monkeypatch.setattr(distributed, 'make_strategy', lambda kv: _FakeServerJob('dist_sync', 1, 2))
    from gluon_unet.training.loop import fit
    cfg = tiny(epochs=1, val_split=0.25)
    history = fit(cfg, verbose=False)
    assert len(history) == 1 and 'val_loss' not in history[0]  # rank 0 validates
    assert not os.path.exists(cfg.output)


def test_job_plan_environment():
    plan = launch.job_plan(2, 1, ['a', 'b'], 'a', 9000, {'PS_VERBOSE': '1'})
    assert [(p['role'], p['index'], p['host']) for p in plan] == [
        ('scheduler', 0, 'a'), ('server', 0, 'a'), ('worker', 0, 'a'), ('worker', 1, 'b')]
    assert plan[3]['env'] == {'DMLC_ROLE': 'worker', 'DMLC_PS_ROOT_URI': 'a', 'DMLC_PS_ROOT_PORT': '9000',
                              'DMLC_NUM_SERVER': '1', 'DMLC_NUM_WORKER': '2', 'PS_VERBOSE': '1',
                              'GLUON_UNET_LOCAL_WORKERS': '1'}
    # Three workers on two hosts: two share host a's cores.
    plan = launch.job_plan(3, 1, ['a', 'b'], 'a', 9000)
    assert [p['env'].get('GLUON_UNET_LOCAL_WORKERS') for p in plan] == [None, None, '2', '1', '2']


def test_workers_sharing_a_machine_split_its_cores(monkeypatch):
    from gluon_unet.machine import runtime
    monkeypatch.setattr(runtime, 'physical_cores', lambda: 8)
    two = {'GLUON_UNET_LOCAL_WORKERS': '2'}
    assert runtime.apply_runtime_defaults(dict(two), contexts=1) == {'OMP_NUM_THREADS': '4'}
    assert runtime.apply_runtime_defaults(dict(two), contexts=2)['OMP_NUM_THREADS'] == '2'


def test_launch_forwards_the_users_settings_but_not_gluon_unets_defaults(monkeypatch):
    # ssh workers run on other machines: the launcher's own core count must not travel.
    from gluon_unet.machine import runtime
    seen = {}

    class FakeJob:
        def __init__(self, plan, argv_for, grace):
            seen['env'] = plan[-1]['env']

        def run(self):
            return 0

    monkeypatch.setattr(launch, 'Job', FakeJob)
    monkeypatch.setenv('OMP_NUM_THREADS', '2')
    monkeypatch.setattr(runtime, '_applied', {'OMP_NUM_THREADS': '2'})  # chosen by this process
    monkeypatch.setenv('MXNET_CPU_TEMP_COPY', '64')  # the user's
    assert launch_main(['-n', '1', '--port', '9000', '--', 'bin/train']) == 0
    assert 'OMP_NUM_THREADS' not in seen['env'] and seen['env']['MXNET_CPU_TEMP_COPY'] == '64'
    monkeypatch.setenv('OMP_NUM_THREADS', '3')  # now the user's
    launch_main(['-n', '1', '--port', '9000', '--', 'bin/train'])
    assert seen['env']['OMP_NUM_THREADS'] == '3'


def test_ssh_command_carries_env_cwd_and_quoting(tmp_path):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('# cluster\nnode1 slots=8\n\nnode2\n')
    assert launch.read_hostfile(str(hostfile)) == ['node1', 'node2']
    argv = launch.ssh_command('node2', {'DMLC_ROLE': 'worker', 'DMLC_PS_ROOT_URI': 'node1'},
                              ['bin/train', '--output', 'runs/a b'], '/shared/repo')
    assert argv[:5] == ['ssh', '-o', 'BatchMode=yes', '-o', 'StrictHostKeyChecking=accept-new']
    assert argv[5:7] == ['--', 'node2']  # a host can never become an ssh option
    # What the remote login shell runs: sh -c '<script>'.
    import shlex
    remote = shlex.split(argv[7])
    assert remote[:2] == ['sh', '-c']
    assert remote[2].startswith("exec 3<&0; cd /shared/repo && env DMLC_PS_ROOT_URI=node1 DMLC_ROLE=worker "
                                "bin/train --output 'runs/a b' 3<&- & pid=$!;")
    assert 'kill -TERM $pid' in remote[2]
    with pytest.raises(UserError, match='hostfile'):
        launch.read_hostfile(str(tmp_path / 'missing'))


def test_launch_usage_errors():
    assert launch_main(['-n', '2']) == 2
    assert launch_main(['-n', '2', '--launcher', 'ssh', '--', 'true']) == 2


def test_launch_prefixes_output_and_propagates_a_failure_fast(marker):
    script = ('echo hello $DMLC_ROLE $DMLC_NUM_WORKER $DMLC_NUM_SERVER; '
              'if [ $DMLC_ROLE = worker ]; then sleep 0.5; exit 3; fi; sleep 60; : %s' % marker)
    t0 = time.time()
    code, out = run_in_own_group(LAUNCH + ['-n', '2', '-s', '1', '--grace', '2', '--', 'sh', '-c', script])
    assert code == 3 and time.time() - t0 < 10, out
    for prefix in ('[scheduler] hello scheduler 2 1', '[server 0] hello server', '[worker 0] hello worker',
                   '[worker 1] hello worker'):
        assert prefix in out, out
    assert 'worker 0 exited with code 3' in out or 'worker 1 exited with code 3' in out


def test_launch_forwards_ctrl_c(marker):
    script = ('trap "echo stopping $DMLC_ROLE; exit 0" INT TERM; echo ready; '
              'sh -c "sleep 60; : %s" & wait' % marker)
    proc = subprocess.Popen(LAUNCH + ['-n', '2', '-s', '1', '--grace', '2', '--', 'sh', '-c', script],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.time() + 15
        while len([p for p in pids_with(marker) if role_of(p) == 'worker']) < 2 and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # let the shells install their traps
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = out.decode()
    assert proc.returncode == 130, out
    assert '[worker 0] stopping worker' in out and '[worker 1] stopping worker' in out, out
    time.sleep(0.2)
    assert not pids_with(marker)


# -- real ps-lite jobs ---------------------------------------------------------------------

def dist_config(tmp_path, **kw):
    # 20 images, 4 held out: 16 train = 2 steps of 2 x 4 per epoch (divisible, so the
    # single process sees exactly the same global batches). BatchNorm on: worker r's
    # batch is device r's slice in the single process, so even batch statistics agree.
    base = dict(synthetic_count=20, val_split=0.2, batch_size=4, cpus=1, kvstore='dist_sync',
                optimizer='sgd', lr=0.05, momentum=0.9, batch_norm=True, monitor='val_loss',
                output=str(tmp_path / 'run'))
    base.update(kw)
    return tiny_config(tmp_path, **base)


def test_two_workers_match_one_process_and_resume(tmp_path, marker):
    t_start = time.time()
    ref_dump, dump = tmp_path / 'ref', tmp_path / 'dist'
    ref_dump.mkdir(), dump.mkdir()
    # Reference: one process, 2 devices, the global batch of 8, two epochs unbroken.
    ref_cfg = write_config(tmp_path / 'ref.json', dist_config(
        tmp_path, cpus=2, batch_size=8, kvstore='device', epochs=2, output=str(tmp_path / 'ref-run')))
    code, out = run_in_own_group(HELPER + [ref_cfg, str(ref_dump), marker])
    assert code == 0, out

    # Distributed: 2 workers x batch 4 for one epoch, then resumed for the second.
    for epochs, resume in ((1, None), (2, 'auto')):
        cfg = write_config(tmp_path / ('dist%d.json' % epochs), dist_config(tmp_path, epochs=epochs, resume=resume))
        code, out = run_in_own_group(
            LAUNCH + ['-n', '2', '-s', '1', '--grace', '3', '--'] + HELPER + [cfg, str(dump), marker])
        assert code == 0, out
    wall = time.time() - t_start

    ref = {e: load_dump(ref_dump / ('rank0-epoch%d.npz' % e)) for e in (1, 2)}
    workers = {(r, e): load_dump(dump / ('rank%d-epoch%d.npz' % (r, e))) for r in (0, 1) for e in (1, 2)}
    moved = max_diff(ref[2], load_dump(ref_dump / 'rank0-epoch1.npz'))
    assert moved > 1e-3  # the comparison below is not trivially satisfied
    for e in (1, 2):
        assert max_diff(workers[0, e], workers[1, e]) == 0.0  # identical workers
        for r in (0, 1):
            diff = max_diff(workers[r, e], ref[e])
            assert diff < 1e-5, 'epoch %d rank %d differs from one process by %g' % (e, r, diff)
    print('\n2 workers vs 1 process: max |diff| epoch 1 %.3g, epoch 2 (resumed) %.3g; moved %.3g; '
          'wall %.1fs' % (max_diff(workers[0, 1], ref[1]), max_diff(workers[0, 2], ref[2]), moved, wall))

    # Rank 0 alone wrote: one log, each epoch logged once, checkpoints by rank 0 of 2 workers.
    run_dir = tmp_path / 'run'
    log = (run_dir / 'train.log').read_text()
    assert log.count('epoch 1 |') == 1 and log.count('epoch 2 |') == 1, log
    assert 'worker 0 of 2' in log and 'worker 1 of 2' not in log
    assert 'resumed from' in log
    ckpts = sorted(os.listdir(run_dir / 'checkpoints'))
    assert 'epoch0002.ckpt' in ckpts and 'best.ckpt' in ckpts
    from gluon_unet.checkpoint import load_checkpoint
    meta = load_checkpoint(str(run_dir / 'checkpoints' / 'epoch0002.ckpt'))
    assert meta['epoch'] == 2 and meta['step'] == 4 and 'val_loss' in meta['metrics']
    assert (run_dir / 'export').is_dir()


def test_a_killed_worker_stops_the_job(tmp_path, marker):
    cfg = write_config(tmp_path / (marker + '.json'), dist_config(tmp_path, epochs=10000, val_split=0.0,
                                                           output=str(tmp_path / marker)))
    proc = subprocess.Popen(LAUNCH + ['-n', '2', '-s', '1', '--grace', '3', '--'] + TRAIN + ['--config', cfg],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.time() + 40
        while time.time() < deadline and not os.path.exists(os.path.join(tmp_path, marker, 'metrics.csv')):
            time.sleep(0.2)  # training is under way: an epoch finished
        assert proc.poll() is None, proc.communicate(timeout=30)[0].decode()
        workers = [p for p in pids_with(marker) if role_of(p) == 'worker']
        assert len(workers) == 2
        t0 = time.time()
        os.kill(workers[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = out.decode(errors='replace')
    assert proc.returncode != 0 and took < 60, out
    assert 'exited with code -9; stopping the job' in out, out
    time.sleep(0.2)
    assert not pids_with(marker), 'left behind: %s' % pids_with(marker)


def _listening_sockets(pids):
    """``(address, port)`` of the TCP sockets in LISTEN state owned by ``pids``."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir('/proc/%d/fd' % pid):
                target = os.readlink('/proc/%d/fd/%s' % (pid, fd))
                if target.startswith('socket:['):
                    inodes.add(target[8:-1])
        except OSError:  # gone meanwhile
            pass
    found = []
    for table in ('/proc/net/tcp', '/proc/net/tcp6'):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == '0A' and cols[9] in inodes:  # 0A = LISTEN
                    addr, port = cols[1].split(':')
                    found.append((addr, int(port, 16)))
    return found


def test_local_launcher_binds_the_parameter_server_to_loopback_only(tmp_path, marker):
    # ps-lite unpickles control messages: in local mode nothing may listen beyond 127.0.0.1.
    proc = subprocess.Popen(LAUNCH + ['-n', '2', '-s', '1', '--'] + TRAIN + [
        '--kvstore', 'dist_sync', '--cpus', '1', '--batch-size', '8', '--epochs', '200', '--width', '4',
        '--depth', '2', '--size', '32', '--synthetic-count', '32', '--workers', '0', '--no-progress',
        '--output', str(tmp_path / marker)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        deadline, sockets = time.time() + 90, []
        # scheduler, server and both workers each listen once they have joined
        while time.time() < deadline and len(sockets) < 4:
            time.sleep(0.5)
            sockets = _listening_sockets(pids_with(marker))
        assert len(sockets) >= 4, sockets
        # 127.0.0.1 in /proc/net/tcp's little-endian hex
        assert all(addr == '0100007F' for addr, _ in sockets), sockets
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
