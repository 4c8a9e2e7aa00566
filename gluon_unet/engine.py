"""Training and validation loops: ``fit(cfg)`` is the whole job.

Stages, each a function that returns a dict: build the data (`build_datasets`), the
network (`build_network`), the optimizer, then per epoch `train_epoch` and `validate`,
checkpoint, early stopping, and finally export of the best model.
"""
import collections
import contextlib
import hashlib
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import mxnet as mx
import numpy as np

# Everything fit() may need is imported up front: a run that trains for an hour must not
# fail at its last step because the code on disk changed underneath it.
from . import distributed
from . import metrics as M
from . import postprocess
from . import rundir
from .checkpoint import CheckpointSaver, load_checkpoint, resolve_resume
from .config import TrainConfig, resume_conflicts
from .data import readers
from .data.augment import make_transform
from .data.dataset import make_loader, set_loader_epoch, split_indices
from .data.synthetic import synthetic_dataset
from .data.weights import unet_weight_map
from .devices import has_gpu, make_contexts, require_cpu_bfloat16
from .errors import UserError
from .export import export_checkpoint, export_in_subprocess
from .losses import SegmentationLoss
from .model import build_model, foreground_probability
from .optim import make_lr_scheduler, make_trainer
from .parallel import DataParallelStep, split_batch
from .runlog import MetricsTable, plot_curves, setup_logging
from .rundir import claim_run_folder
from .runtime import configure_runtime
from .utils import atomic_open


