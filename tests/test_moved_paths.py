"""gluon_unet 0.2's module paths still import for one release (gluon_unet/_moved): each
gives the module it moved to - the same object, so patching one patches the other - with a
DeprecationWarning that names the new path; a module that was split gives both parts'
public names. The table is checked against the files, so neither can drift."""
import json
import os
import subprocess
import sys

from gluon_unet._moved import MOVED, SPLIT
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = r'''
import importlib, json, sys, warnings
from gluon_unet._moved import MOVED, SPLIT
found = {}
for old in sorted(MOVED) + sorted(SPLIT):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        module = importlib.import_module('gluon_unet.' + old)
    new = SPLIT.get(old) or (MOVED[old],)
    parts = [importlib.import_module(n) for n in new]
    public = all(getattr(module, k) is v for p in parts for k, v in vars(p).items() if not k.startswith('_'))
    found[old] = {'same': module is parts[0] if old in MOVED else public,
                  'warned': [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)
                             and str(w.message).startswith('gluon_unet.')]}  # not mxnet's own
from gluon_unet import engine
found['from_import'] = engine is importlib.import_module('gluon_unet.training.loop')
print(json.dumps(found))
'''


def test_every_old_path_is_its_new_module_with_a_warning():
    done = subprocess.run([sys.executable, '-c', CHECK], cwd=ROOT, capture_output=True, text=True, timeout=HANG_SECONDS,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found.pop('from_import') is True
    assert set(found) == set(MOVED) | set(SPLIT)
    for old, result in found.items():
        assert result['same'], old
        new = ' and '.join(SPLIT.get(old) or (MOVED[old],))
        assert result['warned'] == ['gluon_unet.%s moved to %s in gluon_unet 0.3.0; the old path goes in 0.4.0'
                                    % (old, new)], (old, result['warned'])


def test_the_table_names_every_file_and_only_modules_that_exist():
    folder = os.path.join(ROOT, 'gluon_unet', '_moved')
    files = {f[:-3] for f in os.listdir(folder) if f.endswith('.py') and f != '__init__.py'}
    assert files == set(MOVED) | set(SPLIT)
    for new in list(MOVED.values()) + [n for parts in SPLIT.values() for n in parts]:
        assert os.path.isfile(os.path.join(ROOT, *new.split('.')) + '.py'), new
    # An old name never shadows a module of today's layout.
    assert not files & {f[:-3] for f in os.listdir(os.path.join(ROOT, 'gluon_unet')) if f.endswith('.py')}
    assert not files & {d for d in os.listdir(os.path.join(ROOT, 'gluon_unet'))}
