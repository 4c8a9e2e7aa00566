"""Training on Horovod (``--kvstore horovod``, issue 51), on loopback with Gloo.

The pieces (the kvstore's sums, the strategy's rules, GPU dealing, the errors) run in
this process without Horovod. The jobs need Horovod built for MXNet and ``horovodrun``;
without them those tests skip - except where ``GLUON_UNET_REQUIRE_HOROVOD=1`` (set by
.ci/run), which makes a skip a failure, so CI cannot silently stop running them.
Every job tags its command line with a unique marker, bounds its waits, and kills
whatever still carries the marker at teardown.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import mxnet as mx
import numpy as np
import pytest

from conftest import load_dump, pids_with, reaped_tag, run_in_own_group, tiny_config, write_config
from device_checks import max_diff
from gluon_unet.training import distributed
from gluon_unet.machine import runtime
from gluon_unet.errors import UserError

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))
HELPER = [sys.executable, os.path.join(ROOT, 'tests', 'dist_helper.py')]
TRAIN = [sys.executable, os.path.join(ROOT, 'bin', 'train')]


def horovodrun_or_skip():
    """``horovodrun`` for a job of Horovod with MXNet; skips (fails under
    ``GLUON_UNET_REQUIRE_HOROVOD=1``) when it is not installed."""
    try:
        import horovod.mxnet  # noqa: F401
        reason = None if shutil.which('horovodrun') else 'horovodrun is not on PATH'
    except ImportError as exc:
        reason = 'Horovod for MXNet is not installed (%s); see requirements-horovod.txt' % exc
    if reason and os.environ.get('GLUON_UNET_REQUIRE_HOROVOD') == '1':
        pytest.fail('GLUON_UNET_REQUIRE_HOROVOD=1 but %s' % reason)
    if reason:
        pytest.skip(reason)
    return shutil.which('horovodrun')


@pytest.fixture
def marker():
    """A unique tag for this test's processes; leftovers are killed (and reported)."""
    yield from reaped_tag('hvdjob')


# -- pieces, without Horovod -----------------------------------------------------------------

class FakeHvd:
    """``horovod.mxnet`` for one process playing rank ``rank`` of ``size`` identical ones:
    an allreduce-sum multiplies by ``size``, a broadcast writes rank 0's ``root_value``."""

    def __init__(self, rank=0, size=2, root_value=None):
        self._rank, self._size, self.root_value, self.names = rank, size, root_value, []

    def init(self):
        pass

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def allreduce_(self, tensor, average=None, name=None, priority=0):
        assert average is False  # the store sums; Gluon's step(n) averages
        self.names.append(name)
        tensor[:] = tensor * self._size

    def broadcast_(self, tensor, root_rank, name=None, priority=0):
        assert root_rank == 0
        self.names.append(name)
        if self.root_value is not None:
            tensor[:] = self.root_value


def test_the_store_sums_every_device_of_every_process_and_broadcasts_rank_0():
    ctxs = [mx.cpu(0), mx.cpu(1)]
    kv = distributed.HorovodKVStore(FakeHvd(size=2))
    grads = [mx.nd.full((2, 3), 1.0, ctx=ctxs[0]), mx.nd.full((2, 3), 2.0, ctx=ctxs[1])]
    kv.pushpull(7, grads)
    for g, c in zip(grads, ctxs):  # (1 + 2) on this process, x 2 processes, on every device
        assert g.context == c and np.array_equal(g.asnumpy(), np.full((2, 3), 6.0))
    one = mx.nd.full((4,), 3.0)
    kv.pushpull(8, one)  # one device: reduced in place
    assert np.array_equal(one.asnumpy(), np.full(4, 6.0))
    kv = distributed.HorovodKVStore(FakeHvd(rank=1, root_value=5.0))
    params = [mx.nd.zeros((3,), ctx=c) for c in ctxs]
    kv.broadcast(3, params[0], params)
    assert all(np.array_equal(p.asnumpy(), np.full(3, 5.0)) for p in params)
    assert kv.type == 'horovod' and (kv.rank, kv.num_workers) == (1, 2)
    assert not kv.is_capable('optimizer')


