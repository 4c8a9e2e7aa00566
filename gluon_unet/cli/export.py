"""``gluon-unet export`` / ``bin/export``: flags generated from
:class:`~gluon_unet.inference.configs.ExportConfig`, then :func:`~gluon_unet.inference.export_run.run_export`."""
import os

from ..errors import signals_raise
from ..inference.configs import ExportConfig
from ..machine.runtime import apply_runtime_defaults
from .common import asks_version, config_parser, parse_configs, reports_errors

EXAMPLES = """examples:
  # the run's best checkpoint (else its latest) to runs/a/export/
  gluon-unet export runs/a
  # one checkpoint, to another folder
  gluon-unet export runs/a/checkpoints/epoch0040.ckpt --output models/a-epoch40"""


def export_parser():
    """The ``bin/export`` parser: one flag per :class:`ExportConfig` field."""
    return config_parser('export', ExportConfig, epilog=EXAMPLES,
                         description='Export a trained model for inference: model-symbol.json + model-0000.params\n'
                                     '+ model.json, loadable with mx.gluon.SymbolBlock.imports alone.')


@reports_errors
def export_main(argv=None):
    """``bin/export``: export a run's best (or a given) checkpoint; returns the exit code."""
    if asks_version(argv):
        return 0
    apply_runtime_defaults()
    with signals_raise():  # SIGTERM: the staging folder removed, one line, exit 143
        config, = parse_configs(export_parser(), argv, ExportConfig)
        # numpy and OpenCV: after the flags (--help needs none)
        from ..inference.export_run import run_export
        from ..inference.batched_onnx import ONNX_FILE
        from ..inference.postprocess import settings_text
        from ..inference.sidecar import INT8_PARAMS, INT8_SYMBOL
        prefix, notes, tuned = run_export(config)
    files = [prefix + '-symbol.json', prefix + '-0000.params']
    onnx = os.path.join(os.path.dirname(prefix), ONNX_FILE)
    files += [onnx] if os.path.isfile(onnx) else []
    if config.int8:
        files += [os.path.join(os.path.dirname(prefix), name) for name in (INT8_SYMBOL, INT8_PARAMS)]
    print('exported %s and %s' % (', '.join(files[:-1]), files[-1]))
    for note in notes:
        print(note)
    if tuned:
        print('post-processing chosen on %d validation images: %s (val DSB %.4f, untuned %.4f)'
              % (tuned['images'], settings_text(tuned), tuned['score'], tuned['base_score']))
    return 0
