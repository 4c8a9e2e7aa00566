"""The typed configuration: every default lives here, once.

`TrainConfig` (with its nested `ModelConfig`) is the single source of truth for a run.
The CLI builds its flags from these fields (``batch_size`` -> ``--batch-size``), the
run directory stores it as ``config.json``, and every checkpoint and export embeds it
so a model can be rebuilt without the command line that trained it.

Why one module: every training setting, its one default, its range and the rules that
tie settings together are read in one place; split by topic, a default and the rule that
checks it would live apart, and ``bin/train --help`` shows them in this order.
"""
import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Optional

from .errors import UserError
from .machine.devices import parse_gpu_list
from .machine.limits import safe_sides, unet_crash

_CHOICES = {
    'upsample': ('deconv', 'bilinear'),
    'optimizer': ('sgd', 'adam', 'adamw'),
    'lr_schedule': ('constant', 'cosine', 'poly', 'step'),
    'loss': ('bce', 'dice', 'bce_dice', 'lovasz', 'bce_lovasz', 'wbce', 'wbce_dice', 'ce'),
    'kvstore': ('device', 'local', 'nccl', 'dist_sync', 'dist_device_sync', 'dist_async', 'horovod'),
    'monitor': ('val_dsb', 'val_iou', 'val_dice', 'val_loss'),
    'layout': ('auto', 'paired', 'dsb', 'csv'),
    'amp_dtype': ('auto', 'float16', 'bfloat16'),
    'normalize': ('none', 'invert', 'percentile', 'auto', 'stain'),
    'balance': ('none', 'groups', 'sqrt', 'oversample'),
    'target': ('mask', 'mask-gap', 'mask+border', 'mask+centre', 'mask+contact', 'mask+touching', 'mask+flow'),
    'memory': ('speed', 'balanced', 'low'),
    'weight_on': ('all', 'second'),
    'tune_mode': ('auto', 'resize', 'tile', 'whole'),  # tiling.MODES, spelled out: no numpy here (a test compares)
}
#: Targets whose maps after the foreground are levels (0..1), not classes: the BCE trains
#: them, the Dice (or Lovasz) term covers the foreground only.
LEVEL_TARGETS = ('mask+centre', 'mask+flow')


#: ``--plane``'s help, the same for bin/train and bin/predict.
PLANE_HELP = ('the plane of every stack to read (a TIFF with several pages or a z, t or channel axis, counted '
              'from 0 over those axes); files of one plane are read whole (default: stacks are refused)')


