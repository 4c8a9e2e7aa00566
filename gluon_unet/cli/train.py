"""``gluon-unet train`` / ``bin/train``: flags generated from ``TrainConfig``, then :func:`~gluon_unet.training.loop.fit`.

Every ``TrainConfig`` (and ``ModelConfig``) field is a flag (``batch_size`` <->
``--batch-size``) with one default, shown in groups (:data:`FLAG_GROUPS`); ``--config
FILE.json`` or ``--config RECIPE`` sets them from a file (:func:`config_from_args`).

Importing this module does not import mxnet: :func:`train_main` first applies the
process-wide settings that libmxnet reads only when it loads (``OMP_NUM_THREADS``,
``MXNET_CPU_TEMP_COPY``, ``CUDA_VISIBLE_DEVICES``:
:func:`~gluon_unet.machine.runtime.prepare_training_process`) for the devices its flags name,
then imports the training modules.
"""
import dataclasses
import json
import os
import sys
import typing
import warnings

from .. import recipes
from ..config import _CHOICES, ModelConfig, TrainConfig, check_types
from ..errors import UserError
from ..machine.runtime import apply_runtime_defaults, prepare_training_process, process_gpus
from ..reporting import get_logger
from ..utils import read_json
from .common import command_parser, config_flag, reports_errors

# The built-in demo (no --data) must finish in a few minutes on a laptop CPU, so it
# trains a small network on small images unless the user says otherwise.
DEMO_DEFAULTS = {'size': 64, 'width': 16, 'depth': 3, 'epochs': 12, 'batch_size': 16,
                 'synthetic_count': 320, 'lr': 3e-3, 'lr_schedule': 'cosine',
                 'loss': 'bce_dice', 'patience': 0}


# ``bin/train --help`` shows the flags in these groups, in this order (the sections of
# config.py; the model's fields form the 'model' group). Every TrainConfig field is in
# exactly one (tests/test_entry_point.py checks it, so a new field must pick its group).
FLAG_GROUPS = {
    'data': ('data', 'masks', 'val_data', 'layout', 'mask_suffix', 'plane', 'size', 'crop', 'val_split', 'channels',
             'normalize', 'denoise', 'balance', 'augment', 'elastic', 'scale_aug', 'stain_jitter', 'paste_rate', 'skip_unpaired', 'workers', 'cache_dir',
             'epoch_samples', 'synthetic_count'),
    'model': ('init',) + tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != 'in_channels'),
    'optimization': ('epochs', 'time_budget', 'batch_size', 'optimizer', 'lr', 'momentum', 'nesterov',
                     'weight_decay', 'clip_grad', 'ema', 'lr_schedule', 'warmup_epochs', 'lr_steps', 'loss',
                     'dice_weight', 'weight_on', 'amp', 'amp_dtype', 'hybridize', 'memory'),
    'devices': ('gpus', 'cpus', 'kvstore', 'update_on_kvstore', 'sync_bn'),
    'run': ('output', 'overwrite', 'resume', 'seed', 'monitor', 'patience', 'min_delta', 'keep_last',
            'threshold', 'tune_postprocess', 'tune_mode', 'tune_tta', 'predict_diameter', 'benchmark', 'progress', 'tensorboard'),
}
# Placeholders in the help: what the value is, not the field's name.
_METAVARS = {'data': 'PATH', 'masks': 'DIR', 'val_data': 'PATH', 'cache_dir': 'DIR', 'output': 'DIR',
             'resume': 'PATH|auto', 'init': 'MODEL', 'gpus': 'IDS', 'size': 'SIZE', 'crop': 'SIZE', 'mask_suffix': 'SUFFIX', 'lr_steps': 'FRACTIONS',
             'ema': 'DECAY', 'time_budget': 'MINUTES', 'scale_aug': 'MIN,MAX', 'stain_jitter': 'SIGMA', 'paste_rate': 'RATE'}
GROUP_TITLES = {'data': 'data', 'model': 'model (the U-Net)', 'optimization': 'optimization',
                'devices': 'devices', 'run': 'run (folder, checkpoints, early stopping)'}

TRAIN_EXAMPLES = """examples:
  # the built-in demo: generated nuclei, a small U-Net, ~1-2 min on 2 CPU cores
  gluon-unet train
  # paired folders on eight GPUs (name.png <-> name_mask.png)
  gluon-unet train --data train_im/ --masks train_mask/ --gpus 0-7 --batch-size 64 --output runs/nuclei
  # Data Science Bowl layout, Dice + BCE, best checkpoint by the DSB score; after a stop, the same
  # command with --resume auto continues it
  gluon-unet train --data stage1_train/ --gpus all --loss bce_dice --monitor val_dsb --output runs/dsb
  gluon-unet train --data stage1_train/ --gpus all --loss bce_dice --monitor val_dsb --output runs/dsb --resume auto

(bin/train and python -m gluon_unet train take the same flags.)"""


