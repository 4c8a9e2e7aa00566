"""Losses, schedules, optimizers, checkpoints and early stopping, one piece at a time."""
import os
import pickle
import subprocess
import sys
import textwrap

import mxnet as mx
import numpy as np
import pytest

from gluon_unet.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from gluon_unet.config import ModelConfig
from gluon_unet.training.loop import fit
from gluon_unet.errors import UserError
from gluon_unet.training.losses import SegmentationLoss
from gluon_unet.model import build_model
from gluon_unet.training.optim import make_lr_scheduler, make_trainer
from gluon_unet.training.recorder import CheckpointSaver
from hang import HANG_SECONDS


def _loss(kind, logits, target, weight=None, **kw):
    logits, target = mx.nd.array(logits), mx.nd.array(target)
    weight = mx.nd.ones_like(target) if weight is None else mx.nd.array(weight)
    return SegmentationLoss(kind, **kw)(logits, target, weight).asnumpy()


def test_bce_from_logits_is_stable_and_exact():
    logits = np.array([[[[-100.0, 100.0], [0.0, 3.0]]]], np.float32)
    target = np.array([[[[0.0, 1.0], [1.0, 0.0]]]], np.float32)
    got = _loss('bce', logits, target)
    expected = np.mean([0.0, 0.0, np.log(2.0), 3.0 + np.log1p(np.exp(-3.0))])
    assert got.shape == (1,) and np.isfinite(got).all()
    np.testing.assert_allclose(got[0], expected, rtol=1e-5)


def test_dice_bce_dice_and_weighted_bce():
    target = np.zeros((2, 1, 4, 4), np.float32)
    target[0, 0, :2] = 1
    perfect = np.where(target > 0, 20.0, -20.0).astype(np.float32)
    dice = _loss('dice', perfect, target)
    assert dice.shape == (2,) and dice.max() < 1e-3  # empty-vs-empty scores perfect too
    wrong = -perfect
    assert _loss('dice', wrong, target)[0] > 0.9
    combo = _loss('bce_dice', wrong, target, dice_weight=2.0)
    np.testing.assert_allclose(combo, _loss('bce', wrong, target) + 2 * _loss('dice', wrong, target), rtol=1e-5)
    weight = np.ones_like(target)
    weight[:, :, 0] = 10  # heavier first row
    assert (_loss('wbce', wrong, target, weight) > _loss('bce', wrong, target)).all()
    # wbce_dice: the weighted BCE plus the unweighted Dice (the weight map must reach the BCE term)
    np.testing.assert_allclose(_loss('wbce_dice', wrong, target, weight, dice_weight=2.0),
                               _loss('wbce', wrong, target, weight) + 2 * _loss('dice', wrong, target), rtol=1e-5)
    for kind in ('wbce', 'wbce_dice'):  # without the map they would silently be bce / bce_dice
        with pytest.raises(ValueError, match='weight map'):
            SegmentationLoss(kind)(mx.nd.array(wrong), mx.nd.array(target))


def _lovasz_reference(logit, label):
    """Berman et al.'s lovasz_hinge_flat, in numpy, for one image and channel."""
    errors = 1.0 - logit * (2.0 * label - 1.0)
    order = np.argsort(-errors, kind='stable')
    gt = label[order]
    inter, union = gt.sum() - np.cumsum(gt), gt.sum() + np.cumsum(1.0 - gt)
    jaccard = 1.0 - inter / union
    jaccard[1:] = jaccard[1:] - jaccard[:-1]
    return float(np.dot(np.maximum(errors[order], 0), jaccard))


