"""The loader (:func:`make_loader`): batches of a
:class:`~gluon_unet.data.dataset.SegmentationDataset` in the order of an
:class:`~gluon_unet.data.sampler.EpochSampler`, made in this process or in its own worker
processes (:class:`LoaderWorkers`), optionally into page-locked memory for the GPUs.
"""
import gc
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import signal
import time
import weakref

import numpy as np
from mxnet import gluon, nd
from mxnet.gluon.data import dataloader as gluon_loader
from mxnet.util import is_np_array, is_np_shape

from ..errors import UserError
from .pinned import PinnedRing
from .sampler import EpochSampler


def default_workers(num_gpus, cores=None):
    """Loader processes when ``--workers`` is not given: 2 per GPU, at most the CPU cores
    less one (the main process feeds the GPUs); 2 for CPU training, where the loader
    shares the cores with the network."""
    cores = cores or os.cpu_count() or 1
    if num_gpus:
        return max(1, min(2 * num_gpus, cores - 1))
    return min(2, cores)


def make_loader(dataset, batch_size, shuffle, seed, workers=0, num_shards=1, shard=0, pin_device=None,
                groups=None, power=0.0, epoch_length=None):
    """A loader over ``dataset`` drawing from an :class:`EpochSampler` (``groups``,
    ``power``, ``epoch_length``: balance them, see there), with ``workers`` processes
    (0 = in this process; see :class:`LoaderWorkers`).

    Call :func:`set_loader_epoch` before each epoch to reshuffle, and ``close()`` when
    done (it ends the workers; also done when the loader is collected and at exit). With
    ``pin_device`` (a GPU id), batches arrive in page-locked memory, which the copies to
    the GPUs read without a staging copy: a few buffers reused batch after batch
    (:class:`~gluon_unet.data.pinned.PinnedRing`; a batch is valid until 3 more were
    drawn), not Gluon's ``pin_memory``, which locks and frees new memory every batch.
    Batches are ``(image, target)`` or, when the dataset has a ``weight_fn``,
    ``(image, target, weight)``.
    """
    sampler = EpochSampler(len(dataset), shuffle=shuffle, seed=seed, num_shards=num_shards, shard=shard,
                           block=batch_size, groups=groups, power=power, epoch_length=epoch_length)
    batches = gluon.data.BatchSampler(sampler, batch_size, last_batch='keep')
    pool = None
    if workers > 0:
        # Processes, not threads: numpy/OpenCV augmentations that hold the GIL would
        # serialize; a prefetch of 2 per worker keeps memory bounded.
        check_shared_memory(dataset, batch_size, 2 * workers)
        pool = LoaderWorkers(dataset, workers)
    pin = PinnedRing(pin_device) if pin_device is not None else None
    return _Loader(dataset, batches, sampler, pool, prefetch=2 * workers, pin=pin)


#: Seconds a worker waits for a task before it checks that its main process still lives.
WORKER_WATCHDOG_SECONDS = 1.0


#: Seconds the workers get to finish at shutdown before they are killed (SIGKILL).
WORKER_EXIT_SECONDS = 5.0


#: Seconds without any batch after which the loader gives up (Gluon's DataLoader default).
BATCH_TIMEOUT_SECONDS = 120.0


_PARENT_ENDS = weakref.WeakSet()  # this process's ends of every live worker's pipe


