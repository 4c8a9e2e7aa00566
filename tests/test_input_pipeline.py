"""The input pipeline scales with the devices and carries no dead weight (issue 17 item 6)."""
import logging
import multiprocessing
import os

import mxnet as mx
import numpy as np
import pytest

from conftest import run_in_own_group
from gluon_unet.config import ModelConfig
from gluon_unet.data import dataset as dataset_mod
from gluon_unet.data import synthetic_dataset
from gluon_unet.data.dataset import default_workers, make_loader
from gluon_unet.data.weights import unet_weight_map
from gluon_unet.errors import UserError
from gluon_unet.losses import SegmentationLoss
from gluon_unet.model import build_model
from gluon_unet.optim import make_trainer
from gluon_unet.parallel import DataParallelStep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('gpus, cores, expected', [(8, 64, 16), (8, 6, 5), (1, 2, 1), (0, 2, 2), (0, 1, 1),
                                                   (4, 1, 1)])
def test_default_workers_scale_with_the_gpus_and_leave_a_core_to_feed_them(gpus, cores, expected):
    assert default_workers(gpus, cores=cores) == expected


def test_batches_carry_a_weight_map_only_when_the_loss_uses_one():
    ds = synthetic_dataset(6, size=32, seed=0)
    batch = next(iter(make_loader(ds, 3, shuffle=False, seed=0)))
    assert len(batch) == 2  # image, target: no all-ones map to copy to every device
    ds.weight_fn = unet_weight_map
    batch = next(iter(make_loader(ds, 3, shuffle=False, seed=0)))
    assert len(batch) == 3 and batch[2].shape == (3, 1, 32, 32) and float(batch[2].max().asscalar()) > 1


def _params_after_steps(with_weight):
    ctxs = [mx.cpu(0), mx.cpu(1)]
    mx.random.seed(0)
    net = build_model(ModelConfig(in_channels=1, width=4, depth=2, batch_norm=False))
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    trainer = make_trainer(net.collect_params(), 'adam', 1e-2, ctxs)
    step = DataParallelStep(net, SegmentationLoss('bce'), trainer, ctxs)
    rng = np.random.RandomState(0)
    for _ in range(3):
        x = mx.nd.array(rng.rand(5, 1, 32, 32))
        y = mx.nd.array(rng.rand(5, 1, 32, 32) > 0.5)
        step(x, y, mx.nd.ones_like(y)) if with_weight else step(x, y)
    return {k: v.data(ctxs[0]).asnumpy() for k, v in net._collect_params_with_prefix().items()}


def test_training_without_the_weight_tensor_is_the_same_training():
    a, b = _params_after_steps(True), _params_after_steps(False)
    assert max(np.abs(a[k] - b[k]).max() for k in a) == 0.0


def _data_pointer(array):
    import ctypes
    ptr = ctypes.c_void_p()
    mx.base.check_call(mx.base._LIB.MXNDArrayGetData(array.handle, ctypes.byref(ptr)))
    return ptr.value


def test_batches_for_gpus_come_in_a_few_reused_pinned_buffers():
    # MXNet 1.9.1 does not pool pinned memory (cudaHostAlloc / cudaFreeHost per array):
    # Gluon's pin_memory locked and freed every batch anew. cpu_pinned is plain memory in a
    # CPU build of MXNet, so the ring's logic runs here; the GPU lane measures it
    # (benchmarks/bench_pinned.py).
    ds = synthetic_dataset(9, size=32, seed=0)
    plain = make_loader(ds, 2, shuffle=False, seed=0)
    pinned = make_loader(ds, 2, shuffle=False, seed=0, pin_device=0)
    assert not pinned.loader._pin_memory and not plain.loader._pin_memory and plain.pin is None
    pointers, sums = set(), []
    for epoch in range(2):
        for batch in pinned:
            assert all(a.context == mx.Context('cpu_pinned', 0) for a in batch)
            pointers.update(_data_pointer(a) for a in batch)
            sums.append([a.sum() for a in batch])  # queued now, read after the buffers were reused
    expected = [[float(a.sum().asscalar()) for a in batch] for _ in range(2) for batch in plain]
    assert [[float(s.asscalar()) for s in row] for row in sums] == expected
    # 5 batches an epoch (4 of 2 images, 1 of 1), 2 arrays each, over 2 epochs: the 8 full
    # batches went through the 3 slots of their shape, the 2 last ones through 2 of the 3
    # of theirs - 10 buffers written, where Gluon's pin_memory allocated 20.
    assert pinned.pin.buffers() == 2 * (3 + 3) and len(pointers) == 2 * (3 + 2)