def test_lovasz_hinge_matches_the_reference_and_its_gradient_the_finite_differences():
    from mxnet import autograd
    rng = np.random.RandomState(0)
    logits = rng.randn(3, 2, 8, 8).astype(np.float32)
    target = (rng.rand(3, 2, 8, 8) > 0.6).astype(np.float32)
    target[1] = 0  # an empty image: all the weight on the largest error

    def reference(z):
        return np.array([np.mean([_lovasz_reference(z[n, c].ravel().astype(np.float64), target[n, c].ravel())
                                  for c in range(2)]) for n in range(3)])

    loss = SegmentationLoss('lovasz')
    loss.initialize()
    np.testing.assert_allclose(_loss('lovasz', logits, target), reference(logits), rtol=1e-5)
    loss.hybridize(static_alloc=True, static_shape=True)  # as training runs it
    np.testing.assert_allclose(loss(mx.nd.array(logits), mx.nd.array(target)).asnumpy(), reference(logits), rtol=1e-5)
    np.testing.assert_allclose(_loss('bce_lovasz', logits, target, dice_weight=0.5),
                               _loss('bce', logits, target) + 0.5 * reference(logits), rtol=1e-5)
    x = mx.nd.array(logits)
    x.attach_grad()
    with autograd.record():
        total = loss(x, mx.nd.array(target)).sum()
    total.backward()
    grad, eps = x.grad.asnumpy(), 1e-3
    assert np.abs(grad).sum() > 0
    for idx in [(0, 0, 1, 2), (2, 1, 5, 5), (1, 0, 3, 3), (0, 1, 7, 0)]:
        up, down = logits.astype(np.float64), logits.astype(np.float64)
        up[idx] += eps
        down[idx] -= eps
        numeric = (reference(up).sum() - reference(down).sum()) / (2 * eps)
        assert grad[idx] == pytest.approx(numeric, rel=2e-2, abs=1e-5), idx
    perfect = np.where(target > 0, 20.0, -20.0).astype(np.float32)
    assert _loss('lovasz', perfect, target).max() == 0.0
    # mask+centre: the level map (second channel) takes no Lovasz term, as it takes no Dice
    np.testing.assert_allclose(_loss('lovasz', logits, target, dice_channels=1),
                               [_lovasz_reference(logits[n, 0].ravel().astype(np.float64), target[n, 0].ravel())
                                for n in range(3)], rtol=1e-5)


def test_softmax_ce_for_several_classes():
    target = np.array([[[[0, 1], [2, 1]]]], np.float32)
    logits = np.zeros((1, 3, 2, 2), np.float32)
    np.testing.assert_allclose(_loss('ce', logits, target), [np.log(3.0)], rtol=1e-5)


def test_cosine_schedule_warms_up_then_decays_to_zero():
    sched = make_lr_scheduler('cosine', 0.1, total_steps=100, warmup_steps=10)
    lrs = [sched(i) for i in range(0, 101)]
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(0.05) and lrs[10] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[100] == pytest.approx(0.0, abs=1e-9)
    step = make_lr_scheduler('step', 1.0, total_steps=100, step_fractions=(0.5,))
    assert step(10) == 1.0 and step(60) == pytest.approx(0.1)
    assert make_lr_scheduler('constant', 0.1, 100) is None


def test_adamw_decay_is_decoupled_from_the_gradient():
    net = build_model(ModelConfig(in_channels=1, width=2, depth=1))
    net.initialize(mx.init.Constant(1.0))
    net(mx.nd.zeros((1, 1, 4, 4)))
    trainer = make_trainer(net.collect_params(), 'adamw', 0.1, [mx.cpu()], weight_decay=0.5)
    for p in net.collect_params().values():
        if p.grad_req != 'null':
            p.grad()[:] = 0  # no gradient: Adam moves nothing, only the decay acts
            p.data()._fresh_grad = True
    before = {p.name: p.data().asnumpy() for p in net.collect_params().values()}
    trainer.step(1)
    w = net.head.weight.data().asnumpy()
    np.testing.assert_allclose(w, 1.0 * (1 - 0.1 * 0.5), rtol=1e-5)
    # Biases and BatchNorm's gamma/beta are not decayed (timm's rule: at most 1-D).
    spared = [p for p in net.collect_params().values() if p.grad_req != 'null' and len(p.shape) <= 1]
    assert len(spared) > 3
    for p in spared:
        np.testing.assert_array_equal(p.data().asnumpy(), before[p.name], err_msg=p.name)


@pytest.mark.parametrize('optimizer', ['sgd', 'adamw'])
def test_weight_decay_spares_biases_and_batchnorm_here_and_on_a_server(optimizer):
    net = build_model(ModelConfig(in_channels=1, width=2, depth=1))
    net.initialize()
    net(mx.nd.zeros((1, 1, 4, 4)))
    trainer = make_trainer(net.collect_params(), optimizer, 0.1, [mx.cpu()], weight_decay=0.5)
    # A dist kvstore's servers update with a pickled copy that has no Parameters.
    server = pickle.loads(pickle.dumps(trainer.optimizer))
    assert server.param_dict == {}
    params = list(trainer.optimizer.param_dict.values())
    kinds = [p.name.rsplit('_', 1)[1] for p in params]
    assert {'weight', 'bias', 'gamma', 'beta'} <= set(kinds)
    for opt in (trainer.optimizer, server):
        wds = opt._get_wds(range(len(params)))
        assert all(wd == (0.5 if kind == 'weight' else 0.0) for kind, wd in zip(kinds, wds)), \
            list(zip(kinds, wds))


