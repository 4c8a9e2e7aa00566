"""--ema: the weight average is what validation sees and checkpoints hold; training is untouched."""
import mxnet as mx
import numpy as np
import pytest

from gluon_unet.training.ema import WeightAverage
from gluon_unet.checkpoint import model_from_checkpoint
from gluon_unet.data.prepare import build_datasets, prepare_data
from gluon_unet.training.loop import fit
from gluon_unet.errors import UserError
from gluon_unet.training.losses import SegmentationLoss
from gluon_unet.training.validation import validate


def _arrays(path, prefix):
    return {k[len(prefix):]: v.asnumpy() for k, v in mx.nd.load(path).items() if k.startswith(prefix)}


def test_update_follows_the_warmed_up_decay_and_averages_running_stats_over_devices():
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net = mx.gluon.nn.BatchNorm(in_channels=3)
    net.initialize(ctx=ctxs)
    params = net._collect_params_with_prefix()
    gamma, mean = params['gamma'], params['running_mean']

    def put(p, values):  # per device
        for arr, v in zip(p.list_data(), values):
            arr[:] = v

    put(gamma, [1.0, 1.0])
    put(mean, [0.0, 2.0])
    avg = WeightAverage(net, ctxs, decay=0.5)
    np.testing.assert_allclose(avg.arrays['running_mean'].asnumpy(), 1.0)  # mean of the devices
    expect_gamma, expect_mean = 1.0, 1.0
    for t, (g, m) in enumerate([(3.0, (4.0, 6.0)), (-1.0, (0.0, 0.0)), (7.0, (1.0, 3.0))], start=1):
        put(gamma, [g, g])
        put(mean, m)
        avg.update(t)
        d = min(0.5, (1.0 + t) / (10.0 + t))
        expect_gamma = d * expect_gamma + (1 - d) * g
        expect_mean = d * expect_mean + (1 - d) * np.mean(m)
        np.testing.assert_allclose(avg.arrays['gamma'].asnumpy(), expect_gamma, rtol=1e-6)
        np.testing.assert_allclose(avg.arrays['running_mean'].asnumpy(), expect_mean, rtol=1e-6)
    with avg.applied():
        for arr in gamma.list_data():
            np.testing.assert_allclose(arr.asnumpy(), expect_gamma, rtol=1e-6)
    for arr in gamma.list_data():  # the training weights are back
        np.testing.assert_array_equal(arr.asnumpy(), 7.0)
    np.testing.assert_array_equal(mean.list_data()[1].asnumpy(), 3.0)


@pytest.mark.parametrize('update_on_kvstore', [True, False])
def test_ema_run_trains_exactly_like_a_plain_run_and_checkpoints_hold_the_average(tiny, tmp_path,
                                                                                  update_on_kvstore):
    # Swapping the average in for validation must not disturb training: with the
    # optimizer on the kvstore, Parameter.set_data would reset it and lose Adam's moments.
    common = dict(epochs=3, cpus=2, optimizer='adam', batch_norm=True, synthetic_count=20, batch_size=6,
                  update_on_kvstore=update_on_kvstore, monitor='val_iou')
    fit(tiny(output=str(tmp_path / 'plain'), **common), verbose=False)
    history = fit(tiny(output=str(tmp_path / 'ema'), ema=0.9, **common), verbose=False)
    plain = _arrays(str(tmp_path / 'plain' / 'checkpoints' / 'epoch0003.ckpt'), 'param:')
    raw = _arrays(str(tmp_path / 'ema' / 'checkpoints' / 'epoch0003.ckpt'), 'train:')
    averaged = _arrays(str(tmp_path / 'ema' / 'checkpoints' / 'epoch0003.ckpt'), 'param:')
    assert set(raw) == set(plain) == set(averaged)
    for k in plain:
        np.testing.assert_allclose(raw[k], plain[k], rtol=1e-5, atol=1e-6, err_msg=k)
        assert np.isfinite(averaged[k]).all()
    assert max(np.abs(averaged[k] - raw[k]).max() for k in raw if 'running' not in k) > 1e-4

    # The validation numbers are those of the checkpoint's model, the average.
    net, cfg, _ = model_from_checkpoint(str(tmp_path / 'ema' / 'checkpoints' / 'epoch0003.ckpt'))
    _, val_ds, _ = prepare_data(cfg, *build_datasets(cfg))  # fit's split of the same generated nuclei
    row = validate(net, [mx.cpu()], val_ds, cfg.batch_size, SegmentationLoss(cfg.loss, cfg.dice_weight),
                   cfg.threshold)
    assert row['val_iou'] == pytest.approx(history[-1]['val_iou'], abs=1e-5)