class LoaderWorkers:
    """The loader's worker processes, ended in a way that cannot block.

    Gluon's DataLoader runs its workers in a ``multiprocessing.Pool``, whose shutdown
    cannot be made safe from outside: ``Pool.terminate`` first takes the task queue's read
    lock, which an idle worker holds while it waits for a task (CPython bpo-22393). A
    worker that died there - killed by the OOM killer, by ``kill -9``, or by a SIGTERM
    whose Python handler then never ran - leaves the lock taken for ever, and the main
    process blocked in ``Pool._help_stuff_finish`` at its exit, or whenever the garbage
    collector ran ``DataLoader.__del__`` (reproduced: ``kill -9`` both idle workers, then
    drop the loader). And ``terminate`` ended the workers with SIGTERM and joined them
    without a time-out.

    Here, as in PyTorch's DataLoader, nothing is shared between the processes that one of
    them could die holding: each worker has a pipe of its own, which carries its tasks
    (sample indices) in and its batches (in shared memory, as Gluon sends them) out. The
    workers ignore SIGINT and SIGTERM (a Ctrl-C or a SIGTERM to the process group is the
    main process's to handle: it saves a checkpoint and then ends them), and end on a
    ``None`` task, when their pipe closes, or when their main process is gone (checked
    every :data:`WORKER_WATCHDOG_SECONDS`). :meth:`close` sends each a ``None``, joins them
    for up to :data:`WORKER_EXIT_SECONDS`, then SIGKILLs and joins any left: every wait has
    a time-out, and no lock is taken. It runs when the loader is closed or collected,
    and at exit before multiprocessing's own exit handler (which would otherwise join the
    workers with no time-out).
    """

    def __init__(self, dataset, count):
        ctx = multiprocessing.get_context('fork')  # the workers share the dataset's pages
        # Gluon's DataLoader does the same before it forks: no operation in flight, and
        # dead loaders' workers collected first.
        nd.waitall()
        gc.collect()
        nd.waitall()
        self.procs, self.conns = [], []
        np_flags = (is_np_shape(), is_np_array())
        # A Ctrl-C or SIGTERM arriving while a worker is forked waits (blocked) until its
        # handlers are set to ignore them; the main process gets it just after.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for i in range(count):
                here, there = ctx.Pipe()
                self.conns.append(here)
                _PARENT_ENDS.add(here)  # before the fork: the worker closes its copy of it too
                try:
                    proc = ctx.Process(target=_worker_main, args=(dataset, there, os.getpid(), np_flags),
                                       name='gluon_unet loader worker %d' % i, daemon=True)
                    proc.start()
                finally:
                    there.close()  # so the pipe reads as closed here once the worker is gone
                self.procs.append(proc)
        except BaseException:
            stop_workers(self.procs, self.conns)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        # Runs when this object is collected, when close() calls it, and at exit at
        # priority 100, before multiprocessing's exit handler reaches its children.
        self._stop = multiprocessing.util.Finalize(self, stop_workers, args=(self.procs, self.conns),
                                                   exitpriority=100)
        self.outstanding = [0] * count  # tasks sent to each worker and not yet answered
        self.sent = 0  # tasks sent in all

    def __len__(self):
        return len(self.procs)

    @property
    def closed(self):
        return not self._stop.still_active()

    def close(self):
        """End the workers (see the class doc); at most about :data:`WORKER_EXIT_SECONDS`."""
        self._stop()

    def send(self, key, samples):
        """Give the task ``(key, samples)`` to the next worker in turn."""
        i = self.sent % len(self.procs)
        try:
            self.conns[i].send((key, samples))
        except OSError:  # its end of the pipe is closed: it is gone
            raise WorkerDied(i, self.procs[i]) from None
        self.outstanding[i] += 1
        self.sent += 1

    def receive(self, timeout):
        """``(worker index, (key, pickled batch, error))``: the next answer of any worker; raises
        :class:`WorkerDied` for a worker that ended with tasks unanswered and
        ``multiprocessing.TimeoutError`` when none answers within ``timeout`` s."""
        waiting = [i for i, n in enumerate(self.outstanding) if n]
        if not waiting:
            raise RuntimeError('no task is outstanding')
        handles = {}
        for i in waiting:
            handles[self.conns[i]] = i
            handles[self.procs[i].sentinel] = i
        ready = multiprocessing.connection.wait(list(handles), timeout)
        if not ready:
            raise multiprocessing.TimeoutError()
        for handle in ready:  # a pipe before its process's end: its last batch may be there
            i = handles[handle]
            if handle is self.conns[i] or self.conns[i].poll():
                try:
                    message = self.conns[i].recv()
                except (EOFError, OSError):
                    break
                self.outstanding[i] -= 1
                return i, message
        raise WorkerDied(i, self.procs[i])