class Interrupted(Exception):
    """Ctrl-C / SIGTERM: a resumable checkpoint was saved; ``exit_code`` is 130 or 143."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


class Diverged(Exception):
    """The loss became NaN or infinite; the last good checkpoint is kept."""
    exit_code = 3


@dataclass
class RunState:
    """What a checkpoint must hold beyond the weights to continue a run exactly."""
    epoch: int = 0               # last completed epoch
    step: int = 0                # optimizer updates so far
    step_in_epoch: int = 0       # batches done in an interrupted epoch
    best: float = None
    best_epoch: int = 0
    bad_epochs: int = 0
    history: list = field(default_factory=list)

    def to_meta(self, cfg, data_id=None):
        return {'config': cfg.to_dict(), 'data': data_id, 'epoch': self.epoch, 'step': self.step,
                'step_in_epoch': self.step_in_epoch, 'best': self.best,
                'best_epoch': self.best_epoch, 'bad_epochs': self.bad_epochs,
                'history': self.history, 'seed': cfg.seed,
                'metrics': self.history[-1] if self.history else {}}

    @classmethod
    def from_meta(cls, meta):
        return cls(epoch=meta['epoch'], step=meta['step'], step_in_epoch=meta.get('step_in_epoch', 0),
                   best=meta.get('best'), best_epoch=meta.get('best_epoch', 0),
                   bad_epochs=meta.get('bad_epochs', 0), history=meta.get('history', []))


def data_fingerprint(train_ds, val_ds, num_workers=1):
    """What identifies the data a run trains on, for resume to compare: sample counts, a
    digest of the sample names in order (the split and the batches follow from them), and
    the number of workers (with a dist kvstore they set the global batch)."""
    digest = hashlib.sha1()
    for ds in (train_ds, val_ds):
        digest.update(('\n'.join(ds.names) if ds is not None else '').encode() + b'\0')
    return {'train': len(train_ds), 'val': 0 if val_ds is None else len(val_ds),
            'names_sha1': digest.hexdigest(), 'workers': num_workers}


def check_resumable(path, meta, cfg, data_id):
    """Refuse, in one line, to resume ``meta`` (a checkpoint's record) with settings or
    data it cannot continue exactly (see ``config.RESUME_FIXED``)."""
    saved = TrainConfig.from_dict(meta['config'])
    conflicts = resume_conflicts(saved, cfg)
    if conflicts:
        raise UserError('--resume %s: the run was trained with %s; resume with the same values (or start a '
                        'new run)' % (path, ', '.join(conflicts)))
    old = meta.get('data')
    if old and (old['train'], old['val'], old['names_sha1']) != (data_id['train'], data_id['val'],
                                                                  data_id['names_sha1']):
        raise UserError('--resume %s: the data changed since the checkpoint (it trained on %d images and '
                        'validated on %d, now %d and %d, or other files); resume with the same --data'
                        % (path, old['train'], old['val'], data_id['train'], data_id['val']))
    if old and old.get('workers', 1) != data_id['workers']:
        raise UserError('--resume %s: the run had %d worker(s), now %d: the global batch would change; '
                        'resume with bin/launch -n %d' % (path, old.get('workers', 1), data_id['workers'],
                                                          old.get('workers', 1)))


# -- data ----------------------------------------------------------------------------------

def build_datasets(cfg):
    """Training and validation datasets for ``cfg`` (generated nuclei when ``data`` is None).

    Returns
    -------
    (train_ds, val_ds) : SegmentationDataset, SegmentationDataset or None
    """
    side = cfg.crop or cfg.size
    if cfg.data is None:
        full = synthetic_dataset(cfg.synthetic_count, side, channels=cfg.model.in_channels or 1,
                                 seed=cfg.seed)
        val = None
    else:
        opts = dict(layout=cfg.layout, mask_suffix=cfg.mask_suffix, size=cfg.size, crop=cfg.crop,
                    channels=cfg.model.in_channels, cache_dir=cfg.cache_dir, workers=cfg.workers,
                    skip_unpaired=cfg.skip_unpaired, progress=cfg.progress, normalize=cfg.normalize)
        full = readers.load_dataset(cfg.data, masks=cfg.masks, **opts)
        val = readers.load_dataset(cfg.val_data, **opts) if cfg.val_data else None
    if val is None and cfg.val_split > 0:
        train_idx, val_idx = split_indices(len(full), cfg.val_split, cfg.seed)
        return full.subset(train_idx), full.subset(val_idx)
    return full, val


def attach_transforms(cfg, train_ds, val_ds):
    """Augmentation (and crops) for training; deterministic crops for validation."""
    weight_fn = None
    if cfg.loss == 'wbce':
        weight_fn = unet_weight_map
    train_tf = val_tf = None
    if cfg.augment or cfg.crop or cfg.elastic:
        train_tf = make_transform(augment=cfg.augment, elastic=cfg.elastic, crop=cfg.crop)
        if cfg.crop:
            # validate() draws per-sample seeds from a fixed sampler seed, so these
            # crops are the same every epoch: comparable numbers across epochs.
            val_tf = make_transform(augment=False, crop=cfg.crop)
    train_ds.transform, train_ds.weight_fn = train_tf, weight_fn
    if val_ds is not None:
        val_ds.transform, val_ds.weight_fn = val_tf, weight_fn


def data_channels(ds):
    """Channel count of a dataset's images."""
    channels = getattr(ds, 'channels', None)
    return channels or int(np.asarray(ds.images[0]).shape[-1])


# -- network -------------------------------------------------------------------------------

def build_network(cfg, ctxs):
    """U-Net initialized on ``ctxs`` (He init), deferred shapes resolved, hybridized."""
    configure_runtime(len(ctxs), ctxs[0].device_type)  # process-wide knobs: one place
    net = build_model(cfg.model, sync_bn_devices=len(ctxs) if cfg.sync_bn and len(ctxs) > 1 else 0)
    mx.random.seed(cfg.seed)
    net.initialize(mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2), ctx=ctxs)
    if cfg.hybridize:
        # static_alloc is the fast path, but with SyncBatchNorm MXNet 1.9's static
        # CachedOp loses the running-statistics update of each step (measured: they lag
        # one step behind plain BatchNorm); the dynamic CachedOp keeps them right.
        static = not (cfg.sync_bn and len(ctxs) > 1)
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
    amp.init(target_dtype=dtype)
    return dtype


def resolve_update_on_kvstore(cfg, amp_dtype):
    """Whether the kvstore applies the optimizer (``Trainer(update_on_kvstore=...)``).

    Off when something must touch the summed gradients before the update: clipping, or
    float16 loss scaling (unscale and overflow check).
    """
    update_on_kv = distributed.default_update_on_kvstore(cfg.kvstore, cfg.update_on_kvstore)
    between = cfg.clip_grad > 0 or amp_dtype == 'float16'
    if between and cfg.kvstore == 'dist_async':
        raise UserError('--kvstore dist_async updates on the servers; it cannot be combined with '
                        '--clip-grad or float16 --amp (use dist_sync)')
    if between and update_on_kv:
        raise UserError('--update-on-kvstore cannot be combined with --clip-grad or float16 --amp '
                        '(they change gradients between reduction and update)')
    return False if between else update_on_kv


