"""Who this process is in a training job: the one object that knows about workers.

Like Lightning's Strategy, a :class:`Strategy` answers every question whose answer
differs between one process (one or many devices, kvstore ``device``/``local``/``nccl``)
and a job of several processes - MXNet's ps-lite (``dist_*`` kvstores, started by
``bin/launch``: :class:`ParameterServer`) or Horovod's ring-allreduce (``--kvstore
horovod``, started by horovodrun, mpirun or srun: :class:`Horovod`): rank, whether this
process writes the run folder, how many batches one update sums, where the optimizer
runs, how a decision made on rank 0 reaches the others. ``fit()`` asks it and never
branches on the kvstore itself.
"""
import contextlib
import itertools
import os
import types

import mxnet as mx

from ..errors import UserError, mxnet_message
from .run_folder import claim_run_folder, default_output

DIST_KVSTORES = ('dist_sync', 'dist_device_sync', 'dist_async')
# How to get Horovod (the file holds the pinned version and the build flags).
HOROVOD_INSTALL = 'requirements-horovod.txt'

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

    def reporting_failures(self):
        """A context manager around the training stages: turns this kind of job's
        errors into one line (:class:`JobFailed`); nothing to translate locally."""
        return contextlib.nullcontext()


class JobFailed(UserError):
    """Another process of the job failed: this one cannot go on and stops at once.

    ``process_unusable``: the command-line entry point exits without waiting for
    MXNet's engine (:func:`gluon_unet.cli.common.reports_errors`), which may still hold
    operations that waited for the lost process.
    """

    def __init__(self, message):
        super().__init__(message, exit_code=1)
        self.process_unusable = True


class _Job(Strategy):
    """What every multi-process job shares: rank 0 writes, every worker's batch counts
    in one update, parameters start from rank 0's and every worker joins the kvstore
    before its first step."""

    @property
    def grad_workers(self):
        # The kvstore sums every worker's batch into one update; Gluon does not count
        # them, so step(n) alone would make the update num_workers times too large.
        return self.num_workers

    def claim_output(self, output, default_base, resume, overwrite):
        if self.is_main:
            return super().claim_output(output, default_base, resume, overwrite)
        # The other workers write nothing; they only need the folder to find --resume auto.
        return contextlib.nullcontext(types.SimpleNamespace(
            path=output or default_output(default_base, resume) or ''))

    def prepare_network(self, net, ctxs):
        # The shape-resolving forward ran in inference mode, where oneDNN reorders conv
        # weights in place into its own layout; a dist kvstore cannot send such arrays
        # (the push fails inside the engine and the server never gets the key), and
        # Horovod reads raw memory (a oneDNN-layout array aborts the process: "We can't
        # generate TBlob for MKLDNN data"). Fresh copies on the same devices are in the
        # default layout.
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
        ``fit()`` calls it after loading a checkpoint, so a resumed job also starts from
        rank 0's weights.
        """
        if not trainer._kv_initialized:
            trainer._init_kvstore()
        if trainer._params_to_init:
            trainer._init_params()
        mx.nd.waitall()


class ParameterServer(_Job):
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
        # Under dist_async each push is its own update.
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

    def checkpoint_trainer(self, trainer, update_on_kvstore):
        # When the servers hold the optimizer state (--update-on-kvstore, dist_async),
        # the workers cannot read it: such checkpoints keep weights only.
        return None if update_on_kvstore else trainer


def import_horovod():
    """``horovod.mxnet``, or a :class:`UserError` saying how to install it."""
    try:
        import horovod.mxnet as hvd
    except ImportError as exc:
        # Not installed, or built without MXNet (check_extension's ImportError says so).
        raise UserError('--kvstore horovod: Horovod for MXNet is not installed (%s); install it with '
                        '"pip install -r %s" (it builds against the installed mxnet: see that file)'
                        % (_first_line(exc), HOROVOD_INSTALL)) from None
    except OSError as exc:
        # Installed, but its library does not load: built against another mxnet or
        # compiler ("undefined symbol"), or a library it links is gone.
        raise UserError('--kvstore horovod: Horovod is installed but its library does not load (%s); rebuild it '
                        'against this mxnet: "pip install --force-reinstall --no-cache-dir -r %s" (see that file)'
                        % (_first_line(exc), HOROVOD_INSTALL)) from None
    return hvd


def _first_line(exc):
    return str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__


class HorovodKVStore(mx.kv.KVStoreBase):
    """The ``gluon.Trainer``'s kvstore in a Horovod job: gradients summed over every
    device of every process, parameters broadcast from rank 0.

    Horovod's own ``DistributedTrainer`` reduces the first device's gradient only (one
    device per process); this store first sums the process's devices, then
    allreduce-sums across processes, and gives the result to every device, as the
    ``device`` kvstore does within one process. It only sums: Gluon's ``step(n)`` turns
    the sum into the mean (:attr:`Horovod.grad_workers`), and the optimizer runs in
    every process (``is_capable('optimizer')`` is False, so the Trainer updates locally).

    Parameters
    ----------
    hvd : module
        ``horovod.mxnet``, initialized.
    """

    def __init__(self, hvd):
        self._hvd = hvd

    def broadcast(self, key, value, out, priority=0):
        """Rank 0's ``value`` into ``value`` and every array of ``out``."""
        outs = out if isinstance(out, (list, tuple)) else [out]
        self._hvd.broadcast_(value, root_rank=0, name='gluon_unet.param.%s' % key, priority=priority)
        for o in outs:
            if o is not value:
                value.copyto(o)

    def pushpull(self, key, value, out=None, priority=0):
        """Sum ``value`` (an array per device) over the devices and the processes, into
        ``out`` (default: ``value`` itself)."""
        values = value if isinstance(value, (list, tuple)) else [value]
        outs = values if out is None else (out if isinstance(out, (list, tuple)) else [out])
        if len(values) == 1 and outs[0] is values[0]:
            total = values[0]  # one device: reduce in place
        else:
            total = mx.nd.add_n(*[v.as_in_context(values[0].context) for v in values])
        self._hvd.allreduce_(total, average=False, name='gluon_unet.grad.%s' % key, priority=priority)
        for o in outs:
            if o is not total:
                total.copyto(o)

    def is_capable(self, capability):
        return False  # no optimizer on the store: each process updates its own copy

    def set_optimizer(self, optimizer):
        raise NotImplementedError('Horovod sums gradients only; the optimizer runs in every process')

    def save_optimizer_states(self, fname, dump_optimizer=False):
        raise NotImplementedError('the optimizer state is in the Trainer of each process')

    def load_optimizer_states(self, fname):
        raise NotImplementedError('the optimizer state is in the Trainer of each process')

    @property
    def type(self):
        return 'horovod'

    @property
    def rank(self):
        return self._hvd.rank()

    @property
    def num_workers(self):
        return self._hvd.size()


