"""AMX: turned on only where the CPU has it and Linux grants the tile state, never handed
to a child process without that permission, and the bfloat16 network keeps oneDNN's fast
kernels on it. The subprocess tests run on every CPU and assert what that CPU should do."""
import json
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from gluon_unet.machine import runtime
from gluon_unet.config import ModelConfig
from gluon_unet.machine.cpu import cpu_has_amx, request_amx_tiles
from gluon_unet.machine.onednn import Float32ReLU, OneDNNLayers, amx_float32_relus
from gluon_unet.model import Layers, UNet, build_model
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_amx_is_read_from_the_cpu_flags():
    assert cpu_has_amx({'avx512f', 'amx_tile', 'amx_bf16', 'amx_int8'})
    assert not cpu_has_amx({'avx512f', 'avx512_bf16'})  # Zen 4: bf16, no AMX
    assert not cpu_has_amx({'amx_tile'})
    assert not cpu_has_amx(set())


@pytest.fixture
def fresh_amx(monkeypatch):
    """enable_amx() as in a new process (it decides once), without the user's variable."""
    monkeypatch.setattr(runtime, '_amx', None)
    monkeypatch.delenv(runtime.ISA_VARIABLE, raising=False)
    asked = []
    monkeypatch.setattr('gluon_unet.machine.cpu.request_amx_tiles',
                        lambda: asked.append(True) or (True, 'granted (simulated)'))
    return asked


def test_a_cpu_without_amx_changes_nothing(fresh_amx, monkeypatch):
    monkeypatch.setattr('gluon_unet.machine.cpu.cpu_has_amx', lambda flags=None: False)
    used, reason = runtime.enable_amx()
    assert not used and reason == 'no AMX on this CPU'
    assert not fresh_amx, 'asked Linux for AMX tile state on a CPU without AMX'
    assert runtime.ISA_VARIABLE not in os.environ


def test_the_users_isa_choice_wins(fresh_amx, monkeypatch):
    monkeypatch.setattr('gluon_unet.machine.cpu.cpu_has_amx', lambda flags=None: True)
    monkeypatch.setenv(runtime.ISA_VARIABLE, 'AVX512_CORE_BF16')
    used, reason = runtime.enable_amx()
    assert not used and 'AVX512_CORE_BF16 (yours) leaves AMX off' in reason
    assert os.environ[runtime.ISA_VARIABLE] == 'AVX512_CORE_BF16' and not fresh_amx


def test_a_users_amx_choice_gets_the_permission_it_needs(fresh_amx, monkeypatch):
    # DNNL_MAX_CPU_ISA=AVX512_CORE_AMX alone made MXNet die with SIGILL (issue 50).
    monkeypatch.setenv(runtime.ISA_VARIABLE, 'avx512_core_amx')
    used, reason = runtime.enable_amx()
    assert used and fresh_amx == [True] and '(yours)' in reason
    assert os.environ[runtime.ISA_VARIABLE] == 'avx512_core_amx'


def test_amx_is_left_off_once_mxnet_is_loaded(fresh_amx, monkeypatch):
    # oneDNN may have read the variable already: setting it now could half-work.
    monkeypatch.setattr('gluon_unet.machine.cpu.cpu_has_amx', lambda flags=None: True)
    assert 'mxnet' in sys.modules
    used, reason = runtime.enable_amx()
    assert not used and 'loaded before' in reason and not fresh_amx
    assert runtime.ISA_VARIABLE not in os.environ


def _run(script, *args, **env):
    full = dict(os.environ, PYTHONPATH=ROOT, **env)
    for key in [k for k, v in env.items() if v is None]:
        full.pop(key)
    full.pop(runtime.ISA_VARIABLE, None) if runtime.ISA_VARIABLE not in env else None
    return subprocess.run([sys.executable, '-c', script, *args], env=full, capture_output=True, text=True,
                          timeout=HANG_SECONDS, cwd=ROOT)


def _amx_expected():
    return cpu_has_amx() and request_amx_tiles()[0]


def _conv_lines(stdout):
    """oneDNN's DNNL_VERBOSE lines of executed primitives, as (kind, implementation, prop)."""
    rows = []
    for line in stdout.splitlines():
        parts = line.split(',')
        if line.startswith('dnnl_verbose,exec') and len(parts) > 5:
            rows.append((parts[3], parts[4], parts[5]))
    return rows


