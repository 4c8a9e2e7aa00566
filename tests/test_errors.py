"""errors.py: the one-line parser every CLI uses and the MXNet-message helper (issue 15)."""
import mxnet as mx
import pytest

from gluon_unet.cli.common import OneLineParser
from gluon_unet.cli.common import reports_errors
from gluon_unet.errors import UserError, mxnet_message
from hang import HANG_SECONDS


def test_one_line_parser_usage_error_is_one_line_exit_2(capsys):
    parser = OneLineParser(prog='tool')
    parser.add_argument('--n', type=int)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(['--n', 'x'])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.count('\n') == 1 and err.startswith('tool: error: ') and '--n' in err


def test_reports_errors_turns_user_error_into_one_line(capsys):
    @reports_errors
    def main(argv=None):
        raise UserError('--data x: no such folder', exit_code=3)

    assert main([]) == 3
    assert capsys.readouterr().err == 'error: --data x: no such folder\n'


def test_mxnet_message_of_a_real_mxnet_error():
    with pytest.raises(mx.MXNetError) as info:
        (mx.nd.ones((2, 3)) + mx.nd.ones((4, 5))).wait_to_read()
    assert str(info.value).startswith('Traceback')  # what the helper is for
    message = mxnet_message(info.value)
    assert 'could not be broadcast' in message and '[2,3]' in message
    assert not message.startswith(('MXNetError', 'Traceback', 'File'))


@pytest.mark.parametrize('text, expected', [
    # MXNet 1.9: traceback first, the cause last.
    ('MXNetError: Traceback (most recent call last):\n  File "../src/x.cc", line 115\n'
     'could not create a primitive descriptor iterator', 'could not create a primitive descriptor iterator'),
    ('Traceback (most recent call last):\n  File "../src/y.cc", line 67\nMXNetError: Check failed: l == 1',
     'Check failed: l == 1'),
    # Older builds: the cause first, then the stack.
    ('[12:00:00] src/io.cc:40: Check failed: fi\nStack trace:\n  [bt] (0) libmxnet.so(+0x1)\n  [bt] (1) x',
     '[12:00:00] src/io.cc:40: Check failed: fi'),
    ('plain message', 'plain message'),
])
def test_mxnet_message_picks_the_cause(text, expected):
    assert mxnet_message(mx.MXNetError(text)) == expected


def test_mxnet_message_limit_and_empty():
    assert mxnet_message(ValueError('x' * 500)) == 'x' * 200
    assert mxnet_message(ValueError('x' * 500), limit=120) == 'x' * 120
    assert mxnet_message(KeyError()) == 'KeyError'
    assert mxnet_message(mx.MXNetError('Traceback (most recent call last):\n  File "a", line 1')) == 'MXNetError'


# The CUDA wheels of mxnet hold libmxnet.so, not the CUDA runtime, cuDNN or NCCL it loads
# (tools/pip/setup.py; apache/mxnet#20279): installed without them, `import mxnet` raises
# OSError from ctypes in mxnet/base.py. A stand-in mxnet package does exactly that here.
FAKE_MXNET_BASE = '''
import ctypes
_LIB = ctypes.CDLL('%s', ctypes.RTLD_LOCAL)
'''


@pytest.mark.parametrize('library, provider', [
    ('libcudnn.so.8', 'cuDNN 8 for CUDA 11: the CUDA wheels of mxnet do not ship it'),
    ('libnvrtc.so.11.2', 'the CUDA 11 runtime libraries (11.7 for mxnet-cu117)'),
    ('libcuda.so.1', 'the NVIDIA driver, which a CUDA build of mxnet needs even to import'),
])
def test_a_library_mxnet_cannot_load_is_one_line_naming_it(tmp_path, library, provider):
    import os
    import subprocess
    import sys
    fake = tmp_path / 'site' / 'mxnet'
    fake.mkdir(parents=True)
    (fake / '__init__.py').write_text('from .base import _LIB\n')
    (fake / 'base.py').write_text(FAKE_MXNET_BASE % library)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / 'site'), root]))
    done = subprocess.run([sys.executable, '-m', 'gluon_unet', 'train', '--width', '4', '--depth', '2',
                           '--size', '32', '--output', str(tmp_path / 'run')],
                          capture_output=True, text=True, timeout=HANG_SECONDS, env=env, cwd=str(tmp_path))
    assert done.returncode == 1 and done.stderr.count('\n') == 1, done.stderr
    assert done.stderr.startswith('error: mxnet cannot load: %s is missing; it comes with %s' % (library, provider))


def test_other_os_errors_are_not_taken_for_a_missing_library(capsys):
    @reports_errors
    def main(argv=None):
        raise OSError('libfoo.so.1: cannot open shared object file')  # not raised inside mxnet

    assert main([]) == 1
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'mxnet cannot load' not in err, err
    assert err.startswith('error: main failed: OSError: libfoo.so.1: cannot open shared object file; this is a bug')
