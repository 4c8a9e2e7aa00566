"""In-memory segmentation datasets, seeded sampling and loaders.

Every source of data (generated nuclei, user folders, the DSB layout, a CSV) ends up as
a :class:`SegmentationDataset`: arrays of images, class masks and instance labels, with
an optional augmentation applied to all three together. Augmentation randomness comes
from a seed derived from ``(run seed, epoch, sample index)``, carried to the dataset by
the sampler, so the same seed gives the same batches with any number of loader workers.
"""
import gc
import logging
import multiprocessing
import pickle
import multiprocessing.connection
import multiprocessing.util
import os
import signal
import time
import weakref

import numpy as np
from mxnet import context, gluon, nd
from mxnet.gluon.data import dataloader as gluon_loader
from mxnet.util import is_np_array, is_np_shape

from ..errors import UserError
from .pinned import PinnedRing
from .targets import make_target, separate_touching


class SegmentationDataset(gluon.data.Dataset):
    """Images with masks and instance labels.

    Parameters
    ----------
    images : array-like, (N, H, W, C) uint8 or float32
        uint8 is scaled by 1/255; float32 is used as is (already normalized).
        May be a ``np.memmap`` or a list of arrays of different sizes (with ``transform``
        cropping them to one size).
    masks : array-like, (N, H, W) uint8
        Class per pixel (binary: 0/1).
    instances : array-like, (N, H, W) int32, optional
        Instance labels (0 = background); needed by the DSB metric and ``wbce``.
        When omitted, connected components of ``masks > 0`` are used.
    names : list of str, optional
        Sample names (file stems) for logs and predictions.
    transform : callable, optional
        ``transform(image, mask, instances, rng) -> (image, mask, instances)``; see
        :mod:`gluon_unet.data.augment`.
    weight_fn : callable, optional
        ``weight_fn(instances) -> (H, W) float32`` per-pixel loss weights (``wbce``).
    target : {'mask', 'mask-gap', 'mask+border', 'mask+centre', 'mask+contact'}
        What the network learns (:func:`gluon_unet.data.targets.make_target`).
    groups : list of str, optional
        Each sample's appearance group (``--balance groups``); None = unknown.

    ``dataset[i]`` or ``dataset[(i, seed)]`` returns ``(image (C,H,W) float32,
    target (K,H,W) float32)`` (K = 1 for ``mask`` and ``mask-gap``, 2 for the targets with
    a second map), plus ``weight (1,H,W) float32`` when ``weight_fn`` is set.
    """

    def __init__(self, images, masks, instances=None, names=None, transform=None, weight_fn=None,
                 original_sizes=None, target='mask', groups=None):
        if len(images) != len(masks):
            raise ValueError('images and masks differ in length: %d vs %d' % (len(images), len(masks)))
        if instances is not None and len(instances) != len(images):
            raise ValueError('instances and images differ in length')
        self.images, self.masks, self._instances = images, masks, instances
        self.names = list(names) if names is not None else ['%05d' % i for i in range(len(images))]
        self.transform, self.weight_fn, self.target = transform, weight_fn, target
        self.original_sizes = original_sizes
        self.groups = None if groups is None else list(groups)

    def __len__(self):
        return len(self.images)

    def instances(self, i):
        """Instance labels of sample ``i`` (connected components if none were given)."""
        if self._instances is not None:
            return np.asarray(self._instances[i])
        from skimage.measure import label
        return label(np.asarray(self.masks[i]) > 0, connectivity=1).astype(np.int32)

    def raw(self, i):
        """``(image HWC, mask HW, instances HW)`` of sample ``i`` before augmentation."""
        return np.asarray(self.images[i]), np.asarray(self.masks[i]), self.instances(i)

    def subset(self, indices, transform=None, weight_fn=None):
        """A view on some samples (used for the train/validation split)."""
        indices = np.asarray(indices, dtype=np.int64)
        pick = _Picker(indices)
        return SegmentationDataset(
            pick(self.images), pick(self.masks),
            None if self._instances is None else pick(self._instances),
            [self.names[i] for i in indices], transform, weight_fn,
            None if self.original_sizes is None else [self.original_sizes[i] for i in indices], self.target,
            None if self.groups is None else [self.groups[i] for i in indices])

    def sample(self, i, seed=None):
        """``(image HWC, mask HW, instances HW)`` of sample ``i`` after its transform with
        ``seed``: the instance labels follow every crop and flip (nearest neighbour), so
        touching nuclei stay apart for the DSB metric."""
        image, mask, inst = self.raw(i)
        if self.transform is not None:
            image, mask, inst = self.transform(image, mask, inst, np.random.default_rng(seed))
        return image, mask, inst

    def __getitem__(self, idx):
        i, seed = idx if isinstance(idx, tuple) else (idx, None)
        image, mask, inst = self.sample(i, seed)
        if image.dtype == np.uint8:
            image = image.astype(np.float32) * (1.0 / 255)
        image = np.ascontiguousarray(image.transpose(2, 0, 1), dtype=np.float32)
        target = make_target(mask, inst, self.target)
        if self.weight_fn is None:
            # No all-ones weight map: it would be batched, copied to every device and
            # multiplied in for nothing.
            return image, target
        if self.target in ('mask-gap', 'mask+contact'):
            # The weight map's border term lives on background pixels between nuclei:
            # with the contacts cleared it lands on the gaps the target asks for (the
            # cut line of mask-gap, the contact line of mask+contact).
            inst = separate_touching(inst)
        return image, target, self.weight_fn(inst).astype(np.float32)[None]


