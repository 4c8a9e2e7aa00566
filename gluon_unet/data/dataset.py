"""In-memory segmentation datasets, seeded sampling and loaders.

Every source of data (generated nuclei, user folders, the DSB layout, a CSV) ends up as
a :class:`SegmentationDataset`: arrays of images, class masks and instance labels, with
an optional augmentation applied to all three together. Augmentation randomness comes
from a seed derived from ``(run seed, epoch, sample index)``, carried to the dataset by
the sampler, so the same seed gives the same batches with any number of loader workers.
"""
import contextlib
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import threading
import weakref

import numpy as np
from mxnet import gluon

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
    """A Gluon DataLoader over ``dataset`` drawing from an :class:`EpochSampler`
    (``groups``, ``power``, ``epoch_length``: balance them, see there).

    Call :func:`set_loader_epoch` before each epoch to reshuffle. With ``pin_device``
    (a GPU id), batches arrive in page-locked memory, which the copies to the GPUs read
    without a staging copy: a few buffers reused batch after batch
    (:class:`~gluon_unet.data.pinned.PinnedRing`; a batch is valid until 3 more were
    drawn), not Gluon's ``pin_memory``, which locks and frees new memory every batch.
    Batches are ``(image, target)`` or, when the dataset has a ``weight_fn``,
    ``(image, target, weight)``.
    """
    sampler = EpochSampler(len(dataset), shuffle=shuffle, seed=seed, num_shards=num_shards, shard=shard,
                           block=batch_size, groups=groups, power=power, epoch_length=epoch_length)
    batches = gluon.data.BatchSampler(sampler, batch_size, last_batch='keep')
    kwargs = {}
    if workers > 0:
        # Threads would serialize on the GIL for numpy/OpenCV augmentations that do not
        # release it; processes with a small prefetch keep memory bounded.
        kwargs = dict(num_workers=workers, prefetch=2 * workers)
        check_shared_memory(dataset, batch_size, 2 * workers)
    shutdown = _WorkerShutdown() if workers > 0 else None
    with _workers_survive_sigterm(shutdown):  # Gluon forks the workers right here
        loader = gluon.data.DataLoader(dataset, batch_sampler=batches, **kwargs)
    if shutdown is not None:
        shutdown.guard(getattr(loader, '_worker_pool', None))
    return _Loader(loader, sampler, workers, pin=PinnedRing(pin_device) if pin_device is not None else None)


class _WorkerShutdown:
    """A flag in shared memory that the loader's worker processes read: set when the
    main process shuts their pool down.

    A SIGTERM sent to the whole process group (``kill -- -PGID``, Slurm's ``scancel``,
    ``pkill -f``) would kill a worker while it waits for a task holding the pool's queue
    lock, and the main process - which handles SIGTERM by saving a checkpoint - would
    then hang forever at exit, shutting the pool down on that lock. So the workers
    ignore SIGTERM while their main process lives, until it shuts the pool down.
    (MXNet's loader ignores SIGINT in its workers for the same reason.)

    Pool's terminate takes that lock itself and then stops the workers, and it must not
    rely on their SIGTERM handler to do so: a Python handler runs only when the worker's
    main thread gets back to Python, and a worker waiting for the lock the terminating
    pool holds never does if the signal was taken by one of MXNet's native threads, or
    arrived just before the wait began. That is the hang at exit seen in CI on Zen 3
    (parent joining, worker in ``SemLock.__enter__`` with the flag set). So once the
    flag is set the pool's workers are stopped with SIGKILL: by then the main process
    holds the queue lock, so no worker can die holding it.
    """

    def __init__(self):
        self.flag = multiprocessing.RawValue('b', 0)
        self.parent = os.getpid()
        self._pool = None
        # At exit, multiprocessing's handler runs its finalizers highest priority first;
        # the pool terminates its workers in one of priority 15. This one comes before it,
        # whatever order the exit hooks ran in.
        multiprocessing.util.Finalize(None, self.set, exitpriority=100)

    def set(self):
        """The pool is being shut down: tell its workers, and have the pool SIGKILL them."""
        self.flag.value = 1
        pool = self._pool() if self._pool is not None else None
        for proc in list(getattr(pool, '_pool', None) or ()):
            # Pool._terminate_pool calls each worker's terminate() after taking the queue lock.
            proc.terminate = proc.kill

    def guard(self, pool):
        """Set the flag whenever ``pool`` is terminated, before exit too: Gluon's
        DataLoader terminates it when collected, at whatever point the garbage collector
        does that."""
        if pool is None:
            return
        self._pool = weakref.ref(pool)
        terminate = pool.terminate

        def set_then_terminate():
            self.set()
            terminate()
        pool.terminate = set_then_terminate


_FORKING = {}  # while a loader forks its workers: its _WorkerShutdown and the SIGTERM handler before


def _loader_sigterm(signum, frame):
    """SIGTERM in a loader worker (see :class:`_WorkerShutdown`)."""
    shutdown, before = _FORKING.get('shutdown'), _FORKING.get('handler')
    if shutdown is None or os.getpid() == shutdown.parent:  # the main process, while it forks
        if callable(before):
            return before(signum, frame)
        if before == signal.SIG_IGN:
            return None
    elif not shutdown.flag.value and os.getppid() == shutdown.parent:
        return None  # the main process lives and has not shut the pool down: it will
    os._exit(128 + signum)


@contextlib.contextmanager
def _workers_survive_sigterm(shutdown):
    """Fork the loader's workers with :func:`_loader_sigterm` as their SIGTERM handler."""
    if shutdown is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    _FORKING.update(shutdown=shutdown, handler=signal.getsignal(signal.SIGTERM))
    signal.signal(signal.SIGTERM, _loader_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, _FORKING['handler'])


class _Loader:
    """The DataLoader, with its sampler at hand and its worker time-out said plainly."""

    def __init__(self, loader, epoch_sampler, workers, pin=None):
        self.loader, self.epoch_sampler, self.workers = loader, epoch_sampler, workers
        self.pin = pin  # a PinnedRing, or None

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        it = iter(self.loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except multiprocessing.TimeoutError:
                raise UserError('the data loader\'s %d worker processes sent no batch for 120 s; batches travel '
                                'through shared memory (/dev/shm, %s): in Docker start the container with '
                                '--shm-size=2g or more, or lower --workers or --batch-size (--workers 0 loads in '
                                'the main process)' % (self.workers, _shm_free_text())) from None
            yield batch if self.pin is None else self.pin(batch)


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

    Gluon's worker processes hand batches over in shared memory; when it runs out (64 MB
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
