"""Page-locked (pinned) host buffers for the batches that feed GPUs, reused batch after batch.

A copy to a GPU reads page-locked memory by DMA, without the staging copy pageable
memory needs. Gluon's ``DataLoader(pin_memory=True)`` gets it with a fresh
``cpu_pinned`` array per batch, and MXNet 1.9.1 does not pool pinned memory: its
``cpu_pinned`` storage is a ``NaiveStorageManager<PinnedMemoryStorage>``
(``src/storage/storage.cc``), which calls ``cudaHostAlloc`` for every array and
``cudaFreeHost`` when it dies (``src/storage/pinned_memory_storage.h``, under the GPU
storage mutex in builds with NCCL). A batch of 64 x 3 x 256 x 256 float32 images with
their targets is ~67 MB locked and unlocked every step, and ``cudaFreeHost`` waits for
the device. :class:`PinnedRing` allocates a few buffers per batch shape once and copies
each batch into the next one.
"""
import collections

import mxnet as mx

#: Buffers per batch shape: the batch being copied to the GPUs, the next one the loader
#: hands over while the step runs, and one to spare for the steps queued ahead (the
#: training loop reads losses two steps late).
RING_SLOTS = 3
#: Batch shapes kept at once (a short last batch adds one); the oldest is let go beyond.
MAX_SHAPES = 4


class PinnedRing:
    """Copy each batch into the next of ``slots`` page-locked buffers for its shape.

    Parameters
    ----------
    device_id : int
        The GPU the buffers are locked for (``cpu_pinned(device_id)``).
    slots : int
        Buffers per shape (and array of the batch).

    Calling it with a batch (a list or tuple of NDArrays) returns the same arrays, in
    pinned memory. A returned batch is valid until ``slots`` more batches have been
    drawn: its buffers are then written again. MXNet orders that write after every
    operation already queued that reads the buffer (the copies to the GPUs), so the
    training step, which queues its copies at once, never sees a batch change.
    """

    def __init__(self, device_id, slots=RING_SLOTS):
        self.ctx = mx.Context('cpu_pinned', int(device_id))
        self.slots = max(1, int(slots))
        # the batch's (shape, dtype)s -> [slot][array] buffers; the next slot to write
        self._rings = collections.OrderedDict()
        self._next = {}

    def __call__(self, batch):
        key = tuple((tuple(a.shape), a.dtype) for a in batch)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = [[mx.nd.empty(shape, ctx=self.ctx, dtype=dtype) for shape, dtype in key]
                                       for _ in range(self.slots)]
            self._next[key] = 0
            if len(self._rings) > MAX_SHAPES:
                old, _ = self._rings.popitem(last=False)
                del self._next[old]
        self._rings.move_to_end(key)
        k = self._next[key]
        self._next[key] = (k + 1) % self.slots
        for array, buffer in zip(batch, ring[k]):
            array.copyto(buffer)
        return tuple(ring[k]) if isinstance(batch, tuple) else list(ring[k])

    def buffers(self):
        """How many pinned arrays the ring holds (for tests and logs)."""
        return sum(len(slot) for ring in self._rings.values() for slot in ring)
