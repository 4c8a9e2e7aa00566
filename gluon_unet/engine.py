"""Training: ``fit(cfg)`` is the whole job, as a short list of named stages.

``fit`` picks the run folder, then ``_train`` runs the stages in order: the data
(`prepare_data`), the resume point (`find_resume_point`), the run folder's writer
(`recorder.RunRecorder`), the network (`build_network`) and the step (`make_step`), the
epochs (`train_epoch` and `validate` each epoch), and the export. Everything that differs
between one process and a multi-machine job is asked of a `distributed.Strategy`.
"""
import collections
import contextlib
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass

import mxnet as mx
import numpy as np

# Everything fit() may need is imported up front: a run that trains for an hour must not
# fail at its last step because the code on disk changed underneath it.
from . import distributed
from . import metrics as M
from . import postprocess
from .averaging import applied, make_average
from .budget import epoch_estimate, planned_epochs
from .checkpoint import damaged_resume, list_checkpoints, load_checkpoint, resolve_resume
from .config import TrainConfig, resume_conflicts
from .data.dataset import default_workers, make_loader, set_loader_epoch
from .data.prepare import BALANCE_POWER, balanced_epoch_length, log_groups, prepare_data
from .data.targets import OUTPUTS
from .devices import context_names, has_gpu, make_contexts
from .hardware import require_cpu_bfloat16
from .errors import DamagedFile, UserError, WriteError
from .export import ExportError
from .sidecar import geometry
from .losses import SegmentationLoss
from .model import build_model, probability_maps
from .optim import make_lr_scheduler, make_trainer, resize_lr_scheduler
from .paths import check_apart
from .parallel import DataParallelStep, MirroredStep, check_sync_bn_batch, split_batch
from .recorder import RunRecorder, RunState
from .reporting import setup_logging
from .search import search_seconds, tune_postprocessing
from .runtime import configure_runtime, process_gpus
from .tblog import require_tensorboardx


