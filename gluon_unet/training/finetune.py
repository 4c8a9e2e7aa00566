"""Fine-tuning: ``bin/train --init MODEL`` starts from a trained model's weights.

MODEL is a shipped model's name (``nuclei``), an export, a run folder or a checkpoint
(:func:`find_source`). What the network is and what it was fed come from MODEL
(:data:`KEPT`): a flag that contradicts them is refused in one line naming both values,
since the weights mean nothing for another architecture or other input pixels. Two
changes are adapted instead: ``--channels`` 1 <-> 3 in the first convolution (a grey
model's filters applied to each colour, or a colour model's summed), and another
``--target`` or ``--classes`` gets a new head. The training settings MODEL was made with
(:data:`INHERITED`: loss, augmentation, optimizer, ...) are the defaults, and the length
and learning rate default to a fine-tune's (:data:`FINE_TUNE_DEFAULTS`); any flag
overrides those.

The run's config records where it started as ``init = '<name or path>@<digest>'``
(``config.json``, every checkpoint, the export's ``model.json``; its card names the
model without a local path: :func:`gluon_unet.models.reference_card`), and a pinned
``--init nuclei@sha256:...`` refuses other weights.
"""
import dataclasses
import os
from dataclasses import dataclass

from .. import models
from ..config import ModelConfig, TrainConfig, flag_name, setting, shown
from ..errors import UserError

#: Set by MODEL; a flag that differs is refused. The network's shape, and what its input
#: pixels are: the normalization, its denoise, and the scale (--crop keeps the native
#: resolution, --size resizes) with the diameter bin/predict rescales to.
KEPT = ('width', 'depth', 'batch_norm', 'upsample', 'normalize', 'denoise', 'predict_diameter')

#: Set by MODEL unless a flag says otherwise: how it was trained.
INHERITED = ('dropout', 'loss', 'dice_weight', 'weight_on', 'optimizer', 'momentum', 'nesterov', 'weight_decay',
             'clip_grad', 'ema', 'lr_schedule', 'lr_steps', 'augment', 'elastic', 'scale_aug', 'stain_jitter',
             'paste_rate', 'batch_size', 'monitor', 'threshold', 'tune_postprocess', 'tune_mode', 'tune_tta',
             'memory', 'hybridize')

#: A fine-tune's own defaults, set before the few-shot benchmark measured them (docs/quality.md): a
#: quarter of the dsb2018 recipe's peak rate, so the first steps on a handful of images
#: do not undo what the model knows; an epoch of 128 crops however few the images (each
#: repeat differently augmented); no validation split (every annotated image trains; the
#: export keeps MODEL's searched post-processing unless --val-data or --val-split says
#: otherwise). The whole command takes 2 min 15 s for the shipped model on 3 images on the
#: 2 cores of an AMD EPYC Zen 4 (docs/quality.md).
FINE_TUNE_DEFAULTS = {'lr': 5e-4, 'epochs': 20, 'warmup_epochs': 1.0, 'epoch_samples': 128, 'val_split': 0.0,
                      'time_budget': 0.0, 'patience': 0}

#: Where MODEL's training resolution is kept: resized training (--size) is another scale
#: for every other --size, native-resolution crops (--crop) are the same scale at any crop.
_SCALE = ('crop', 'size')


@dataclass
class Source:
    """A resolved ``--init``.

    ``label``: the shipped name, or the path as an absolute path; ``kind``: ``'export'``
    or ``'checkpoint'``; ``path``: the export prefix (``.../model``) or the checkpoint
    file; ``config``: the :class:`TrainConfig` it was trained with; ``digest``: of its
    weights; ``postprocess``: its searched post-processing (exports), else None."""
    label: str
    kind: str
    path: str
    config: TrainConfig
    digest: str
    postprocess: dict = None

    @property
    def reference(self):
        """``'nuclei@sha256:...'``: what ``config.json`` records as ``init``."""
        return '%s@%s' % (self.label, self.digest)


def find_source(value, flag='--init'):
    """Resolve ``value`` (``--init``) to a :class:`Source`, checked: a missing, damaged
    or foreign MODEL is one line naming ``flag``.

    A run folder starts from its export (which carries the searched post-processing),
    else from its best checkpoint.
    """
    if not isinstance(value, str) or not value.strip():
        raise UserError('%s must name a model: a shipped model (%s), an export, a run folder or a checkpoint'
                        % (flag, ', '.join(models.names())))
    given, pin = models.split_reference(value)
    path = models.resolve(given)
    name = models.shipped_name(path)
    if not os.path.lexists(path):
        raise UserError('%s %s: no such file or folder, and no shipped model of that name (shipped: %s)'
                        % (flag, given, ', '.join(models.names())))
    label = name or os.path.abspath(given)
    if os.path.isdir(path):
        source = _from_folder(path, label, flag, given)
    elif path.endswith('.ckpt'):
        source = _from_checkpoint(path, label, flag, given)
    elif os.path.basename(path) in ('model.json', 'model-0000.params', 'model-symbol.json'):
        source = _from_export(os.path.join(os.path.dirname(path), 'model'), label, flag, given)
    else:
        raise UserError('%s %s: not a gluon_unet model (a shipped name, an export folder, a run folder or a .ckpt '
                        'checkpoint)' % (flag, given))
    if pin is not None and pin != source.digest:
        raise UserError('%s %s: its weights are %s, not the pinned %s' % (flag, given, source.digest, pin))
    return source


