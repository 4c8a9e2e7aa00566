"""The training step: the network on the devices, mixed precision, the trainer and loss
(:func:`make_step`), and one epoch of steps (:func:`train_epoch`).

:func:`gluon_unet.training.loop.fit` builds these once per run; the benchmarks and ``gluon-unet
doctor`` build the same step, so they measure and check what training runs.
"""
import collections
import math
import time

import mxnet as mx
import numpy as np

from . import distributed
from ..config import LEVEL_TARGETS
from ..errors import UserError
from ..machine.cpu import require_cpu_bfloat16
from ..machine.devices import has_gpu
from ..machine.onednn import OneDNNLayers
from ..machine.runtime import amx_state, configure_runtime
from ..model import Layers, build_model
from ..reporting import root_logger_untouched
from .losses import SegmentationLoss
from .optim import make_trainer
from .parallel import DataParallelStep, MirroredStep


class Diverged(Exception):
    """The loss became NaN or infinite; the last good checkpoint is kept."""
    exit_code = 3


def network_layers(cfg, ctxs, amp_dtype=None):
    """How the U-Net's pieces are built for training on ``ctxs`` (:class:`~gluon_unet.model.Layers`):
    SyncBatchNorm with ``--sync-bn`` on several devices, AMP's casts, and on CPU contexts
    the oneDNN rewrites (:class:`~gluon_unet.machine.onednn.OneDNNLayers`)."""
    layers = Layers(sync_bn_devices=len(ctxs) if cfg.sync_bn and len(ctxs) > 1 else 0, amp=amp_dtype is not None)
    if ctxs[0].device_type != 'cpu' or not mx.runtime.Features().is_enabled('MKLDNN'):
        return layers
    bfloat16 = amp_dtype == 'bfloat16'
    # Fused layers and the skips' identity only with --memory speed: the recomputation of
    # balanced/low marks separate layers (fused, 'low' saved nothing at width 16).
    return OneDNNLayers(layers, bfloat16=bfloat16, amx=bfloat16 and amx_state()[0], training=cfg.memory == 'speed')


def build_network(cfg, ctxs, amp_dtype=None, net=None):
    """U-Net initialized on ``ctxs`` (He init), deferred shapes resolved, hybridized.

    ``amp_dtype``: :func:`init_amp`'s result (None = float32). ``net``: your own
    HybridBlock instead of the U-Net of ``cfg.model`` (initialized here unless it
    already is).
    """
    configure_runtime(len(ctxs), ctxs[0].device_type)  # process-wide knobs: one place
    mx.random.seed(cfg.seed)
    init = mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2)
    own = net is None
    if own:
        net = build_model(cfg.model, network_layers(cfg, ctxs, amp_dtype))
        net.initialize(init, ctx=ctxs)
    else:
        net.initialize(init, ctx=ctxs)  # no-op (with a warning from MXNet) if already initialized
        net.collect_params().reset_ctx(ctxs)
    if cfg.hybridize:
        # static_alloc is the fast path. SyncBatchNorm keeps the dynamic CachedOp: it was
        # chosen when its running statistics seemed to lag a step behind; that turned out to
        # be the first step's update lost to the Trainer's broadcast (fixed in
        # DataParallelStep, and static SyncBN then matches whole-batch BN on CPU contexts),
        # but static SyncBN on GPUs has never been run, so it is not switched on blind.
        static = not (cfg.sync_bn and len(ctxs) > 1)
        # With --memory balanced/low the hybridized graph only validates (MirroredStep
        # trains through its own bound graph): static buffers would stay allocated for
        # nothing - those of the shape-resolving pass below alone are ~25 MiB per training
        # image at width 64, 256 px, batch 4.
        static = static and cfg.memory == 'speed'
        net.hybridize(static_alloc=static, static_shape=static)
    # Resolve deferred parameter shapes now, once, from the main thread: the threaded
    # SyncBatchNorm step must not race to initialize them.
    side = cfg.crop or cfg.size
    x = mx.nd.zeros((1, cfg.model.in_channels, side, side), ctx=ctxs[0])
    if own:
        # Symbolically, not by a forward pass: that pass created oneDNN inference kernels
        # for a batch of one that training never runs and that stay cached with their
        # scratch memory (bfloat16 on AMX, width 16, 128 px: 81 MiB, 40 -> 36 MiB per
        # training image at batch 16). Gluon finishes a deferred initialization in this
        # order too, so a seed gives the same weights (tests/test_model.py).
        net.infer_shape(x)
        for param in net.collect_params().values():
            param._finish_deferred_init()
    else:
        # Your own block may not infer shapes symbolically: one forward pass, as Gluon does.
        with mx.autograd.predict_mode():
            net(x).wait_to_read()
    return net


