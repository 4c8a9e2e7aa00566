"""Command-line entry points: ``bin/train``, ``bin/predict``, ``bin/evaluate`` and
``bin/export`` call the ``*_main`` functions here (``bin/launch`` calls ``launch.main``).
Training flags are generated from the config dataclasses, so every option has one name
(``batch_size`` <-> ``--batch-size``) and one default.

Importing this module does not import mxnet. Each entry point first applies the
process-wide settings that libmxnet reads only when it loads (``OMP_NUM_THREADS``,
``MXNET_CPU_TEMP_COPY``: :func:`~gluon_unet.runtime.apply_runtime_defaults`), then imports
the modules that need mxnet: ``train_main`` after reading its flags, for its number of
CPU contexts; the others for one.
"""
import argparse
import dataclasses
import json
import os
import sys
import typing
import warnings

from . import add_version_flag, recipes, version_string
from .config import _CHOICES, ModelConfig, TrainConfig, check_types, flag_name
from .errors import OneLineParser, UserError, reports_errors, signals_raise
from .reporting import get_logger
from .runtime import apply_runtime_defaults, prepare_training_process, process_gpus
from .utils import read_json

# The built-in demo (no --data) must finish in a few minutes on a laptop CPU, so it
# trains a small network on small images unless the user says otherwise.
DEMO_DEFAULTS = {'size': 64, 'width': 16, 'depth': 3, 'epochs': 12, 'batch_size': 16,
                 'synthetic_count': 320, 'lr': 3e-3, 'lr_schedule': 'cosine',
                 'loss': 'bce_dice', 'patience': 0}


def _arg_type(tp):
    if typing.get_origin(tp) is typing.Union:
        tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
    return tp


# ``bin/train --help`` shows the flags in these groups, in this order (the sections of
# config.py; the model's fields form the 'model' group). Every TrainConfig field is in
# exactly one (tests/test_entry_point.py checks it, so a new field must pick its group).
FLAG_GROUPS = {
    'data': ('data', 'masks', 'val_data', 'layout', 'mask_suffix', 'size', 'crop', 'val_split', 'channels',
             'normalize', 'denoise', 'balance', 'augment', 'elastic', 'skip_unpaired', 'workers', 'cache_dir',
             'synthetic_count'),
    'model': tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != 'in_channels'),
    'optimization': ('epochs', 'time_budget', 'batch_size', 'optimizer', 'lr', 'momentum', 'nesterov',
                     'weight_decay', 'clip_grad', 'ema', 'lr_schedule', 'warmup_epochs', 'lr_steps', 'loss',
                     'dice_weight', 'weight_on', 'amp', 'amp_dtype', 'hybridize', 'memory'),
    'devices': ('gpus', 'cpus', 'kvstore', 'update_on_kvstore', 'sync_bn'),
    'run': ('output', 'overwrite', 'resume', 'seed', 'monitor', 'patience', 'min_delta', 'keep_last',
            'threshold', 'tune_postprocess', 'tune_mode', 'tune_tta', 'benchmark', 'progress', 'tensorboard'),
}
# Placeholders in the help: what the value is, not the field's name.
_METAVARS = {'data': 'PATH', 'masks': 'DIR', 'val_data': 'PATH', 'cache_dir': 'DIR', 'output': 'DIR',
             'resume': 'PATH|auto', 'gpus': 'IDS', 'size': 'SIZE', 'crop': 'SIZE', 'mask_suffix': 'SUFFIX', 'lr_steps': 'FRACTIONS',
             'ema': 'DECAY', 'time_budget': 'MINUTES'}
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


def _field_help(f, default):
    """The help text of a config field: its description, its allowed values when it has
    a fixed set (shown in the metavar instead), its default once."""
    text = f.metadata.get('help', '')
    if 'default' in text:  # the description already says what the default means
        return text
    if default is None:
        return text
    shown = ('on' if default else 'off') if isinstance(default, bool) else repr(default) \
        if default == '' else str(default)
    demo = DEMO_DEFAULTS.get(f.name)
    if demo is not None and demo != default:
        return '%s (default: %s; demo without --data: %s)' % (text, shown, demo)
    return '%s (default: %s)' % (text, shown)


def _config_flag(f, hints):
    """(flag, add_argument keyword arguments) for one config field."""
    tp = _arg_type(hints[f.name])
    default = f.default if f.default is not dataclasses.MISSING else None
    kwargs = dict(dest=f.name, default=argparse.SUPPRESS, help=_field_help(f, default))
    if tp is bool:
        kwargs['action'] = argparse.BooleanOptionalAction
    else:
        kwargs['type'] = tp
        # The allowed values are checked by TrainConfig.validate() (one message for flags
        # and --config files alike), not by argparse: shown, not enforced, here.
        choices = _CHOICES.get(f.name)
        kwargs['metavar'] = ('{%s}' % ','.join(choices) if choices else _METAVARS.get(f.name)
                             or {int: 'N', float: 'X'}.get(tp) or f.name.upper())
    return flag_name(f.name), kwargs


