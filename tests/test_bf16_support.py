"""bfloat16 on CPUs without AVX-512: a probe, a one-line stop for --amp, and test skips.

MXNet 1.9.1's oneDNN has no bfloat16 convolution on an AVX2-only CPU (AMD Zen 3): a bf16
AMP network fails at its first forward with "could not create a primitive descriptor
iterator". Machines with avx512_bf16 (Zen 4) run it, so the other case is simulated by
making the probe's MXNet call raise the way oneDNN does.
"""
import os
import subprocess
import sys
import textwrap

import mxnet as mx
import numpy as np
import pytest

from conftest import skip_unless_cpu_bfloat16
from gluon_unet.machine import cpu as hardware
from gluon_unet.errors import UserError
from hang import HANG_SECONDS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))
ONEDNN_ERROR = ('MXNetError: Traceback (most recent call last):\n'
                '  File "../src/operator/nn/mkldnn/mkldnn_convolution.cc", line 115\n'
                'could not create a primitive descriptor iterator')
ZEN3_CPUINFO = ('processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n'
                'flags\t\t: fpu sse sse2 avx avx2 fma bmi2\n\n')


@pytest.fixture
def fresh_probe():
    """The probe's result is cached per process: forget it before and after the test."""
    hardware.cpu_bfloat16_support.cache_clear()
    yield
    hardware.cpu_bfloat16_support.cache_clear()


@pytest.fixture
def zen3(monkeypatch, tmp_path, fresh_probe):
    """Pretend to be an AVX2-only CPU: its /proc/cpuinfo, and oneDNN refusing bf16 convs."""
    cpuinfo = tmp_path / 'cpuinfo'
    cpuinfo.write_text(ZEN3_CPUINFO)
    monkeypatch.setattr(hardware, '_CPUINFO', str(cpuinfo))

    def refuse():
        raise mx.base.MXNetError(ONEDNN_ERROR)
    monkeypatch.setattr(hardware, '_bfloat16_probe', refuse)


def _bf16(x):
    return mx.nd.amp_cast(x, dtype=np.dtype([('bfloat16', np.uint16)]))


def test_probe_agrees_with_a_real_bfloat16_convolution(fresh_probe):
    ok, reason = hardware.cpu_bfloat16_support()
    assert '\n' not in reason and 'this CPU (' in reason, reason
    if not ok:
        pytest.skip(reason)
    # The probe said yes: a bfloat16 convolution with its backward really runs, and
    # computes what float32 computes (to bfloat16 precision).
    x = mx.nd.random.uniform(shape=(2, 3, 8, 8))
    w = mx.nd.random.uniform(shape=(5, 3, 3, 3))
    xb, wb = _bf16(x), _bf16(w)
    wb.attach_grad()
    with mx.autograd.record():
        y = mx.nd.Convolution(xb, wb, kernel=(3, 3), pad=(1, 1), num_filter=5, no_bias=True)
        loss = mx.nd.amp_cast(y, dtype='float32').sum()
    loss.backward()
    ref = mx.nd.Convolution(mx.nd.amp_cast(xb, dtype='float32'), mx.nd.amp_cast(wb, dtype='float32'),
                            kernel=(3, 3), pad=(1, 1), num_filter=5, no_bias=True).asnumpy()
    got = mx.nd.amp_cast(y, dtype='float32').asnumpy()
    assert np.abs(got - ref).max() <= 0.02 * np.abs(ref).max()
    assert np.isfinite(mx.nd.amp_cast(wb.grad, dtype='float32').asnumpy()).all()
    assert hardware.cpu_bfloat16_support() == (True, reason)  # cached, same answer