def test_resumed_ema_run_matches_an_unbroken_one(tiny, tmp_path):
    common = dict(epochs=4, cpus=2, optimizer='adam', lr_schedule='cosine', batch_norm=True, augment=True,
                  synthetic_count=20, batch_size=6, ema=0.8)
    fit(tiny(output=str(tmp_path / 'a'), **common), verbose=False)
    fit(tiny(output=str(tmp_path / 'b'), **common), verbose=False, callbacks=[lambda r: r['epoch'] == 2])
    history = fit(tiny(output=str(tmp_path / 'b'), resume='auto', **common), verbose=False)
    assert [r['epoch'] for r in history] == [1, 2, 3, 4]
    for prefix in ('param:', 'train:'):
        a = _arrays(str(tmp_path / 'a' / 'checkpoints' / 'epoch0004.ckpt'), prefix)
        b = _arrays(str(tmp_path / 'b' / 'checkpoints' / 'epoch0004.ckpt'), prefix)
        diff = max(np.abs(a[k] - b[k]).max() for k in a if 'running' not in k)
        assert diff <= 1e-5, (prefix, diff)


def test_resume_must_keep_the_ema_setting(tiny, tmp_path):
    common = dict(epochs=2, synthetic_count=12)
    fit(tiny(output=str(tmp_path / 'r'), ema=0.9, **common), verbose=False, callbacks=[lambda r: True])
    with pytest.raises(UserError, match=r'--ema 0\.9 \(now 0\.0\)'):
        fit(tiny(output=str(tmp_path / 'r'), resume='auto', **common), verbose=False)


@pytest.mark.parametrize('value', [1.0, -0.1, 1.5])
def test_ema_outside_zero_one_is_refused(tiny, value):
    with pytest.raises(UserError, match=r'--ema must be a number in \[0, 1\)'):
        tiny(ema=value).validate()


def test_an_ema_checkpoint_holds_only_arrays_saved_from_the_cpu(tmp_path):
    # The average lives on the first training device. On GPUs an array saved from gpu(k)
    # comes back on gpu(k) in mx.nd.load wherever a GPU is visible (export, predict):
    # checked here with cpu(1), cpu(2), whose ids the file records the same way.
    from device_checks import check_ema_checkpoint_holds_only_cpu_arrays
    check_ema_checkpoint_holds_only_cpu_arrays([mx.cpu(1), mx.cpu(2)], tmp_path)


def test_the_average_copies_nothing_between_devices_at_each_step(tmp_path):
    # BatchNorm's running statistics differ per device; their mean over the devices is
    # taken when the average is read, not at each of the run's steps (on 8 GPUs that was
    # 7 copies per statistic and step into the first one). Counted with MXNet's profiler.
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Conv2D(4, 3, in_channels=1), mx.gluon.nn.BatchNorm(in_channels=4))
    net.initialize(ctx=ctxs)
    avg = WeightAverage(net, ctxs, decay=0.9)
    mx.nd.waitall()
    mx.profiler.set_config(profile_imperative=True, aggregate_stats=True, filename=str(tmp_path / 'profile.json'))
    mx.profiler.dumps(reset=True)
    mx.profiler.set_state('run')
    try:
        avg.update(1)
        mx.nd.waitall()
    finally:
        mx.profiler.set_state('stop')
    import json
    ops = json.loads(mx.profiler.dumps(format='json', reset=True))['Time']['operator']
    assert 'CopyCPU2CPU' not in ops, {k: v['Count'] for k, v in ops.items()}
    assert sum(v['Count'] for v in ops.values()) > 0  # the profiler saw the update
