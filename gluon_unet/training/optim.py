"""Optimizers and learning-rate schedules, built on MXNet's own (``mx.optimizer``,
``mx.lr_scheduler``) so their state round-trips through ``Trainer.save_states``."""
import mxnet as mx
from mxnet import gluon

from ..errors import UserError, mxnet_message


@mx.optimizer.register
class AdamW(mx.optimizer.Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter); MXNet 1.9 has none built in.

    The Adam part runs with no L2 term; the decay ``lr * wd * w`` is applied to the
    weight directly, so it is not rescaled by the adaptive denominator.
    """

    def _get_wd(self, index):
        return 0.0

    def update(self, index, weight, grad, state):
        super().update(index, weight, grad, state)
        wd = mx.optimizer.Optimizer._get_wd(self, index)  # the real per-parameter wd
        if wd:
            weight[:] = weight * (1.0 - self._get_lr(index) * wd)


def make_lr_scheduler(schedule, lr, total_steps, warmup_steps=0, step_fractions=(0.6, 0.85)):
    """An ``mx.lr_scheduler`` stepped per iteration, or ``None`` for a constant rate.

    Parameters
    ----------
    schedule : {'constant', 'cosine', 'poly', 'step'}
    lr : float
        Peak learning rate (after warmup).
    total_steps : int
        Optimizer updates in the whole run.
    warmup_steps : int
        Linear warmup from 0 to ``lr``.
    step_fractions : sequence of float
        For ``'step'``: where in the run the rate drops 10x.
    """
    total_steps = max(1, int(total_steps))
    warmup_steps = min(int(warmup_steps), total_steps - 1)
    common = dict(base_lr=lr, warmup_steps=warmup_steps, warmup_begin_lr=0.0, warmup_mode='linear')
    if schedule == 'cosine':
        return mx.lr_scheduler.CosineScheduler(total_steps, final_lr=0.0, **common)
    if schedule == 'poly':
        return mx.lr_scheduler.PolyScheduler(total_steps, pwr=0.9, final_lr=0.0, **common)
    if schedule == 'step':
        steps = sorted({max(warmup_steps + 1, int(f * total_steps)) for f in step_fractions})
        return mx.lr_scheduler.MultiFactorScheduler(steps, factor=0.1, **common)
    if warmup_steps:
        # A factor of 1 never decays: a constant rate that still warms up.
        return mx.lr_scheduler.FactorScheduler(total_steps + 1, factor=1.0, **common)
    return None


def make_trainer(params, optimizer, lr, ctxs, kvstore='device', update_on_kvstore=None,
                 weight_decay=0.0, momentum=0.9, nesterov=True, lr_scheduler=None):
    """A ``gluon.Trainer`` whose kvstore sums gradients across ``ctxs``.

    Parameters
    ----------
    params : ParameterDict
    optimizer : {'sgd', 'adam', 'adamw'}
    kvstore : str or mx.kv.KVStore
        ``'device'`` reduces on the devices (GPU peer-to-peer); ``'local'`` on the CPU;
        ``'nccl'`` needs GPUs; a created dist kvstore for multi-machine training.
    update_on_kvstore : bool or None
        ``False`` is needed for gradient clipping and AMP (they touch the gradients
        between reduction and update).
    weight_decay : float
        Applied to the convolution kernels only, not to biases or BatchNorm's gamma/beta.
    """
    if kvstore == 'nccl' and not any(c.device_type == 'gpu' for c in ctxs):
        raise UserError('--kvstore nccl needs GPUs (NCCL is a GPU library); use --kvstore device '
                        'or local on CPU')
    if update_on_kvstore and len(ctxs) == 1 and isinstance(kvstore, str) and 'dist' not in kvstore:
        # One device in one process: Gluon creates no kvstore (model._create_kvstore), and
        # Trainer._init_kvstore then asked None whether it can run an optimizer
        # (AttributeError). The update is local either way.
        update_on_kvstore = None
    opt_params = {'learning_rate': lr, 'wd': weight_decay}
    if lr_scheduler is not None:
        opt_params['lr_scheduler'] = lr_scheduler
    if optimizer == 'sgd':
        name = 'nag' if nesterov and momentum > 0 else 'sgd'
        opt_params['momentum'] = momentum
    elif optimizer in ('adam', 'adamw'):
        name = optimizer
    else:
        raise UserError('--optimizer must be one of sgd, adam, adamw (got %r)' % optimizer)
    try:
        trainer = gluon.Trainer(params, name, opt_params, kvstore=kvstore,
                                update_on_kvstore=update_on_kvstore)
    except mx.MXNetError as exc:
        raise UserError('--kvstore %s: MXNet could not create it: %s'
                        % (kvstore, mxnet_message(exc))) from None
    # The optimizer's param_dict maps the Trainer's own indices to its Parameters. Here it
    # reads wd_mult from the Parameters; a dist kvstore's servers get a pickled copy without
    # them (Optimizer.__getstate__ drops param_dict) and read the index-keyed wd_mult.
    opt = trainer.optimizer
    for index, param in opt.param_dict.items():
        if _exempt_from_decay(param):
            param.wd_mult = 0.0
            opt.wd_mult[index] = 0.0
    return trainer


def _exempt_from_decay(param):
    """Biases and BatchNorm's gamma/beta (every parameter of at most one dimension) are not
    decayed: pulling them to zero regularizes nothing and, for gamma, shrinks a layer's
    output scale (the rule of timm's ``param_groups_weight_decay``)."""
    return len(param.shape or ()) <= 1 or param.name.endswith(('_bias', '_gamma', '_beta'))


def resize_lr_scheduler(scheduler, total_steps, step_fractions=(0.6, 0.85)):
    """Change, in place, the run length ``scheduler`` (from :func:`make_lr_scheduler`)
    decays over, so the rate still reaches its end at the new last step.

    In place because the trainer (and a local kvstore updating on itself) holds this
    very object. Cosine and poly are functions of the step, so the rate moves smoothly
    to the new curve. The step schedule keeps the drops already taken and moves the
    ones still ahead. A constant rate (``None`` or a factor-1 schedule) has no length.
    """
    total_steps = max(1, int(total_steps))
    if isinstance(scheduler, (mx.lr_scheduler.CosineScheduler, mx.lr_scheduler.PolyScheduler)):
        scheduler.max_update = max(total_steps, scheduler.warmup_steps + 1)
        scheduler.max_steps = scheduler.max_update - scheduler.warmup_steps
    elif isinstance(scheduler, mx.lr_scheduler.MultiFactorScheduler):
        taken = list(scheduler.step[:scheduler.cur_step_ind])
        after = taken[-1] if taken else scheduler.warmup_steps
        ahead = []
        for f in sorted(step_fractions)[len(taken):]:  # MXNet wants them increasing
            after = max(after + 1, int(f * total_steps))
            ahead.append(after)
        scheduler.step = taken + ahead