def test_nccl_and_float16_need_gpus(tiny):
    with pytest.raises(UserError, match='--kvstore nccl needs GPUs'):
        make_trainer(build_model(ModelConfig(in_channels=1)).collect_params(), 'sgd', 0.1,
                     [mx.cpu(0), mx.cpu(1)], kvstore='nccl')
    with pytest.raises(UserError, match='float16 needs GPUs'):
        fit(tiny(amp=True, amp_dtype='float16'), verbose=False)


def test_amp_init_leaves_the_root_logger_alone():
    # MXNet's amp.init logs through logging.info, which configures the root logger when
    # nothing has: every gluon_unet line after it reached stderr twice. In a subprocess,
    # because amp.init patches MXNet for the whole process.
    script = textwrap.dedent('''
        import logging
        import mxnet as mx
        from gluon_unet.config import TrainConfig
        from gluon_unet.training.step import init_amp
        assert init_amp(TrainConfig(amp=True), [mx.cpu()]) == 'bfloat16'
        print('root handlers', len(logging.getLogger().handlers))
    ''')
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    assert 'root handlers 0' in done.stdout


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    net = build_model(ModelConfig(in_channels=1, width=2, depth=1))
    net.initialize()
    net(mx.nd.zeros((1, 1, 4, 4)))
    path = str(tmp_path / 'epoch0001.ckpt')
    save_checkpoint(path, net, None, {'epoch': 1, 'config': {}})
    before = open(path, 'rb').read()

    def crash(fname, data):
        with open(fname, 'wb') as f:
            f.write(b'half a checkpoint')
        raise OSError('disk full')
    monkeypatch.setattr(mx.nd, 'save', crash)
    with pytest.raises(OSError):
        save_checkpoint(path, net, None, {'epoch': 2, 'config': {}})
    assert open(path, 'rb').read() == before  # the old checkpoint survives untouched
    assert os.listdir(str(tmp_path)) == ['epoch0001.ckpt']  # and no temporary file is left
    monkeypatch.undo()
    assert load_checkpoint(path)['epoch'] == 1
    with open(path, 'wb') as f:
        f.write(b'garbage')
    with pytest.raises(UserError, match='damaged'):
        load_checkpoint(path)


def test_saver_keeps_best_and_last_n(tmp_path):
    net = build_model(ModelConfig(in_channels=1, width=2, depth=1))
    net.initialize()
    net(mx.nd.zeros((1, 1, 4, 4)))
    saver = CheckpointSaver(str(tmp_path), 'val_iou', 'max', keep_last=2)
    flags = [saver.end_epoch(net, None, {'epoch': epoch, 'value': value, 'config': {}}, value)
             for epoch, value in enumerate([0.1, 0.5, 0.3, 0.4, 0.2], start=1)]
    assert flags == [True, True, False, False, False]
    assert (saver.best, saver.best_epoch, saver.bad_epochs) == (0.5, 2, 3)
    names = [os.path.basename(p) for p in list_checkpoints(str(tmp_path))]
    assert names == ['epoch0004.ckpt', 'epoch0005.ckpt']
    best = load_checkpoint(str(tmp_path / 'best.ckpt'))
    assert best['value'] == 0.5 and best['best_epoch'] == 2
    assert load_checkpoint(str(tmp_path / 'epoch0005.ckpt'))['bad_epochs'] == 3
    assert not saver.is_better(float('nan'))
    low = CheckpointSaver(str(tmp_path), 'val_loss', 'min', min_delta=0.05)
    low.restore({'best': 0.2, 'best_epoch': 1})
    assert low.is_better(0.1) and not low.is_better(0.16)
    # A saver without a folder keeps score and writes nothing (non-zero ranks).
    quiet = CheckpointSaver(None, 'val_iou')
    assert quiet.end_epoch(net, None, {'epoch': 1}, 0.3) and quiet.save(net, None, {'epoch': 1}) is None


def test_early_stopping_stops_after_patience(tiny):
    # A learning rate of ~0 means nothing improves after the first epoch.
    history = fit(tiny(epochs=10, patience=2, lr=1e-12, monitor='val_loss', min_delta=1e-3),
                  verbose=False)
    assert len(history) == 3
    assert [r['best'] for r in history] == [True, False, False]