class WorkerDied(Exception):
    """A loader worker ended with tasks unanswered."""

    def __init__(self, index, proc):
        proc.join(1.0)
        code = proc.exitcode
        how = ('was killed by %s' % _signal_name(-code) if code is not None and code < 0
               else 'ended (exit code %s)' % code)
        hint = ' (the out-of-memory killer?)' if code == -signal.SIGKILL else ''
        super().__init__('the data loader\'s worker %d (pid %d) %s%s before the epoch\'s batches were made; '
                         'training stopped (--workers 0 loads in the main process)' % (index, proc.pid, how, hint))


def _signal_name(number):
    try:
        return signal.Signals(number).name
    except ValueError:
        return 'signal %d' % number


def stop_workers(procs, conns, grace=None):
    """End loader worker processes without ever blocking: a ``None`` task to each, a join
    of up to ``grace`` seconds (:data:`WORKER_EXIT_SECONDS`), then SIGKILL and a bounded
    join for any still alive; their pipes are closed. Safe from any thread, at exit, and
    when a worker is dead, stopped or never reads again."""
    grace = WORKER_EXIT_SECONDS if grace is None else grace
    for conn in conns:
        try:
            os.set_blocking(conn.fileno(), False)  # a full pipe must not block the goodbye
            conn.send(None)
        except (OSError, ValueError):  # closed, broken, full: the join below times out instead
            pass
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()  # SIGKILL: nothing is shared that it could hold
    for proc in procs:
        proc.join(5.0)  # bounded: a process in uninterruptible sleep must not hang the exit either
    for conn in conns:
        _PARENT_ENDS.discard(conn)
        conn.close()