class Horovod(_Job):
    """A process of a Horovod job (``--kvstore horovod``) started by horovodrun, mpirun
    or srun: ring-allreduce between the processes, no parameter servers.

    Like ``dist_sync``: ``--batch-size`` is per process, one update averages the
    gradient over the global batch (processes x ``--batch-size``), every process
    applies the same optimizer step to the same sum (the optimizer state is local and
    checkpointed), data are sharded by rank, rank 0 alone writes. Started alone (no
    launcher), it is a job of one.
    """

    def __init__(self):
        if os.environ.get('DMLC_ROLE'):
            # bin/launch would start independent jobs of one, all writing one run folder,
            # and its parameter server would wait for workers that never come.
            raise UserError('--kvstore horovod is started by horovodrun, mpirun or srun, not bin/launch '
                            '(which starts ps-lite jobs: --kvstore dist_sync)')
        hvd = import_horovod()
        try:
            hvd.init()
        except Exception as exc:  # a launcher's environment Horovod cannot use
            raise UserError('--kvstore horovod: Horovod could not start (%s); start the processes with '
                            'horovodrun, mpirun or srun' % mxnet_message(exc, limit=160)) from None
        self._hvd = hvd
        super().__init__(HorovodKVStore(hvd), hvd.rank(), hvd.size())

    def update_on_kvstore(self, requested):
        """Always False: Horovod sums gradients, each process runs the optimizer."""
        if requested:
            raise UserError('--update-on-kvstore with --kvstore horovod: Horovod only sums gradients, the '
                            'optimizer runs in every process; drop --update-on-kvstore')
        return False

    def broadcast(self, values):
        """Rank 0's ``values`` (floats) on every process; every process must call this
        at the same point (like :meth:`ParameterServer.broadcast`)."""
        arr = mx.nd.array([float(v) for v in values], dtype='float64')
        # One name per length: Horovod matches the processes' tensors by name, and a
        # name must keep its shape from one call to the next.
        self._hvd.broadcast_(arr, root_rank=0, name='gluon_unet.control.%d' % len(values))
        return arr.asnumpy().tolist()

    @contextlib.contextmanager
    def reporting_failures(self):
        """When a process of the job dies or fails, Horovod shuts down in every other
        process, and each one's next wait (a loss read back, a broadcast) raises an
        MXNetError carrying Horovod's explanation: that becomes one line here, not a
        traceback from wherever the wait happened (the launcher stops the job anyway;
        this is what each process prints meanwhile)."""
        try:
            yield
        except mx.MXNetError as exc:
            text = str(exc)
            if 'Horovod' not in text:
                raise
            if 'has been shut down' in text:
                raise JobFailed('--kvstore horovod: another process of the job failed or exited, so Horovod '
                                'shut down and process %d of %d stops too (the first error in the job\'s '
                                'output is the cause)' % (self.rank, self.num_workers)) from None
            raise JobFailed('--kvstore horovod: %s' % mxnet_message(exc)) from None


def make_strategy(kvstore):
    """The :class:`Strategy` for ``--kvstore``."""
    if kvstore in DIST_KVSTORES:
        return ParameterServer(kvstore)
    if kvstore == 'horovod':
        return Horovod()
    return Strategy(kvstore)
