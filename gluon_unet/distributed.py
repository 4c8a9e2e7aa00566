"""Multi-machine training through MXNet's parameter server (ps-lite kvstore)."""
import os

import mxnet as mx

from .errors import UserError

DIST_KVSTORES = ('dist_sync', 'dist_device_sync', 'dist_async')


def kvstore_for(kvstore, ctxs):
    """The kvstore to give ``gluon.Trainer``, and this process's rank and worker count.

    Local kvstores (``device``, ``local``, ``nccl``) are passed as names (the Trainer
    creates them, and none at all for one device); a dist kvstore is created here
    because its rank decides which shard of the data this worker reads.

    Returns
    -------
    (kvstore, rank, num_workers)
    """
    if kvstore not in DIST_KVSTORES:
        return kvstore, 0, 1
    try:
        kv = mx.kv.create(kvstore)
    except mx.MXNetError as exc:
        raise UserError('--kvstore %s: could not join the parameter server (%s); start workers with '
                        'bin/launch' % (kvstore, str(exc).strip().splitlines()[0][:120])) from None
    return kv, kv.rank, kv.num_workers


# Keys for control values, far above the Trainer's parameter keys (0 .. #params - 1).
_CONTROL_KEY_BASE = 1 << 24
_next_control_key = [_CONTROL_KEY_BASE]


def from_rank0(kv, values):
    """Rank 0's ``values`` (floats), on every worker: one agreed decision for all.

    A worker that decided on its own (early stopping on rank 0's validation, which
    checkpoint to resume) would run a different number of steps and leave the others
    waiting forever for its gradients. Uses the kvstore's own broadcast (rank 0
    initializes a fresh key, everyone pulls); every worker must call this at the same
    point. Without a dist kvstore it returns ``values`` unchanged.
    """
    values = [float(v) for v in values]
    if not isinstance(kv, mx.kv.KVStore) or 'dist' not in kv.type:
        return values
    key = _next_control_key[0]
    _next_control_key[0] += 1
    out = mx.nd.zeros(len(values))
    kv.broadcast(key, mx.nd.array(values), out=out)
    return out.asnumpy().tolist()


def init_kvstore(trainer):
    """Join ``trainer``'s dist kvstore now: rank 0's weights are on every worker on return.

    Gluon does this lazily inside the first ``trainer.step()``, after that step's
    forward and backward were queued: each parameter is pushed by rank 0 and pulled
    into every worker (``kv.broadcast``) while the engine is still running the step
    that reads those weights. On a loaded machine this intermittently started one
    worker from a wrong value in one or more parameters - not noise but the same
    values every time, as if read from another live array (seen: ``head.bias`` 2.83,
    BatchNorm gammas near 0 instead of 1) - and the workers trained apart from step
    one on. ``Trainer.load_states`` (resume) initializes eagerly and never showed it.
    Doing the same before any training op, then waiting until every pulled value has
    landed, costs one round trip per parameter, once per run.
    """
    if not trainer._kv_initialized:
        trainer._init_kvstore()
    if trainer._params_to_init:
        trainer._init_params()
    mx.nd.waitall()


def grad_workers(kvstore, num_workers):
    """How many workers' batches are summed into one update (see DataParallelStep)."""
    return num_workers if kvstore in ('dist_sync', 'dist_device_sync') else 1


def default_update_on_kvstore(kvstore, requested):
    """``--update-on-kvstore`` resolved for a dist kvstore (``requested`` for the others).

    Synchronous: off by default - the servers only sum gradients and every worker
    applies the same optimizer step to the same sum, so the weights stay identical and
    the optimizer state (momentum, LR schedule position) is local and can be
    checkpointed (``Trainer.save_states`` refuses when the servers hold it).
    Asynchronous: on - MXNet allows nothing else.
    """
    if kvstore == 'dist_async':
        if requested is False:
            raise UserError('--kvstore dist_async updates on the servers; drop --no-update-on-kvstore')
        return True
    if kvstore in DIST_KVSTORES and requested is None:
        return False
    return requested


def serve():
    """Be the parameter server / scheduler this process was started as.

    For these roles ``import mxnet`` (at the top of this module) runs ps-lite's loop and
    calls ``sys.exit()`` once every worker has finished, so importing this module never
    returns there: ``bin/train`` checks ``DMLC_ROLE`` before it parses flags or
    touches data, model or output folder, and calls this.
    """
    # Only reached when MXNet was imported before DMLC_ROLE was set (so it did not serve).
    raise UserError('DMLC_ROLE=%s: MXNet was imported before the role was set; start the job with '
                    'bin/launch' % os.environ.get('DMLC_ROLE'))