def test_too_little_shared_memory_warns_naming_shm_size(monkeypatch, caplog):
    ds = synthetic_dataset(4, size=32, seed=0)
    monkeypatch.setattr(dataset_mod, '_shm_free', lambda: 1000)
    with caplog.at_level(logging.WARNING, logger='gluon_unet'):
        assert not dataset_mod.check_shared_memory(ds, 64, prefetch=4)
    assert '--shm-size=' in caplog.text and '/dev/shm' in caplog.text
    monkeypatch.setattr(dataset_mod, '_shm_free', lambda: 10 ** 12)
    assert dataset_mod.check_shared_memory(ds, 64, prefetch=4)


def test_a_loader_time_out_is_one_line_naming_shm_size():
    class Stalled:
        def __len__(self):
            return 1

        def __iter__(self):
            raise multiprocessing.TimeoutError()
            yield

    loader = dataset_mod._Loader(Stalled(), None, workers=4)
    with pytest.raises(UserError, match=r'--shm-size=2g.*--workers 0') as err:
        list(loader)
    assert '\n' not in str(err.value)


@pytest.mark.parametrize('how', ['exit handler first', 'pool collected first'])
def test_the_workers_are_told_before_their_pool_is_terminated(how):
    # The workers ignore SIGTERM until the main process says it is shutting their pool down
    # (a SIGTERM to the whole process group must not kill one holding the queue lock).
    # Whichever way the pool ends - multiprocessing's exit handler before any other exit
    # hook, or Gluon's DataLoader collected - the flag must be set when it starts. (Not
    # the fix of the hang at exit seen in CI on Zen 3: that is the test below.)
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent('''
        import multiprocessing.pool, multiprocessing.util, sys
        sys.path.insert(0, sys.argv[1])
        seen = []
        terminate_pool = multiprocessing.pool.Pool._terminate_pool.__func__
        def spy(cls, *args):
            seen.append(dataset._FORKING['shutdown'].flag.value)
            return terminate_pool(cls, *args)
        multiprocessing.pool.Pool._terminate_pool = classmethod(spy)
        from gluon_unet.data import dataset, synthetic_dataset
        loader = dataset.make_loader(synthetic_dataset(8, 32), batch_size=2, shuffle=True, seed=0, workers=2)
        for _ in loader:
            pass
        if sys.argv[2] == 'exit handler first':
            multiprocessing.util._run_finalizers(0)
        else:
            loader.loader._worker_pool.terminate()
        print('flag when the pool terminated:', seen)
    ''')
    done = subprocess.run([sys.executable, '-c', script, ROOT, how], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'flag when the pool terminated: [1]' in done.stdout, done.stdout


@pytest.mark.parametrize('how', ['exit handler first', 'pool collected first'])
def test_a_pool_ends_even_when_a_worker_never_runs_its_sigterm_handler(how, tmp_path):
    # The hang at exit seen on Zen 3: the terminating pool holds the queue lock and joins a
    # worker waiting for it, whose Python SIGTERM handler never ran (the signal went to one
    # of MXNet's native threads, or came just before the wait began). Here a worker whose
    # SIGTERM is ignored and that never finishes its item is that worker every time: the
    # pool must still end it and the process exit.
    import sys
    import textwrap
    script = textwrap.dedent('''
        import os, signal, sys, time
        sys.path.insert(0, sys.argv[1])
        from gluon_unet.data import dataset, synthetic_dataset

        class Deaf(type(synthetic_dataset(1, 32))):
            def __getitem__(self, i):
                if isinstance(i, tuple) and i[0] == 7:  # the sampler hands out (index, seed)
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    open(sys.argv[3], 'w').close()
                    time.sleep(3600)
                return super().__getitem__(i)

        ds = synthetic_dataset(8, 32)
        ds.__class__ = Deaf
        loader = dataset.make_loader(ds, batch_size=2, shuffle=False, seed=0, workers=2)
        it = iter(loader)
        next(it)  # the batch with item 7 is asked for now, and never comes
        while not os.path.exists(sys.argv[3]):  # until a worker is in it
            time.sleep(0.05)
        if sys.argv[2] == 'pool collected first':
            loader.loader._worker_pool.terminate()
        print('terminating')
    ''')
    # A hang fails on the time-out, the deaf worker killed with its process group.
    code, out = run_in_own_group([sys.executable, '-c', script, ROOT, how, str(tmp_path / 'deaf')], timeout=90)
    assert code == 0 and 'terminating' in out, out[-2000:]
