"""What ``--time-budget``'s re-planning did to a run's learning rate.

The budget plans the run's length again after every epoch and stretches or shrinks the
LR schedule to end with the last epoch that fits, so when the plan moves by an epoch the
rate jumps a little (``gluon_unet/training/budget.py``). This compares the rate each epoch ended
with (``metrics.csv``) with the rate the schedule would have given had the final epoch
count been known from the start, and sums the difference over the run. No training, no
hold-out: seconds.

    python benchmarks/budget_lr_replay.py RUN [RUN ...]
"""
import argparse
import csv
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from gluon_unet.errors import UserError  # noqa: E402


def ideal_rates(cfg, epochs, steps_per_epoch):
    """The LR at the end of each of ``epochs`` epochs under a schedule fitted to them
    from the start: ``make_lr_scheduler`` with the arguments the engine gives it.

    ``cfg`` is the run's ``TrainConfig`` (``TrainConfig.from_dict`` of its config.json)."""
    from gluon_unet.training.optim import make_lr_scheduler
    sched = make_lr_scheduler(cfg.lr_schedule, cfg.lr, epochs * steps_per_epoch,
                              warmup_steps=int(cfg.warmup_epochs * steps_per_epoch),
                              step_fractions=cfg.step_fractions())
    return [sched(e * steps_per_epoch) if sched else cfg.lr for e in range(1, epochs + 1)]


def compare(logged, ideal):
    """Per-epoch ratios logged / ideal, the largest relative difference, and the summed
    absolute difference as a share of the ideal schedule's sum (the 'area' of the LR
    curve; the last epoch's ideal rate is 0, so ratios skip zeros)."""
    ratios = [a / b for a, b in zip(logged, ideal) if b > 0]
    area = sum(ideal)
    return {'ratios': ratios, 'max_rel': max(abs(r - 1) for r in ratios) if ratios else 0.0,
            'area_rel': sum(abs(a - b) for a, b in zip(logged, ideal)) / area if area else 0.0,
            'sum_rel': (sum(logged) - area) / area if area else 0.0}


def read_run(run):
    """(``TrainConfig``, logged per-epoch LRs, steps per epoch) of a run folder."""
    from gluon_unet.config import TrainConfig
    with open(os.path.join(run, 'config.json')) as f:
        cfg = TrainConfig.from_json(f.read())
    with open(os.path.join(run, 'metrics.csv'), newline='') as f:
        logged = [float(r['lr']) for r in csv.DictReader(f)]
    with open(os.path.join(run, 'train.log')) as f:
        found = re.search(r'(\d+) steps per epoch', f.read())
    if not found:
        raise ValueError('train.log names no "steps per epoch"')
    return cfg, logged, int(found.group(1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('runs', nargs='+', metavar='RUN', help='run folders (config.json, metrics.csv, train.log)')
    args = parser.parse_args(argv)
    for run in args.runs:
        try:
            cfg, logged, steps = read_run(run)
        except FileNotFoundError as exc:
            raise SystemExit('error: %s: no %s (a run folder holds config.json, metrics.csv and train.log)'
                             % (run, os.path.basename(exc.filename)))
        except (OSError, KeyError, ValueError, UserError) as exc:
            raise SystemExit('error: %s: %s' % (run, exc))
        st = compare(logged, ideal_rates(cfg, len(logged), steps))
        print('%s: %d epochs; largest LR difference %.0f %%; summed |difference| %.1f %% of the schedule; '
              'total rate %+.1f %%' % (run, len(logged), 100 * st['max_rel'], 100 * st['area_rel'],
                                       100 * st['sum_rel']))
        print('  logged / ideal per epoch: ' + ' '.join('%.2f' % r for r in st['ratios']))


if __name__ == '__main__':
    main()