def option(default, help, **extra):
    """A config dataclass field whose metadata says how its command-line flag looks.

    ``gluon_unet.cli.common`` makes one flag per field from it: ``help`` (the default is
    added to it), and optionally ``flag`` (another name than the field's), ``short``
    (``'-n'``), ``metavar``, ``choices`` (enforced by the parser), ``required``,
    ``positional`` and ``rest`` (a positional taking everything after it, e.g. a command).
    Two more are rules the tests generate cases from: ``within`` (a numeric field's
    :class:`Range`) and ``path`` (``'in'``: a file or folder the command reads, ``'out'``:
    one it writes; every output is kept apart from every input of the same command).
    """
    meta = {'help': help, **extra}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts, for its one-line error and for the tests that
    generate bad values from it (``tests/test_cli_contract.py``): ``low`` to ``high``,
    each included unless ``open`` names it (``'low'``, ``'high'``, ``'both'``). nan and
    the infinities never pass. ``note`` ends the message, e.g. ``'(0 = off)'``."""
    low: float
    high: float
    open: str = ''
    note: str = ''

    def contains(self, value):
        low_ok = value > self.low if self.open in ('low', 'both') else value >= self.low
        high_ok = value < self.high if self.open in ('high', 'both') else value <= self.high
        return bool(low_ok and high_ok and math.isfinite(value))  # nan fails every comparison

    def words(self, integer):
        """``'between 1 and 7'``, ``'in [0, 1)'``: what the message says the value must be."""
        if integer:
            return 'an integer between %d and %d' % (self.low, self.high)
        brackets = ('(' if self.open in ('low', 'both') else '[') + '%g, %g' + \
            (')' if self.open in ('high', 'both') else ']')
        return 'a number in ' + brackets % (self.low, self.high)


def within(low, high, open='', note=''):
    """``option(..., within=within(0, 1, 'high'))``: a :class:`Range`."""
    return Range(low, high, open, note)


def shown(value, limit=60, as_json=False):
    """``repr(value)`` (``as_json``: its JSON) cut to ``limit`` characters, for a one-line
    error that echoes a value: a nested list of 2,000 characters stays a short line."""
    try:
        text = json.dumps(value) if as_json else repr(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + '...'


def check_fields(config, flag=None):
    """Raise :class:`UserError` naming the flag of the first field of ``config`` (a config
    dataclass) whose value has not its field's type (:func:`check_types`) or lies outside
    its ``within`` range (:func:`check_ranges`): what every command's ``validate()`` checks
    first."""
    check_types({f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                 if not dataclasses.is_dataclass(getattr(config, f.name))}, type(config))
    check_ranges(config, flag)


def check_ranges(config, flag=None):
    """Raise :class:`UserError` naming the flag of the first field of ``config`` (a config
    dataclass) whose value is outside its ``within`` :class:`Range`.

    ``flag``: field name -> flag (default ``--field-name``, or the field's ``flag``)."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        rng, value = f.metadata.get('within'), getattr(config, f.name)
        if rng is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not rng.contains(value):
            integer = int in (typing.get_args(hints[f.name]) or (hints[f.name],))
            name = flag(f.name) if flag else '--' + f.metadata.get('flag', f.name.replace('_', '-'))
            raise UserError('%s must be %s%s (got %s)' % (name, rng.words(integer),
                                                          ' ' + rng.note if rng.note else '', shown(value)))


#: The help of ``--gpus`` and ``--cpus``, the same for every command that takes them.
GPU_IDS = "'0-7', '0,2,5', '0-3,6', 'all'"
GPUS_HELP = 'GPU ids: %s; empty = CPU' % GPU_IDS
CPUS_HELP = 'number of CPU contexts when no GPU is used'


@dataclass
class ModelConfig:
    """Architecture of the U-Net; enough to rebuild it from a checkpoint."""
    in_channels: int = option(0, 'input channels: 1 or 3 (images are converted); 0 = from the data',
                            flag='channels',
                            within=within(0, 3, note='(1 or 3; 0 = from the data)'))
    classes: int = option(1, 'output classes; 1 = binary mask with a sigmoid', within=within(1, 256))
    width: int = option(32, 'filters of the first level; doubled at every pooling', within=within(1, 1024))
    depth: int = option(4, 'number of poolings; image sides must be divisible by 2**depth', within=within(1, 7))
    batch_norm: bool = option(True, 'BatchNorm after every convolution')
    dropout: float = option(0.0, 'dropout rate at the bottleneck (0 = off)', within=within(0, 1, 'high'))
    upsample: str = option('deconv', 'decoder upsampling: transposed conv or bilinear resize + conv')
    target: str = option('mask', 'what the network predicts: mask (foreground); mask-gap (foreground with a '
                               '1 px background line where nuclei touch, so the map keeps them apart); or '
                               'mask+border (foreground and the nuclei\'s borders, a second output channel: '
                               'instances grow from the interiors, so touching nuclei come apart); or '
                               'mask+centre (foreground and each nucleus\' distance to its edge as a fraction of '
                               'its largest, a second channel: instances grow from its hill tops and meet in the '
                               'valleys between touching nuclei); or mask+contact (foreground and the lines where '
                               'nuclei touch, a second channel: instances grow from the foreground less the '
                               'contacts; with --loss wbce_dice the contacts weigh most); or mask+touching (the '
                               'same, the band where nuclei meet drawn wider for larger nuclei, as the 2018 DSB '
                               'winners drew it); or mask+flow (foreground and the direction from each pixel to '
                               'its nucleus\' centre, two more channels, as Cellpose: instances gather where the '
                               'directions meet, so touching nuclei part where the directions turn)')

    @property
    def outputs(self):
        """Output channels of the network: ``classes``, plus one for the targets with a
        second map (``mask+border``, ``mask+centre``, ``mask+contact``, ``mask+touching``),
        two for ``mask+flow`` (the direction's y and x)."""
        return self.classes + (2 if self.target == 'mask+flow' else self.target.startswith('mask+'))


@dataclass
class TrainConfig:
    """Everything a training run needs. See ``bin/train --help`` for the flags."""
    model: ModelConfig = field(default_factory=ModelConfig)

    # data
    data: Optional[str] = option(None, 'training images: a folder (paired or DSB layout) or a CSV; '
                                     'absent = generated demo nuclei', path='in')
    masks: Optional[str] = option(None, 'mask folder for the paired layout', path='in')
    val_data: Optional[str] = option(None, 'separate validation set (same layouts as --data)', path='in')
    layout: str = option('auto', 'input layout (auto-detected by default)')
    mask_suffix: str = option('_mask', 'paired layout: name.png <-> name<suffix>.png')
    plane: Optional[int] = option(None, PLANE_HELP, metavar='N', within=within(0, 10 ** 6))
    size: int = option(128, 'train at SIZE x SIZE pixels (images resized with area interpolation)',
                       within=within(1, 16384))
    crop: int = option(0, 'random SIZE crops at native resolution instead of resizing (0 = off)',
                       within=within(0, 16384, note='(0 = off)'))
    val_split: float = option(0.1, 'fraction held out for validation (seeded shuffle)', within=within(0, 1, 'high'))
    workers: Optional[int] = option(None, 'data loader worker processes (0 = in the main process); default: '
                                         '2 per GPU up to the CPU cores less one, or 2 for CPU training',
                                    within=within(0, 1024))
    cache_dir: Optional[str] = option(None, 'where to cache decoded arrays (default: $XDG_CACHE_HOME/gluon_unet, '
                                          'i.e. ~/.cache/gluon_unet; never inside your data)', path='in')
    normalize: str = option('none', 'per-image input normalization, also applied by bin/predict: invert '
                                  '(bright-background images become dark-background), percentile '
                                  '(light denoise, then stretch 0.5..99.8th percentile to 0..255), auto (both), '
                                  'stain (colour tissue: its hematoxylin channel, nuclei bright; grey images: '
                                  'auto), none')
    denoise: float = option(1.0, 'Gaussian sigma (pixels) of the denoise before the percentile stretch of '
                               '--normalize percentile, auto and stain, so a dim nucleus is not stretched into '
                               'specks; 0 = off; stored in the export',
                            within=within(0, 100, note='(pixels; 0 = off)'))
    balance: str = option('none', 'groups: draw every appearance group equally often per epoch (same epoch '
                                'length; rare groups repeat); sqrt: in proportion to the square root of its '
                                'size (rare groups more often, common ones not starved); oversample: every '
                                'group as often as the largest one (nothing is cut down; the epoch grows to '
                                'groups x largest). Groups: the CSV\'s group column, else from the pixels '
                                '(fluorescence, brightfield, colour); validation is not resampled')
    skip_unpaired: bool = option(False, 'warn about images without a mask instead of failing')
    augment: bool = option(True, 'flips, 90-degree rotations, scale/crop, brightness/contrast/gamma')
    elastic: bool = option(False, 'elastic deformation augmentation')
    scale_aug: str = option('0.8,1.25', 'range of the zoom factor of --augment, drawn log-uniform (2.0 shows the '
                                      'nuclei twice as wide); e.g. 0.5,2.0 when the images to segment may have '
                                      'nuclei of other sizes than the training ones')
    stain_jitter: float = option(0.0, 'HED stain jitter of colour training images (Tellez et al. 2018): their '
                                    'hematoxylin, eosin and DAB densities scaled by 1 +- SIGMA and shifted by '
                                    '+- SIGMA at random, before --normalize; grey images are left alone. 0.05 '
                                    'light, 0.2 strong; 0 = off', within=within(0, 1, 'high', '(e.g. 0.05; 0 = off)'))
    paste_rate: float = option(0.0, 'share of training crops (with --augment) that get 1-5 copies of their own nuclei '
                                    'pasted against other nuclei, touching or overlapping them, so that crowded '
                                    'clumps are seen more often than the data has them; 0.05 is what the 2018 DSB '
                                    'winners used; 0 = off', within=within(0, 1))
    epoch_samples: int = option(0, 'training crops drawn per epoch; 0 = one per training image. Fewer images than '
                                   'this repeat, each repeat augmented anew (fine-tuning on a few annotated images)',
                                within=within(0, 100000000, note='(0 = one per training image)'))
    synthetic_count: int = option(192, 'number of generated demo images when --data is absent',
                                  within=within(1, 1000000))

    # where the weights start
    init: Optional[str] = option(None, 'fine-tune MODEL: a shipped model (nuclei), an export, a run folder or a '
                                     'checkpoint. Its architecture, normalization and scale are kept (a flag that '
                                     'contradicts them is refused), --channels 1<->3 is adapted in the first layer, '
                                     'another --target gets a new head; its training settings and a fine-tune\'s '
                                     'length and learning rate are the defaults. NAME@sha256:... pins its weights',
                                 path='in')

    # devices and data-parallel step
    gpus: str = option('', GPUS_HELP + " (with --kvstore horovod: the host's GPUs, dealt to its processes by local "
                                       "rank; 'all' = GPU <local rank>)")
    cpus: int = option(1, CPUS_HELP, within=within(1, 1024))
    kvstore: str = option('device', 'gradient aggregation across devices / machines')
    update_on_kvstore: Optional[bool] = option(None, 'run the optimizer on the kvstore '
                                                  '(default: MXNet decides; off with --clip-grad/--amp)')

    # optimization
    epochs: int = option(50, 'maximum number of epochs', within=within(1, 100000))
    time_budget: float = option(0.0, 'minutes the whole run may take (0 = no limit): the data loading counts, and '
                                   'the post-processing search after the epochs is kept aside (estimated after '
                                   'the first epoch from a probe of its validation images); after each epoch, '
                                   'the run is cut to the epochs that fit and the LR schedule ends with the last '
                                   'of them', within=within(0, 525600, note='(minutes; 0 = no limit)'))
    batch_size: int = option(16, 'batch size per process, split across its devices (with a dist '
                                'kvstore or horovod: per worker process; the global batch is workers x this)',
                             within=within(1, 65536))
    optimizer: str = option('adam', 'optimizer')
    lr: float = option(1e-3, 'peak learning rate', within=within(0, 100, 'low'))
    momentum: float = option(0.9, 'SGD momentum', within=within(0, 1, 'high'))
    nesterov: bool = option(True, 'Nesterov momentum for SGD')
    weight_decay: float = option(0.0, 'weight decay of the convolution kernels (decoupled for adamw; '
                                 'biases and BatchNorm gamma/beta are not decayed)', within=within(0, 10))
    clip_grad: float = option(0.0, 'clip the global gradient norm (0 = off)', within=within(0, 1e6, note='(0 = off)'))
    ema: float = option(0.0, 'keep an exponential moving average of the weights with this decay per step '
                           '(e.g. 0.99: about the last 100 steps; warmed up as (1+t)/(10+t)); validation, '
                           'the best checkpoint and the export use the average, training the raw weights; '
                           '0 = off', within=within(0, 1, 'high', '(a decay per step, e.g. 0.99; 0 = off)'))
    lr_schedule: str = option('constant', 'learning-rate schedule, stepped every iteration')
    warmup_epochs: float = option(0.0, 'linear warmup length in epochs', within=within(0, 100000))
    lr_steps: str = option('0.6,0.85', "'step' schedule: fractions of training where LR drops 10x")
    loss: str = option('bce', 'loss: bce, dice, bce_dice, lovasz (the Lovasz hinge, a convex surrogate of the IoU), '
                            'bce_lovasz (bce + lovasz), wbce (BCE weighted by the U-Net paper\'s map, heavy in '
                            'the gaps between nuclei), wbce_dice (wbce + Dice), ce (classes > 1)')
    dice_weight: float = option(1.0, 'weight of the Dice term in bce_dice and wbce_dice, of the Lovasz term in '
                                   'bce_lovasz', within=within(0, 1e6))
    weight_on: str = option('all', 'wbce and wbce_dice: the outputs the pixel weights apply to: all, or second (the '
                                 'second map of a two-map --target only: the foreground keeps the plain BCE, so '
                                 'its outlines are drawn as bce_dice draws them)')
    amp: bool = option(False, 'mixed precision: float16 on GPU, bfloat16 on CPU')
    amp_dtype: str = option('auto', 'mixed precision type (auto: float16 on GPU, bfloat16 on CPU)')
    sync_bn: bool = option(False, 'synchronize BatchNorm statistics across devices (--batch-size must divide '
                                'over them; an epoch\'s last batch is cut to a multiple of the device count)')
    hybridize: bool = option(True, 'compile the network (static_alloc, static_shape)')
    memory: str = option('speed', 'training memory against speed, same results: speed (hybridized, static '
                                'buffers), balanced (a bound graph recomputing BatchNorm and ReLU in backward: '
                                '-13 percent memory per image at width 64), low (recomputing each block but its '
                                'output: -34 percent, about one more forward pass of compute). balanced '
                                'and low do not combine with --amp or --sync-bn. docs/performance.md has the '
                                'figures')

    # run bookkeeping
    output: Optional[str] = option(None, 'run folder (config, logs, metrics, checkpoints, export); default: '
                                       'a new runs/unet, runs/unet-2, ... (runs/demo... for the demo). '
                                       'A folder holding another run is refused', path='out')
    overwrite: bool = option(False, 'start over in an --output that holds a run: deletes its config, logs, '
                                  'metrics, checkpoints and export (other files stay)')
    seed: int = option(0, 'random seed (data split, initialization, augmentation)', within=within(0, 2 ** 32 - 1))
    monitor: str = option('val_iou', 'metric that picks the best checkpoint and drives early stopping')
    patience: int = option(20, 'early stopping: epochs without improvement (0 = off)',
                           within=within(0, 100000, note='(0 = off)'))
    min_delta: float = option(0.0, 'early stopping: smallest change that counts as improvement',
                              within=within(0, 1e6))
    keep_last: int = option(2, 'how many recent checkpoints to keep besides the best', within=within(0, 100000))
    resume: Optional[str] = option(None, "checkpoint or run folder to resume from, or 'auto' (latest in "
                                       "--output; without --output, the newest runs/unet-N)")
    threshold: float = option(0.5, 'probability threshold for masks', within=within(0, 1, 'both'))
    tune_postprocess: bool = option(True, 'after training, choose the threshold, watershed h and minimum object '
                                        'size on the validation split; stored in the export for bin/predict')
    tune_mode: str = option('auto', 'the bin/predict --mode the search predicts the validation images with '
                                  '(auto, tile, whole, resize): the one you will predict with')
    tune_tta: bool = option(False, 'search the post-processing on test-time-augmented validation maps (8 flips / '
                                 'quarter turns: 8x the search\'s prediction time), for a model you will run '
                                 'with bin/predict --tta')
    predict_diameter: Optional[str] = option(None, "the bin/predict --diameter this model uses when none is given "
                                                   "(stored in the export): range = enlarge small nuclei to the training "
                                                   "median, shrink only those larger than trained on for that kind of "
                                                   "image; auto = every image to the median; PIXELS; none (default)",
                                             metavar='range|auto|PIXELS|none')
    benchmark: bool = option(False, 'short synthetic speed run: images/s per device and scaling')
    progress: bool = option(True, 'show progress bars')
    tensorboard: bool = option(False, 'write TensorBoard logs to <run>/tb: loss and lr per step, metrics and '
                                    'validation overlays per epoch (needs tensorboardX)')

    # -- (de)serialization -------------------------------------------------------------
    def to_dict(self):
        """Plain-JSON form, as stored in config.json, checkpoints and exports."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        """Rebuild from :meth:`to_dict` output; unknown keys are an error. A config saved
        before a setting existed gets the value that reproduces what that run did
        (:data:`BEFORE_IT_EXISTED`), not today's default."""
        d = dict(d)
        for key, value in BEFORE_IT_EXISTED.items():
            d.setdefault(key, value)
        model = ModelConfig(**d.pop('model', {}))
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise UserError('config has unknown keys: %s' % ', '.join(sorted(unknown)))
        return cls(model=model, **d)

    def to_json(self):
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text):
        return cls.from_dict(json.loads(text))

    def scale_range(self):
        """``--scale-aug`` as ``(min, max)`` floats (raises ValueError when malformed)."""
        lo, hi = (float(v) for v in self.scale_aug.split(','))
        return lo, hi

    def step_fractions(self):
        """``--lr-steps`` as floats: where in the run the 'step' schedule drops."""
        return [float(s) for s in self.lr_steps.split(',') if s.strip()]

    # -- validation ---------------------------------------------------------------------
    def validate(self):
        """Raise :class:`UserError` naming the flag of the first invalid value: its type,
        its range (each field's ``within``), then the rules that tie fields together."""
        check_types(dataclasses.asdict(self.model), ModelConfig)
        check_types({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != 'model'},
                    TrainConfig)
        if self.model.in_channels not in (0, 1, 3):
            raise UserError('--channels must be 1 or 3 (or 0 = from the data) (got %s)'
                            % shown(self.model.in_channels))
        check_ranges(self.model, flag_name)
        check_ranges(self)
        for key, allowed in _CHOICES.items():
            value = getattr(self.model, key) if hasattr(self.model, key) else getattr(self, key)
            if value not in allowed:
                raise UserError('%s must be one of %s (got %s)'
                                % (flag_name(key), ', '.join(allowed), shown(value)))
        self._check_text_values()
        self._check_devices()
        self._check_shape()
        self._check_loss_and_target()
        return self

    def _check_text_values(self):
        """The fields that hold a number or a list as text: --scale-aug, --lr-steps, --predict-diameter."""
        try:
            lo, hi = self.scale_range()
        except ValueError:
            lo = hi = math.nan
        if not 0 < lo <= hi < math.inf:  # nan fails too
            raise UserError('--scale-aug must be MIN,MAX zoom factors with 0 < MIN <= MAX, e.g. 0.5,2.0 (got %s)'
                            % shown(self.scale_aug))
        if self.paste_rate and not self.augment:
            raise UserError('--paste-rate %g pastes nuclei as part of --augment; drop --no-augment or --paste-rate'
                            % self.paste_rate)
        # Checked whatever --lr-schedule says: a value is refused where it is given, not
        # when a later run (or --resume with another schedule) starts to read it.
        try:
            steps = self.step_fractions()
        except ValueError:
            steps = None
        if not steps or not all(0 < s < 1 for s in steps):
            raise UserError("--lr-steps must be comma-separated fractions in (0, 1) (got %s)"
                            % shown(self.lr_steps))
        if self.predict_diameter is not None:
            from .data.sizes import diameter_choice_error  # numpy: not for --help (stdlib only)
            problem = diameter_choice_error(self.predict_diameter)
            if problem:
                raise UserError('--predict-diameter %s' % problem)
            if self.predict_diameter != 'none' and not self.crop:
                raise UserError('--predict-diameter %s needs training at native resolution (--crop): images resized '
                                'to --size have no one nucleus size to rescale to (--predict-diameter none turns it '
                                'off)' % self.predict_diameter)

    def _check_devices(self):
        """--gpus' syntax, and what the kvstore, the time budget, SyncBatchNorm, AMP and
        --memory allow together."""
        parse_gpu_list(self.gpus)
        if self.time_budget and self.lr_schedule != 'constant' and self.kvstore.startswith('dist') \
                and (self.kvstore == 'dist_async' or self.update_on_kvstore):
            # The servers run the optimizer on a copy of the schedule sent at the start.
            raise UserError('--time-budget with --kvstore %s%s: the LR schedule runs on the servers and cannot '
                            'be fitted to the epochs that fit; use --lr-schedule constant or a synchronous '
                            'kvstore updating on the workers' % (self.kvstore, ' --update-on-kvstore'
                                                                 if self.update_on_kvstore else ''))
        if self.sync_bn and self.kvstore == 'horovod':
            # Horovod has no SyncBatchNorm for MXNet, and with one GPU per process MXNet's
            # would be plain BatchNorm: refused rather than silently ignored.
            raise UserError('--sync-bn with --kvstore horovod: MXNet synchronizes BatchNorm only between the '
                            'devices of one process and Horovod runs one process per GPU; drop --sync-bn '
                            '(each process normalizes over its own --batch-size)')
        if self.memory != 'speed' and (self.amp or self.sync_bn):
            # Both work through autograd (loss scaling, the threaded SyncBatchNorm step);
            # the memory settings train through a bound symbol (parallel.MirroredStep).
            raise UserError('--memory %s does not combine with %s; use --memory speed'
                            % (self.memory, '--amp' if self.amp else '--sync-bn'))

    def _check_shape(self):
        """The training side must halve ``depth`` times, and run on this MXNet."""
        m, side = self.model, self.crop or self.size
        if side % (2 ** m.depth):
            raise UserError('--%s %d is not divisible by 2**depth = %d (depth %d); use a multiple of %d'
                            % ('crop' if self.crop else 'size', side, 2 ** m.depth, m.depth, 2 ** m.depth))
        if not self.gpus:
            self._check_cpu_shape(side)

    def _check_loss_and_target(self):
        """Which losses train which targets and classes."""
        m = self.model
        if m.target != 'mask' and (m.classes > 1 or self.loss == 'ce'):
            raise UserError('--target %s is for binary masks (--classes 1) with a sigmoid loss '
                            '(bce, dice, bce_dice, lovasz, bce_lovasz, wbce, wbce_dice), not --loss ce' % m.target)
        if m.target in LEVEL_TARGETS and self.loss in ('dice', 'lovasz'):
            # The centre and flow maps are levels (0..1), trained by the BCE alone: with
            # Dice or the Lovasz hinge only on the foreground, they would get no loss at all.
            raise UserError('--target %s needs a loss with a BCE term for its %s maps '
                            '(bce, bce_dice, bce_lovasz, wbce, wbce_dice), not --loss %s'
                            % (m.target, m.target[5:], self.loss))
        if self.weight_on == 'second' and m.target == 'mask+flow':
            raise UserError('--weight-on second is for a --target with one second map (mask+border, mask+centre, '
                            'mask+contact, mask+touching), not mask+flow: its weight map goes on every output')
        if self.weight_on == 'second' and (self.loss not in ('wbce', 'wbce_dice')
                                           or not m.target.startswith('mask+')):
            raise UserError('--weight-on second needs --loss wbce or wbce_dice and a --target with a second map '
                            '(mask+border, mask+centre, mask+contact, mask+touching) (got --loss %s, --target %s)'
                            % (self.loss, m.target))
        if (m.classes > 1) != (self.loss == 'ce'):
            raise UserError("--loss ce goes with --classes > 1, and --classes > 1 needs --loss ce "
                            "(got --loss %s, --classes %d)" % (self.loss, m.classes))

    def _check_cpu_shape(self, side):
        """Refuse a side whose network MXNet 1.9.1's CPU build dies on (:mod:`.limits`):
        validation and the first forward run it in inference mode."""
        m = self.model
        unet = dict(width_=m.width, depth=m.depth, bf16=self.amp)
        crash = unet_crash(side, side, outputs=m.outputs, **unet)
        if crash:
            below, above = safe_sides(side, 2 ** m.depth, outputs=m.outputs, **unet)
            flag = '--crop' if self.crop else '--size'
            raise UserError('%s %d: MXNet 1.9.1 on CPU dies (SIGFPE, a division by zero in oneDNN) building %s; '
                            'use %s%s, or train on GPUs' % (flag, side, crash, '%s %d or ' % (flag, below)
                                                           if below else '', '%s %d' % (flag, above)))