def _from_folder(path, label, flag, given):
    for prefix in (os.path.join(path, 'export', 'model'), os.path.join(path, 'model')):
        if os.path.isfile(prefix + '-0000.params') or os.path.isfile(os.path.join(os.path.dirname(prefix),
                                                                                  'model.json')):
            return _from_export(prefix, label, flag, given)
    best = os.path.join(path, 'checkpoints', 'best.ckpt')
    if os.path.isfile(best):
        return _from_checkpoint(best, label, flag, given)
    raise UserError('%s %s: no model there (an export: model.json + model-0000.params, or a run folder\'s '
                    'checkpoints/best.ckpt)' % (flag, given))


def _from_export(prefix, label, flag, given):
    from ..inference.sidecar import PARAMS, SIDECAR, SYMBOL, read_sidecar, verify_export, weights_digest
    folder = os.path.dirname(prefix)
    sidecar = os.path.join(folder, SIDECAR)
    if not os.path.isfile(sidecar):
        raise UserError('%s %s: no %s beside the weights: not a gluon_unet export' % (flag, given, SIDECAR))
    meta = read_sidecar(sidecar)
    if not os.path.isfile(prefix + '-0000.params') or not os.path.isfile(prefix + '-symbol.json'):
        raise UserError('%s %s: fine-tuning needs the export\'s MXNet files (%s, %s); this one has %s only'
                        % (flag, given, SYMBOL, PARAMS, ', '.join(sorted(os.listdir(folder)))))
    if not isinstance(meta.get('config'), dict):
        raise UserError('%s %s: its %s has no training config: not a gluon_unet export' % (flag, given, SIDECAR))
    verify_export(meta, {SYMBOL: prefix + '-symbol.json', PARAMS: prefix + '-0000.params'}, sidecar)
    digest = weights_digest(prefix)
    return Source(label, 'export', prefix, _config(meta['config'], flag, given), _named_digest(digest),
                  meta.get('postprocess') if isinstance(meta.get('postprocess'), dict) else None)


def _from_checkpoint(path, label, flag, given):
    from ..checkpoint import load_checkpoint
    from ..inference.sidecar import file_sha256
    meta = load_checkpoint(path)  # checks its digest: a damaged file is one line
    if not isinstance(meta.get('config'), dict):
        raise UserError('%s %s: the checkpoint holds no training config' % (flag, given))
    return Source(label, 'checkpoint', path, _config(meta['config'], flag, given), 'sha256:' + file_sha256(path))


def _config(saved, flag, given):
    try:
        return TrainConfig.from_dict(saved)
    except (UserError, TypeError) as exc:
        raise UserError('%s %s: its training config cannot be read by this gluon_unet (%s)'
                        % (flag, given, exc)) from None


def _named_digest(digest):
    """:func:`~gluon_unet.inference.sidecar.weights_digest` with its algorithm named."""
    return digest if ':' in digest else 'sha256:' + digest


def chosen_settings(cfg, defaults=None):
    """The names of the settings of ``cfg`` that differ from ``defaults`` (a
    :class:`TrainConfig`, default: the dataclass's defaults): what the Python API's
    caller chose, where no command line says which flags were given."""
    defaults = defaults or TrainConfig()
    out = {f.name for f in dataclasses.fields(ModelConfig) if getattr(cfg.model, f.name) !=
           getattr(defaults.model, f.name)}
    out |= {f.name for f in dataclasses.fields(TrainConfig) if f.name != 'model' and getattr(cfg, f.name) !=
            getattr(defaults, f.name)}
    return out