def init_amp(cfg, ctxs):
    """Turn on mixed precision (must precede model construction); returns the dtype."""
    if not cfg.amp:
        return None
    dtype = cfg.amp_dtype
    if dtype == 'auto':
        dtype = 'float16' if has_gpu(ctxs) else 'bfloat16'
    if dtype == 'float16' and not has_gpu(ctxs):
        raise UserError('--amp-dtype float16 needs GPUs (--gpus); on CPU use bfloat16')
    if dtype == 'bfloat16' and has_gpu(ctxs):
        raise UserError('--amp-dtype bfloat16 is for CPU training in MXNet 1.9; use float16 on GPUs')
    from mxnet.contrib import amp
    with root_logger_untouched():  # amp.init logs with logging.info
        amp.init(target_dtype=dtype)
    return dtype


def resolve_update_on_kvstore(cfg, amp_dtype, strategy):
    """Whether the kvstore applies the optimizer (``Trainer(update_on_kvstore=...)``).

    Off when something must touch the summed gradients before the update: clipping, or
    float16 loss scaling (unscale and overflow check).
    """
    update_on_kv = strategy.update_on_kvstore(cfg.update_on_kvstore)
    between = cfg.clip_grad > 0 or amp_dtype == 'float16'
    if between and cfg.kvstore == 'dist_async':
        raise UserError('--kvstore dist_async updates on the servers; it cannot be combined with '
                        '--clip-grad or float16 --amp (use dist_sync)')
    if between and update_on_kv:
        raise UserError('--update-on-kvstore cannot be combined with --clip-grad or float16 --amp '
                        '(they change gradients between reduction and update)')
    return False if between else update_on_kv


# --memory -> what MirroredStep recomputes in backward (model.recompute); 'speed' trains
# the hybridized network through autograd (DataParallelStep).
MEMORY_RECOMPUTE = {'balanced': 'activations', 'low': 'blocks'}


def make_step(cfg, net, ctxs, amp_dtype=None, strategy=None, lr_scheduler=None, update_on_kvstore=None):
    """The training step of ``cfg`` for ``net`` on ``ctxs``: trainer, loss, AMP.

    Used by :func:`fit` and by the benchmarks, so both measure the same step.

    Parameters
    ----------
    amp_dtype : {None, 'float16', 'bfloat16'}
        From :func:`init_amp`. Only float16 scales the loss: bfloat16 has float32's
        exponent range, so nothing underflows, and the dynamic scaler's overflow check
        costs a host synchronization and a pass over all gradients every step
        (``multi_all_finite``).
    strategy : distributed.Strategy, optional
        Defaults to one process with ``cfg.kvstore``.
    update_on_kvstore : bool, optional
        From :func:`resolve_update_on_kvstore` (resolved here when not given).

    Returns
    -------
    DataParallelStep
    """
    strategy = strategy or distributed.make_strategy(cfg.kvstore)
    if update_on_kvstore is None:
        update_on_kvstore = resolve_update_on_kvstore(cfg, amp_dtype, strategy)
    scaling = amp_dtype == 'float16'
    trainer = make_trainer(net.collect_params(), cfg.optimizer, cfg.lr, ctxs, kvstore=strategy.kvstore,
                           update_on_kvstore=update_on_kvstore, weight_decay=cfg.weight_decay,
                           momentum=cfg.momentum, nesterov=cfg.nesterov, lr_scheduler=lr_scheduler)
    if scaling:
        from mxnet.contrib import amp
        amp.init_trainer(trainer)
    # A centre or flow map is a level, not a class: Dice on the foreground only (see SegmentationLoss).
    loss_fn = SegmentationLoss(cfg.loss, cfg.dice_weight,
                               dice_channels=1 if cfg.model.target in LEVEL_TARGETS else None,
                               weight_second_only=cfg.weight_on == 'second')
    threaded = cfg.sync_bn and len(ctxs) > 1
    if cfg.hybridize and not threaded:
        # A graph keeps the scratch buffer it drew at its first call. Imperatively, each
        # loss op's backward drew the next one from the pool all CPU contexts share, and
        # when that was the buffer another device's backward held, this device's whole
        # backward waited for the other's (see DataParallelStep._forward_backward). Fewer
        # engine operations per step, too. Not with SyncBatchNorm on several devices: its
        # step calls the loss from one thread per device, and a HybridBlock builds its
        # graph at its first call, unguarded against several threads at once; a thread
        # failing there leaves the others at SyncBatchNorm's barrier for ever. (A CI run
        # hung in test_sync_bn_skips_a_batch_... with the loss hybridized there; not
        # reproduced in 5 runs since, so the threaded path keeps the imperative loss.)
        static = cfg.memory == 'speed'
        loss_fn.hybridize(static_alloc=static, static_shape=static)
    if cfg.memory != 'speed':
        # --memory: a bound graph that recomputes in backward (validate() has refused
        # --amp and --sync-bn with it).
        return MirroredStep(net, loss_fn, trainer, ctxs, recompute=MEMORY_RECOMPUTE[cfg.memory],
                            clip_grad=cfg.clip_grad, workers=strategy.grad_workers)
    return DataParallelStep(net, loss_fn, trainer, ctxs,
                            clip_grad=cfg.clip_grad, loss_scaling=scaling,
                            sync_bn=threaded, workers=strategy.grad_workers)


