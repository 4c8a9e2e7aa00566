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

from .config import ModelConfig, TrainConfig, check_types, flag_name
from .devices import cpu_context_count
from .errors import OneLineParser, UserError, reports_errors
from .reporting import get_logger
from .runtime import apply_runtime_defaults

# The built-in demo (no --data) must finish in a few minutes on a laptop CPU, so it
# trains a small network on small images unless the user says otherwise.
DEMO_DEFAULTS = {'size': 64, 'width': 16, 'depth': 3, 'epochs': 12, 'batch_size': 16,
                 'synthetic_count': 320, 'lr': 3e-3, 'lr_schedule': 'cosine',
                 'loss': 'bce_dice', 'patience': 0}


def _arg_type(tp):
    if typing.get_origin(tp) is typing.Union:
        tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
    return tp


def add_config_arguments(parser, cls=TrainConfig):
    """Add one flag per config field (nested ModelConfig fields included)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name == 'model':
            add_config_arguments(parser.add_argument_group('model'), ModelConfig)
            continue
        tp = _arg_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = '%s (default: %s)' % (f.metadata.get('help', ''), default)
        kwargs = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text)
        if tp is bool:
            kwargs['action'] = argparse.BooleanOptionalAction
        else:
            kwargs['type'] = tp
            kwargs['metavar'] = f.name.upper()
        parser.add_argument(flag_name(f.name), **kwargs)
    return parser


def config_from_args(given, config_file=None):
    """Build a validated TrainConfig: defaults < demo defaults < config file < flags."""
    values = {}
    if config_file:
        try:
            with open(config_file) as f:
                loaded = json.load(f)
        except (OSError, ValueError) as exc:
            raise UserError('--config %s: cannot read it as JSON (%s)' % (config_file, exc)) from None
        where = '--config %s' % config_file
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


def train_parser():
    parser = OneLineParser(
        prog='train', description='Train a U-Net on all the given devices. Without --data, trains on '
                                  'generated nuclei (a demo that ends in an exported model).')
    parser.add_argument('--config', help='JSON file with config values (flags override it)')
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
    # N CPU contexts need cores / N OpenMP threads each and more of MXNet's shared CPU
    # scratch buffers, or they oversubscribe the cores and take turns (4 contexts: +44 %
    # time per step; docs/performance.md, finding 6). Only now is N known, and mxnet,
    # which reads both settings once when it loads, is not loaded yet.
    apply_runtime_defaults(contexts=max(1, cpu_context_count(cfg.gpus, cfg.cpus)))
    if cfg.benchmark:
        from .benchmark import benchmark_main
        return benchmark_main(cfg)
    from .engine import Diverged, Interrupted, fit
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
    import cv2
    from .data.synthetic import synthetic_nuclei
    from .predict import predict_paths
    images, _, _ = synthetic_nuclei(count, size=2 * (cfg.crop or cfg.size), channels=cfg.model.in_channels or 1,
                                    seed=cfg.seed + 1)
    inputs = os.path.join(run_dir, 'demo_inputs')
    os.makedirs(inputs, exist_ok=True)
    for i, image in enumerate(images):
        cv2.imwrite(os.path.join(inputs, 'demo%02d.png' % i), image)
    out = os.path.join(run_dir, 'predictions')
    records = predict_paths(run_dir, inputs, out, gpus=cfg.gpus, cpus=cfg.cpus, overlay=True,
                            rle=os.path.join(out, 'submission.csv'), progress=False)
    get_logger().info('demo: segmented %d new images (%d nuclei) into %s', len(records),
                      sum(r['objects'] for r in records), out)


def predict_main(argv=None):
    """``bin/predict``: :func:`gluon_unet.predict.main` with all the cores."""
    apply_runtime_defaults()
    from .predict import main
    return main(argv)


def evaluate_main(argv=None):
    """``bin/evaluate``: :func:`gluon_unet.evaluate.main` with all the cores."""
    apply_runtime_defaults()
    from .evaluate import main
    return main(argv)


def export_main(argv=None):
    """``bin/export``: :func:`gluon_unet.export.main` with all the cores."""
    apply_runtime_defaults()
    from .export import main
    return main(argv)