def test_a_trainer_on_the_store_steps_like_the_device_kvstore():
    # One process of a job of one, 2 CPU contexts: the same update as kvstore 'device'.
    ctxs = [mx.cpu(0), mx.cpu(1)]
    x = mx.nd.array(np.random.RandomState(0).rand(4, 5))
    weights = {}
    for name, kv in (('device', 'device'), ('horovod', distributed.HorovodKVStore(FakeHvd(size=1)))):
        net = mx.gluon.nn.Dense(3, in_units=5)
        net.initialize(mx.init.Constant(0.1), ctx=ctxs)
        trainer = mx.gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.5, 'momentum': 0.9},
                                   kvstore=kv, update_on_kvstore=False)
        for _ in range(3):
            with mx.autograd.record():
                losses = [(net(part) ** 2).sum() for part in mx.gluon.utils.split_and_load(x, ctxs)]
            mx.autograd.backward(losses)
            trainer.step(4)
        weights[name] = [p.data(c).asnumpy() for p in net.collect_params().values() for c in ctxs]
    assert all(np.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(weights['device'], weights['horovod']))
    assert np.abs(weights['device'][0] - 0.1).max() > 1e-2  # it moved


def test_the_strategy_follows_dist_sync_rules(monkeypatch, tiny, tmp_path):
    fake = FakeHvd(rank=1, size=4)
    monkeypatch.setattr(distributed, 'import_horovod', lambda: fake)
    s = distributed.make_strategy('horovod')
    assert isinstance(s, distributed.Horovod) and (s.rank, s.num_workers, s.is_main) == (1, 4, False)
    assert s.grad_workers == 4  # step(n x processes): the mean over the global batch
    assert s.update_on_kvstore(None) is False
    with pytest.raises(UserError, match='drop --update-on-kvstore'):
        s.update_on_kvstore(True)
    assert s.checkpoint_trainer('trainer', False) == 'trainer'  # the optimizer state is local
    monkeypatch.setenv('DMLC_ROLE', 'worker')  # bin/launch's: the wrong launcher
    with pytest.raises(UserError, match='not bin/launch'):
        distributed.make_strategy('horovod')
    fake.root_value = 9.0
    assert s.broadcast([1, 2]) == [9.0, 9.0]
    with s.claim_output(str(tmp_path / 'run'), 'runs/unet', None, False) as folder:
        assert folder.path == str(tmp_path / 'run') and not (tmp_path / 'run').exists()  # rank 1 writes nothing
    # --sync-bn: MXNet's syncs within a process only, Horovod runs one process per GPU
    with pytest.raises(UserError, match='--sync-bn with --kvstore horovod'):
        tiny(kvstore='horovod', sync_bn=True).validate()


def test_a_lost_peer_is_one_line(monkeypatch):
    monkeypatch.setattr(distributed, 'import_horovod', lambda: FakeHvd(rank=0, size=2))
    s = distributed.make_strategy('horovod')
    with pytest.raises(distributed.JobFailed, match='another process of the job failed') as info:
        with s.reporting_failures():
            raise mx.MXNetError('Traceback:\n  File "x"\nMXNetError: Horovod has been shut down. This was caused '
                                'by an exception on one of the ranks')
    assert info.value.exit_code == 1 and info.value.process_unusable
    with pytest.raises(mx.MXNetError, match='out of memory'):  # not Horovod's: left alone
        with s.reporting_failures():
            raise mx.MXNetError('out of memory')


def test_without_horovod_one_line_naming_the_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, 'horovod', None)  # import horovod -> ImportError
    monkeypatch.setitem(sys.modules, 'horovod.mxnet', None)
    from gluon_unet.cli import train_main
    code = train_main(['--kvstore', 'horovod', '--width', '4', '--depth', '2', '--size', '32', '--epochs', '1',
                       '--synthetic-count', '8', '--workers', '0', '--no-progress', '--output', str(tmp_path / 'r')])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith('error: --kvstore horovod: Horovod for MXNet is not installed') \
        and 'requirements-horovod.txt' in err[0]
    from gluon_unet.cli import doctor
    assert doctor.horovod_status().startswith('not installed (only --kvstore horovod needs it')


