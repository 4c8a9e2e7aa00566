"""``--time-budget``: as many epochs as fit in the minutes given, with the learning-rate
schedule fitted to them.

A recipe's "30 epochs in an hour" holds on the machine it was timed on; on a slower one
the same run overruns, and cutting it short by hand leaves the cosine schedule
half-decayed. Here the epoch count is planned again after every epoch from the epochs'
measured wall time (training, validation and checkpointing), and the schedule is
stretched or shrunk to end with the last epoch that fits (``optim.resize_lr_scheduler``).

The budget is the whole ``bin/train``: the data loading before the epochs is counted
as spent, and the post-processing search after them is kept aside, estimated from a
probe after the first epoch (a quarter of its validation pixels predicted, all its
images labelled once with each kind of markers; :func:`gluon_unet.inference.postprocess_search.search_estimate`), so a budget
of 60 means the run, search and export included, ends within about an hour.
"""

#: The next epoch is predicted by the slowest of the last few: one quick epoch must not
#: promise time a loaded machine does not have, and the first epoch's one-off costs
#: (building the graph) leave the window after a few epochs. A slow epoch entering and
#: leaving the window moves the plan by an epoch and back; no hysteresis holds it still,
#: since on the DSB runs that moved the summed learning rate by under 2 %
#: (``benchmarks/budget_lr_replay.py``), and holding a plan would leave time unused.
WINDOW = 3


def epoch_estimate(epoch_seconds):
    """The seconds the next epoch is planned to take: the slowest of the last
    :data:`WINDOW` completed ones."""
    return max(epoch_seconds[-WINDOW:])


def planned_epochs(budget_seconds, spent_seconds, epoch_seconds, done, max_epochs, reserve_seconds=0.0):
    """The number of epochs the run should have in all.

    Parameters
    ----------
    budget_seconds : float
        Wall seconds the run may take; 0 = no limit.
    spent_seconds : float
        Seconds the run has taken so far: data loading and epochs (earlier processes of
        a resumed run and an interrupted epoch's part included).
    epoch_seconds : list of float
        Wall seconds of each completed epoch.
    done : int
        Epochs completed.
    max_epochs : int
        ``--epochs``: the budget only ever shortens a run.
    reserve_seconds : float
        Kept for what follows the epochs (the post-processing search).

    Returns
    -------
    int
        Between ``done`` (stop now) and ``max_epochs``; ``max_epochs`` until an epoch
        has been measured, so a run always gets at least one.
    """
    if not budget_seconds or not epoch_seconds:
        return max_epochs
    per_epoch = epoch_estimate(epoch_seconds)
    left = max(0.0, budget_seconds - spent_seconds - reserve_seconds)
    fit = int(left // per_epoch) if per_epoch > 0 else max_epochs
    return max(done, min(max_epochs, done + fit))
