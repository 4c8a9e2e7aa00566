"""``--memory``: the recomputing steps train exactly like the default one, recompute what
they claim, plan less memory, resume across settings, and bad values are one line."""
import collections
import os
import re
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from gluon_unet.training.benchmark import synthetic_batch
from gluon_unet.checkpoint import list_checkpoints
from gluon_unet.config import ModelConfig, TrainConfig
from gluon_unet.training.loop import fit
from gluon_unet.training.parallel import DataParallelStep, MirroredStep
from gluon_unet.training.step import build_network, make_step
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(memory, **kw):
    model = ModelConfig(in_channels=1, width=kw.pop('width', 4), depth=kw.pop('depth', 2), batch_norm=True,
                        dropout=kw.pop('dropout', 0.0))
    base = dict(model=model, size=32, batch_size=4, memory=memory, progress=False, optimizer='adam', lr=1e-2)
    base.update(kw)
    return TrainConfig(**base)


def _train(memory, steps=3, cpus=1, **kw):
    """Losses of ``steps`` steps and the parameters after them (running statistics too)."""
    cfg = _config(memory, cpus=cpus, **kw)
    ctxs = [mx.cpu(i) for i in range(cpus)]
    net = build_network(cfg, ctxs)
    step = make_step(cfg, net, ctxs)
    batch = synthetic_batch(cfg, seed=1)
    losses = [sum(l.asscalar() for l in step(*batch)['loss_sums']) for _ in range(steps)]
    params = {k: v.data(ctxs[0]).asnumpy() for k, v in net._collect_params_with_prefix().items()}
    return step, losses, params


@pytest.mark.parametrize('memory', ['balanced', 'low'])
def test_memory_settings_train_like_the_default_step(memory):
    _, ref_losses, ref = _train('speed')
    step, losses, params = _train(memory)
    assert isinstance(step, MirroredStep) and step.recompute == {'balanced': 'activations', 'low': 'blocks'}[memory]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert ref_losses[-1] < ref_losses[0]  # it trains: the check compares something
    for k in ref:  # weights, and BatchNorm running statistics updated once per step
        np.testing.assert_allclose(params[k], ref[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_low_memory_on_two_contexts_with_weights_clipping_and_a_short_batch():
    # wbce feeds a third input; clipping goes through allreduce_grads + update; a batch of 3
    # on 2 contexts splits unevenly (2 + 1).
    kw = dict(cpus=2, loss='wbce', clip_grad=0.5, batch_size=3)
    # The reference is the imperative step: on 2+ contexts the static CachedOp's BatchNorm
    # running statistics lag one update behind it (its weights and losses match).
    _, ref_losses, ref = _train('speed', hybridize=False, **kw)
    step, losses, params = _train('low', **kw)
    assert isinstance(step, MirroredStep)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k in ref:
        np.testing.assert_allclose(params[k], ref[k], rtol=1e-4, atol=1e-5, err_msg=k)


def _mirrored_ops(step):
    """{op name: count} of the nodes the bound graph recomputes in backward."""
    (ex, _), = step._execs.values()
    return dict(collections.Counter(re.findall(r'Op:(\w+), Name=\S+_mirror$', ex.debug_str(), re.M)))


def test_each_setting_recomputes_what_it_says():
    assert isinstance(_train('speed', steps=1)[0], DataParallelStep)
    balanced = _mirrored_ops(_train('balanced', steps=1)[0])
    low = _mirrored_ops(_train('low', steps=1)[0])
    # depth 2: 3 double convolutions above the decoder's 2 = 5 blocks of 2 conv/BN/ReLU.
    assert balanced == {'BatchNorm': 10, 'Activation': 10}, balanced
    # low: everything in a block but its last ReLU, from the block's input; in the decoder
    # the upsampling and the concatenation too, and the poolings.
    assert low == {'Convolution': 10, 'BatchNorm': 10, 'Activation': 5, 'Deconvolution': 2, 'Concat': 2,
                   'Pooling': 2}, low


def _peak_rss_mib(memory):
    """Peak memory of a subprocess training 3 steps at width 16, 128 px (process-wide
    effects only show in a fresh process)."""
    code = ('import sys; sys.path.insert(0, %r)\n'
            'import mxnet as mx\n'
            'from gluon_unet.config import ModelConfig, TrainConfig\n'
            'from gluon_unet.training.step import build_network, make_step\n'
            'from gluon_unet.training.benchmark import synthetic_batch\n'
            'cfg = TrainConfig(model=ModelConfig(in_channels=1, width=16, depth=3), size=128, batch_size=4,\n'
            '                  memory=%r, progress=False)\n'
            'step = make_step(cfg, build_network(cfg, [mx.cpu()]), [mx.cpu()])\n'
            'batch = synthetic_batch(cfg)\n'
            'def rss(k):\n'
            '    return [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(k)][0]\n'
            'base = rss("VmRSS")\n'
            'for _ in range(3):\n'
            '    step(*batch)\n'
            'mx.nd.waitall()\n'
            'print((rss("VmHWM") - base) / 1024)\n' % (ROOT, memory))
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.strip().splitlines()[-1])


def test_low_memory_takes_less_memory_than_the_default_in_a_fresh_process():
    speed, low = _peak_rss_mib('speed'), _peak_rss_mib('low')
    # Measured (2-core Zen 4, 1 thread): low 100 MiB, balanced 126, speed 142-146.
    assert low < 0.8 * speed, (speed, low)


def test_memory_setting_may_change_on_resume_and_continues_the_same_run(tmp_path):
    common = dict(epochs=2, synthetic_count=12, batch_size=4, workers=0, augment=False, patience=0,
                  tune_postprocess=False, val_split=0.25, seed=3)

    def cfg(out, memory, **kw):
        c = _config(memory, **dict(common, **kw))
        c.output = str(tmp_path / out)
        return c
    fit(cfg('a', 'speed'), verbose=False)
    fit(cfg('b', 'speed'), verbose=False, callbacks=[lambda r: r['epoch'] == 1])
    history = fit(cfg('b', 'low', resume='auto'), verbose=False)
    assert [r['epoch'] for r in history] == [1, 2]
    a = mx.nd.load(list_checkpoints(str(tmp_path / 'a' / 'checkpoints'))[-1])
    b = mx.nd.load(list_checkpoints(str(tmp_path / 'b' / 'checkpoints'))[-1])
    keys = [k for k in a if k.startswith('param:')]
    assert keys
    for k in keys:
        np.testing.assert_allclose(b[k].asnumpy(), a[k].asnumpy(), rtol=1e-4, atol=1e-5, err_msg=k)
    # The setting is part of the run's saved config (checkpoints and config.json).
    with open(str(tmp_path / 'b' / 'config.json')) as f:
        assert '"memory": "low"' in f.read()


def _train_cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'train'), '--width', '4', '--depth', '2',
                           '--size', '32', '--workers', '0', '--no-progress'] + list(args),
                          capture_output=True, text=True, timeout=HANG_SECONDS)