class Interrupted(Exception):
    """Ctrl-C / SIGTERM: a resumable checkpoint was saved; ``exit_code`` is 130 or 143."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


class Diverged(Exception):
    """The loss became NaN or infinite; the last good checkpoint is kept."""
    exit_code = 3


def check_resumable(path, meta, cfg, data_id):
    """Refuse, in one line, to resume ``meta`` (a checkpoint's record) with settings or
    data it cannot continue exactly (``config.RESUME_POLICY``)."""
    saved = TrainConfig.from_dict(meta['config'])
    conflicts = resume_conflicts(saved, cfg)
    if conflicts:
        raise UserError('--resume %s: the run was trained with %s; resume with the same values (or start a '
                        'new run)' % (path, ', '.join(conflicts)))
    old = meta.get('data')
    keys = ('train', 'val', 'names_sha1', 'content_sha1')
    if old and any(k in old and old[k] != data_id[k] for k in keys):
        read = resume_conflicts(saved, cfg, kind='data')
        raise UserError('--resume %s: the data changed since the checkpoint (it trained on %d images and '
                        'validated on %d, now %d and %d, or other files or pixels%s); resume with the same data'
                        % (path, old['train'], old['val'], data_id['train'], data_id['val'],
                           '; read with %s' % ', '.join(read) if read else ''))
    if old and old.get('workers', 1) != data_id['workers']:
        raise UserError('--resume %s: the run had %d worker(s), now %d: the global batch would change; '
                        'resume with bin/launch -n %d' % (path, old.get('workers', 1), data_id['workers'],
                                                          old.get('workers', 1)))


# -- network -------------------------------------------------------------------------------

def build_network(cfg, ctxs, amp_dtype=None, net=None):
    """U-Net initialized on ``ctxs`` (He init), deferred shapes resolved, hybridized.

    ``amp_dtype``: :func:`init_amp`'s result (None = float32). ``net``: your own
    HybridBlock instead of the U-Net of ``cfg.model`` (initialized here unless it
    already is).
    """
    configure_runtime(len(ctxs), ctxs[0].device_type)  # process-wide knobs: one place
    mx.random.seed(cfg.seed)
    init = mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2)
    if net is None:
        net = build_model(cfg.model, sync_bn_devices=len(ctxs) if cfg.sync_bn and len(ctxs) > 1 else 0,
                          amp_dtype=amp_dtype)
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
    with mx.autograd.predict_mode():
        net(mx.nd.zeros((1, cfg.model.in_channels, side, side), ctx=ctxs[0])).wait_to_read()
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
    # amp.init logs with the module-level logging.info, which configures the root logger
    # when the application has not (logging.basicConfig): every gluon_unet line after it
    # was printed twice. A handler on the root logger for the call keeps it unconfigured.
    root, quiet = logging.getLogger(), logging.NullHandler()
    root.addHandler(quiet)
    try:
        amp.init(target_dtype=dtype)
    finally:
        root.removeHandler(quiet)
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
    # A centre map is a level, not a class: Dice on the foreground only (see SegmentationLoss).
    loss_fn = SegmentationLoss(cfg.loss, cfg.dice_weight,
                               dice_channels=1 if cfg.model.target == 'mask+centre' else None,
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


# -- one epoch -----------------------------------------------------------------------------

class _StopFlag:
    """Set by SIGINT/SIGTERM; the loop checks it after each step."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:  # a second Ctrl-C: the user really wants out
            raise KeyboardInterrupt
        self.signum = signum

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


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


def _forward_eval(net, ctxs, arrays, loss_fn, second=None):
    """Inference-mode forward of ``arrays[0]`` split over ``ctxs``: probability maps
    ``(N, K, H, W)`` (foreground, then the ``second`` map of a two-map model: 'border',
    'centre' or 'contact') and the summed loss against ``arrays[1:]`` (target, weight), computed on
    the devices; also whether the model is binary (a foreground, alone or with a second map)."""
    probs, losses = [], []
    with mx.autograd.predict_mode():
        for part in split_batch(arrays, ctxs):
            logits = net(part[0])
            losses.append(loss_fn(logits, *part[1:]).sum())
            probs.append(probability_maps(logits, second))
    maps = np.concatenate([p.asnumpy() for p in probs], axis=0)
    return maps, sum(float(l.asscalar()) for l in losses), bool(second) or logits.shape[1] == 1


def validate(net, ctxs, dataset, batch_size, loss_fn, threshold=0.5, instance_metric=True, keep=None):
    """Validation loss, pixel IoU (averaged over thresholds 0.50:0.95), Dice and DSB score.

    Pixel metrics are summed over the whole set (not averaged per batch), so the
    numbers do not depend on the batch size or on how batches fall on devices; they
    score the foreground against the true nuclei (a ``mask-gap`` model's target gaps
    count as foreground; a two-map model's second channel enters the loss and, through
    the instances, the DSB score). A two-map model's ``val_dsb`` is the better of two
    scores, both also returned: its instances grown from its second map's markers
    (``val_dsb_border``, ``val_dsb_centre`` or ``val_dsb_contact``) and from the distance
    watershed on its foreground (``val_dsb_distance``). With a list ``keep``, the first few
    ``(image, truth, probability)`` are appended to it (for TensorBoard's overlays).
    """
    pixel = M.PixelMetrics()
    loss_total, offset = 0.0, 0
    t0 = time.time()
    binary = True
    gap_target = getattr(dataset, 'target', 'mask') == 'mask-gap'
    second = _second(getattr(dataset, 'target', 'mask'))
    # The search after training chooses a two-map model's markers between its second map
    # and the distance watershed (search.tune_postprocess), so the epoch it is given
    # is picked by the better of the two: scored by the second map's markers alone, a
    # centre model's val_dsb peaked early while the distance watershed, which the search
    # then chose, kept improving (experiments/dsb2018/log.md, the centre map at depth 5).
    dsbs = {markers: M.DSBMetric() for markers in ((second, 'distance') if second else (None,))}
    for batch, maps, loss_sum, binary, true_labels in _val_batches(net, ctxs, dataset, batch_size, loss_fn):
        loss_total += loss_sum
        truth = batch[1].asnumpy()[:, 0]
        prob = maps[:, 0]
        labels = [true_labels(k) for k in range(len(prob))] if binary and (
            instance_metric or gap_target) else None
        if gap_target:  # its gaps are foreground in the truth: score against the true nuclei
            truth = np.stack(labels) > 0
        pixel.update(prob, truth > 0)  # foreground = any non-background class
        if keep is not None and len(keep) < KEEP_VAL_SAMPLES:
            keep.extend(zip(batch[0].asnumpy(), truth, prob))
            del keep[KEEP_VAL_SAMPLES:]
        if binary and instance_metric:
            for k in range(len(prob)):
                for markers, dsb in dsbs.items():
                    dsb.update(postprocess.instances_from_maps(maps[k], threshold, markers=markers), labels[k])
        offset += len(prob)
    px = pixel.result()
    result = {'val_loss': loss_total / max(1, offset), 'val_iou': px['iou'], 'val_iou50': px['iou50'],
              'val_dice': px['dice']}
    if instance_metric and binary:
        scores = {markers: dsb.result() for markers, dsb in dsbs.items()}
        result['val_dsb'] = max(scores.values())
        if second:
            result.update(('val_dsb_%s' % markers, score) for markers, score in scores.items())
    result['val_seconds'] = time.time() - t0
    return result


KEEP_VAL_SAMPLES = 4  # validation overlays per epoch in TensorBoard


def _val_batches(net, ctxs, dataset, batch_size, loss_fn):
    """The validation set in inference mode, batch by batch, in order, with the loader's
    deterministic crops: yields ``(batch, maps, loss_sum, binary, true_labels)`` (maps as
    :func:`_forward_eval` gives them), where
    ``true_labels(k)`` are the true instance labels of the batch's sample ``k``, cropped
    like its image (see :func:`val_instances`)."""
    loader = make_loader(dataset, batch_size, shuffle=False, seed=0, workers=0)
    seeds = loader.epoch_sampler.seeds()
    second = _second(getattr(dataset, 'target', 'mask'))
    offset = 0
    for batch in loader:
        prob, loss_sum, binary = _forward_eval(net, ctxs, list(batch), loss_fn, second)
        yield batch, prob, loss_sum, binary, \
            (lambda k, first=offset: val_instances(dataset, first + k, seeds[first + k]))
        offset += len(prob)


def _second(target):
    """The second output map a ``--target`` adds ('border', 'centre', 'contact'), or None."""
    outputs = OUTPUTS[target]
    return outputs[1] if len(outputs) > 1 else None


def val_instances(dataset, i, seed):
    """The true instance labels of validation sample ``i`` as the network saw it (cropped
    like the image with the loader's ``seed``): touching nuclei count as separate
    objects, as in the DSB metric itself - not as connected components of the mask."""
    if dataset.transform is None:
        return dataset.instances(i)
    return dataset.sample(i, seed)[2]


# -- the whole run -------------------------------------------------------------------------

def fit(cfg, train_ds=None, val_ds=None, verbose=True, callbacks=(), net=None):
    """Train a U-Net as configured; the Python API behind ``bin/train``.

    Parameters
    ----------
    cfg : TrainConfig
    train_ds, val_ds : SegmentationDataset, optional
        Your own datasets; when omitted they come from ``cfg.data`` (or generated nuclei).
    verbose : bool
        Log to stderr (the run folder's ``train.log`` is always written).
    callbacks : sequence of callable or objects with ``on_epoch_end``
        Called after every epoch (once its checkpoint is saved): ``cb(record)``, or
        ``cb.on_epoch_end(record, context)`` with an :class:`EpochContext` (network,
        trainer, run state, config). Returning True ends training there, like early
        stopping.
    net : HybridBlock, optional
        Your own network instead of the U-Net of ``cfg.model``: any block mapping
        ``(N, C, H, W)`` to logits ``(N, classes, H, W)``; it is trained on all the
        devices, checkpointed and exported the same way (set ``cfg.model.in_channels``,
        ``classes`` and ``depth`` - input sides are multiples of ``2**depth`` - to match
        it; not with ``amp``).

    Returns
    -------
    FitResult
        A list with one record per epoch (losses, metrics, learning rate, images/s,
        seconds), and ``.output``, the run folder (``metrics.csv``, checkpoints, export).
    """
    cfg = TrainConfig.from_dict(cfg.to_dict())  # private copy: fit() resolves a few fields
    cfg.validate()
    ctxs = make_contexts(process_gpus(cfg.gpus, cfg.kvstore), cfg.cpus)  # Horovod: this process's share
    if cfg.sync_bn:
        check_sync_bn_batch(cfg.batch_size, len(ctxs))
    # What was asked for is checked before what this machine can do: a request that
    # cannot work anywhere must say so on every CPU, not only on those with bfloat16.
    if net is not None and cfg.amp:
        raise UserError('amp with your own network: MXNet AMP rewrites the operators for the whole process, '
                        'so its float32 export is rebuilt from cfg.model in a fresh process; train it in float32')
    check_amp_support(cfg, ctxs)
    if cfg.tensorboard:
        require_tensorboardx()
    strategy = distributed.make_strategy(cfg.kvstore)
    default_base = 'runs/demo' if cfg.data is None and train_ds is None else 'runs/unet'
    # The run folder is an output: never the data, nor inside it (the next run would read it).
    check_apart([('--output', cfg.output or default_base)],
                [('--data', cfg.data), ('--masks', cfg.masks), ('--val-data', cfg.val_data)], 'train')
    # Claimed (and locked) before any data is decoded: a clash costs seconds, not the
    # minutes of a decode; released - and removed if still empty - on any error.
    with strategy.claim_output(cfg.output, default_base, cfg.resume, cfg.overwrite) as folder:
        cfg.output = folder.path
        with strategy.reporting_failures():  # another process of the job failed: one line
            history = _train(cfg, ctxs, strategy, (train_ds, val_ds), verbose, callbacks, net)
    return FitResult(history, output=cfg.output, is_main=strategy.is_main)


class FitResult(list):
    """What :func:`fit` returns: the per-epoch records (a list), plus ``output`` (the run
    folder, which fit() picks when ``cfg.output`` is None) and ``is_main`` (False on the
    workers of a multi-machine job other than rank 0, which write nothing)."""

    def __init__(self, history, output, is_main=True):
        super().__init__(history)
        self.output, self.is_main = output, is_main


def check_amp_support(cfg, ctxs):
    """Stop before any work when ``--amp`` cannot run on these devices."""
    if cfg.amp and not has_gpu(ctxs) and cfg.amp_dtype in ('auto', 'bfloat16'):
        require_cpu_bfloat16()


@dataclass
class _Run:
    """The fixed parts of a run that every epoch uses."""
    cfg: TrainConfig
    ctxs: list
    net: object
    step: DataParallelStep
    loader: object
    steps_per_epoch: int
    val_ds: object
    recorder: RunRecorder
    average: object = None   # the --ema weight average (None = off)
    started: float = 0.0     # _clock() when this process began the run (--time-budget)
    search_reserve: float = None  # --time-budget: seconds kept for the search (None = not probed yet)
    probe_seconds: float = 0.0    # the search probe's share of the next epoch's clock (not the epoch's own)


def _will_tune(cfg, val_ds):
    """Whether the run ends with the post-processing search (rank 0 holds ``val_ds``)."""
    return bool(cfg.tune_postprocess and val_ds is not None and len(val_ds) and cfg.model.classes == 1)


def _train(cfg, ctxs, strategy, datasets, verbose, callbacks, user_net=None):
    """The stages of a run: data, resume point, run folder, network and step, epochs, export."""
    started = _clock()  # --time-budget counts the data loading too
    # Console only until the input is known to be good: bad input writes nothing.
    log = setup_logging(None, verbose=verbose and strategy.is_main)
    gpus = [c.device_id for c in ctxs if c.device_type == 'gpu']
    workers_note = ''
    if cfg.workers is None:  # decoding and the loader scale with the GPUs
        cfg.workers = default_workers(len(gpus))
        workers_note = ' (default for %d GPU(s); --workers to change)' % len(gpus)
    train_ds, val_ds, data_id = prepare_data(cfg, *datasets, strategy.num_workers)
    groups = getattr(train_ds, 'groups', None)
    if cfg.balance != 'none' and groups is None:
        raise UserError('--balance %s: the training images have no appearance groups (generated demo '
                        'nuclei, or a dataset of your own without .groups); use --balance none' % cfg.balance)
    resume_path = find_resume_point(cfg, data_id, strategy)
    monitor = cfg.monitor if val_ds is not None else 'train_loss'
    with _on_write_error(cfg, complete=False):
        recorder = RunRecorder(cfg, monitor, data_id, enabled=strategy.is_main, verbose=verbose,
                               user_net=user_net)
        recorder.start()
    if val_ds is None:
        # Said once, because both fall-backs are silent in the epoch lines.
        log.info('no validation images (--val-split 0, no --val-data): the best checkpoint is the one with the '
                 'lowest train_loss, not %s%s', cfg.monitor,
                 '; the export keeps the default post-processing (bin/predict flags override it)'
                 if cfg.tune_postprocess else '')
    amp_dtype = init_amp(cfg, ctxs)
    net = build_network(cfg, ctxs, amp_dtype, user_net)
    strategy.prepare_network(net, ctxs)
    log_groups(log, groups, cfg.balance)
    loader = make_loader(train_ds, cfg.batch_size, shuffle=True, seed=cfg.seed, workers=cfg.workers,
                         num_shards=strategy.num_workers, shard=strategy.rank,
                         pin_device=gpus[0] if gpus else None,
                         groups=groups if cfg.balance != 'none' else None, power=BALANCE_POWER.get(cfg.balance, 0.0),
                         epoch_length=balanced_epoch_length(groups, cfg.balance))
    steps_per_epoch = len(loader)
    lr_sched = make_lr_scheduler(cfg.lr_schedule, cfg.lr, cfg.epochs * steps_per_epoch,
                                 warmup_steps=int(cfg.warmup_epochs * steps_per_epoch),
                                 step_fractions=cfg.step_fractions())
    update_on_kv = resolve_update_on_kvstore(cfg, amp_dtype, strategy)
    step = make_step(cfg, net, ctxs, amp_dtype, strategy, lr_sched, update_on_kv)
    ckpt_trainer = strategy.checkpoint_trainer(step.trainer, update_on_kv)
    average = make_average(net, ctxs, cfg.ema)
    state = RunState()
    if resume_path:
        meta = load_checkpoint(resume_path, net, ckpt_trainer, ctx=ctxs, average=average)
        state = RunState.from_meta(meta)
        recorder.saver.restore(meta)
        log.info('resumed from %s (epoch %d, step %d%s)', resume_path, state.epoch, state.step,
                 ', %d batches into the next epoch' % state.step_in_epoch if state.step_in_epoch else '')
    strategy.join(step.trainer)  # not lazily inside the first step, racing with it
    log.info('training on %d device(s) %s%s, %d train / %d val images, %d steps per epoch, %d loader '
             'worker(s)%s', len(ctxs), context_names(ctxs),
             ' (worker %d of %d)' % (strategy.rank, strategy.num_workers) if strategy.num_workers > 1 else '',
             len(train_ds), 0 if val_ds is None else len(val_ds), steps_per_epoch, cfg.workers, workers_note)
    # Validation runs on rank 0 only, over the whole validation set: the numbers are
    # exactly those a single process would report for these weights; the others wait
    # at the next step.
    run = _Run(cfg, ctxs, net, step, loader, steps_per_epoch, val_ds if strategy.is_main else None, recorder,
               average, started=started)
    try:
        with _on_write_error(cfg, complete=False):
            _train_epochs(run, state, strategy, ckpt_trainer, callbacks)
    finally:
        # The loader's workers end here, not at some later garbage collection or at exit:
        # the search and the export need none, and their memory is freed for them.
        loader.close()
        recorder.close()
    tuned = None
    with _AfterTraining(cfg, recorder, state) as after, _on_write_error(cfg, complete=True):
        if _will_tune(cfg, run.val_ds) and state.history:
            load_checkpoint(recorder.best_checkpoint(), net=net)  # tune what will be exported
            tuned = tune_postprocessing(net, ctxs, run.val_ds, geometry(cfg), cfg.batch_size,
                                        mode=cfg.tune_mode, tta=cfg.tune_tta)
            log.info('post-processing chosen on %d validation images in %.1f s: %s (val DSB %.4f, untuned %.4f); '
                     'stored in the export, bin/predict uses it', tuned['images'], tuned['seconds'],
                     postprocess.settings_text(tuned), tuned['score'], tuned['base_score'])
        after.exporting()
        recorder.finish(state, amp_dtype, tuned)
    return state.history


def _finish_command(cfg):
    """The command that does what a run does after its last epoch: the search (when the
    run does one) and the export."""
    command = 'bin/export %s' % cfg.output
    if cfg.tune_postprocess:
        command += ' --tune-postprocess'
        command += ' --mode %s' % cfg.tune_mode if cfg.tune_mode != 'auto' else ''
        command += ' --tta' if cfg.tune_tta else ''
    return command


def _kept(cfg, complete, unexported=False):
    """What a run stopped by a failed write or a signal keeps, and how to go on (a note
    for its one-line error); ``unexported``: say that the export was not written."""
    folder = os.path.join(cfg.output, 'checkpoints')
    if complete:
        best = os.path.join(folder, 'best.ckpt')
        return ('training is complete and its checkpoints are intact (best: %s)%s; finish with %s, or the same '
                'bin/train command with --resume auto'
                % (best, ', the export was not written' if unexported else '', _finish_command(cfg)))
    found = list_checkpoints(folder) if os.path.isdir(folder) else []
    if not found:
        return 'no checkpoint had been written yet'
    return 'the last good checkpoint %s is intact: once the folder can be written, continue with --resume auto' \
        % found[-1]


@contextlib.contextmanager
def _on_write_error(cfg, complete):
    """A :class:`~.errors.WriteError` in the block - or, after the epochs, a failed
    export in a subprocess - says what the run keeps (:func:`_kept`)."""
    try:
        yield
    except WriteError as exc:
        raise exc.add(_kept(cfg, complete)) from None
    except ExportError as exc:
        if not complete:
            raise
        exc.args = ('%s; %s' % (exc.args[0], _kept(cfg, complete)),)
        raise exc from None


class _AfterTraining:
    """SIGINT/SIGTERM after the last epoch: the post-processing search is stopped at once
    (it writes nothing), the export is finished first (a second signal stops it too).
    Either way the run ends with :class:`Interrupted` saying that training is complete
    and which command finishes the job - never silently, never with a traceback."""

    def __init__(self, cfg, recorder, state):
        self.cfg, self.recorder, self.state = cfg, recorder, state
        self.stage, self.signum, self._old, self._pid = 'search', None, {}, os.getpid()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread() and self.recorder.enabled:
            self._old = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def exporting(self):
        """The search is over; the export begins."""
        self.stage = 'export'

    def _handle(self, signum, frame):
        if os.getpid() != self._pid:  # a forked child that inherited the handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.stage == 'export' and self.signum is None:
            self.signum = signum  # finished first: a half-replaced export would be worse
            return
        self.signum = signum
        raise Interrupted('%s during the %s after the last epoch (%d): %s'
                          % (signal.Signals(signum).name,
                             'post-processing search' if self.stage == 'search' else 'export',
                             self.state.epoch, _kept(self.cfg, complete=True, unexported=True)), 128 + signum)

    def __exit__(self, exc_type, exc, tb):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}
        if exc_type is None and self.signum is not None:
            raise Interrupted('%s during the export after the last epoch (%d): the export was finished first; '
                              'the run is complete (%s)' % (signal.Signals(self.signum).name, self.state.epoch,
                                                           os.path.join(self.cfg.output, 'export')),
                              128 + self.signum)
        return False


