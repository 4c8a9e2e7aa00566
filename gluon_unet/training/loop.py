"""Training: ``fit(cfg)`` is the whole job, as a short list of named stages.

``fit`` picks the run folder, then ``_train`` runs the stages in order, each from the
module that owns it: the data (`data.prepare.prepare_data`), the resume point
(`resume.find_resume_point`), the run folder's writer (`recorder.RunRecorder`), the
network and the step (`step.build_network`, `step.make_step`), the epochs
(`step.train_epoch` and `validation.validate` each epoch, planned by `--time-budget`),
the post-processing search (`search`) and the export. How a run stops early and what it
keeps is `stops`. Everything that differs between one process and a multi-machine job is
asked of a `distributed.Strategy`.
"""
import os
import signal
import time
from dataclasses import dataclass

import mxnet as mx

# Everything fit() may need is imported up front: a run that trains for an hour must not
# fail at its last step because the code on disk changed underneath it.
from . import distributed
from .. import models
from ..checkpoint import load_checkpoint
from ..config import TrainConfig
from ..data.cache import default_cache_dir
from ..data.loader import default_workers, make_loader, set_loader_epoch
from ..data.prepare import BALANCE_POWER, balanced_epoch_length, check_data_apart, log_groups, prepare_data
from ..errors import UserError
from ..inference import postprocess
from ..inference.postprocess_search import search_seconds, tune_on_dataset
from ..inference.sidecar import geometry
from ..machine.devices import context_names, make_contexts
from ..machine.runtime import process_gpus
from ..outputs import check_inputs
from ..reporting import log_to_files, setup_logging
from .budget import epoch_estimate, planned_epochs
from .ema import applied, make_average
from .finetune import find_source, fine_tune_config, load_source_weights
from .optim import make_lr_scheduler, resize_lr_scheduler
from .parallel import DataParallelStep, check_sync_bn_batch
from .recorder import RunRecorder, RunState, val_metrics_text
from .resume import find_resume_point
from .step import build_network, check_amp_support, init_amp, make_step, resolve_update_on_kvstore, train_epoch
from .stops import AfterTraining, Interrupted, StopFlag, on_write_error
from .tblog import require_tensorboardx
from .validation import second_output, validate