def test_gpus_are_dealt_to_the_processes_of_a_host():
    hvd4 = {'HOROVOD_LOCAL_RANK': '3', 'HOROVOD_LOCAL_SIZE': '4'}
    assert runtime.process_gpus('0-7', 'horovod', hvd4) == '6,7'
    assert runtime.process_gpus('0-3', 'horovod', hvd4) == '3'
    assert runtime.process_gpus('all', 'horovod', hvd4) == '3'  # one GPU per process
    assert runtime.process_gpus('0-7', 'dist_sync', hvd4) == '0-7'  # only Horovod deals
    assert runtime.process_gpus('', 'horovod', hvd4) == ''  # CPU contexts
    assert runtime.process_gpus('0-7', 'horovod', {}) == '0-7'  # no launcher: the process takes all
    with pytest.raises(UserError, match='cannot be dealt evenly to the 4 processes'):
        runtime.process_gpus('0-5', 'horovod', hvd4)
    # The launcher bound a GPU to each process (SLURM --gpus-per-task): nothing to deal.
    assert runtime.process_gpus('all', 'horovod', dict(hvd4, CUDA_VISIBLE_DEVICES='5')) == 'all'
    # Open MPI's mpirun, MPICH/Intel MPI, srun
    assert runtime.local_process({'OMPI_COMM_WORLD_LOCAL_RANK': '1', 'OMPI_COMM_WORLD_LOCAL_SIZE': '8'}) == (1, 8)
    assert runtime.local_process({'MPI_LOCALRANKID': '0', 'MPI_LOCALNRANKS': '2'}) == (0, 2)
    slurm = {'SLURM_LOCALID': '2', 'SLURM_STEP_TASKS_PER_NODE': '8(x2),4', 'SLURM_NODEID': '2'}
    assert runtime.local_process(slurm) == (2, 4)
    assert runtime.local_process({'SLURM_LOCALID': '2', 'SLURM_STEP_TASKS_PER_NODE': 'junk'}) is None
    assert runtime.local_process({}) is None
    # The processes on a host share its cores, as bin/launch's do.
    assert runtime.local_workers(hvd4) == 4 and runtime.local_workers({}) == 1
    assert runtime.local_workers(dict(hvd4, GLUON_UNET_LOCAL_WORKERS='2')) == 2


def test_ci_turns_a_missing_horovod_into_a_failure(monkeypatch):
    monkeypatch.setitem(sys.modules, 'horovod.mxnet', None)
    monkeypatch.delenv('GLUON_UNET_REQUIRE_HOROVOD', raising=False)
    with pytest.raises(pytest.skip.Exception, match='requirements-horovod.txt'):
        horovodrun_or_skip()
    monkeypatch.setenv('GLUON_UNET_REQUIRE_HOROVOD', '1')  # .ci/run's
    with pytest.raises(pytest.fail.Exception, match='GLUON_UNET_REQUIRE_HOROVOD=1 but Horovod for MXNet is not'):
        horovodrun_or_skip()


def test_bench_dist_worker_measures_the_trainers_step(capsys):
    # The measuring half of benchmarks/bench_dist.py, in one process without a job.
    sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
    import bench_dist
    assert bench_dist.parse_configs('16:4:128:4,8:2:32:2') == [(16, 4, 128, 4), (8, 2, 32, 2)]
    with pytest.raises(SystemExit, match='WIDTH:DEPTH:SIZE:BATCH'):
        bench_dist.parse_configs('16:4')
    assert bench_dist.worker('device', 4, 2, 32, 2) == 0
    record = json.loads(capsys.readouterr().out.split('BENCH ', 1)[1])
    assert record['workers'] == 1 and record['params'] > 0 and record['step_s'] > 0
    assert record['images_per_s'] == pytest.approx(2 / record['step_s'])


# -- real Horovod jobs (Gloo on loopback) ---------------------------------------------------

def hvd_config(tmp_path, **kw):
    # 28 images, 4 held out: 24 train = 3 steps of 2 x 4 per epoch, so the single process
    # at batch 8 sees exactly the same global batches. No BatchNorm: each process
    # normalizes over its own batch (as each device does without --sync-bn), which a
    # process with the whole batch cannot match.
    base = dict(synthetic_count=28, val_split=1 / 7, batch_size=4, cpus=1, kvstore='horovod', optimizer='sgd',
                lr=0.05, momentum=0.9, batch_norm=False, monitor='val_loss', output=str(tmp_path / 'run'))
    base.update(kw)
    return tiny_config(tmp_path, **base)


class _Dump:
    """fit() callback: the trainable parameters after each epoch, as dist_helper writes them."""

    def __init__(self):
        self.epochs = {}

    def on_epoch_end(self, record, context):
        self.epochs[record['epoch']] = {
            '%s@0' % name: p.data(context.ctxs[0]).asnumpy()
            for name, p in context.net._collect_params_with_prefix().items() if p.grad_req != 'null'}


