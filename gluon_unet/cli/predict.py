"""``gluon-unet predict`` / ``bin/predict``: flags generated from
:class:`~gluon_unet.inference.configs.PredictConfig` (and the files of :class:`PredictCommand`),
then :func:`~gluon_unet.inference.predict.predict_paths`.

This entry point imports no mxnet itself: the process settings its devices and mode need
are applied first, and an export predicted with onnxruntime never loads it.
"""
import argparse
import os
import sys
from dataclasses import dataclass

from ..config import option
from ..errors import signals_raise, stop_signals
from ..inference.configs import PredictConfig
from ..machine.runtime import prepare_training_process
from .common import add_fields, asks_version, command_parser, parse_configs, reports_errors


@dataclass
class PredictCommand:
    """What ``bin/predict`` takes besides :class:`~gluon_unet.inference.configs.PredictConfig`: the
    files, and whether failed images fail the command."""
    model: str = option(None, 'run folder (uses its export/), export folder or export prefix', required=True,
                        metavar='RUN_DIR|PREFIX', path='in')
    input: str = option(None, 'an image, a folder of images, or a DSB root (<id>/images/<id>.png)', required=True,
                        metavar='DIR|FILE', path='in')
    output: str = option(None, 'folder for the outputs', required=True, metavar='DIR', path='out')
    allow_failures: bool = option(False, 'exit 0 even if some images could not be read or written (they are '
                                         'listed on stderr either way; the others are always written). If every '
                                         'image fails the exit code is 2 regardless')


def predict_parser():
    """The ``bin/predict`` parser: the files, every :class:`PredictConfig` field, then
    ``--allow-failures``."""
    parser = command_parser(
        'predict', description='Segment nuclei with an exported model, at the original resolution; writes\n'
                               '<id>_mask.png, <id>_labels.png (16-bit instance ids) and optionally overlays\n'
                               'and a DSB submission CSV.')
    add_fields(parser, PredictCommand, ('model', 'input', 'output'))
    add_fields(parser, PredictConfig)
    return add_fields(parser, PredictCommand, ('allow_failures',))


@reports_errors
def predict_main(argv=None):
    """``bin/predict``: segment images with an exported model; returns the exit code.

    The process settings its devices and mode need are applied before mxnet loads:
    the threads of ``--cpus`` contexts, ``--gpus`` as ``CUDA_VISIBLE_DEVICES``, and for
    ``--mode whole`` cuDNN's heuristics instead of its autotuner.
    """
    if asks_version(argv):
        return 0
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument('--gpus', default='')
    peek.add_argument('--cpus', default='1')
    peek.add_argument('--mode', default='auto')
    known, _ = peek.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        cpus = int(known.cpus)
    except ValueError:
        cpus = 1  # the real parser reports the bad value
    prepare_training_process(known.gpus, max(1, cpus))
    if known.mode == 'whole' and 'MXNET_CUDNN_AUTOTUNE_DEFAULT' not in os.environ and 'mxnet' not in sys.modules:
        # Whole images come in many sizes, and cuDNN times every convolution algorithm
        # for each new shape on each GPU (the variable is read per new shape:
        # cudnn_convolution-inl.h): its heuristics are the better deal there.
        os.environ['MXNET_CUDNN_AUTOTUNE_DEFAULT'] = '0'
    # Ctrl-C, SIGTERM and SIGHUP: temporary files removed, the manifest says why, one line,
    # exit 130/143/129 - whatever SIGINT handler the process inherited (the Python API's
    # caller, a test run, may have replaced Python's KeyboardInterrupt).
    with signals_raise(stop_signals()):
        command, config = parse_configs(predict_parser(), argv, PredictCommand, PredictConfig)
        from ..inference.predict import predict_paths  # numpy, OpenCV: after the flags (--help needs none)
        result = predict_paths(command.model, command.input, command.output, config)
    if not config.progress:  # --no-progress drops the bar, not the record of what ran
        print(result.line)
    if result.failures:
        print('%s: %s' % ('warning' if command.allow_failures else 'error', result.summary()), file=sys.stderr)
        return 0 if command.allow_failures else 1
    return 0
