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
images labelled once with each kind of markers; :func:`search_estimate`), so a budget
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


def search_estimate(predict_seconds, predicted_pixels, search_pixels, labelings):
    """Seconds the post-processing search will take, from a probe of it.

    The search predicts each of its images once, then labels all of them once per
    setting it tries. The probe predicts some of them (``predicted_pixels`` of the
    ``search_pixels``) and labels all of them once with each kind of markers the search
    uses: its prediction time is scaled by the pixels, each labelling time by the number
    of settings that label that way.

    Parameters
    ----------
    predict_seconds : float
        The probe's time for predicting ``predicted_pixels``.
    predicted_pixels, search_pixels : int
        Pixels the probe predicted, and all the pixels the search will use.
    labelings : sequence of (float, int)
        For each kind of markers: the probe's seconds for one labelling of all the
        search's images, and how many labellings of that kind the search does
        (``postprocess.search_arms``).
    """
    predict = predict_seconds * float(search_pixels) / predicted_pixels if predicted_pixels > 0 else 0.0
    return predict + sum(seconds * count for seconds, count in labelings)


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
