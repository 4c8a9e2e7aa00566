"""A missing dependency is one line naming what to install, and Ctrl-C while a command
is still importing is one line and exit 130 (issue 70, rule 1). Each runs a real
``bin/*`` in a subprocess whose imports of one module fail (a ``sys.meta_path`` hook)."""
import os
import subprocess
import sys

import pytest

from gluon_unet.errors import REQUIRED
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Run ``bin/<command>`` with imports of the module ``BLOCK`` raising ``RAISE``.
WRAPPER = '''
import runpy, sys
block, kind, script = sys.argv[1:4]
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == block:
            if kind == 'interrupt':
                raise KeyboardInterrupt
            raise ModuleNotFoundError('No module named %r' % name, name=name)
sys.meta_path.insert(0, Hook())
sys.argv = sys.argv[3:]
runpy.run_path(script, run_name='__main__')
'''


def _run(block, kind, command, *args):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    proc = subprocess.run([sys.executable, '-c', WRAPPER, block, kind, os.path.join(ROOT, 'bin', command)] + list(args),
                          capture_output=True, text=True, timeout=HANG_SECONDS, env=env, cwd=ROOT)
    return proc.returncode, [line for line in proc.stderr.splitlines() if line.strip()]


#: (command, args, a module it imports inside its entry point; --help needs none)
CASES = [('predict', ['--model', 'm', '--input', 'i', '--output', 'o'], 'cv2'), ('train', ['--epochs', '1'], 'mxnet')]


@pytest.mark.parametrize('command, args, module', CASES, ids=['%s-%s' % (c[0], c[2]) for c in CASES])
def test_a_missing_dependency_is_one_line_naming_what_to_install(command, args, module):
    code, err = _run(module, 'missing', command, *args)
    assert code != 0 and len(err) == 1 and 'Traceback' not in err[0], err
    assert 'bug' not in err[0] and ('pip install %s' % REQUIRED[module] in err[0] if module in REQUIRED
                                    else 'pip install' in err[0]), err


@pytest.mark.parametrize('command, args, module', CASES, ids=['%s-%s' % (c[0], c[2]) for c in CASES])
def test_ctrl_c_while_importing_is_one_line_and_exit_130(command, args, module):
    code, err = _run(module, 'interrupt', command, *args)
    assert code == 130 and err == ['interrupted'], (code, err)


#: The commands whose --help needs nothing but the standard library and gluon_unet itself:
#: all of them (their config classes live in numpy-free modules, e.g. config.py, inference/configs.py).
STDLIB_HELP = ['train', 'launch', 'doctor', 'models', 'predict', 'evaluate', 'export', 'package']
HEAVY = ('numpy', 'cv2', 'mxnet', 'skimage', 'scipy', 'tifffile', 'tqdm', 'matplotlib')


@pytest.mark.parametrize('command', STDLIB_HELP)
def test_help_needs_only_the_standard_library(command):
    wrapper = WRAPPER.replace("if name.split('.')[0] == block:", "if name.split('.')[0] in block.split(','):")
    # python -m gluon_unet COMMAND --help, with every third-party import failing
    wrapper = wrapper.replace("runpy.run_path(script, run_name='__main__')",
                              "runpy.run_module('gluon_unet', run_name='__main__', alter_sys=True)")
    proc = subprocess.run([sys.executable, '-c', wrapper, ','.join(HEAVY), 'missing', 'gluon_unet', command, '--help'],
                          capture_output=True, text=True, timeout=HANG_SECONDS, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0 and proc.stdout.startswith('usage: '), proc.stderr[-2000:]
