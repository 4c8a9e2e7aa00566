"""``gluon-unet evaluate`` / ``bin/evaluate``: flags generated from
:class:`~gluon_unet.inference.configs.EvaluateConfig`, then the scores as a table (and a CSV)."""
from ..errors import signals_raise
from ..inference.configs import EvaluateConfig
from ..machine.runtime import apply_runtime_defaults
from .common import asks_version, config_parser, parse_configs, reports_errors

EXAMPLES = """examples:
  # predictions of bin/predict against a Data Science Bowl folder, scores to a CSV
  gluon-unet evaluate --pred runs/a/predictions --truth stage1_test/ --csv scores.csv
  # probability maps against a folder of masks, foreground at 0.4
  gluon-unet evaluate --pred probs/ --truth masks/ --threshold 0.4"""


def evaluate_parser():
    """The ``bin/evaluate`` parser: one flag per :class:`EvaluateConfig` field."""
    return config_parser('evaluate', EvaluateConfig, epilog=EXAMPLES,
                         description='Score predicted nuclei against ground truth: Data Science Bowl 2018\n'
                                     'instance score, pixel IoU and Dice, and at IoU 0.5, 0.75 and 0.9\n'
                                     'the object-matching scores of StarDist and Cellpose (TP, FP, FN,\n'
                                     'precision, recall, F1, AP, mean matched IoU, panoptic quality),\n'
                                     'per image and mean.')


@reports_errors
def evaluate_main(argv=None):
    """``bin/evaluate``: score predictions against ground truth; returns the exit code."""
    if asks_version(argv):
        return 0
    apply_runtime_defaults()
    with signals_raise():
        config, = parse_configs(evaluate_parser(), argv, EvaluateConfig)
        from ..inference.evaluate import format_table, run_evaluate  # numpy: after the flags (--help needs none)
        rows, mean, extra = run_evaluate(config)
    print(format_table(rows, mean))
    missing = [r['image_id'] for r in rows if r['status'] == 'missing']
    if missing:
        print('%d of %d truth images have no prediction and score 0: %s%s'
              % (len(missing), len(rows), ', '.join(missing[:5]), ', ...' if len(missing) > 5 else ''))
    if extra:
        print('%d predictions have no truth and were ignored: %s%s'
              % (len(extra), ', '.join(extra[:5]), ', ...' if len(extra) > 5 else ''))
    if config.csv:
        print('scores written to %s' % config.csv)
    return 0