def make_step(cfg, net, ctxs, amp_dtype=None, kvstore=None, lr_scheduler=None, workers=1):
    """The training step of ``cfg`` for ``net`` on ``ctxs``: trainer, loss, AMP.

    Used by :func:`fit` and by the benchmarks, so both measure the same step.

    Parameters
    ----------
    amp_dtype : {None, 'float16', 'bfloat16'}
        From :func:`init_amp`. Only float16 scales the loss: bfloat16 has float32's
        exponent range, so nothing underflows, and the dynamic scaler's overflow check
        costs a host synchronization and a pass over all gradients every step
        (``multi_all_finite``).
    kvstore : str or KVStore, optional
        Defaults to ``cfg.kvstore``.
    workers : int
        See :class:`~gluon_unet.parallel.DataParallelStep`.

    Returns
    -------
    DataParallelStep
    """
    scaling = amp_dtype == 'float16'
    trainer = make_trainer(net.collect_params(), cfg.optimizer, cfg.lr, ctxs,
                           kvstore=cfg.kvstore if kvstore is None else kvstore,
                           update_on_kvstore=resolve_update_on_kvstore(cfg, amp_dtype),
                           weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                           nesterov=cfg.nesterov, lr_scheduler=lr_scheduler)
    if scaling:
        from mxnet.contrib import amp
        amp.init_trainer(trainer)
    return DataParallelStep(net, SegmentationLoss(cfg.loss, cfg.dice_weight), trainer, ctxs,
                            clip_grad=cfg.clip_grad, loss_scaling=scaling,
                            sync_bn=cfg.sync_bn and len(ctxs) > 1, workers=workers)


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