START = r'''
import json, os, subprocess, sys
from gluon_unet.machine.runtime import apply_runtime_defaults, amx_state, configure_runtime, user_environ
apply_runtime_defaults()
used, reason = amx_state()
handed_on = user_environ().get('DNNL_MAX_CPU_ISA')  # what bin/launch and the export child get
from gluon_unet.machine.cpu import cpu_bfloat16_support
import mxnet as mx
configure_runtime(1)  # as fit() and bin/train --benchmark start
if cpu_bfloat16_support()[0]:
    # One bfloat16 convolution wide enough for oneDNN 2.4's AMX kernels.
    import numpy as np
    bf16 = np.dtype([('bfloat16', np.uint16)])  # how MXNet 1.9 names bfloat16 to numpy
    x = mx.nd.amp_cast(mx.nd.ones((2, 32, 16, 16)), dtype=bf16)
    w = mx.nd.amp_cast(mx.nd.ones((32, 32, 3, 3)), dtype=bf16)
    mx.nd.Convolution(x, w, kernel=(3, 3), pad=(1, 1), num_filter=32, no_bias=True).wait_to_read()
child = subprocess.run([sys.executable, '-c', 'import os; print(os.environ.get("DNNL_MAX_CPU_ISA"))'],
                       capture_output=True, text=True).stdout.strip()
print('RESULT ' + json.dumps({'used': used, 'reason': reason, 'env': os.environ.get('DNNL_MAX_CPU_ISA'),
                             'child': child, 'handed_on': handed_on}))
'''


def _result(out):
    assert out.returncode == 0, out.stderr[-3000:]
    line = [l for l in out.stdout.splitlines() if l.startswith('RESULT ')][-1]
    return json.loads(line[len('RESULT '):])


def test_amx_is_used_exactly_where_the_cpu_has_it_and_never_inherited():
    out = _run(START, DNNL_VERBOSE='1')
    result = _result(out)
    amx_kernels = [r for r in _conv_lines(out.stdout) if 'amx' in r[1]]
    if _amx_expected():
        assert result['used'], result['reason']
        assert amx_kernels, 'AMX turned on, but oneDNN ran no AMX kernel'
    else:
        assert not result['used'] and not amx_kernels
    # Never handed to gluon_unet's own child processes, and out of the environment once
    # oneDNN has read it: a child process (exec clears the tile permission) must not
    # inherit an AMX setting it would die of.
    assert result['handed_on'] is None
    assert result['env'] is None and result['child'] == 'None'


def test_a_users_amx_setting_no_longer_crashes():
    # Before: SIGILL (return code -4) at the first bfloat16 convolution on an AMX Xeon.
    out = _run(START, DNNL_MAX_CPU_ISA='AVX512_CORE_AMX')
    result = _result(out)
    assert result['used'] == _amx_expected()
    assert result['env'] == result['handed_on'] == 'AVX512_CORE_AMX'  # the user's own, left as it was


STEP = r'''
import sys
from gluon_unet.machine.runtime import apply_runtime_defaults, amx_state
apply_runtime_defaults()
from gluon_unet.training.benchmark import make_training_step, synthetic_batch, time_steps
from gluon_unet.config import ModelConfig, TrainConfig
import mxnet as mx
cfg = TrainConfig(model=ModelConfig(in_channels=1, width=int(sys.argv[1]), depth=2), size=32, batch_size=4,
                  amp=True, progress=False)
step = make_training_step(cfg, [mx.cpu()])
time_steps(step, synthetic_batch(cfg), 2)
print('RESULT {"used": %s}' % ('true' if amx_state()[0] else 'false'))
'''


@pytest.mark.usefixtures('requires_bf16')
@pytest.mark.parametrize('width', [8, 24])
def test_bfloat16_training_runs_no_reference_kernel(width):
    # On AMX, BatchNorm backward fell back to oneDNN's reference kernel (bnorm_ref: half
    # the step at width 16) until onednn.Float32ReLU; at widths of channels that are not
    # multiples of 32 beyond 16 (24: 24, 48, 96), until onednn.amx_float32_relus.
    out = _run(STEP, str(width), DNNL_VERBOSE='1')
    assert _result(out)['used'] == _amx_expected()
    rows = _conv_lines(out.stdout)
    assert any(kind == 'batch_normalization' and prop == 'backward' for kind, _, prop in rows)
    # Concatenating a bfloat16 map in the plain layout with one in an AMX layout runs
    # oneDNN's reference concat, a copy as fast as the reorder it saves (1.3-1.5 ms for
    # 16x16x128x128 twice on a 2-core Xeon), unlike the reference BatchNorm and convolution.
    slow = sorted({r for r in rows if 'ref' in r[1] and r[0] != 'concat'})
    assert not slow, slow


def _bfloat16(amx):
    """The layers of a bfloat16 network on oneDNN, on AMX or not."""
    return OneDNNLayers(Layers(amp=True), bfloat16=True, amx=amx)