@pytest.mark.parametrize('argv, words', [(['--memory', 'bogus'], ['--memory', 'speed, balanced, low']),
                                         (['--memory', 'low', '--amp'], ['--memory low', '--amp']),
                                         (['--memory', 'balanced', '--cpus', '2', '--sync-bn'],
                                          ['--memory balanced', '--sync-bn'])])
def test_bad_memory_values_are_one_line_exit_2(tmp_path, argv, words):
    done = _train_cli('--output', str(tmp_path / 'run'), *argv)
    lines = [l for l in done.stderr.strip().splitlines() if l.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert all(w in lines[0] for w in words) and 'Traceback' not in done.stderr, lines
    assert not (tmp_path / 'run').exists()


def test_one_context_with_a_memory_setting_gets_one_scratch_buffer():
    from gluon_unet.machine import runtime
    assert 'MXNET_CPU_TEMP_COPY' not in runtime.recommended_settings(1, {})
    assert runtime.recommended_settings(1, {}, memory='low')['MXNET_CPU_TEMP_COPY'] == '1'
    assert runtime.recommended_settings(1, {}, memory='balanced')['MXNET_CPU_TEMP_COPY'] == '1'
    # Several contexts need their buffers to run side by side, whatever the setting.
    assert runtime.recommended_settings(2, {}, memory='low')['MXNET_CPU_TEMP_COPY'] == '64'
    assert runtime.recommended_settings(1, {}, gpus=True, memory='low') == {}
    # The user's own value wins.
    env = {'MXNET_CPU_TEMP_COPY': '4'}
    assert 'MXNET_CPU_TEMP_COPY' not in runtime.apply_runtime_defaults(env, memory='low')


@pytest.mark.parametrize('memory, copies', [('low', 1), ('speed', 4)])
def test_bin_train_applies_the_setting_before_mxnet_loads(tmp_path, memory, copies):
    env = {k: v for k, v in os.environ.items() if k != 'MXNET_CPU_TEMP_COPY'}
    done = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'train'), '--width', '4', '--depth', '2',
                           '--size', '32', '--workers', '0', '--no-progress', '--synthetic-count', '16',
                           '--epochs', '1', '--batch-size', '4', '--no-tune-postprocess', '--memory', memory,
                           '--output', str(tmp_path / 'run')],
                          capture_output=True, text=True, timeout=HANG_SECONDS, env=env)
    assert done.returncode == 0, done.stderr
    logged = done.stdout + done.stderr
    assert 'MXNET_CPU_TEMP_COPY=%d,' % copies in logged, logged
    with open(str(tmp_path / 'run' / 'config.json')) as f:
        assert '"memory": "%s"' % memory in f.read()