def find_resume_point(cfg, data_id, strategy):
    """The checkpoint to resume from, checked against ``cfg`` and the data, or None; the
    same step on every worker."""
    path = resolve_resume(cfg.resume, cfg.output)
    try:
        meta = load_checkpoint(path) if path else None
    except DamagedFile as exc:  # never trained on: say which earlier checkpoint is intact
        raise damaged_resume(exc, cfg.resume) from None
    if meta is not None:
        check_resumable(path, meta, cfg, data_id)
    # Each worker resolved --resume on its own file system (no one writes before the
    # first epoch ends, which needs every worker); all must start at the same step.
    step = meta['step'] if meta else -1
    rank0_step = int(strategy.broadcast([step])[0])
    if rank0_step != step:
        raise UserError('--resume: worker rank %d would resume at step %d but rank 0 at step %d; put '
                        '--output on a shared file system or give every worker the same --resume file'
                        % (strategy.rank, step, rank0_step))
    return path


def _train_epochs(run, state, strategy, ckpt_trainer, callbacks):
    """Epochs until ``--epochs`` (or what fits in ``--time-budget``), early stopping, a
    callback or a signal."""
    cfg, log = run.cfg, run.recorder.log
    # A resumed run plans from the epochs it has measured (the budget may have changed).
    clock = _clock()  # one running clock: checkpointing counts in the next epoch
    state.train_seconds += clock - run.started  # this process's data loading and setup
    total = _plan_epochs(run, state, strategy)
    stop = _StopFlag().install()
    try:
        epoch = state.epoch
        while epoch < total:
            epoch += 1
            row, samples = _run_epoch(run, epoch, state, stop, total)
            now = _clock()
            state.train_seconds += now - clock
            if row is None:  # interrupted mid-epoch
                path = run.recorder.interrupted(run.net, ckpt_trainer, state, run.average)
                saved = 'saved %s: ' % path if path else ''  # (rank 0 saves for a multi-machine job)
                raise Interrupted('%s: stopped in epoch %d after %d steps; %scontinue with --resume auto'
                                  % (signal.Signals(stop.signum).name, epoch, state.step_in_epoch, saved),
                                  128 + stop.signum)
            # Spent either way, but a one-off: the probe must not make every epoch look longer.
            state.epoch_seconds.append(now - clock - run.probe_seconds)
            clock, run.probe_seconds = now, 0.0
            run.recorder.end_epoch(run.net, ckpt_trainer, state, row, len(run.ctxs), samples, run.average)
            # Rank 0 alone knows the validation numbers: its decisions hold for every
            # worker (one stopping alone would leave the others waiting for its gradients).
            by_callback, early = strategy.broadcast([run_callbacks(callbacks, row, run, state),
                                                     run.recorder.should_stop_early()])
            if by_callback:
                log.info('stopped by a callback after epoch %d', epoch)
                break
            if early:
                saver = run.recorder.saver
                log.info('early stopping: %s did not improve for %d epochs (best %.4f at epoch %d)',
                         saver.monitor, cfg.patience, saver.best, saver.best_epoch)
                break
            total = _plan_epochs(run, state, strategy, total)
    finally:
        stop.restore()