def _narrow_relus(net):
    found = []

    def visit(block):
        if isinstance(block, Float32ReLU):
            found.append(block)
        for child in block._children.values():
            visit(child)
    visit(net)
    return found


def test_only_bfloat16_layers_on_amx_that_need_it_get_the_float32_relu():
    # Blocks of 8, 16, 32, 64 / 32, 16, 8 channels: the first ReLU of the four blocks of 8
    # and 16 channels (the second's gradient arrives in a layout BatchNorm handles).
    cfg = ModelConfig(in_channels=1, width=8, depth=3)
    assert len(_narrow_relus(build_model(cfg, _bfloat16(amx=True)))) == 4
    # 24, 48 / 96 / 48, 24: both ReLUs of every block but the bottom's, whose input has 48.
    assert len(_narrow_relus(build_model(ModelConfig(in_channels=1, width=24, depth=2), _bfloat16(amx=True)))) == 9
    assert [amx_float32_relus(i, c) for i, c in [(3, 16), (16, 32), (3, 32), (32, 64), (24, 48), (48, 96)]] == [
        (True, False), (False, False), (False, False), (False, False), (True, True), (True, False)]
    assert not _narrow_relus(build_model(cfg, _bfloat16(amx=False)))
    from gluon_unet.config import TrainConfig
    from gluon_unet.training.step import network_layers
    float32 = network_layers(TrainConfig(model=cfg), [mx.cpu(0)], amp_dtype=None)
    assert not _narrow_relus(build_model(cfg, float32))  # float32 does not use AMX
    assert not _narrow_relus(build_model(ModelConfig(in_channels=1, width=32, depth=2), _bfloat16(amx=True)))


def test_the_float32_relu_is_the_same_function_with_the_same_parameters():
    # Same outputs and gradients, same structural names: checkpoints move between
    # machines with and without AMX.
    from conftest import unet_twin
    x = mx.nd.array(np.random.RandomState(0).randn(2, 1, 16, 16))
    results, names = [], []
    for amx in (False, True):
        _, structural, y, dx = unet_twin(0, x, in_channels=1, width=4, depth=2, layers=OneDNNLayers(Layers(), amx=amx))
        names.append(structural)
        results.append((y, dx))
    assert len(_narrow_relus(UNet(in_channels=1, width=4, depth=2, layers=OneDNNLayers(Layers(), amx=True)))) == 5
    assert names[0] == names[1]
    for a, b in zip(*results):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_settle_takes_only_our_own_setting_out_of_the_environment(monkeypatch):
    monkeypatch.setitem(runtime._applied, runtime.ISA_VARIABLE, runtime.AMX_ISA)
    monkeypatch.setenv(runtime.ISA_VARIABLE, runtime.AMX_ISA)  # as enable_amx sets it
    runtime.settle_amx()
    assert runtime.ISA_VARIABLE not in os.environ
    monkeypatch.setenv(runtime.ISA_VARIABLE, 'AVX512_CORE_BF16')  # the user's: kept
    runtime.settle_amx()
    assert os.environ[runtime.ISA_VARIABLE] == 'AVX512_CORE_BF16'


def test_loading_an_export_settles_amx(tmp_path, monkeypatch):
    # bin/predict and bin/export never go through fit(): loading the model is where mxnet
    # has surely run, so the AMX setting leaves the environment there.
    from conftest import export_brightness_model
    from gluon_unet.inference import batched as inference
    calls = []
    monkeypatch.setattr(inference, 'settle_amx', lambda: calls.append(True))
    inference.load_exported(export_brightness_model(str(tmp_path / 'export')))
    assert calls == [True]



UPSAMPLED = r"""
import json
import mxnet as mx
import numpy as np
from mxnet.contrib import amp
amp.init(target_dtype='bfloat16')
from gluon_unet.machine.onednn import OneDNNLayers
from gluon_unet.model import Layers, UNet


def build(amx, cast, width=8):
    mx.random.seed(0)
    net = UNet(in_channels=1, width=width, depth=2, layers=OneDNNLayers(Layers(amp=True), bfloat16=True, amx=amx))
    for block in net.up:
        if hasattr(block.join, 'to_bfloat16'):
            block.join.to_bfloat16 = block.join.to_bfloat16 and cast
    net.initialize(mx.init.Xavier())
    return net


def concat_dtypes(net):
    inner = net(mx.sym.var('data')).get_internals()
    _, types, _ = inner.infer_type(data='float32')
    return [np.dtype(t).names[0] if np.dtype(t).names else str(np.dtype(t))
            for name, t in zip(inner.list_outputs(), types) if 'concat' in name]


def run(net):
    x = mx.nd.array(np.random.RandomState(0).randn(2, 1, 16, 16))
    net.hybridize()
    x.attach_grad()
    with mx.autograd.record():
        y = mx.nd.amp_cast(net(x), dtype='float32')
        loss = (y * y).sum()
    loss.backward()
    return [y.asnumpy().tolist(), x.grad.asnumpy().tolist(),
            [p.grad().asnumpy().tolist() for _, p in sorted(net.collect_params().items()) if p.grad_req != 'null']]


print('RESULT ' + json.dumps({
    'same': run(build(False, False)) == run(build(False, True)),
    'concat': {'before': concat_dtypes(build(False, False)), 'plain': concat_dtypes(build(False, True)),
               'amx': concat_dtypes(build(True, True)), 'amx24': concat_dtypes(build(True, True, 24))}}))
"""


