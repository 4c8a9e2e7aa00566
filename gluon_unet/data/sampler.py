"""The order of an epoch: a seeded shuffle that hands each sample its augmentation seed,
balanced over appearance groups (``--balance``) and dealt to the workers of a
multi-machine job so that they see the same global batches as one process would."""
import numpy as np
from mxnet import gluon


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
    ``epoch_length`` draws that many per epoch instead: with ``groups``, ``--balance
    oversample`` (every group as often as the largest one, so the common group is not
    cut down to make room for the rare ones); without, ``--epoch-samples`` (a few
    images repeat, every one once per reshuffled pass before any a second time). The order
    is computed here, in the main process, from ``(seed, epoch)`` alone, so it is the
    same with any number of loader workers, and every shard deals from the same order.
    """

    def __init__(self, length, shuffle=True, seed=0, num_shards=1, shard=0, block=1, groups=None, power=0.0,
                 epoch_length=None):
        if not 0 <= shard < num_shards:
            raise ValueError('shard %d out of range for %d shards' % (shard, num_shards))
        if groups is not None and len(groups) != length:
            raise ValueError('groups has %d labels for %d samples' % (len(groups), length))
        if epoch_length is not None and epoch_length < 1:
            raise ValueError('epoch_length must be >= 1 (got %r)' % (epoch_length,))
        # draws per epoch: the dataset's size unless --balance or --epoch-samples choose another
        self.size = length
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
        if self.groups is None and self.length == self.size:
            rng = np.random.default_rng([self.seed, self.epoch])
            order = rng.permutation(self.length) if self.shuffle else np.arange(self.length)
            return order, self.seeds()[order]
        if self.groups is None:  # --epoch-samples: whole passes over the images, each reshuffled
            rng = np.random.default_rng([self.seed, self.epoch, 3])
            passes = -(-self.length // self.size)
            order = np.concatenate([rng.permutation(self.size) if self.shuffle else np.arange(self.size)
                                    for _ in range(passes)])[:self.length].astype(np.int64)
            # By position, like balanced groups: each repeat of an image gets its own augmentation.
            return order, np.random.default_rng([self.seed, self.epoch, 1]).integers(0, 2 ** 31, size=self.length)
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
