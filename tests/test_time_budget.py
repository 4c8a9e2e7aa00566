"""--time-budget: the run is cut to the epochs that fit, the LR schedule ends with the
last of them, the data loading counts and the post-processing search is kept aside, and
a resumed run goes on counting the time already spent."""
import itertools
import os

import pytest

from gluon_unet.training import loop as engine
from gluon_unet.training.budget import planned_epochs
from gluon_unet.checkpoint import load_checkpoint
from gluon_unet.config import TrainConfig
from gluon_unet.training.loop import fit
from gluon_unet.errors import UserError
from gluon_unet.inference.configs import SECOND_MAPS
from gluon_unet.training.optim import make_lr_scheduler, resize_lr_scheduler
from gluon_unet.inference.postprocess_search import search_estimate


def test_planned_epochs_fits_what_is_left_and_never_passes_epochs():
    assert planned_epochs(0, 50.0, [10.0], 1, 30) == 30            # no budget
    assert planned_epochs(600, 0.0, [], 0, 30) == 30               # nothing measured yet
    assert planned_epochs(100, 20.0, [20.0], 1, 10) == 5           # 80 s left, 20 s an epoch
    assert planned_epochs(200, 50.0, [10.0, 30.0, 10.0], 3, 20) == 8  # the slowest recent epoch
    assert planned_epochs(200, 130.0, [100.0, 10.0, 10.0, 10.0], 4, 20) == 11  # 100 s left the window
    assert planned_epochs(100, 95.0, [30.0, 35.0, 30.0], 3, 10) == 3  # no time for another: stop
    assert planned_epochs(100, 120.0, [60.0, 60.0], 2, 10) == 2    # overspent: never below done
    assert planned_epochs(10 ** 6, 10.0, [10.0], 1, 7) == 7        # --epochs caps it
    assert planned_epochs(100, 20.0, [20.0], 1, 10, reserve_seconds=30.0) == 3  # 50 s left after the search
    assert planned_epochs(100, 20.0, [20.0], 1, 10, reserve_seconds=90.0) == 1  # the search takes it all


def test_the_search_estimate_scales_the_probe_by_pixels_and_settings():
    # 2 s predicting a quarter of the pixels; 0.5 s labelling all of them once; 28 labellings.
    assert search_estimate(2.0, 100, 400, [(0.5, 28)]) == pytest.approx(2.0 * 4 + 28 * 0.5)
    assert search_estimate(2.0, 0, 400, [(0.5, 28)]) == pytest.approx(28 * 0.5)
    # a two-map model: 28 labellings with its own markers, 27 with the (slower) distance watershed
    assert search_estimate(2.0, 100, 400, [(0.5, 28), (0.8, 27)]) == pytest.approx(8 + 14 + 27 * 0.8)


@pytest.mark.parametrize('schedule', ['cosine', 'poly'])
def test_a_resized_decay_ends_at_the_new_last_step_like_one_built_for_it(schedule):
    sched = make_lr_scheduler(schedule, 0.1, 100, warmup_steps=10)
    resize_lr_scheduler(sched, 50)
    fresh = make_lr_scheduler(schedule, 0.1, 50, warmup_steps=10)
    for t in (5, 10, 20, 35, 49):
        assert sched(t) == pytest.approx(fresh(t)), t
    assert sched(50) == pytest.approx(0.0) and sched(80) == pytest.approx(0.0)
    resize_lr_scheduler(sched, 5)  # shorter than the warmup: the decay still has a step
    assert sched.max_update == 11 and sched(11) == pytest.approx(0.0)


def test_a_resized_step_schedule_keeps_the_drops_taken_and_moves_those_ahead():
    sched = make_lr_scheduler('step', 1.0, 100, step_fractions=(0.6, 0.85))
    assert sched.step == [60, 85]
    assert sched(70) == pytest.approx(0.1)  # the first drop is taken
    resize_lr_scheduler(sched, 80, (0.6, 0.85))
    assert sched.step == [60, 68]
    assert sched(69) == pytest.approx(0.01)
    untouched = make_lr_scheduler('step', 1.0, 100, step_fractions=(0.6, 0.85))
    resize_lr_scheduler(untouched, 50, (0.85, 0.6))
    assert untouched.step == [30, 42]
    resize_lr_scheduler(None, 50)  # a constant rate has no length