@pytest.mark.usefixtures('requires_bf16')
def test_the_upsampled_map_is_concatenated_in_bfloat16_with_the_same_result():
    # The 1x1 up-convolution's output goes through reshapes and transposes, which MXNet's
    # bfloat16 lists run in float32; without the cast back, each level's concatenation was
    # float32 (twice the bytes, and a cast back for the next convolution). Its values are
    # bfloat16 already, so the cast changes no output and no gradient, bit for bit.
    result = _result(_run(UPSAMPLED, DNNL_MAX_CPU_ISA=None))
    assert result['same']
    assert result['concat'] == {'before': ['float32', 'float32'], 'plain': ['bfloat16', 'bfloat16'],
                                'amx': ['bfloat16', 'bfloat16'],
                                # skips of 24 and 48 channels are float32 under AMX
                                # (onednn.amx_float32_relus): those stay float32
                                'amx24': ['float32', 'float32']}


SKIP_SUMS = r"""
import json, sys
import mxnet as mx
import numpy as np
from mxnet.contrib import amp
amp.init(target_dtype='bfloat16')
from gluon_unet.machine.onednn import OneDNNLayers
from gluon_unet.machine.runtime import amx_state
from gluon_unet.model import Layers, UNet

mx.random.seed(0)
# 16 and 32 channels: blocked skips (at 8, oneDNN keeps one plain and add_n stays MXNet's)
net = UNet(in_channels=1, width=16, depth=2,
           layers=OneDNNLayers(Layers(amp=True), bfloat16=True, amx=amx_state()[0], training=True))
for block in net.up:
    block.join.skip_blocked = block.join.skip_blocked and sys.argv[1] == 'on'
net.initialize(mx.init.Xavier())
net.hybridize(static_alloc=True, static_shape=True)
x = mx.nd.array(np.random.RandomState(0).randn(4, 1, 32, 32))
x.attach_grad()
with mx.autograd.record():
    y = mx.nd.amp_cast(net(x), dtype='float32')
    loss = (y * y).sum()
loss.backward()
print('RESULT ' + json.dumps({
    'blocked': [block.join.skip_blocked for block in net.up],
    'values': [y.asnumpy().tolist(), x.grad.asnumpy().tolist(),
               [p.grad().asnumpy().tolist() for _, p in sorted(net.collect_params().items())
                if p.grad_req != 'null']]}))
"""


@pytest.mark.usefixtures('requires_bf16')
def test_bfloat16_skip_gradients_are_summed_by_onednn_with_the_same_result():
    # Each skip's two gradients (pooling's, blocked; the concatenation's, plain) were
    # summed by MXNet's element-wise bfloat16 kernel, 13x slower than oneDNN's sum, which
    # MXNet uses only when both are blocked. The 1x1 average pooling in front of the
    # concatenation is an identity whose gradient is blocked: oneDNN sums, same numbers.
    runs = {}
    for mode in ('on', 'off'):
        out = _run(SKIP_SUMS, mode, DNNL_VERBOSE='1')
        runs[mode] = (_result(out), sum(kind == 'sum' for kind, _, _ in _conv_lines(out.stdout)))
    assert runs['on'][0]['blocked'] == [True, True] and runs['off'][0]['blocked'] == [False, False]
    assert runs['on'][1] >= 2 > runs['off'][1], (runs['on'][1], runs['off'][1])
    (y_on, dx_on, grads_on), (y_off, dx_off, grads_off) = runs['on'][0]['values'], runs['off'][0]['values']
    assert len(grads_on) == len(grads_off) > 0
    for on, off in [(y_on, y_off), (dx_on, dx_off)] + list(zip(grads_on, grads_off)):
        np.testing.assert_array_equal(np.asarray(on), np.asarray(off))