def add_config_arguments(parser, cls=TrainConfig):
    """Add one flag per config field (nested ModelConfig fields included), in the
    groups of :data:`FLAG_GROUPS`."""
    fields = {}
    for c in (TrainConfig, ModelConfig) if cls is TrainConfig else (cls,):
        hints = typing.get_type_hints(c)
        fields.update({f.metadata.get('flag', f.name): (f, hints) for f in dataclasses.fields(c)
                       if f.name != 'model'})
    for group, names in FLAG_GROUPS.items():
        present = [n for n in names if n in fields]
        if not present:
            continue
        target = parser.add_argument_group(GROUP_TITLES[group])
        for name in present:
            flag, kwargs = _config_flag(*fields.pop(name))
            target.add_argument(flag, **kwargs)
    for f, hints in fields.values():  # a field no group names yet: still a flag
        flag, kwargs = _config_flag(f, hints)
        parser.add_argument(flag, **kwargs)
    return parser


#: A --config file is a few hundred bytes of settings; anything past this is not one.
CONFIG_MAX_BYTES = 1 << 20


def config_from_args(given, config_file=None):
    """Build a validated TrainConfig: defaults < demo defaults < config file < flags.

    ``config_file`` is a JSON file, or the name of a recipe shipped in
    ``gluon_unet/recipes`` (``'dsb2018'``) when no such file exists."""
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
    parser = OneLineParser(
        prog=prog, usage='%(prog)s [--data PATH] [--gpus IDS | --cpus N] [options]',
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=TRAIN_EXAMPLES,
        description='Train a U-Net on all the given devices. Without --data, trains on generated\n'
                    'nuclei (a demo that ends in an exported model). Every flag is a field of\n'
                    'TrainConfig (gluon_unet/config.py); --config FILE.json or --config RECIPE sets them\n'
                    'from a file.')
    add_version_flag(parser)
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
    cfg = config_from_args(args, config_file)
    # Only now are the devices known, and mxnet, which reads these settings once when it
    # loads, is not loaded yet: N CPU contexts need cores / N OpenMP threads each and more
    # of MXNet's shared CPU scratch buffers, or they oversubscribe the cores and take turns
    # (docs/explanation/multi-device.md, "Several CPU contexts"); --gpus 4-7 sets
    # CUDA_VISIBLE_DEVICES so that no CUDA context lands on GPU 0 (runtime.py says why).
    # Under --kvstore horovod, --gpus names the host's GPUs and this process takes its share.
    prepare_training_process(process_gpus(cfg.gpus, cfg.kvstore), cfg.cpus, cfg.memory)
    if cfg.benchmark:
        from .benchmark import benchmark_main
        return benchmark_main(cfg)
    from .data.cache import CacheWarning
    from .engine import Diverged, Interrupted, fit
    # The log says it in one line; Python's warning would repeat it with a source line.
    warnings.simplefilter('ignore', CacheWarning)
    try:
        history = fit(cfg)
    except Interrupted as exc:
        print(str(exc), file=sys.stderr)
        return exc.exit_code
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
    from .data.synthetic import synthetic_nuclei
    from .predict import predict_paths, write_png
    images, _, _ = synthetic_nuclei(count, size=2 * (cfg.crop or cfg.size), channels=cfg.model.in_channels or 1,
                                    seed=cfg.seed + 1)
    inputs = os.path.join(run_dir, 'demo_inputs')
    for i, image in enumerate(images):
        write_png(os.path.join(inputs, 'demo%02d.png' % i), image[..., 0] if image.shape[-1] == 1 else image)
    out = os.path.join(run_dir, 'predictions')
    # The run's own predictions folder: a resumed demo replaces its earlier model's outputs
    # (only the files their manifest lists; anything of yours there stays).
    records = predict_paths(run_dir, inputs, out, gpus=cfg.gpus, cpus=cfg.cpus, overlay=True,
                            rle=os.path.join(out, 'submission.csv'), progress=False, overwrite=True)
    if records.failures:  # e.g. the disk filled up: the model itself is exported and intact
        raise UserError('demo: %s; the trained model in %s is intact' % (records.summary(), run_dir), exit_code=1)
    get_logger().info('demo: segmented %d new images (%d nuclei) into %s', len(records),
                      sum(r['objects'] for r in records), out)


def _asks_version(argv):
    """Print the versions when ``argv`` holds ``--version`` (before any ``--``): answered
    here, before the command's module (and mxnet) loads. True when it did."""
    args = sys.argv[1:] if argv is None else list(argv)
    if '--version' in args[:args.index('--') if '--' in args else len(args)]:
        print(version_string())
        return True
    return False