def add_config_arguments(parser):
    """Add one flag per TrainConfig field (nested ModelConfig fields included), in the
    groups of :data:`FLAG_GROUPS`."""
    fields = {}
    for c in (TrainConfig, ModelConfig):
        hints = typing.get_type_hints(c)
        fields.update({f.metadata.get('flag', f.name): (f, hints) for f in dataclasses.fields(c)
                       if f.name != 'model'})
    for group, names in FLAG_GROUPS.items():
        present = [n for n in names if n in fields]
        if not present:
            continue
        target = parser.add_argument_group(GROUP_TITLES[group])
        for name in present:
            flags, kwargs = _train_flag(*fields.pop(name))
            target.add_argument(*flags, **kwargs)
    for f, hints in fields.values():  # a field no group names yet: still a flag
        flags, kwargs = _train_flag(f, hints)
        parser.add_argument(*flags, **kwargs)
    return parser


def _train_flag(f, hints):
    # The allowed values are checked by TrainConfig.validate() (one message for flags
    # and --config files alike), not by argparse: shown, not enforced, here.
    return config_flag(f, hints, metavars=_METAVARS, demo=DEMO_DEFAULTS, shown_choices=_CHOICES)


#: A --config file is a few hundred bytes of settings; anything past this is not one.
CONFIG_MAX_BYTES = 1 << 20


def config_from_args(given, config_file=None, chosen=None):
    """Build a validated TrainConfig: defaults < demo defaults < config file < flags.

    ``config_file`` is a JSON file, or the name of a recipe shipped in
    ``gluon_unet/recipes`` (``'dsb2018'``) when no such file exists. ``chosen``, a set,
    receives the names of the settings the file and the flags set (what ``--init``'s
    model may not replace)."""
    values = {}
    if config_file:
        if not os.path.exists(config_file) and recipes.path(config_file):
            if given.get('data') is None:  # else the demo's generated nuclei, at the recipe's sizes
                raise UserError('--config %s: a recipe for your images; give them with --data PATH'
                                % config_file)
            config_file = recipes.path(config_file)
        elif not os.path.exists(config_file):
            raise UserError('--config %s: no such file, and no recipe of that name (recipes: %s)'
                            % (config_file, ', '.join(recipes.names())))
        where = '--config %s' % config_file
        loaded = read_json(config_file, where, CONFIG_MAX_BYTES)
        if not isinstance(loaded, dict):
            raise UserError('%s: must hold a JSON object of settings, like {"lr": 0.001} (got %s)'
                            % (where, type(loaded).__name__))
        model = loaded.pop('model', {})
        if not isinstance(model, dict):
            raise UserError('%s: "model" must be an object of model settings, like {"width": 32} (got %s)'
                            % (where, json.dumps(model)))
        check_types(model, ModelConfig, where)
        check_types(loaded, TrainConfig, where)
        values.update(model)
        values.update(loaded)
    values.update(given)
    if chosen is not None:
        chosen.update(values)
    if values.get('data') is None:
        for key, value in DEMO_DEFAULTS.items():
            values.setdefault(key, value)
    model_names = {f.name for f in dataclasses.fields(ModelConfig)}
    model = {k: values.pop(k) for k in list(values) if k in model_names}
    unknown = set(values) - {f.name for f in dataclasses.fields(TrainConfig)}
    if unknown:
        raise UserError('--config %s: unknown keys %s' % (config_file, ', '.join(sorted(unknown))))
    cfg = TrainConfig(model=ModelConfig(**model), **values)
    if cfg.data is not None and not os.path.exists(cfg.data):
        raise UserError('--data %s: no such file or folder' % cfg.data)
    if cfg.masks is not None and not os.path.isdir(cfg.masks):
        raise UserError('--masks %s: no such folder' % cfg.masks)
    if cfg.val_data is not None and not os.path.exists(cfg.val_data):
        raise UserError('--val-data %s: no such file or folder' % cfg.val_data)
    return cfg.validate()