def test_two_processes_match_one_at_twice_the_batch_and_resume(tmp_path, marker):
    horovodrun = horovodrun_or_skip()
    t_start = time.time()
    # Reference, in this process: one device, the global batch of 8, two epochs unbroken.
    from gluon_unet.training.loop import fit
    ref = _Dump()
    fit(hvd_config(tmp_path, batch_size=8, kvstore='device', epochs=2, output=str(tmp_path / 'ref')),
        verbose=False, callbacks=[ref])
    # Horovod: 2 processes x batch 4 for one epoch, then resumed for the second.
    dump = tmp_path / 'hvd'
    dump.mkdir()
    for epochs, resume in ((1, None), (2, 'auto')):
        cfg = write_config(tmp_path / ('hvd%d-%s.json' % (epochs, marker)),
                           hvd_config(tmp_path, epochs=epochs, resume=resume))
        code, out = run_in_own_group([horovodrun, '-np', '2', '-H', 'localhost:2', '--gloo'] + HELPER
                                     + [cfg, str(dump), marker])
        assert code == 0, out
    wall = time.time() - t_start
    ranks = {(r, e): load_dump(dump / ('rank%d-epoch%d.npz' % (r, e))) for r in (0, 1) for e in (1, 2)}
    moved = max_diff(ref.epochs[2], ref.epochs[1])
    assert moved > 1e-3  # the comparison below is not trivially satisfied
    for e in (1, 2):
        assert max_diff(ranks[0, e], ranks[1, e]) == 0.0  # identical processes
        diff = max_diff(ranks[0, e], ref.epochs[e])
        assert diff <= 1e-5, 'epoch %d differs from one process at twice the batch by %g' % (e, diff)
    print('\nhorovod 2 x 4 vs 1 x 8: max |diff| epoch 1 %.3g, epoch 2 (resumed) %.3g; moved %.3g; wall %.1fs'
          % (max_diff(ranks[0, 1], ref.epochs[1]), max_diff(ranks[0, 2], ref.epochs[2]), moved, wall))
    # Rank 0 alone wrote: one log, each epoch once, checkpoints, the export.
    run_dir = tmp_path / 'run'
    log = (run_dir / 'train.log').read_text()
    assert log.count('epoch 1 |') == 1 and log.count('epoch 2 |') == 1, log
    assert 'worker 0 of 2' in log and 'worker 1 of 2' not in log and 'resumed from' in log
    from gluon_unet.checkpoint import load_checkpoint
    meta = load_checkpoint(str(run_dir / 'checkpoints' / 'epoch0002.ckpt'))
    assert meta['epoch'] == 2 and meta['step'] == 6
    assert (run_dir / 'export').is_dir()


def _rank_pids(marker, rank):
    """PIDs of the Python processes of the job tagged ``marker`` that Horovod made rank ``rank``."""
    found = []
    for pid in pids_with(marker):
        try:
            with open('/proc/%d/environ' % pid, 'rb') as f:
                env = dict(kv.split(b'=', 1) for kv in f.read().split(b'\0') if b'=' in kv)
            with open('/proc/%d/cmdline' % pid, 'rb') as f:
                argv0 = f.read().split(b'\0')[0]
        except OSError:  # gone meanwhile
            continue
        if env.get(b'HOROVOD_RANK') == str(rank).encode() and b'python' in os.path.basename(argv0):
            found.append(pid)
    return found


def test_a_killed_rank_stops_the_job(tmp_path, marker):
    horovodrun = horovodrun_or_skip()
    out_dir = tmp_path / marker
    cfg = write_config(tmp_path / (marker + '.json'), hvd_config(tmp_path, epochs=10000, val_split=0.0,
                                                                 output=str(out_dir)))
    proc = subprocess.Popen([horovodrun, '-np', '2', '-H', 'localhost:2', '--gloo'] + TRAIN + ['--config', cfg],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.time() + 90
        while time.time() < deadline and not (out_dir / 'metrics.csv').exists():
            time.sleep(0.2)  # training is under way: an epoch finished
        assert proc.poll() is None, proc.communicate(timeout=30)[0].decode()
        victims = _rank_pids(marker, 1)
        assert len(victims) == 1, victims
        t0 = time.time()
        os.kill(victims[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)  # a hang fails here instead of blocking
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = out.decode(errors='replace')
    assert proc.returncode != 0 and took < 60, out
    assert 'Process 1 exit with status code 137' in out, out
    # Rank 0 either stops on its own with one line or is stopped by horovodrun: no traceback.
    assert '[0]<stderr>:Traceback' not in out, out
    time.sleep(0.2)
    assert not pids_with(marker), 'left behind: %s' % pids_with(marker)
    print('\nkilled rank 1: the job ended %.1f s later' % took)