def check_amp_support(cfg, ctxs):
    """Stop before any work when ``--amp`` cannot run on these devices."""
    if cfg.amp and not has_gpu(ctxs) and cfg.amp_dtype in ('auto', 'bfloat16'):
        require_cpu_bfloat16()


def train_epoch(step, loader, epoch, stop, on_step=None, skip_batches=0, progress=None, lookahead=2,
                on_loss=None):
    """Run one epoch of ``step`` over ``loader``.

    Loss values are read back ``lookahead`` steps late: the devices keep a short queue
    of work and the host never waits for the step it just issued.

    Returns
    -------
    dict
        ``train_loss``, ``images``, ``seconds``, ``images_per_s``, ``per_device_images``,
        ``steps``, ``skipped`` and ``interrupted`` (True when a signal stopped it).

    ``on_step(k)`` is called after the k-th step of the epoch is issued, ``on_loss(k,
    mean_loss)`` once its loss has been read back.
    """
    ndev = len(step.ctxs)
    per_device = np.zeros(ndev, np.int64)
    pending = collections.deque()
    loss_total, images, steps, skipped = 0.0, 0, skip_batches, 0
    t0 = time.time()

    def drain(keep):
        nonlocal loss_total
        while len(pending) > keep:
            at, sums, n = pending.popleft()
            value = sum(s.asscalar() for s in sums)
            if not math.isfinite(value):
                raise Diverged('loss is %s at epoch %d, step %d of the epoch; stopping (the last good '
                               'checkpoint is kept; try a lower --lr or --clip-grad)' % (value, epoch, at))
            loss_total += value
            if on_loss is not None:
                on_loss(at, value / n)

    for batch in loader:  # (image, target) or (image, target, weight)
        if not step.runnable(batch[0].shape[0]):
            skipped += batch[0].shape[0]
            continue
        out = step(*batch)
        n = out['samples']  # with SyncBatchNorm, a multiple of the device count
        skipped += out.get('dropped', 0)
        steps += 1
        images += n
        per_device[:len(out['per_device'])] += out['per_device']
        pending.append((steps, out['loss_sums'], n))
        drain(lookahead)
        if progress is not None:
            progress.update(batch[0].shape[0])
            if steps % 5 == 0 and loss_total:
                progress.set_postfix(loss='%.4f' % (loss_total / max(1, images - sum(p[2] for p in pending))),
                                     img_s='%.1f' % (images / (time.time() - t0)))
        if on_step is not None:
            on_step(steps)
        if stop.signum is not None:
            break
    drain(0)
    mx.nd.waitall()
    seconds = time.time() - t0
    return {'train_loss': loss_total / max(1, images), 'images': images, 'seconds': seconds,
            'images_per_s': images / seconds if seconds > 0 else 0.0,
            'per_device_images': per_device.tolist(), 'steps': steps, 'skipped': skipped,
            'interrupted': stop.signum is not None}