class _Picker:
    """Index an array (or list, or memmap) lazily so subsets do not copy the data."""

    def __init__(self, indices):
        self.indices = indices

    def __call__(self, arr):
        return _Subset(arr, self.indices)


class _Subset:
    def __init__(self, arr, indices):
        self.arr, self.indices = arr, indices

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        return self.arr[int(self.indices[i])]


class EpochSampler(gluon.data.Sampler):
    """Seeded shuffling that also hands each sample its augmentation seed.

    Yields ``(index, seed)`` pairs. With ``num_shards > 1`` (distributed training) the
    shuffled order is padded by wrapping around to a multiple of ``num_shards * block``
    and dealt to the shards in blocks of ``block`` samples, round-robin: every shard has
    the same length (every worker runs the same number of equal-size steps, so none
    waits forever at the end of an epoch), and with ``block`` = the per-worker batch,
    step k of all workers together is exactly batch k of one process using a
    ``num_shards`` times larger batch - distributed and single-process runs see the same
    global batches.

    With ``groups`` (one label per index, ``--balance groups``) every group is drawn
    equally often per epoch, in an epoch of the same length (:func:`balanced_order`):
    a rare group's samples repeat, each repeat with its own augmentation seed.
    ``epoch_length`` (with ``groups`` only) draws that many per epoch instead
    (``--balance oversample``: every group as often as the largest one, so the common
    group is not cut down to make room for the rare ones). The order
    is computed here, in the main process, from ``(seed, epoch)`` alone, so it is the
    same with any number of loader workers, and every shard deals from the same order.
    """

    def __init__(self, length, shuffle=True, seed=0, num_shards=1, shard=0, block=1, groups=None, power=0.0,
                 epoch_length=None):
        if not 0 <= shard < num_shards:
            raise ValueError('shard %d out of range for %d shards' % (shard, num_shards))
        if groups is not None and len(groups) != length:
            raise ValueError('groups has %d labels for %d samples' % (len(groups), length))
        if epoch_length is not None and (groups is None or epoch_length < 1):
            raise ValueError('epoch_length needs groups and must be >= 1 (got %r)' % (epoch_length,))
        # draws per epoch: the dataset's size unless balanced groups choose another
        length = length if epoch_length is None else int(epoch_length)
        self.length, self.shuffle, self.seed = length, shuffle, seed
        self.num_shards, self.shard, self.epoch, self.skip = num_shards, shard, 0, 0
        self.block = max(1, int(block))
        self.groups = None if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
        self.power = power

    def set_epoch(self, epoch, skip_samples=0):
        """Select the epoch's order; ``skip_samples`` resumes an interrupted epoch."""
        self.epoch, self.skip = epoch, skip_samples

    def _per_shard(self):
        if self.num_shards == 1:
            return self.length
        round_ = self.num_shards * self.block
        return -(-self.length // round_) * self.block

    def __len__(self):
        return self._per_shard() - self.skip

    def _epoch(self):
        """``(indices, seeds)`` of the whole epoch in visiting order, before sharding."""
        if self.groups is None:
            rng = np.random.default_rng([self.seed, self.epoch])
            order = rng.permutation(self.length) if self.shuffle else np.arange(self.length)
            return order, self.seeds()[order]
        order = balanced_order(self.groups, self.length, np.random.default_rng([self.seed, self.epoch, 2]),
                               self.power)
        # By position, not by index: the repeats of a rare group's sample differ.
        return order, np.random.default_rng([self.seed, self.epoch, 1]).integers(0, 2 ** 31, size=self.length)

    def _shard(self, arr):
        """This shard's part of an epoch-long array."""
        if self.num_shards == 1:
            return arr
        per = self._per_shard()
        padded = np.resize(arr, per * self.num_shards)  # wraps around to pad
        blocks = padded.reshape(-1, self.num_shards, self.block)  # (round, shard, block)
        return blocks[:, self.shard].reshape(-1)

    def order(self):
        """The indices this shard visits in the current epoch."""
        return self._shard(self._epoch()[0])

    def seeds(self):
        """Each sample's augmentation seed in the current epoch, by sample index (without
        ``groups``; with them the seeds go by position, see :meth:`__iter__`)."""
        return np.random.default_rng([self.seed, self.epoch, 1]).integers(0, 2 ** 31, size=self.length)

    def __iter__(self):
        order, seeds = (self._shard(a) for a in self._epoch())
        for i, seed in zip(order[self.skip:], seeds[self.skip:]):
            yield int(i), int(seed)


def balanced_order(groups, length, rng, power=0.0):
    """An epoch of ``length`` indices drawing every group equally often (or in proportion
    to its size to the ``power``), shuffled.

    Parameters
    ----------
    groups : (N,) int array
        Group of every index, 0 .. G-1.
    length : int
        Indices to draw; each group gets ``length * size**power / sum(sizes**power)``,
        rounded down (the remainder goes to random groups): ``power`` 0 = equal shares,
        0.5 = in proportion to the square root of the group's size (a rare group is seen
        more often than its size says, a common one is not starved), 1 = no balancing.
    rng : np.random.Generator

    Returns
    -------
    (length,) int64
        A group smaller than its share repeats its samples - every sample once per
        reshuffled pass before any sample a second time, so repeats are as even as they
        can be; a larger group contributes a random subset (a different one each epoch).
    """
    groups = np.asarray(groups)
    names, sizes = np.unique(groups, return_counts=True)
    weights = sizes.astype(np.float64) ** power
    share = np.floor(length * weights / weights.sum()).astype(np.int64)
    share[rng.permutation(len(names))[:length - share.sum()]] += 1
    parts = []
    for g, k in zip(names, share):
        members = np.flatnonzero(groups == g)
        passes = -(-k // len(members))
        parts.append(np.concatenate([rng.permutation(members) for _ in range(passes)])[:k])
    return rng.permutation(np.concatenate(parts)).astype(np.int64)


def split_indices(n, val_fraction, seed):
    """Seeded train/validation split (not Keras' 'last N %').

    Returns
    -------
    (train_idx, val_idx) : tuple of np.ndarray
        Disjoint, together covering ``range(n)``; at least one validation sample when
        ``val_fraction > 0``.
    """
    order = np.random.default_rng([seed, 12345]).permutation(n)
    n_val = int(round(n * val_fraction))
    if val_fraction > 0:
        n_val = max(1, n_val)
    if n - n_val < 1:
        raise UserError('--val-split %.3g leaves no training images (%d images in all)'
                        % (val_fraction, n))
    return np.sort(order[n_val:]), np.sort(order[:n_val])


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