_clock = time.monotonic  # --time-budget's clock (tests give it a fake one)


def _plan_epochs(run, state, strategy, before=None):
    """``--time-budget``: the run's length in epochs after what has been measured (the
    planned length ``before``, None at the start), the same on every worker (rank 0's
    clock decides), with the LR schedule fitted to it."""
    cfg, log = run.cfg, run.recorder.log
    budget = cfg.time_budget * 60.0
    if budget and state.epoch_seconds and run.search_reserve is None:
        run.search_reserve = _probe_search(run)
    reserve = run.search_reserve or 0.0
    total = planned_epochs(budget, state.train_seconds, state.epoch_seconds, state.epoch, cfg.epochs,
                           reserve_seconds=reserve)
    total = int(strategy.broadcast([total])[0])
    if total != before:
        resize_lr_scheduler(run.step.trainer.optimizer.lr_scheduler, total * run.steps_per_epoch,
                            cfg.step_fractions())
    if total != (cfg.epochs if before is None else before):
        left = max(0.0, budget - state.train_seconds) / 60.0
        kept = ', %.1f of them kept for the search' % (reserve / 60.0) if reserve else ''
        per_epoch = epoch_estimate(state.epoch_seconds)
        if total > state.epoch:
            log.info('time budget: %d of --epochs %d fit (%.1f of %g min left%s, epochs take up to %.0f s); '
                     'the LR schedule now ends with epoch %d', total, cfg.epochs, left, cfg.time_budget, kept,
                     per_epoch, total)
        else:
            log.info('time budget: stopping after epoch %d of --epochs %d (%.1f of %g min left%s, an epoch '
                     'takes up to %.0f s)', state.epoch, cfg.epochs, left, cfg.time_budget, kept, per_epoch)
    return total


