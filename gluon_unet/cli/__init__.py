"""The command line: the only part of gluon_unet that parses arguments.

``gluon-unet COMMAND`` (:func:`main`), ``python -m gluon_unet COMMAND`` and ``bin/COMMAND``
run the ``*_main`` entry points of this package's modules, one per command, each of which
builds its flags from the command's config dataclass (:mod:`gluon_unet.cli.common`).

Importing this package does not import mxnet: each entry point first applies the
settings that libmxnet reads only when it loads (``OMP_NUM_THREADS``,
``MXNET_CPU_TEMP_COPY``, ``CUDA_VISIBLE_DEVICES``: :mod:`gluon_unet.machine.runtime`) for the
devices its flags name, then imports the modules that need mxnet.
"""
import sys

from .. import version_string
from .common import default_signals, printed
from .doctor import doctor_main
from .evaluate import evaluate_main
from .export import export_main
from .launch import launch_main
from .models import models_main
from .package import package_main
from .predict import predict_main
from .train import train_main

__all__ = ['main', 'train_main', 'predict_main', 'evaluate_main', 'export_main', 'launch_main', 'doctor_main',
           'package_main', 'models_main', 'COMMANDS']

# command -> (entry point in this module, one line for the overview)
COMMANDS = {
    'train': ('train_main', 'train a U-Net on the given devices (no --data: the built-in demo)'),
    'predict': ('predict_main', 'segment images with an exported model (tiling, TTA, instances)'),
    'evaluate': ('evaluate_main', 'score predicted masks against ground truth (DSB score, IoU, Dice)'),
    'export': ('export_main', 'export a run or checkpoint for inference (symbol + params + model.json)'),
    'launch': ('launch_main', 'run a command as a distributed job (scheduler, servers, workers)'),
    'doctor': ('doctor_main', 'check the install: versions, MXNet features, GPUs, threads; --gpus runs a step'),
    'models': ('models_main', 'list the models shipped with gluon_unet (predict --model nuclei, train --init nuclei)'),
    'package': ('package_main', 'write a bioimage.io Model Zoo package (zip) of an export (needs onnxruntime)'),
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
        return printed(overview(prog), prog)
    if command == '--version':
        return printed(version_string(), prog)
    if command not in COMMANDS:
        print('%s: error: unknown command %r (choose from %s)' % (prog, command, ', '.join(COMMANDS)),
              file=sys.stderr)
        return 2
    entry = globals()[COMMANDS[command][0]]
    try:
        code = entry(rest)
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        code = exc.code
    finally:
        if argv is None:  # this process's own command line: its exit comes next
            default_signals()
    if code is None:
        return 0
    if not isinstance(code, int):
        print(code, file=sys.stderr)
        return 1
    return code