def fine_tune_config(cfg, source, given=None):
    """``cfg`` for fine-tuning ``source`` (a :class:`Source`): a new :class:`TrainConfig`.

    Parameters
    ----------
    cfg : TrainConfig
        What the user asked for.
    source : Source
    given : set of str, optional
        The settings the user chose (field names; ``in_channels`` for ``--channels``). The
        command line knows which flags were given; the default, for the Python API, is
        every setting that differs from TrainConfig's default.

    Raises
    ------
    UserError
        A chosen setting contradicts :data:`KEPT` (one line naming both values).
    """
    given = chosen_settings(cfg) if given is None else set(given)
    src = source.config
    model = dataclasses.asdict(cfg.model)
    rest = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig) if f.name != 'model'}

    def set_(name, value):
        (model if name in model else rest)[name] = value

    for name in KEPT:
        if name in given and setting(cfg, name) != setting(src, name):
            raise UserError('%s %s contradicts --init %s, trained with %s %s: fine-tuning keeps the model\'s '
                            'architecture and input pixels; drop %s' % (
                                flag_name(name), shown(setting(cfg, name)), source.label, flag_name(name),
                                shown(setting(src, name)), flag_name(name)))
        set_(name, setting(src, name))
    _scale(cfg, src, source, given, set_)
    channels = cfg.model.in_channels if 'in_channels' in given and cfg.model.in_channels else src.model.in_channels
    if channels != src.model.in_channels and not {channels, src.model.in_channels} <= {1, 3}:
        raise UserError('--channels %d with --init %s (%d channels): only 1 <-> 3 is adapted'
                        % (channels, source.label, src.model.in_channels))
    set_('in_channels', channels)
    for name in ('target', 'classes'):  # another one gets a new head
        set_(name, setting(cfg, name) if name in given else setting(src, name))
    for name in INHERITED:
        if name not in given:
            set_(name, setting(src, name))
    for name, value in FINE_TUNE_DEFAULTS.items():
        if name not in given:
            set_(name, value)
    rest['init'] = source.reference
    return TrainConfig(model=ModelConfig(**model), **rest)


def _scale(cfg, src, source, given, set_):
    """The training scale: native-resolution crops stay crops (of any size), a resized
    model keeps its --size."""
    if src.crop:
        if 'crop' in given and not cfg.crop:
            raise UserError('--crop 0 contradicts --init %s, trained on native-resolution crops (--crop %d): '
                            'resizing to --size would show it nuclei at another scale; give a --crop'
                            % (source.label, src.crop))
        set_('crop', cfg.crop if 'crop' in given else src.crop)
        return
    for name in _SCALE:
        if name in given and setting(cfg, name) != setting(src, name):
            raise UserError('%s %s contradicts --init %s, trained resized to --size %d: another --size shows it '
                            'nuclei at another scale; drop %s' % (flag_name(name), setting(cfg, name), source.label,
                                                                  src.size, flag_name(name)))
        set_(name, setting(src, name))


def source_arrays(source):
    """The weights of ``source`` by structural name (``down.0.conv1.weight``: the names
    checkpoints use), as CPU NDArrays."""
    import mxnet as mx
    if source.kind == 'checkpoint':
        arrays = mx.nd.load(source.path)
        return {k[len('param:'):]: v for k, v in arrays.items() if k.startswith('param:')}
    from ..inference.export import export_arrays
    return export_arrays(source.path, source.config.model, '--init')


def load_source_weights(net, source, in_channels):
    """Put ``source``'s weights into ``net`` (initialized on its devices).

    The first convolution is adapted to ``in_channels`` (1 -> 3: the grey filters on each
    colour, divided by 3 so a grey image gives the same response; 3 -> 1: the colour
    filters summed), and a head of another shape (another ``--target`` or ``--classes``)
    keeps its fresh initialization. Returns notes on what was adapted (for the log).
    """
    import mxnet as mx
    saved = source_arrays(source)
    params = net._collect_params_with_prefix()
    notes = []
    missing = sorted(set(params) - set(saved))
    if missing:
        raise UserError('--init %s: the model has no weights for %s' % (source.label, ', '.join(missing[:3])))
    first = next(iter(params))
    for name, param in params.items():
        value = saved[name]
        if value.shape != param.shape:
            if name == first and value.shape[1] != param.shape[1] and value.shape[:1] + value.shape[2:] == \
                    param.shape[:1] + param.shape[2:]:
                notes.append('first convolution adapted from %d to %d input channels'
                             % (value.shape[1], param.shape[1]))
                value = mx.nd.repeat(value, param.shape[1], axis=1) / param.shape[1] if value.shape[1] == 1 \
                    else value.sum(axis=1, keepdims=True)
            elif name.startswith('head.'):
                if not any(n.startswith('new head') for n in notes):
                    notes.append('new head: %d output map(s) where the model had %d, trained from scratch'
                                 % (param.shape[0], value.shape[0]))
                continue
            else:
                raise UserError('--init %s: parameter %s has shape %s, the model wants %s'
                                % (source.label, name, value.shape, param.shape))
        param.set_data(value.astype(param.dtype))
    return notes