def _probe_search(run):
    """``--time-budget``'s estimate of the post-processing search after the epochs (0 when
    the run does none, or on workers other than rank 0, whose plan rank 0's replaces).
    Its few seconds are spent now, so they count as spent, but not in the next epoch's
    length that plans the following ones."""
    cfg = run.cfg
    if not _will_tune(cfg, run.val_ds):
        return 0.0
    started = time.monotonic()  # not _clock: tests fake that one to count epochs
    seconds, probed, images = search_seconds(run.net, run.ctxs, run.val_ds, geometry(cfg), cfg.batch_size,
                                             mode=cfg.tune_mode, tta=cfg.tune_tta,
                                             second=_second(cfg.model.target), clock=_clock)
    run.recorder.log.info('time budget: the post-processing search after the epochs is estimated at %.1f min '
                          '(%d of its %d validation images probed); kept aside', seconds / 60.0, probed, images)
    run.probe_seconds += time.monotonic() - started
    return seconds


@dataclass
class EpochContext:
    """What a callback object's ``on_epoch_end(record, context)`` receives, like Keras'
    ``self.model`` or Lightning's ``(trainer, pl_module)``: the network being trained
    (on every device; read weights with ``net.collect_params()``), the trainer, the run's
    progress and config, and the run folder; with ``--ema``, ``average``, the weight
    average the checkpoints hold (``with context.average.applied():`` puts it in ``net``)."""
    net: object
    trainer: object
    state: RunState
    cfg: TrainConfig
    ctxs: list
    output: str
    average: object = None