def _worker_main(dataset, conn, parent, np_flags):
    """A loader worker: answer ``(key, samples)`` tasks with ``(key, pickled batch, None)``
    (or ``(key, None, exception)``) until a ``None`` task, a closed pipe or the end of the
    main process ``parent``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    for other in list(_PARENT_ENDS):  # other loaders' pipes, inherited: they must close with their owner
        other.close()
    gluon_loader._worker_initializer(dataset, *np_flags)
    while True:
        try:
            if not conn.poll(WORKER_WATCHDOG_SECONDS):
                if os.getppid() != parent:
                    return
                continue
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        key, samples = task
        try:
            answer = (key, gluon_loader._worker_fn(samples, gluon_loader.default_mp_batchify_fn), None)
        except Exception as exc:  # noqa: BLE001 - handed to the main process, which raises it
            answer = (key, None, _portable(exc))
        try:
            conn.send(answer)
        except (OSError, ValueError):
            return


def _portable(exc):
    """``exc`` with its traceback, picklable (else a RuntimeError holding its text)."""
    import traceback
    from multiprocessing.pool import ExceptionWithTraceback  # what Pool sends: raised with the worker's traceback
    wrapped = ExceptionWithTraceback(exc, exc.__traceback__)
    try:
        pickle.dumps(wrapped)
        return wrapped
    except Exception:  # noqa: BLE001
        return RuntimeError(''.join(traceback.format_exception(exc)))


class _Loader:
    """Batches of a dataset in the order of an :class:`EpochSampler`, made in this
    process or by :class:`LoaderWorkers`."""

    def __init__(self, dataset, batch_sampler, epoch_sampler, workers=None, prefetch=0, pin=None):
        self.dataset, self.batch_sampler, self.epoch_sampler = dataset, batch_sampler, epoch_sampler
        self.pool, self.prefetch = workers, max(1, prefetch)
        self.pin = pin  # a PinnedRing, or None
        self.workers = len(workers) if workers is not None else 0
        self._epoch = 0  # tags each pass's tasks: answers to an abandoned pass are dropped

    def __len__(self):
        return len(self.batch_sampler)

    def close(self):
        """End the worker processes (if any); the loader cannot be iterated after it."""
        if self.pool is not None:
            self.pool.close()

    def __iter__(self):
        batches = self._in_process() if self.pool is None else self._from_workers()
        for batch in batches:
            yield batch if self.pin is None else self.pin(batch)

    def _in_process(self):
        for samples in self.batch_sampler:
            yield gluon_loader.default_batchify_fn([self.dataset[i] for i in samples])

    def _from_workers(self):
        pool = self.pool
        if pool.closed:
            raise RuntimeError('the data loader was closed')
        self._epoch += 1
        try:
            yield from self._passes(pool, self._epoch)
        except WorkerDied as exc:
            raise UserError(str(exc)) from None
        except multiprocessing.TimeoutError:
            raise UserError('the data loader\'s %d worker processes sent no batch for %d s; batches travel through '
                            'shared memory (/dev/shm, %s): in Docker start the container with --shm-size=2g or '
                            'more, or lower --workers or --batch-size (--workers 0 loads in the main process)'
                            % (self.workers, BATCH_TIMEOUT_SECONDS, _shm_free_text())) from None

    def _passes(self, pool, epoch):
        """One pass over the batch sampler: up to ``prefetch`` tasks out, batches in order."""
        tasks = iter(self.batch_sampler)
        ready, sent, wanted = {}, 0, 0
        while True:
            while sent - wanted < self.prefetch:
                samples = next(tasks, None)
                if samples is None:
                    break
                pool.send((epoch, sent), samples)
                sent += 1
            if wanted == sent:
                return
            while wanted not in ready:
                i, ((at, k), data, error) = pool.receive(BATCH_TIMEOUT_SECONDS)
                if error is not None and at == epoch:
                    raise error
                if data is not None:
                    # Unpickled even when stale (an abandoned pass): that fetches the shared
                    # memory from the worker, which holds it until someone does.
                    try:
                        batch = pickle.loads(data)
                    except OSError:  # the worker died before the batch's memory was fetched
                        raise WorkerDied(i, pool.procs[i]) from None
                    if at == epoch:
                        ready[k] = batch
            yield ready.pop(wanted)
            wanted += 1


def _shm_free():
    try:
        st = os.statvfs('/dev/shm')
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _shm_free_text():
    free = _shm_free()
    return 'not found' if free is None else '%d MB free' % (free // 2 ** 20)


def check_shared_memory(dataset, batch_size, prefetch):
    """Warn when /dev/shm cannot hold the batches the loader's workers prefetch.

    The loader's worker processes hand batches over in shared memory; when it runs out (64 MB
    is Docker's default) the loader stalls until its 120 s time-out.

    Returns
    -------
    bool
        False when it warned.
    """
    free = _shm_free()
    if free is None or not len(dataset):
        return True
    sample = dataset[0]
    batch_bytes = batch_size * sum(np.asarray(a).nbytes for a in sample)
    need = batch_bytes * (prefetch + 1)
    if free >= need:
        return True
    logging.getLogger('gluon_unet').warning(
        'warning: /dev/shm has %d MB free, but the loader keeps up to %d batches of ~%d MB there: in Docker '
        'use --shm-size=%dm or more, or lower --workers / --batch-size', free // 2 ** 20, prefetch + 1,
        max(1, batch_bytes // 2 ** 20), 2 * need // 2 ** 20 + 64)
    return False


def set_loader_epoch(loader, epoch, skip_samples=0):
    """Reshuffle (and reseed augmentation) for ``epoch``, optionally skipping its start."""
    loader.epoch_sampler.set_epoch(epoch, skip_samples)