def test_a_refused_probe_leaves_nothing_on_stderr(monkeypatch, fresh_probe, capfd):
    # MXNet's C++ side logs the refusal to file descriptor 2 before raising (seen on Zen 3:
    # doctor printed '[05:33:00] ../src/operator/nn/mkldnn/mkldnn_convolution.cc:139: ...'
    # above its own one-line answer).
    def refuse_loudly():
        os.write(2, b'[05:33:00] ../src/operator/nn/mkldnn/mkldnn_convolution.cc:139: could not create\n')
        raise mx.base.MXNetError(ONEDNN_ERROR)
    monkeypatch.setattr(hardware, '_bfloat16_probe', refuse_loudly)
    ok, reason = hardware.cpu_bfloat16_support()
    os.write(2, b'after\n')  # and file descriptor 2 works again
    assert not ok and 'could not create a primitive descriptor iterator' in reason
    assert capfd.readouterr().err == 'after\n'


def test_probe_reports_the_cpu_when_onednn_refuses(zen3):
    ok, reason = hardware.cpu_bfloat16_support()
    assert not ok
    assert 'AMD EPYC 7B13' in reason and 'no AVX-512' in reason and 'bfloat16' in reason, reason
    assert 'could not create a primitive descriptor iterator' in reason and '\n' not in reason, reason


def test_probe_failure_is_simulated_at_the_mxnet_call(monkeypatch, fresh_probe):
    # The probe catches MXNetError only from MXNet itself: make the first MXNet
    # Convolution fail the way oneDNN does on Zen 3 and the probe must say no.
    real = mx.nd.Convolution

    def conv(*args, **kwargs):
        raise mx.base.MXNetError(ONEDNN_ERROR)
    monkeypatch.setattr(mx.nd, 'Convolution', conv)
    ok, reason = hardware.cpu_bfloat16_support()
    monkeypatch.setattr(mx.nd, 'Convolution', real)
    assert not ok and 'could not create a primitive descriptor iterator' in reason


def test_require_cpu_bfloat16_stops_with_one_line(zen3):
    with pytest.raises(UserError) as info:
        hardware.require_cpu_bfloat16()
    message = str(info.value)
    assert '\n' not in message and info.value.exit_code == 2
    assert message.startswith('--amp: bfloat16 mixed precision needs a CPU with AVX-512')
    assert 'AMD EPYC 7B13' in message and message.endswith('train without --amp (float32)')


def test_require_cpu_bfloat16_passes_where_the_probe_does(fresh_probe):
    ok, reason = hardware.cpu_bfloat16_support()
    if not ok:
        pytest.skip(reason)
    hardware.require_cpu_bfloat16()


def test_bf16_tests_skip_only_when_the_probe_says_no(zen3):
    with pytest.raises(pytest.skip.Exception) as info:
        skip_unless_cpu_bfloat16()
    assert 'AMD EPYC 7B13' in str(info.value) and 'bfloat16' in str(info.value)


def test_bf16_tests_run_where_the_probe_says_yes(monkeypatch, fresh_probe):
    monkeypatch.setattr(hardware, '_bfloat16_probe', lambda: None)
    skip_unless_cpu_bfloat16()  # no skip


def test_train_amp_on_a_cpu_without_bf16_stops_with_one_line_before_training(tmp_path):
    # amp.init() is process-global: run bin/train's entry point in a child process with
    # the probe made to fail as on Zen 3.
    script = textwrap.dedent('''
        import sys
        import mxnet as mx
        from gluon_unet.machine import cpu as hardware
        def refuse():
            raise mx.base.MXNetError(%r)
        hardware._bfloat16_probe = refuse
        from gluon_unet.cli import train_main
        sys.exit(train_main(sys.argv[1:]))
    ''' % ONEDNN_ERROR)
    out = tmp_path / 'run'
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    done = subprocess.run([sys.executable, '-c', script, '--amp', '--epochs', '1', '--synthetic-count', '16',
                           '--size', '32', '--width', '4', '--depth', '2', '--no-progress',
                           '--output', str(out)],
                          capture_output=True, text=True, timeout=HANG_SECONDS, cwd=str(tmp_path), env=env)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: --amp: bfloat16 mixed precision needs a CPU '
                                                   'with AVX-512'), done.stderr[-2000:]
    # Stopped before loading data or writing the run folder (bad input writes nothing).
    assert not (out / 'config.json').exists() and not (out / 'export').exists()