@pytest.fixture
def clock(monkeypatch):
    """Every reading of the budget's clock is 100 s after the one before: epochs of 100 s."""
    ticks = itertools.count(0, 100.0)
    monkeypatch.setattr(engine, '_clock', lambda: next(ticks))


def _budget_cfg(tiny, tmp_path, **kw):
    # No post-processing search unless a test asks: its probe would read the clock too.
    settings = dict(output=str(tmp_path / 'run'), epochs=8, lr=0.01, lr_schedule='cosine', warmup_epochs=1,
                    synthetic_count=16, batch_size=8, tune_postprocess=False)
    return tiny(**{**settings, **kw})


def test_a_budget_cuts_the_run_and_its_cosine_ends_with_the_last_epoch(tiny, tmp_path, clock):
    # 7 minutes: 100 s of loading, epochs of 100 s; after epoch 1, 220 s are left for 2 more.
    history = fit(_budget_cfg(tiny, tmp_path, time_budget=7.0), verbose=False)
    assert [r['epoch'] for r in history] == [1, 2, 3]
    assert history[-1]['lr'] == pytest.approx(0.0, abs=1e-12)
    assert history[1]['lr'] > 0
    meta = load_checkpoint(os.path.join(str(tmp_path / 'run'), 'checkpoints', 'best.ckpt'))
    assert meta['train_seconds'] == pytest.approx(100.0 * (meta['epoch'] + 1))  # the loading counts
    with open(os.path.join(str(tmp_path / 'run'), 'train.log')) as f:
        log = f.read()
    assert 'time budget: 3 of --epochs 8 fit' in log and 'ends with epoch 3' in log


def test_an_interrupted_budgeted_run_resumes_with_the_time_it_had_spent(tiny, tmp_path, clock):
    unbroken = fit(_budget_cfg(tiny, tmp_path / 'a', time_budget=7.0), verbose=False)
    fit(_budget_cfg(tiny, tmp_path / 'b', time_budget=7.0), verbose=False, callbacks=[lambda r: r['epoch'] == 1])
    # The new process's clock starts anew; the checkpoint's 200 s are still spent, and
    # loading again costs 100 s more: 120 s are left, for one epoch, not the unbroken two.
    resumed = fit(_budget_cfg(tiny, tmp_path / 'b', time_budget=7.0, resume='auto'), verbose=False)
    assert [r['epoch'] for r in unbroken] == [1, 2, 3]
    assert [r['epoch'] for r in resumed] == [1, 2]
    assert resumed[0]['lr'] == pytest.approx(unbroken[0]['lr'])  # epoch 1 is the checkpoint's, unchanged
    assert resumed[-1]['lr'] == pytest.approx(0.0, abs=1e-12)
    meta = load_checkpoint(os.path.join(str(tmp_path / 'b' / 'run'), 'checkpoints', 'epoch0002.ckpt'))
    assert meta['train_seconds'] == pytest.approx(400.0)  # 2 loadings, 2 epochs
    # A larger budget on resume gives the run the epochs it now has time for: 900 s in
    # all, 500 s spent once this third loading is counted, so 4 more.
    longer = fit(_budget_cfg(tiny, tmp_path / 'b', time_budget=15.0, resume='auto'), verbose=False)
    assert [r['epoch'] for r in longer] == [1, 2, 3, 4, 5, 6]
    assert longer[-1]['lr'] == pytest.approx(0.0, abs=1e-12)


