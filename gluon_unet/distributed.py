"""Multi-machine training through MXNet's parameter server (ps-lite kvstore)."""
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