def fit(cfg, train_ds=None, val_ds=None, verbose=True, callbacks=(), net=None, init=None, given=None):
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
    init : str, optional
        Fine-tune this model (``cfg.init``, ``bin/train --init``): a shipped model's name
        (``'nuclei'``), an export, a run folder or a checkpoint; see
        :mod:`gluon_unet.training.finetune` for what it fixes and what it adapts.
    given : set of str, optional
        With ``init``: the settings of ``cfg`` you chose (field names), which MODEL's own
        do not replace; default: those that differ from TrainConfig's defaults.

    Returns
    -------
    FitResult
        A list with one record per epoch (losses, metrics, learning rate, images/s,
        seconds), and ``.output``, the run folder (``metrics.csv``, checkpoints, export).
    """
    cfg = TrainConfig.from_dict(cfg.to_dict())  # private copy: fit() resolves a few fields
    if init is not None:
        cfg.init = init
    if cfg.init and net is not None:
        raise UserError('init with your own network: --init rebuilds the U-Net of the model it starts from; '
                        'load your weights into your network yourself')
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
    # The run folder is an output: never the data, nor inside it (the next run would read
    # it), nor the cache of decoded arrays (only a data-caching run writes there).
    if train_ds is None:
        check_inputs([('--data', cfg.data, 'file|folder'), ('--masks', cfg.masks, 'folder'),
                      ('--val-data', cfg.val_data, 'file|folder')])
    if cfg.cache_dir and os.path.lexists(cfg.cache_dir):  # made when missing
        check_inputs([('--cache-dir', cfg.cache_dir, 'folder')])
    cache = cfg.cache_dir or (default_cache_dir() if cfg.data else None)
    # The data includes the folders a CSV's files lie in; the cache is written as well as read.
    check_data_apart([('--output', cfg.output or default_base)], cfg, cache, 'train',
                     also_read=[('--init', models.resolve(models.split_reference(cfg.init)[0]) if cfg.init else None)])
    source = None
    if cfg.init:  # MODEL's settings, then what was chosen against them, checked again
        source = find_source(cfg.init)
        cfg = fine_tune_config(cfg, source, given).validate()
    # Claimed (and locked) before any data is decoded: a clash costs seconds, not the
    # minutes of a decode; released - and removed if still empty - on any error.
    with strategy.claim_output(cfg.output, default_base, cfg.resume, cfg.overwrite) as folder:
        cfg.output = folder.path
        with strategy.reporting_failures():  # another process of the job failed: one line
            history = _train(cfg, ctxs, strategy, (train_ds, val_ds), verbose, callbacks, net, source)
    return FitResult(history, output=cfg.output, is_main=strategy.is_main)


class FitResult(list):
    """What :func:`fit` returns: the per-epoch records (a list), plus ``output`` (the run
    folder, which fit() picks when ``cfg.output`` is None) and ``is_main`` (False on the
    workers of a multi-machine job other than rank 0, which write nothing)."""

    def __init__(self, history, output, is_main=True):
        super().__init__(history)
        self.output, self.is_main = output, is_main


@dataclass
class _TrainingRun:
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


def _train(cfg, ctxs, strategy, datasets, verbose, callbacks, user_net=None, source=None):
    """The stages of a run: data, resume point, run folder, network and step, epochs,
    then the post-processing search and the export. ``source``: the
    :class:`~.finetune.Source` of ``--init`` (None: random initial weights)."""
    started = _clock()  # --time-budget counts the data loading too
    # Console only until the input is known to be good: bad input writes nothing.
    log = setup_logging(None, verbose=verbose and strategy.is_main)
    train_ds, val_ds, data_id, workers_note = _data(cfg, ctxs, strategy, datasets)
    resume_path = find_resume_point(cfg, data_id, strategy)
    recorder = _start_recorder(cfg, val_ds, data_id, strategy, verbose, user_net)
    amp_dtype = init_amp(cfg, ctxs)
    net = build_network(cfg, ctxs, amp_dtype, user_net)
    if source is not None and not resume_path:  # a resumed run's checkpoint holds its weights
        notes = load_source_weights(net, source, cfg.model.in_channels)
        recorder.log.info('fine-tuning %s (%s %s)%s', source.reference, source.kind, source.path,
                 ''.join('; ' + n for n in notes))
    strategy.prepare_network(net, ctxs)
    _log_data(log, cfg, train_ds)
    # Validation runs on rank 0 only, over the whole validation set: the numbers are
    # exactly those a single process would report for these weights; the others wait
    # at the next step.
    run, ckpt_trainer = _assemble(cfg, ctxs, net, train_ds, val_ds if strategy.is_main else None, recorder,
                                  strategy, amp_dtype, started)
    state = RunState()
    if resume_path:
        meta = load_checkpoint(resume_path, net, ckpt_trainer, ctx=ctxs, average=run.average)
        state = RunState.from_meta(meta)
        recorder.saver.restore(meta)
        log.info('resumed from %s (epoch %d, step %d%s)', resume_path, state.epoch, state.step,
                 ', %d batches into the next epoch' % state.step_in_epoch if state.step_in_epoch else '')
    strategy.join(run.step.trainer)  # not lazily inside the first step, racing with it
    log.info('training on %d device(s) %s%s, %d train / %d val images, %d steps per epoch, %d loader '
             'worker(s)%s', len(ctxs), context_names(ctxs),
             ' (worker %d of %d)' % (strategy.rank, strategy.num_workers) if strategy.num_workers > 1 else '',
             len(train_ds), 0 if val_ds is None else len(val_ds), run.steps_per_epoch, cfg.workers, workers_note)
    if source is not None and not resume_path and run.val_ds is not None and len(run.val_ds):
        # What the fine-tune has to beat: its --init model on the same validation images
        # (a few annotated images can make a model worse on the others: docs/quality.md).
        state.init_scores = {k: v for k, v in validate(net, ctxs, run.val_ds, cfg.batch_size, run.step.loss_fn,
                                                        cfg.threshold).items() if k.startswith('val_')}
        log.info('before fine-tuning, %s on the %d validation images: %s', source.label, len(run.val_ds),
                 val_metrics_text(state.init_scores))
    # One flag from the first step to the export: a signal that lands between two phases
    # (as the last epoch's checkpoint is written) is carried into the next, never dropped.
    stop = StopFlag().install()
    try:
        try:
            with on_write_error(cfg, complete=False):
                _train_epochs(run, state, strategy, ckpt_trainer, callbacks, stop)
        finally:
            # The loader's workers end here, not at some later garbage collection or at exit:
            # the search and the export need none, and their memory is freed for them.
            run.loader.close()
            recorder.close()
        _search_and_export(run, state, amp_dtype, stop, source)
    except Interrupted as exc:
        log_to_files(exc.line)  # the stop line, in train.log too (the boundary prints it)
        raise
    finally:
        stop.restore()
    return state.history


def _data(cfg, ctxs, strategy, datasets):
    """``(train_ds, val_ds, data_id, workers_note)``: the run's datasets, this process's share."""
    gpus = [c for c in ctxs if c.device_type == 'gpu']
    workers_note = ''
    if cfg.workers is None:  # decoding and the loader scale with the GPUs
        cfg.workers = default_workers(len(gpus))
        workers_note = ' (default for %d GPU(s); --workers to change)' % len(gpus)
    train_ds, val_ds, data_id = prepare_data(cfg, *datasets, strategy.num_workers)
    if cfg.balance != 'none' and getattr(train_ds, 'groups', None) is None:
        raise UserError('--balance %s: the training images have no appearance groups (generated demo '
                        'nuclei, or a dataset of your own without .groups); use --balance none' % cfg.balance)
    return train_ds, val_ds, data_id, workers_note


def _start_recorder(cfg, val_ds, data_id, strategy, verbose, user_net):
    """The run folder claimed and its recorder started (the input is good by now)."""
    monitor = cfg.monitor if val_ds is not None else 'train_loss'
    with on_write_error(cfg, complete=False):
        recorder = RunRecorder(cfg, monitor, data_id, enabled=strategy.is_main, verbose=verbose,
                               user_net=user_net)
        recorder.start()
    if val_ds is None:
        # Said once, because both fall-backs are silent in the epoch lines.
        recorder.log.info('no validation images (--val-split 0, no --val-data): the best checkpoint is the one with '
                          'the lowest train_loss, not %s%s', cfg.monitor,
                          ('; the export keeps the post-processing of --init\'s model' if cfg.init else
                           '; the export keeps the default post-processing (bin/predict flags override it)')
                          if cfg.tune_postprocess else '')
    return recorder


def _log_data(log, cfg, train_ds):
    """What the sampling and the stain jitter will do with these training images."""
    log_groups(log, getattr(train_ds, 'groups', None), cfg.balance)
    if cfg.stain_jitter:
        # Said because it may do nothing: on grey data, or on a dataset given without its colour.
        colour = getattr(train_ds, 'colour', None)
        count = 0 if colour is None or getattr(train_ds, 'stain', None) is None else sum(c is not None for c in colour)
        log.info('--stain-jitter %g: %d colour training images are jittered', cfg.stain_jitter, count)


def _assemble(cfg, ctxs, net, train_ds, val_ds, recorder, strategy, amp_dtype, started):
    """``(run, checkpoint trainer)``: the loader, the LR schedule, the step and the weight
    average around ``net``, as the fixed parts every epoch uses."""
    gpus = [c.device_id for c in ctxs if c.device_type == 'gpu']
    groups = getattr(train_ds, 'groups', None)
    loader = make_loader(train_ds, cfg.batch_size, shuffle=True, seed=cfg.seed, workers=cfg.workers,
                         num_shards=strategy.num_workers, shard=strategy.rank,
                         pin_device=gpus[0] if gpus else None,
                         groups=groups if cfg.balance != 'none' else None, power=BALANCE_POWER.get(cfg.balance, 0.0),
                         epoch_length=cfg.epoch_samples or balanced_epoch_length(groups, cfg.balance))
    steps_per_epoch = len(loader)
    lr_sched = make_lr_scheduler(cfg.lr_schedule, cfg.lr, cfg.epochs * steps_per_epoch,
                                 warmup_steps=int(cfg.warmup_epochs * steps_per_epoch),
                                 step_fractions=cfg.step_fractions())
    update_on_kv = resolve_update_on_kvstore(cfg, amp_dtype, strategy)
    step = make_step(cfg, net, ctxs, amp_dtype, strategy, lr_sched, update_on_kv)
    run = _TrainingRun(cfg, ctxs, net, step, loader, steps_per_epoch, val_ds, recorder,
                       make_average(net, ctxs, cfg.ema), started=started)
    return run, strategy.checkpoint_trainer(step.trainer, update_on_kv)


def _search_and_export(run, state, amp_dtype, stop, source=None):
    """After the epochs: the post-processing search on the best checkpoint, then the export;
    a stop asked for before (``stop``, still pending) stops them before they begin. A
    fine-tune without validation images keeps the searched settings of the model it
    started from (``source``)."""
    cfg, recorder, tuned = run.cfg, run.recorder, None
    with AfterTraining(cfg, recorder, state, pending=stop.signum) as after, on_write_error(cfg, complete=True):
        if _will_tune(cfg, run.val_ds) and state.history:
            load_checkpoint(recorder.best_checkpoint(), net=run.net)  # tune what will be exported
            tuned = tune_on_dataset(run.net, run.ctxs, run.val_ds, geometry(cfg), cfg.batch_size,
                                    mode=cfg.tune_mode, tta=cfg.tune_tta)
            recorder.log.info('post-processing chosen on %d validation images in %.1f s: %s (val DSB %.4f, untuned '
                              '%.4f); stored in the export, bin/predict uses it', tuned['images'], tuned['seconds'],
                              postprocess.settings_text(tuned), tuned['score'], tuned['base_score'])
        elif source is not None and source.postprocess and cfg.model.target == source.config.model.target:
            tuned = dict(source.postprocess, inherited=source.reference)
            recorder.log.info('post-processing of %s kept (no validation images to search on): %s',
                              source.label, postprocess.settings_text(tuned))
        after.exporting()
        recorder.finish(state, amp_dtype, tuned)


def _train_epochs(run, state, strategy, ckpt_trainer, callbacks, stop):
    """Epochs until ``--epochs`` (or what fits in ``--time-budget``), early stopping, a
    callback or a signal (``stop``, a :class:`StopFlag` the caller installed)."""
    cfg, log = run.cfg, run.recorder.log
    # A resumed run plans from the epochs it has measured (the budget may have changed).
    clock = _clock()  # one running clock: checkpointing counts in the next epoch
    state.train_seconds += clock - run.started  # this process's data loading and setup
    total = _plan_epochs(run, state, strategy)
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
                                             second=second_output(cfg.model.target), clock=_clock)
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
