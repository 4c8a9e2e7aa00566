"""``gluon-unet evaluate`` / ``bin/evaluate``: flags generated from
:class:`~gluon_unet.inference.evaluate.EvaluateConfig`, then the scores as a table (and a CSV)."""
from ..errors import reports_errors, signals_raise
from ..machine.runtime import apply_runtime_defaults
from .common import asks_version, config_parser, parse_configs

EXAMPLES = """examples:
  # predictions of bin/predict against a Data Science Bowl folder, scores to a CSV
  gluon-unet evaluate --pred runs/a/predictions --truth stage1_test/ --csv scores.csv
  # probability maps against a folder of masks, foreground at 0.4
  gluon-unet evaluate --pred probs/ --truth masks/ --threshold 0.4"""


def evaluate_parser():
    """The ``bin/evaluate`` parser: one flag per :class:`EvaluateConfig` field."""
    from ..inference.evaluate import EvaluateConfig
    return config_parser('evaluate', EvaluateConfig, epilog=EXAMPLES,
                         description='Score predicted nuclei against ground truth: Data Science Bowl 2018\n'
                                     'instance score, pixel IoU and Dice per image and mean.')


@reports_errors
def evaluate_main(argv=None):
    """``bin/evaluate``: score predictions against ground truth; returns the exit code."""
    if asks_version(argv):
        return 0
    apply_runtime_defaults()
    from ..inference.evaluate import COLUMNS, EvaluateConfig, check_csv, evaluate, format_table, mean_row, write_csv
    from ..paths import check_apart, check_replaceable
    with signals_raise():
        config, = parse_configs(evaluate_parser(), argv, EvaluateConfig)
        check_apart([('--csv', config.csv)], [('--pred', config.pred), ('--truth', config.truth)], 'evaluate')
        check_replaceable(config.csv, COLUMNS[0] + ',', '--csv', 'a table of scores')
        if config.csv:
            check_csv(config.csv)  # before the scoring, not after it
        rows, extra = evaluate(config.pred, config.truth, config.threshold)
        mean = mean_row(rows)
        if config.csv:
            write_csv(config.csv, rows)
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