#: Settings added after runs were saved whose default is not what those runs did: the
#: denoise before the percentile stretch (runs before it had none).
BEFORE_IT_EXISTED = {'denoise': 0.0}


def check_types(values, cls, where=None):
    """Raise :class:`UserError` when a value does not have its field's type.

    ``where`` names the source (e.g. ``'--config run.json'``); without it, the flag is
    named. ints are accepted where floats are expected (and converted by the caller).
    """
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in hints or key == 'model':
            continue
        tp, optional = hints[key], False
        if typing.get_origin(tp) is typing.Union:
            optional = type(None) in typing.get_args(tp)
            tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
        if value is None and optional or tp not in (bool, int, float, str):
            continue  # a list (launch's command) is built by the parser, not typed by a user
        ok = {bool: lambda v: isinstance(v, bool),
              int: lambda v: isinstance(v, int) and not isinstance(v, bool),
              float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              str: lambda v: isinstance(v, str)}[tp](value)
        if not ok:
            kind = {bool: 'true or false', int: 'an integer', float: 'a number', str: 'a string'}[tp]
            if key == 'gpus':
                kind = 'a string of GPU ids such as "0-7" or "0,2"'
            meta = next((f.metadata for f in dataclasses.fields(cls) if f.name == key), {})
            name = ('%s: %s' % (where, key)) if where else meta.get('metavar', key.upper()) \
                if meta.get('positional') else flag_name(key)
            raise UserError('%s must be %s%s (got %s)' % (name, kind, ' or null' if optional else '',
                                                          shown(value, as_json=True)))


def setting(cfg, name):
    """The value of the setting ``name`` of a :class:`TrainConfig`, its own or its model's
    (``width`` is ``cfg.model.width``)."""
    return getattr(cfg.model, name) if name in {f.name for f in dataclasses.fields(ModelConfig)} else \
        getattr(cfg, name)


def flag_name(field_name):
    """``batch_size`` -> ``--batch-size`` (and ``in_channels`` -> ``--channels``)."""
    for f in dataclasses.fields(ModelConfig):
        if f.name == field_name and 'flag' in f.metadata:
            return '--' + f.metadata['flag']
    return '--' + field_name.replace('_', '-')
