"""Resuming on another number of devices continues the run exactly, on every device.

MXNet counts each parameter's updates per device id (``Optimizer._set_current_context``,
called by ``Updater.__call__`` with the weight's device id) and Adam's bias correction
reads that count. A device id missing from the restored state restarted at t=1, so its
weight copy drifted from the others'. Tiny network, direct API, CPU contexts (the GPU
lane runs the same check: tests/test_gpu.py).
"""
import functools
import json

import mxnet as mx
import numpy as np
import pytest

from device_checks import (RESUME_MODES, RESUME_STEPS, check_resume_across_device_counts, cpu_contexts,
                           resume_run, tiny_conv_net)
from gluon_unet.checkpoint import load_checkpoint
from gluon_unet.training.optim import make_trainer


@functools.lru_cache(maxsize=None)
def _unbroken(ndev, optimizer, mode):
    return resume_run(cpu_contexts(ndev), optimizer, mode, range(RESUME_STEPS))


@pytest.mark.parametrize('mode', sorted(RESUME_MODES))
@pytest.mark.parametrize('before, after', [(1, 2), (2, 1), (1, 4), (4, 3)])
@pytest.mark.parametrize('optimizer', ['sgd', 'adam', 'adamw'])
def test_resume_on_another_device_count_matches_an_unbroken_run(tmp_path, optimizer, before, after, mode):
    check_resume_across_device_counts(cpu_contexts, before, after, optimizer, mode, tmp_path,
                                      unbroken=_unbroken(before, optimizer, mode))
    if mode == 'clip':  # the clipped cases must clip, or they test nothing more
        clipped, unclipped = _unbroken(before, optimizer, 'clip'), _unbroken(before, optimizer, 'local')
        assert max(np.abs(unclipped[k][0] - clipped[k][0]).max() for k in clipped) > 1e-4


def test_resume_gives_every_device_the_count_of_keys_a_gpu_kvstore_spread(tmp_path):
    """With ``update_on_kvstore`` on GPUs each key is counted under the GPU holding its
    merge buffer (``CommDevice::InitMergeBuffer`` balances keys over the GPUs), so a
    checkpoint from 2 GPUs has half the keys under device 0 and half under device 1. CPU
    contexts count every key under ``cpu_pinned(0)``, so the record is laid out here as
    2 GPUs would write it, and resumed on 3 devices."""
    path = str(tmp_path / 'half.ckpt')
    resume_run(cpu_contexts(1), 'adam', 'local', range(RESUME_STEPS // 2), save=path)
    arrays = mx.nd.load(path)
    meta = json.loads(arrays['meta'].asnumpy().tobytes().decode())
    counts = meta['optimizer_state']['index_update_counts']['0']
    spread = {'0': {}, '1': {}}
    for i, (key, n) in enumerate(sorted(counts.items())):
        spread[str(i % 2)][key] = n
    meta['optimizer_state']['index_update_counts'] = spread
    arrays['meta'] = mx.nd.array(np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), dtype=np.uint8)
    del arrays['digest']  # edited on purpose: loaded unchecked, as a checkpoint from before digests
    mx.nd.save(path, arrays)

    ctxs = cpu_contexts(3)
    net = tiny_conv_net(ctxs)
    trainer = make_trainer(net.collect_params(), 'adam', 0.01, ctxs, update_on_kvstore=False)
    load_checkpoint(path, net, trainer, ctx=ctxs)
    assert set(counts.values()) == {RESUME_STEPS // 2}
    index = {name: trainer._param2idx[p.name] for name, p in net._collect_params_with_prefix().items()}
    for dev in (0, 1, 2):
        assert trainer.optimizer._all_index_update_counts[dev] == {index[k[1:]]: n for k, n in counts.items()}, dev


def _shift_conv_counter_to_before_a_power_of_ten():
    """Create unnamed Conv2D blocks until the next two get global names that straddle a
    power of ten ('conv9', 'conv10'), which sort the other way round than they were made."""
    n = int(mx.gluon.nn.Conv2D(1, 1).prefix[len('conv'):-1]) + 1  # the next block's number
    for _ in range(10 ** len(str(n)) - 1 - n):  # up to ~900 blocks in a long session: milliseconds
        mx.gluon.nn.Conv2D(1, 1)


def test_resume_in_a_session_that_numbered_the_parameters_otherwise(tmp_path):
    """gluon.Trainer numbers a ParameterDict by sorted global name ('conv10_weight'
    before 'conv9_weight'), and those names carry process-wide counters: the resumed
    trainer numbers the same parameters otherwise. Optimizer state keyed by that number
    put the first convolution's Adam moments on the second (a shape error here; silent
    where shapes agree). Keyed by structural name, the resume matches the unbroken run."""
    _shift_conv_counter_to_before_a_power_of_ten()
    check_resume_across_device_counts(cpu_contexts, 1, 2, 'adam', 'clip', tmp_path)


def test_a_position_keyed_checkpoint_numbered_otherwise_is_refused_in_one_line(tmp_path):
    """A format-2 checkpoint keys its state by the saving Trainer's positions: where this
    session numbers the parameters otherwise, a shape that does not fit is refused."""
    from gluon_unet.errors import UserError
    path = str(tmp_path / 'old.ckpt')
    _shift_conv_counter_to_before_a_power_of_ten()
    ctxs = cpu_contexts(1)
    net = tiny_conv_net(ctxs)  # 'conv9', 'conv10': its trainer numbers the second convolution first
    trainer = make_trainer(net.collect_params(), 'adam', 0.01, ctxs, update_on_kvstore=False)
    resume_run(ctxs, 'adam', 'local', range(2), save=path)  # 'conv11', 'conv12': numbered in order
    arrays = mx.nd.load(path)
    meta = json.loads(arrays['meta'].asnumpy().tobytes().decode())
    # Rewritten as format 2 wrote it: keyed by the saving trainer's positions.
    position = {name: i for i, name in enumerate(['0.bias', '0.weight', '1.bias', '1.weight'])}
    state = meta['optimizer_state']
    old = {}
    for key, layout in state['layout'].items():
        new_key = 'i%d' % position[key[1:]]
        for name in [k for k in arrays if k.startswith('opt:' + key + '.')]:
            arrays['opt:' + new_key + name[len('opt:' + key):]] = arrays.pop(name)
        old[new_key] = layout
    state['layout'] = old
    state['index_update_counts'] = {d: {'i%d' % position[k[1:]]: n for k, n in c.items()}
                                    for d, c in state['index_update_counts'].items()}
    meta['format'] = 2
    arrays['meta'] = mx.nd.array(np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), dtype=np.uint8)
    del arrays['digest']
    mx.nd.save(path, arrays)
    with pytest.raises(UserError, match='optimizer state .* has shape .* its parameter'):
        load_checkpoint(path, net, trainer, ctx=ctxs)