def predict_main(argv=None):
    """``bin/predict``: :func:`gluon_unet.predict.main`, with the process settings its
    devices and mode need applied before mxnet loads."""
    if _asks_version(argv):
        return 0
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument('--gpus', default='')
    peek.add_argument('--cpus', default='1')
    peek.add_argument('--mode', default='auto')
    known, _ = peek.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        cpus = int(known.cpus)
    except ValueError:
        cpus = 1  # predict's own parser reports the bad value
    prepare_training_process(known.gpus, max(1, cpus))
    if known.mode == 'whole' and 'MXNET_CUDNN_AUTOTUNE_DEFAULT' not in os.environ and 'mxnet' not in sys.modules:
        # Whole images come in many sizes, and cuDNN times every convolution algorithm
        # for each new shape on each GPU (the variable is read per new shape:
        # cudnn_convolution-inl.h): its heuristics are the better deal there.
        os.environ['MXNET_CUDNN_AUTOTUNE_DEFAULT'] = '0'
    from .predict import main
    with signals_raise():  # SIGTERM: temporary files removed, one line, exit 143
        return main(argv)


def evaluate_main(argv=None):
    """``bin/evaluate``: :func:`gluon_unet.evaluate.main` with all the cores."""
    if _asks_version(argv):
        return 0
    apply_runtime_defaults()
    from .evaluate import main
    with signals_raise():
        return main(argv)


def export_main(argv=None):
    """``bin/export``: :func:`gluon_unet.export.main` with all the cores."""
    if _asks_version(argv):
        return 0
    apply_runtime_defaults()
    from .engine import retune
    from .export import main
    with signals_raise():
        return main(argv, retune=retune)


def doctor_main(argv=None):
    """``gluon-unet doctor``: :func:`gluon_unet.doctor.main` (it chooses the thread
    settings for its own ``--cpus`` before mxnet loads, as ``bin/train`` does)."""
    from .doctor import main
    return main(argv)


def launch_main(argv=None):
    """``bin/launch``: :func:`gluon_unet.launch.main` (sets nothing: each process of the
    job chooses its own settings)."""
    from .launch import main
    return main(argv)


# -- the one entry point: gluon-unet / python -m gluon_unet -----------------------------------

# command -> (entry point in this module, one line for the overview)
COMMANDS = {
    'train': ('train_main', 'train a U-Net on the given devices (no --data: the built-in demo)'),
    'predict': ('predict_main', 'segment images with an exported model (tiling, TTA, instances)'),
    'evaluate': ('evaluate_main', 'score predicted masks against ground truth (DSB score, IoU, Dice)'),
    'export': ('export_main', 'export a run or checkpoint for inference (symbol + params + model.json)'),
    'launch': ('launch_main', 'run a command as a distributed job (scheduler, servers, workers)'),
    'doctor': ('doctor_main', 'check the install: versions, MXNet features, GPUs, threads; --gpus runs a step'),
}


def overview(prog):
    """The top-level ``--help`` text."""
    width = max(len(c) for c in COMMANDS)
    lines = ['usage: %s COMMAND [ARGS ...]' % prog, '       %s --version' % prog, '',
             'Train U-Net segmentation models on all the GPUs of a machine with MXNet Gluon.', '',
             'commands:']
    lines += ['  %-*s  %s' % (width, name, text) for name, (_, text) in COMMANDS.items()]
    lines += ['', "'%s COMMAND --help' lists a command's flags. bin/train, bin/predict, ... and the" % prog,
              'gluon-unet-train, gluon-unet-predict, ... scripts are the same commands.', '',
              'examples:',
              '  # the built-in demo (~1-2 min on 2 CPU cores)', '  %s train' % prog,
              '  # check the GPU build and every card before a long run', '  %s doctor --gpus all' % prog,
              '  # train on eight GPUs, then segment new images',
              '  %s train --data DIR --gpus 0-7 --batch-size 64 --output runs/a' % prog,
              '  %s predict --model runs/a --input images/ --output masks/' % prog]
    return '\n'.join(lines)


def main(argv=None, prog='gluon-unet'):
    """``gluon-unet COMMAND ARGS`` / ``python -m gluon_unet COMMAND ARGS``: run COMMAND's
    entry point with ARGS exactly as ``bin/COMMAND ARGS`` would (same flags, output and
    exit code). Returns the exit code; a usage error is one line and exit code 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print('%s: error: a command is required: %s (%s --help for more)'
              % (prog, ', '.join(COMMANDS), prog), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command in ('-h', '--help', 'help'):
        print(overview(prog))
        return 0
    if command == '--version':
        print(version_string())
        return 0
    if command not in COMMANDS:
        print('%s: error: unknown command %r (choose from %s)' % (prog, command, ', '.join(COMMANDS)),
              file=sys.stderr)
        return 2
    entry = globals()[COMMANDS[command][0]]
    try:
        code = entry(rest)
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        code = exc.code
    if code is None:
        return 0
    if not isinstance(code, int):
        print(code, file=sys.stderr)
        return 1
    return code