def train_epoch(step, loader, epoch, stop, on_step=None, skip_batches=0, progress=None, lookahead=2):
    """Run one epoch of ``step`` over ``loader``.

    Loss values are read back ``lookahead`` steps late: the devices keep a short queue
    of work and the host never waits for the step it just issued.

    Returns
    -------
    dict
        ``train_loss``, ``images``, ``seconds``, ``images_per_s``, ``per_device_images``,
        ``steps``, ``skipped`` and ``interrupted`` (True when a signal stopped it).
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

    for image, target, weight in loader:
        n = image.shape[0]
        if not step.runnable(n):
            skipped += n
            continue
        out = step(image, target, weight)
        steps += 1
        images += n
        per_device[:len(out['per_device'])] += out['per_device']
        pending.append((steps, out['loss_sums'], n))
        drain(lookahead)
        if progress is not None:
            progress.update(n)
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


def _forward_eval(net, ctxs, arrays, loss_fn):
    """Inference-mode forward of ``arrays[0]`` split over ``ctxs``: foreground probability
    ``(N, H, W)`` and the summed loss against ``arrays[1:]`` (target, weight), computed on
    the devices; also whether the model is binary (one output class)."""
    probs, losses = [], []
    with mx.autograd.predict_mode():
        for part in split_batch(arrays, ctxs):
            logits = net(part[0])
            losses.append(loss_fn(logits, *part[1:]).sum())
            probs.append(foreground_probability(logits))
    prob = np.concatenate([p.asnumpy() for p in probs], axis=0)
    return prob, sum(float(l.asscalar()) for l in losses), logits.shape[1] == 1


def validate(net, ctxs, dataset, batch_size, loss_fn, threshold=0.5, instance_metric=True):
    """Validation loss, pixel IoU (averaged over thresholds 0.50:0.95), Dice and DSB score.

    Pixel metrics are summed over the whole set (not averaged per batch), so the
    numbers do not depend on the batch size or on how batches fall on devices.
    """
    pixel, dsb = M.PixelMetrics(), M.DSBMetric()
    loss_total, offset = 0.0, 0
    t0 = time.time()
    loader = make_loader(dataset, batch_size, shuffle=False, seed=0, workers=0)
    binary = True
    for image, target, weight in loader:
        prob, loss_sum, binary = _forward_eval(net, ctxs, [image, target, weight], loss_fn)
        loss_total += loss_sum
        truth = target.asnumpy()[:, 0]
        pixel.update(prob, truth > 0)  # foreground = any non-background class
        if binary and instance_metric:
            for k in range(len(prob)):
                pred_labels = postprocess.instances_from_prob(prob[k], threshold)
                dsb.update(pred_labels, _val_instances(dataset, offset + k, truth[k]))
        offset += len(prob)
    px = pixel.result()
    result = {'val_loss': loss_total / max(1, offset), 'val_iou': px['iou'], 'val_iou50': px['iou50'],
              'val_dice': px['dice']}
    if instance_metric and binary:
        result['val_dsb'] = dsb.result()
    result['val_seconds'] = time.time() - t0
    return result


def _val_instances(dataset, i, truth_mask):
    """Instance labels aligned with the validation target (crops change the geometry)."""
    if dataset.transform is None:
        return dataset.instances(i)
    from skimage.measure import label
    return label(truth_mask > 0, connectivity=1)


# -- the whole run -------------------------------------------------------------------------

def fit(cfg, train_ds=None, val_ds=None, verbose=True, callbacks=()):
    """Train a U-Net as configured; the Python API behind ``bin/train``.

    Parameters
    ----------
    cfg : TrainConfig
    train_ds, val_ds : SegmentationDataset, optional
        Your own datasets; when omitted they come from ``cfg.data`` (or generated nuclei).
    verbose : bool
        Log to stderr (the run folder's ``train.log`` is always written).
    callbacks : sequence of callable
        Each is called as ``cb(record)`` after every epoch (once its checkpoint is
        saved); a callback returning True ends training there, like early stopping.

    Returns
    -------
    list of dict
        One record per epoch (losses, metrics, learning rate, images/s, seconds); the
        run folder holds the same in ``metrics.csv``, plus checkpoints and the export.
    """
    cfg = TrainConfig.from_dict(cfg.to_dict())  # private copy: fit() resolves a few fields
    cfg.validate()
    ctxs = make_contexts(cfg.gpus, cfg.cpus)
    check_amp_support(cfg, ctxs)
    kvstore, rank, num_workers = distributed.kvstore_for(cfg.kvstore, ctxs)
    is_main = rank == 0  # only rank 0 writes (logs, metrics, checkpoints, export)
    default_base = 'runs/demo' if cfg.data is None and train_ds is None else 'runs/unet'
    if is_main:
        # Claimed (and locked) before any data is decoded: a clash costs seconds, not
        # the minutes of a decode; released - and removed if still empty - on any error.
        folder = claim_run_folder(cfg.output, default_base, cfg.resume, cfg.overwrite)
        cfg.output = folder.path
    else:
        folder = contextlib.nullcontext()
        cfg.output = cfg.output or rundir.default_output(default_base, cfg.resume) or ''
    with folder:
        history = _fit_in_folder(cfg, ctxs, kvstore, rank, num_workers, train_ds, val_ds, verbose, callbacks)
    return FitResult(history, output=cfg.output, is_main=is_main)


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


def _fit_in_folder(cfg, ctxs, kvstore, rank, num_workers, train_ds, val_ds, verbose, callbacks):
    is_main = rank == 0
    # Console only until the input is known to be good: bad input writes nothing.
    log = setup_logging(None, verbose=verbose and is_main)
    resume_path = resolve_resume(cfg.resume, cfg.output)
    if train_ds is None:
        train_ds, val_ds = build_datasets(cfg)
    channels = data_channels(train_ds)
    if cfg.model.in_channels == 0:
        cfg.model.in_channels = channels
    elif cfg.model.in_channels != channels:
        raise UserError('--channels %d but the data has %d channels' % (cfg.model.in_channels, channels))
    data_id = data_fingerprint(train_ds, val_ds, num_workers)
    resume_step = -1
    if resume_path:
        resume_meta = load_checkpoint(resume_path)
        check_resumable(resume_path, resume_meta, cfg, data_id)
        resume_step = resume_meta['step']
    # Distributed: each worker resolved --resume on its own file system (no one writes
    # before the first epoch ends, which needs every worker); all must start at the same step.
    rank0_step = int(distributed.from_rank0(kvstore, [resume_step])[0])
    if rank0_step != resume_step:
        raise UserError('--resume: worker rank %d would resume at step %d but rank 0 at step %d; put '
                        '--output on a shared file system or give every worker the same --resume file'
                        % (rank, resume_step, rank0_step))
    attach_transforms(cfg, train_ds, val_ds)
    if is_main:
        log = setup_logging(cfg.output, verbose=verbose)
        with atomic_open(os.path.join(cfg.output, 'config.json')) as f:
            f.write(cfg.to_json())
    amp_dtype = init_amp(cfg, ctxs)
    net = build_network(cfg, ctxs)
    if cfg.kvstore.startswith('dist'):
        # The shape-resolving forward ran in inference mode, where oneDNN reorders conv
        # weights in place into its own layout; a dist kvstore cannot send such arrays
        # (the push fails inside the engine and the server never gets the key). Fresh
        # copies on the same devices are in the default layout.
        net.collect_params().reset_ctx(ctxs)
    loader = make_loader(train_ds, cfg.batch_size, shuffle=True, seed=cfg.seed, workers=cfg.workers,
                         num_shards=num_workers, shard=rank)
    steps_per_epoch = len(loader)
    lr_sched = make_lr_scheduler(cfg.lr_schedule, cfg.lr, cfg.epochs * steps_per_epoch,
                                 warmup_steps=int(cfg.warmup_epochs * steps_per_epoch),
                                 step_fractions=[float(s) for s in cfg.lr_steps.split(',') if s.strip()])
    step = make_step(cfg, net, ctxs, amp_dtype, kvstore=kvstore, lr_scheduler=lr_sched,
                     workers=distributed.grad_workers(cfg.kvstore, num_workers))
    trainer = step.trainer
    update_on_kv = resolve_update_on_kvstore(cfg, amp_dtype)
    # Trainer.save_states/load_states refuse when a dist kvstore's servers hold the
    # optimizer state (--update-on-kvstore, dist_async): such checkpoints keep weights only.
    ckpt_trainer = None if update_on_kv and cfg.kvstore.startswith('dist') else trainer
    state = RunState()
    if resume_path:
        state = RunState.from_meta(load_checkpoint(resume_path, net, ckpt_trainer, ctx=ctxs))
        log.info('resumed from %s (epoch %d, step %d%s)', resume_path, state.epoch, state.step,
                 ', %d batches into the next epoch' % state.step_in_epoch if state.step_in_epoch else '')
    if cfg.kvstore.startswith('dist'):
        # Not lazily inside the first step, racing with it: see init_kvstore.
        distributed.init_kvstore(trainer)
    monitor = cfg.monitor if val_ds is not None else 'train_loss'
    saver = CheckpointSaver(os.path.join(cfg.output, 'checkpoints'), monitor,
                            'min' if monitor.endswith('loss') else 'max', cfg.keep_last) if is_main else None
    table = MetricsTable(os.path.join(cfg.output, 'metrics.csv'))
    log.info('training on %d device(s) %s%s, %d train / %d val images, %d steps per epoch',
             len(ctxs), ','.join(str(c) for c in ctxs),
             ' (worker %d of %d)' % (rank, num_workers) if num_workers > 1 else '', len(train_ds),
             0 if val_ds is None else len(val_ds), steps_per_epoch)

    stop = _StopFlag().install()
    try:
        for epoch in range(state.epoch + 1, cfg.epochs + 1):
            # Validation runs on rank 0 only, over the whole validation set: the numbers
            # are exactly those a single process would report for these weights (no
            # shard padding, per-image DSB mean intact); the others wait at the next step.
            row = _run_epoch(cfg, epoch, state, step, loader, net, ctxs, val_ds if is_main else None,
                             step.loss_fn, trainer, stop, steps_per_epoch, log)
            if row is None:  # interrupted mid-epoch
                path = saver.save(net, ckpt_trainer, state.to_meta(cfg, data_id), False, state.step_in_epoch) \
                    if is_main else None
                name = signal.Signals(stop.signum).name
                raise Interrupted('%s: stopped in epoch %d after %d steps; resume with --resume %s'
                                  % (name, epoch, state.step_in_epoch, path or 'auto'),
                                  128 + stop.signum)
            value = row.get(monitor)
            is_best = is_main and saver.is_better(value, state.best, cfg.min_delta)
            if is_best:
                state.best, state.best_epoch, state.bad_epochs = value, epoch, 0
            else:
                state.bad_epochs += 1
            row['best'] = bool(is_best)
            if is_main:
                saver.save(net, ckpt_trainer, state.to_meta(cfg, data_id), is_best)
                table.write(state.history)
                _plot_quietly(state.history, os.path.join(cfg.output, 'curves.png'), log)
            log.info(_epoch_line(row, monitor, len(ctxs)))
            # Rank 0 alone knows the validation numbers: its decisions hold for every
            # worker (one stopping alone would leave the others waiting for its gradients).
            by_callback, early = distributed.from_rank0(kvstore, [any([cb(row) for cb in callbacks]),
                                                      bool(cfg.patience and state.bad_epochs >= cfg.patience)])
            if by_callback:
                log.info('stopped by a callback after epoch %d', epoch)
                break
            if early:
                log.info('early stopping: %s did not improve for %d epochs (best %.4f at epoch %d)',
                         monitor, cfg.patience, state.best, state.best_epoch)
                break
    finally:
        stop.restore()
    if is_main and state.history:
        _export_best(cfg, saver, amp_dtype, log)
        _summary(cfg, state, monitor, log)
    return state.history


def _run_epoch(cfg, epoch, state, step, loader, net, ctxs, val_ds, loss_fn, trainer, stop,
               steps_per_epoch, log):
    """Train and validate one epoch; returns its record, or None when interrupted."""
    skip = state.step_in_epoch
    # Reseeding per epoch makes dropout (and anything else on MXNet's RNG) independent
    # of how many epochs ran in this process: a resumed run matches an unbroken one.
    mx.random.seed(cfg.seed * 100003 + epoch)
    set_loader_epoch(loader, epoch, skip_samples=skip * cfg.batch_size)
    bar = _progress(cfg, epoch, (steps_per_epoch - skip) * cfg.batch_size)

    def on_step(k):
        state.step += 1
        state.step_in_epoch = k

    try:
        stats = train_epoch(step, loader, epoch, stop, on_step=on_step, skip_batches=skip, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    if stats['interrupted'] and state.step_in_epoch < steps_per_epoch:
        return None
    state.epoch, state.step_in_epoch = epoch, 0
    if stats['skipped']:
        log.info('epoch %d: %d sample(s) of a batch smaller than the device count were skipped '
                 '(SyncBatchNorm needs every device)', epoch, stats['skipped'])
    row = {'epoch': epoch, 'lr': trainer.learning_rate, 'train_loss': stats['train_loss'],
           'images_per_s': stats['images_per_s'], 'seconds': stats['seconds']}
    for i, n in enumerate(stats['per_device_images']):
        row['dev%d_images_per_s' % i] = n / stats['seconds'] if stats['seconds'] else 0.0
    if val_ds is not None and len(val_ds):
        row.update(validate(net, ctxs, val_ds, cfg.batch_size, loss_fn, cfg.threshold))
    state.history.append(row)
    return row


def _progress(cfg, epoch, total):
    if not cfg.progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc='epoch %d/%d' % (epoch, cfg.epochs), unit='img', leave=False,
                dynamic_ncols=True)


def _epoch_line(row, monitor, ndev):
    parts = ['epoch %d' % row['epoch'], 'loss %.4f' % row['train_loss']]
    for key in ('val_loss', 'val_iou', 'val_dice', 'val_dsb'):
        if key in row:
            parts.append('%s %.4f' % (key, row[key]))
    parts.append('lr %.2e' % row['lr'])
    parts.append('%.1f img/s' % row['images_per_s'])
    if ndev > 1:
        parts.append('per device [%s]' % ' '.join('%.1f' % row['dev%d_images_per_s' % i]
                                                  for i in range(ndev)))
    parts.append('%.1fs' % row['seconds'])
    if row.get('best'):
        parts.append('* best %s' % monitor)
    return ' | '.join(parts)


def _export_best(cfg, saver, amp_dtype, log):
    best = os.path.join(saver.folder, 'best.ckpt')
    out = os.path.join(cfg.output, 'export')
    prefix = (export_in_subprocess if amp_dtype else export_checkpoint)(best, out)
    log.info('exported %s-symbol.json / -0000.params', prefix)


def _summary(cfg, state, monitor, log):
    best = next((r for r in state.history if r['epoch'] == state.best_epoch), state.history[-1])
    metrics = ', '.join('%s %.4f' % (k, best[k]) for k in ('val_iou', 'val_dice', 'val_dsb', 'val_loss')
                        if k in best)
    log.info('done: %d epochs; best %s at epoch %d (%s); run folder %s; model %s',
             state.epoch, monitor, state.best_epoch, metrics or 'train_loss %.4f' % best['train_loss'],
             cfg.output, os.path.join(cfg.output, 'export'))


def _plot_quietly(history, path, log):
    try:
        plot_curves(history, path)
    except Exception as exc:  # a plotting problem must never cost a training run
        log.info('could not draw %s: %s', path, exc)