def train_parser(prog='train'):
    """The ``bin/train`` parser: ``--config`` and one flag per config field."""
    parser = command_parser(
        prog, usage='%(prog)s [--data PATH] [--gpus IDS | --cpus N] [options]', epilog=TRAIN_EXAMPLES,
        description='Train a U-Net on all the given devices. Without --data, trains on generated\n'
                    'nuclei (a demo that ends in an exported model). Every flag is a field of\n'
                    'TrainConfig (gluon_unet/config.py); --config FILE.json or --config RECIPE sets them\n'
                    'from a file.')
    parser.add_argument('--config', metavar='FILE.json|RECIPE',
                        help='JSON file with config values, or the name of a shipped recipe (%s); flags '
                             'override it' % ', '.join(recipes.names()))
    return add_config_arguments(parser)


@reports_errors
def train_main(argv=None):
    """``bin/train``: parse flags, train, export. Returns the process exit code."""
    if os.environ.get('DMLC_ROLE') in ('server', 'scheduler'):
        # bin/launch runs this same command as the parameter servers and the scheduler:
        # importing mxnet serves the job and exits there (mxnet's kvstore_server), so
        # they never parse the workers' flags.
        apply_runtime_defaults()
        import mxnet  # noqa: F401
    args = vars(train_parser().parse_args(argv))
    config_file = args.pop('config', None)
    chosen = set()
    cfg = config_from_args(args, config_file, chosen)
    # Only now are the devices known, and mxnet, which reads these settings once when it
    # loads, is not loaded yet: N CPU contexts need cores / N OpenMP threads each and more
    # of MXNet's shared CPU scratch buffers, or they oversubscribe the cores and take turns
    # (docs/explanation/multi-device.md, "Several CPU contexts"); --gpus 4-7 sets
    # CUDA_VISIBLE_DEVICES so that no CUDA context lands on GPU 0 (runtime.py says why).
    # Under --kvstore horovod, --gpus names the host's GPUs and this process takes its share.
    prepare_training_process(process_gpus(cfg.gpus, cfg.kvstore), cfg.cpus, cfg.memory)
    if cfg.benchmark:
        from ..training.benchmark import benchmark_main
        return benchmark_main(cfg)
    from ..data.cache import CacheWarning
    from ..training.loop import fit
    from ..training.step import Diverged
    # The log says it in one line; Python's warning would repeat it with a source line.
    warnings.simplefilter('ignore', CacheWarning)
    try:
        history = fit(cfg, given=chosen)  # a stop (training.stops.Interrupted) is the error boundary's one line
    except Diverged as exc:
        print('error: %s' % exc, file=sys.stderr)
        return Diverged.exit_code
    # Only the process that exported (rank 0 of a bin/launch job) has a model to show;
    # the other workers end when training does.
    if cfg.data is None and history and history.is_main:
        demo_predictions(cfg, history.output)
    return 0


def demo_predictions(cfg, run_dir, count=8):
    """End the demo like a real job: segment new generated images with the export.

    Writes ``<run_dir>/demo_inputs/*.png`` (images the model never saw, seed + 1) and
    ``<run_dir>/predictions/`` (masks, instance labels, overlays, a DSB submission CSV).
    """
    from ..data.synthetic import synthetic_nuclei
    from ..inference.predict import predict_paths
    from ..inference.predict_outputs import write_png
    images, _, _ = synthetic_nuclei(count, size=2 * (cfg.crop or cfg.size), channels=cfg.model.in_channels or 1,
                                    seed=cfg.seed + 1)
    inputs = os.path.join(run_dir, 'demo_inputs')
    for i, image in enumerate(images):
        write_png(os.path.join(inputs, 'demo%02d.png' % i), image[..., 0] if image.shape[-1] == 1 else image)
    out = os.path.join(run_dir, 'predictions')
    # The run's own predictions folder: a resumed demo replaces its earlier model's outputs
    # (only the files their manifest lists; anything of yours there stays), never bin/predict's.
    from ..paths import MANIFEST, demo_predictions as by_demo
    if os.path.exists(os.path.join(out, MANIFEST)) and not by_demo(out, run_dir):
        get_logger().info('demo: %s holds predictions bin/predict wrote, so the demo kept them and predicted '
                          'nothing: bin/predict --model %s --input %s --output DIR', out, run_dir, inputs)
        return
    records = predict_paths(run_dir, inputs, out, gpus=cfg.gpus, cpus=cfg.cpus, overlay=True,
                            rle=os.path.join(out, 'submission.csv'), progress=False, overwrite=True)
    if records.failures:  # e.g. the disk filled up: the model itself is exported and intact
        raise UserError('demo: %s; the trained model in %s is intact' % (records.summary(), run_dir), exit_code=1)
    get_logger().info('demo: segmented %d new images (%d nuclei) into %s', len(records),
                      sum(r['objects'] for r in records), out)
