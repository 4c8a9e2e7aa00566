"""Who this process is in a training job: the one object that knows about workers.

Like Lightning's Strategy, a :class:`Strategy` answers every question whose answer
differs between one process (one or many devices, kvstore ``device``/``local``/``nccl``)
and a parameter-server job of several workers (MXNet's ps-lite, ``dist_*`` kvstores):
rank, whether this process writes the run folder, how many batches one update sums,
where the optimizer runs, how a decision made on rank 0 reaches the others. ``fit()``
asks it and never branches on the kvstore itself.
"""
import contextlib
import itertools
import types

import mxnet as mx

from .errors import UserError, mxnet_message
from .rundir import claim_run_folder, default_output

DIST_KVSTORES = ('dist_sync', 'dist_device_sync', 'dist_async')

# Keys for rank 0's control values, far above the Trainer's parameter keys
# (0 .. #params - 1). Process-wide on purpose: the servers keep every key they were
# given for the life of the job, whichever kvstore object pushed it, so a key must never
# be reused within a process (e.g. by a second fit() in the same worker).
_CONTROL_KEYS = itertools.count(1 << 24)


class Strategy:
    """One process, one or several devices: rank 0 of 1, decisions are its own.

    Parameters
    ----------
    kvstore : str
        ``device``, ``local`` or ``nccl``: passed by name to ``gluon.Trainer``, which
        creates it (and none at all for one device).
    rank, num_workers : int
        Only for tests that play a non-zero rank without a parameter server.
    """

    def __init__(self, kvstore, rank=0, num_workers=1):
        self.kvstore, self.rank, self.num_workers = kvstore, rank, num_workers

    @property
    def is_main(self):
        """Whether this process writes logs, metrics, checkpoints and the export."""
        return self.rank == 0

    @property
    def grad_workers(self):
        """Processes whose equal batches one update sums (see ``DataParallelStep``)."""
        return 1

    def update_on_kvstore(self, requested):
        """``gluon.Trainer(update_on_kvstore=...)`` for ``--update-on-kvstore`` = ``requested``.

        ``nccl`` defaults to False: with MXNet's default (True) KVStoreNCCL would keep
        every merge buffer, weight copy and optimizer state on the first GPU
        (kvstore_nccl.h: "always use devs[0] as root"). ``device`` balances its
        buffers over the GPUs, so MXNet's default stays.
        """
        if self.kvstore == 'nccl' and requested is None:
            return False
        return requested

    def claim_output(self, output, default_base, resume, overwrite):
        """The run folder (locked) as a context manager with ``.path``; see :mod:`.rundir`."""
        return claim_run_folder(output, default_base, resume, overwrite)

    def broadcast(self, values):
        """Rank 0's ``values`` (floats) on every worker; here, ``values`` themselves."""
        return [float(v) for v in values]

    def prepare_network(self, net, ctxs):
        """Make ``net``'s parameters ready for this kvstore (nothing to do locally)."""

    def join(self, trainer):
        """Connect ``trainer`` to the kvstore before the first step (lazy locally)."""

    def checkpoint_trainer(self, trainer, update_on_kvstore):
        """The trainer whose optimizer state a checkpoint can hold."""
        return trainer


class ParameterServer(Strategy):
    """A worker of a ps-lite job started by ``bin/launch`` (``--kvstore dist_*``)."""

    def __init__(self, kvstore):
        try:
            kv = mx.kv.create(kvstore)
        except mx.MXNetError as exc:
            raise UserError('--kvstore %s: could not join the parameter server (%s); start workers with '
                            'bin/launch' % (kvstore, mxnet_message(exc, limit=120))) from None
        super().__init__(kv, kv.rank, kv.num_workers)
        self.sync = kvstore != 'dist_async'

    @property
    def grad_workers(self):
        # dist_sync sums every worker's batch into one update; Gluon does not count them,
        # so step(n) alone would make the update num_workers times too large. Under
        # dist_async each push is its own update.
        return self.num_workers if self.sync else 1

    def update_on_kvstore(self, requested):
        """Synchronous: off by default - the servers only sum gradients and every worker
        applies the same optimizer step to the same sum, so the weights stay identical
        and the optimizer state is local and can be checkpointed. Asynchronous: on -
        MXNet allows nothing else."""
        if not self.sync:
            if requested is False:
                raise UserError('--kvstore dist_async updates on the servers; drop --no-update-on-kvstore')
            return True
        return False if requested is None else requested

    def claim_output(self, output, default_base, resume, overwrite):
        if self.is_main:
            return super().claim_output(output, default_base, resume, overwrite)
        # The other workers write nothing; they only need the folder to find --resume auto.
        return contextlib.nullcontext(types.SimpleNamespace(
            path=output or default_output(default_base, resume) or ''))

    def broadcast(self, values):
        """Rank 0's ``values`` on every worker: one agreed decision for all.

        A worker that decided on its own (early stopping on rank 0's validation, which
        checkpoint to resume) would run a different number of steps and leave the
        others waiting forever for its gradients. Uses the kvstore's own broadcast
        (rank 0 initializes a fresh key, everyone pulls); every worker must call this
        at the same point.
        """
        out = mx.nd.zeros(len(values))
        self.kvstore.broadcast(next(_CONTROL_KEYS), mx.nd.array([float(v) for v in values]), out=out)
        return out.asnumpy().tolist()

    def prepare_network(self, net, ctxs):
        # The shape-resolving forward ran in inference mode, where oneDNN reorders conv
        # weights in place into its own layout; a dist kvstore cannot send such arrays
        # (the push fails inside the engine and the server never gets the key). Fresh
        # copies on the same devices are in the default layout.
        net.collect_params().reset_ctx(ctxs)

    def join(self, trainer):
        """Join the kvstore now: rank 0's weights are on every worker on return.

        Gluon does this lazily inside the first ``trainer.step()``, after that step's
        forward and backward were queued: each parameter is pushed by rank 0 and pulled
        into every worker (``kv.broadcast``) while the engine is still running the step
        that reads those weights. On a loaded machine this intermittently started one
        worker from a wrong value in one or more parameters - not noise but the same
        values every time, as if read from another live array (seen: ``head.bias``
        2.83, BatchNorm gammas near 0 instead of 1) - and the workers trained apart from
        step one on. Initializing before any training op, then waiting until every
        pulled value has landed, costs one round trip per parameter, once per run.
        """
        if not trainer._kv_initialized:
            trainer._init_kvstore()
        if trainer._params_to_init:
            trainer._init_params()
        mx.nd.waitall()

    def checkpoint_trainer(self, trainer, update_on_kvstore):
        # When the servers hold the optimizer state (--update-on-kvstore, dist_async),
        # the workers cannot read it: such checkpoints keep weights only.
        return None if update_on_kvstore else trainer


def make_strategy(kvstore):
    """The :class:`Strategy` for ``--kvstore``."""
    if kvstore in DIST_KVSTORES:
        return ParameterServer(kvstore)
    return Strategy(kvstore)
