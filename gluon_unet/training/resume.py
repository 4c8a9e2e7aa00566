"""``--resume``: what may change since a checkpoint (:data:`RESUME_POLICY`), and the
checkpoint a run continues from, checked against the settings and the data
(:func:`find_resume_point`).
"""
import dataclasses
import typing
from dataclasses import dataclass

from ..checkpoint import damaged_resume, load_checkpoint, resolve_resume
from ..config import ModelConfig, TrainConfig, flag_name, setting
from ..data.prepare import data_changed
from ..errors import DamagedFile, UserError


@dataclass(frozen=True)
class ResumeRule:
    """What ``--resume`` does when one setting changed since the checkpoint.

    ``kind``: ``'refuse'`` - the setting shapes the run (``shapes``: the model, the
    batches, the input pixels, the update or which checkpoint is chosen as the best), so a
    change is refused, naming the flag; ``'data'`` - it says where or how the data is
    read, so it may change while the data does not (the data's fingerprint - image
    counts, names, pixels - is compared, and when that differs the changed settings of
    this kind are named with it); ``'allow'`` - it shapes none of these (``shapes`` says
    why not). ``key(cfg)``, for a setting that counts only in some runs (``when`` says
    which), is what is compared: None where it does not count.
    """
    kind: str
    shapes: str
    when: str = ''
    key: typing.Any = None


def _refuse(shapes, when='', key=None):
    return ResumeRule('refuse', shapes, when, key)


def _allow(why):
    return ResumeRule('allow', why)


_MODEL, _BATCHES, _PIXELS, _UPDATE, _BEST = ('the model', 'the batches', 'the input pixels', 'the update',
                                             'the choice of the best checkpoint')


_DATA = ResumeRule('data', 'where and how the data is read')


def _if(condition, name):
    """``key`` of a setting that counts where ``condition(cfg)`` holds."""
    return lambda cfg: getattr(cfg, name) if condition(cfg) else None


def _has_validation(cfg):
    return cfg.val_split > 0 or cfg.val_data is not None


#: Every setting and what ``--resume`` does when it changed: tests/test_resume_policy.py
#: checks every field of TrainConfig and ModelConfig is here, and the docs' sentence is
#: :func:`resume_policy_text`. The optimizer state and the LR schedule's position only
#: mean something for the same optimizer and schedule, the position inside an
#: interrupted epoch only for the same batches, the best value so far only for the same
#: metric compared the same way. Devices may change: weights and optimizer state move to
#: the new ones, and the gradient is the same mean over the same global batch (only
#: BatchNorm's batch statistics pool other images, as with any device count - which
#: --sync-bn changes too).
RESUME_POLICY = {
    # the model (ModelConfig)
    'in_channels': _refuse(_MODEL), 'classes': _refuse(_MODEL), 'width': _refuse(_MODEL),
    'depth': _refuse(_MODEL), 'batch_norm': _refuse(_MODEL), 'dropout': _refuse(_MODEL),
    'upsample': _refuse(_MODEL), 'target': _refuse(_MODEL),
    # data
    'data': _DATA, 'masks': _DATA, 'val_data': _DATA, 'layout': _DATA, 'mask_suffix': _DATA,
    'skip_unpaired': _DATA, 'synthetic_count': _DATA, 'plane': _DATA,
    'size': _refuse(_BATCHES), 'crop': _refuse(_BATCHES), 'val_split': _refuse(_BATCHES),
    'balance': _refuse(_BATCHES), 'augment': _refuse(_BATCHES), 'elastic': _refuse(_BATCHES),
    'scale_aug': _refuse(_BATCHES, 'with --augment', _if(lambda c: c.augment, 'scale_aug')),
    'stain_jitter': _refuse(_BATCHES), 'paste_rate': _refuse(_BATCHES),
    'seed': _refuse(_BATCHES), 'batch_size': _refuse(_BATCHES), 'epoch_samples': _refuse(_BATCHES),
    'normalize': _refuse(_PIXELS),
    'denoise': _refuse(_PIXELS, 'with --normalize percentile, auto or stain',
                       _if(lambda c: c.normalize in ('percentile', 'auto', 'stain'), 'denoise')),
    'workers': _allow('the same batches with any number of loader workers'),
    'cache_dir': _allow('only where decoded arrays are kept'),
    # the update
    'optimizer': _refuse(_UPDATE), 'lr': _refuse(_UPDATE),
    'momentum': _refuse(_UPDATE, 'with --optimizer sgd', _if(lambda c: c.optimizer == 'sgd', 'momentum')),
    'nesterov': _refuse(_UPDATE, 'with --optimizer sgd', _if(lambda c: c.optimizer == 'sgd', 'nesterov')),
    'weight_decay': _refuse(_UPDATE), 'clip_grad': _refuse(_UPDATE), 'ema': _refuse(_UPDATE),
    'lr_schedule': _refuse(_UPDATE), 'warmup_epochs': _refuse(_UPDATE),
    'lr_steps': _refuse(_UPDATE, 'with --lr-schedule step', _if(lambda c: c.lr_schedule == 'step', 'lr_steps')),
    # The other schedules are shaped by the run's length.
    'epochs': _refuse(_UPDATE, 'unless --lr-schedule constant without --warmup-epochs',
                      _if(lambda c: c.lr_schedule != 'constant' or c.warmup_epochs > 0, 'epochs')),
    'loss': _refuse(_UPDATE),
    'dice_weight': _refuse(_UPDATE, 'with --loss bce_dice, wbce_dice or bce_lovasz',
                           _if(lambda c: c.loss in ('bce_dice', 'wbce_dice', 'bce_lovasz'), 'dice_weight')),
    'weight_on': _refuse(_UPDATE, 'with --loss wbce or wbce_dice',
                         _if(lambda c: c.loss in ('wbce', 'wbce_dice'), 'weight_on')),
    'amp': _refuse(_UPDATE), 'amp_dtype': _refuse(_UPDATE, 'with --amp', _if(lambda c: c.amp, 'amp_dtype')),
    # ps-lite's asynchronous servers apply each worker's gradient on its own: another update.
    'kvstore': _refuse(_UPDATE, 'from or to dist_async', lambda c: c.kvstore == 'dist_async'),
    'update_on_kvstore': _allow('the same update, computed on the kvstore or not'),
    'gpus': _allow('devices may change'), 'cpus': _allow('devices may change'),
    'sync_bn': _allow('like the device count, it only changes which images BatchNorm\'s statistics pool'),
    'hybridize': _allow('the same computation'), 'memory': _allow('the same computation'),
    'time_budget': _allow('the run is planned again from the epochs it has measured'),
    # which checkpoint is the best, and when training stops
    'monitor': _refuse(_BEST, 'with validation images', _if(_has_validation, 'monitor')),
    'min_delta': _refuse(_BEST),
    'threshold': _refuse(_BEST, 'with --monitor val_dsb',
                         _if(lambda c: c.monitor == 'val_dsb' and _has_validation(c), 'threshold')),
    'patience': _allow('only when training stops early'),
    'keep_last': _allow('only how many checkpoints are kept'),
    # after the last epoch, and bookkeeping
    'tune_postprocess': _allow('after the last epoch'), 'tune_mode': _allow('after the last epoch'),
    'tune_tta': _allow('after the last epoch'), 'predict_diameter': _allow('stored in the export'),
    # What --init fixed (the model, the input pixels) is compared as those settings.
    'init': _allow('the checkpoint holds the weights it started from'),
    'output': _allow('the run folder'), 'resume': _allow('the checkpoint itself'),
    'overwrite': _allow('not used with --resume'), 'benchmark': _allow('no training'),
    'progress': _allow('display only'), 'tensorboard': _allow('logs only'),
}


_MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


#: The TrainConfig settings a resumed run must share with its checkpoint in every run.
RESUME_FIXED = tuple(k for k, r in RESUME_POLICY.items() if r.kind == 'refuse' and r.key is None
                     and k not in _MODEL_FIELDS)


def resume_conflicts(saved, current, kind='refuse'):
    """The settings of ``kind`` (see :class:`ResumeRule`) that differ between a
    checkpoint's config and this run's, as ``['--batch-size 16 (now 8)', ...]``: for
    ``'refuse'``, empty when the run can be resumed."""
    out = []
    for name, rule in RESUME_POLICY.items():
        if rule.kind != kind:
            continue
        compared = rule.key or (lambda cfg: setting(cfg, name))
        # A conditional setting left as it was is not named when its condition changed:
        # the setting that changed is.
        if compared(saved) != compared(current) and setting(saved, name) != setting(current, name):
            out.append('%s %s (now %s)' % (flag_name(name), setting(saved, name), setting(current, name)))
    return out


def resume_policy_text():
    """The docs' paragraph on what ``--resume`` refuses and allows, made from
    :data:`RESUME_POLICY` (so the two cannot disagree)."""
    def flag(name):
        rule = RESUME_POLICY[name]
        return '`%s`%s' % (flag_name(name), ' ' + rule.when if rule.when else '')

    groups = {}
    for name, rule in RESUME_POLICY.items():
        if rule.kind == 'refuse':
            groups.setdefault(rule.shapes, []).append(flag(name))
    shaped = '; '.join('%s (%s)' % (what, ', '.join(flags)) for what, flags in groups.items())
    data = ', '.join(flag(n) for n, r in RESUME_POLICY.items() if r.kind == 'data')
    allowed = ', '.join(flag(n) for n, r in RESUME_POLICY.items()
                        if r.kind == 'allow' and n not in ('resume', 'overwrite', 'benchmark'))
    return ('`--resume` refuses, in one line naming each changed flag with its old value, any change of what '
            'shaped the run: %s. The data may be read from elsewhere (%s) but must be the same images - the '
            'same count, names and pixels - and, with `bin/launch`, the same number of workers. Anything else '
            'may change: %s.' % (shaped, data, allowed))


def check_resumable(path, meta, cfg, data_id):
    """Refuse, in one line, to resume ``meta`` (a checkpoint's record) with settings or
    data it cannot continue exactly (:data:`RESUME_POLICY`)."""
    saved = TrainConfig.from_dict(meta['config'])
    conflicts = resume_conflicts(saved, cfg)
    if conflicts:
        raise UserError('--resume %s: the run was trained with %s; resume with the same values (or start a '
                        'new run)' % (path, ', '.join(conflicts)))
    old = meta.get('data')
    if data_changed(old, data_id):
        read = resume_conflicts(saved, cfg, kind='data')
        raise UserError('--resume %s: the data changed since the checkpoint (it trained on %d images and '
                        'validated on %d, now %d and %d, or other files or pixels%s); resume with the same data'
                        % (path, old['train'], old['val'], data_id['train'], data_id['val'],
                           '; read with %s' % ', '.join(read) if read else ''))
    if old and old.get('workers', 1) != data_id['workers']:
        raise UserError('--resume %s: the run had %d worker(s), now %d: the global batch would change; '
                        'resume with bin/launch -n %d' % (path, old.get('workers', 1), data_id['workers'],
                                                          old.get('workers', 1)))


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