def test_the_search_is_kept_aside_and_probed_once(tiny, tmp_path, clock, monkeypatch):
    calls = []

    def search_seconds(*args, **kwargs):
        calls.append(kwargs)
        return 250.0, 1, 2

    monkeypatch.setattr(engine, 'search_seconds', search_seconds)
    # 11 minutes: 100 s loading, epoch 1 100 s, 250 s for the search: 210 s left, for 2
    # more epochs (the probe itself is the fake search_seconds: it reads no clock).
    history = fit(_budget_cfg(tiny, tmp_path, time_budget=11.0, tune_postprocess=True, synthetic_count=24),
                  verbose=False)
    assert [r['epoch'] for r in history] == [1, 2, 3]
    assert len(calls) == 1 and calls[0]['second'] is None
    with open(os.path.join(str(tmp_path / 'run'), 'train.log')) as f:
        log = f.read()
    assert 'search after the epochs is estimated at 4.2 min (1 of its 2 validation images probed)' in log
    assert '4.2 of them kept for the search' in log


@pytest.mark.parametrize('second', SECOND_MAPS)
def test_search_seconds_times_a_probe_of_the_search_images(tiny, tmp_path, second):
    import mxnet as mx

    from gluon_unet.data.prepare import build_datasets
    from gluon_unet.inference.postprocess_search import search_images, search_labelings, search_seconds
    from gluon_unet.inference.sidecar import geometry
    from gluon_unet.training.step import build_network
    cfg = tiny(synthetic_count=40, val_split=0.25)
    _, val_ds = build_datasets(cfg)
    net = build_network(cfg, [mx.cpu()])
    sizes = [labels.size for _, labels in search_images(val_ds)]
    assert len(sizes) == len(val_ds) == 10
    # predicting took 3 s, labelling all once 1 s with the watershed, 5 s with the random walker
    readings = iter([10.0, 13.0, 14.0, 19.0])
    seconds, probed, images = search_seconds(net, [mx.cpu()], val_ds, geometry(cfg), 8, probe_fraction=0.25,
                                             clock=lambda: next(readings))
    assert (probed, images) == (3, 10)  # equal sizes: 3 images reach a quarter of the pixels
    assert seconds == pytest.approx(3.0 * sum(sizes) / sum(sizes[:3]) + (search_labelings(None) - 1) * 1.0 + 5.0)
    with pytest.raises(StopIteration):
        next(readings)  # four readings: before, between, after the watershed and the random walker
    # A model with maps after the foreground (every kind): each kind of markers is timed on
    # its own and scaled by its own count.
    from gluon_unet.inference.postprocess_search import search_arms
    assert search_arms(second) == [(second, 28), ('distance', 27), ('randomwalker', 1)]
    assert search_labelings(second) == 56
    # its own markers 1 s for all images, the distance 2 s, the random walker 3 s
    readings = iter([0.0, 1.0, 2.0, 4.0, 7.0])
    assert search_seconds(net, [mx.cpu()], val_ds, geometry(cfg), 8, second=second,
                          clock=lambda: next(readings))[0] == pytest.approx(1.0 * 10 / 3 + 28 * 1.0 + 27 * 2.0 + 3.0)
    with pytest.raises(StopIteration):
        next(readings)


def test_without_a_budget_the_run_has_all_its_epochs(tiny, tmp_path, clock):
    history = fit(_budget_cfg(tiny, tmp_path, epochs=3), verbose=False)
    assert [r['epoch'] for r in history] == [1, 2, 3]
    assert history[-1]['lr'] == pytest.approx(0.0, abs=1e-12)


def test_a_negative_budget_and_a_schedule_held_by_the_servers_are_refused():
    with pytest.raises(UserError, match=r'--time-budget must be a number in \[0, 525600\] \(minutes; 0 = no limit\)'):
        TrainConfig(time_budget=-1.0).validate()
    with pytest.raises(UserError, match='--time-budget with --kvstore dist_async'):
        TrainConfig(time_budget=30.0, lr_schedule='cosine', kvstore='dist_async').validate()
    TrainConfig(time_budget=30.0, lr_schedule='constant', kvstore='dist_async').validate()
    TrainConfig(time_budget=30.0, lr_schedule='cosine', kvstore='dist_sync').validate()