def run_callbacks(callbacks, row, run, state):
    """Call every callback after an epoch; True when one asks to stop.

    A plain function is called as ``fn(record)``; an object with an ``on_epoch_end``
    method as ``obj.on_epoch_end(record, context)`` with an :class:`EpochContext`.
    """
    context = EpochContext(run.net, run.step.trainer, state, run.cfg, run.ctxs, run.cfg.output, run.average)
    stop = False
    for cb in callbacks:
        hook = getattr(cb, 'on_epoch_end', None)
        stop = bool(hook(row, context) if hook is not None else cb(row)) or stop
    return stop


def _run_epoch(run, epoch, state, stop, total):
    """Train and validate one epoch; returns its record (None when interrupted) and, with
    ``--tensorboard``, a few validation ``(image, truth, probability)`` for overlays."""
    cfg = run.cfg
    skip = state.step_in_epoch
    # Reseeding per epoch makes dropout (and anything else on MXNet's RNG) independent
    # of how many epochs ran in this process: a resumed run matches an unbroken one.
    mx.random.seed(cfg.seed * 100003 + epoch)
    set_loader_epoch(run.loader, epoch, skip_samples=skip * cfg.batch_size)
    bar = _progress(cfg, epoch, total, (run.steps_per_epoch - skip) * cfg.batch_size)

    first_step = state.step - skip  # global step of the epoch's step 0

    def on_step(k):
        state.step += 1
        state.step_in_epoch = k
        if run.average is not None:
            run.average.update(state.step)
        run.recorder.step(state.step, lr=run.step.trainer.learning_rate)

    def on_loss(k, loss):
        run.recorder.step(first_step + k, loss=loss)

    try:
        stats = train_epoch(run.step, run.loader, epoch, stop, on_step=on_step, skip_batches=skip, progress=bar,
                            on_loss=on_loss)
    finally:
        if bar is not None:
            bar.close()
    if stats['interrupted'] and state.step_in_epoch < run.steps_per_epoch:
        return None, []
    state.epoch, state.step_in_epoch = epoch, 0
    if stats['skipped']:
        run.recorder.log.info('epoch %d: %d sample(s) of the last batch left out: with --sync-bn each of the %d '
                              'devices takes an equal share of a batch (SyncBatchNorm weighs every device\'s '
                              'statistics equally); the epoch shuffles, so other samples are left out next time',
                              epoch, stats['skipped'], len(run.ctxs))
    row = {'epoch': epoch, 'lr': run.step.trainer.learning_rate, 'train_loss': stats['train_loss'],
           'images_per_s': stats['images_per_s'], 'seconds': stats['seconds']}
    for i, n in enumerate(stats['per_device_images']):
        row['dev%d_images_per_s' % i] = n / stats['seconds'] if stats['seconds'] else 0.0
    samples = []
    if run.val_ds is not None and len(run.val_ds):
        with applied(run.average):  # the model the checkpoint will hold
            row.update(validate(run.net, run.ctxs, run.val_ds, cfg.batch_size, run.step.loss_fn, cfg.threshold,
                                keep=samples if cfg.tensorboard else None))
    state.history.append(row)
    return row, samples


def _progress(cfg, epoch, epochs, images):
    if not cfg.progress:
        return None
    from tqdm import tqdm
    return tqdm(total=images, desc='epoch %d/%d' % (epoch, epochs), unit='img', leave=False,
                dynamic_ncols=True)
