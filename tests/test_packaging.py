"""Packaging that tells the truth (issue 14 item 5, issue 46): pyproject.toml says which
Pythons and dependencies, the sdist holds what installing and testing need, the wheel
built from it holds the package and its commands, setup.py and ``pip install .`` work,
constraints.txt pins CI."""
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

import gluon_unet
import gluon_unet.cli
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tomllib = pytest.importorskip('tomllib')  # Python 3.11+


def _pyproject():
    with open(os.path.join(ROOT, 'pyproject.toml'), 'rb') as f:
        return tomllib.load(f)


def _requirements(name):
    with open(os.path.join(ROOT, name)) as f:
        return [line.split('#')[0].strip() for line in f
                if line.split('#')[0].strip() and not line.startswith('-')]


def _names(requirements):
    return {re.split(r'[<>=!~\[ ;]', r, maxsplit=1)[0].lower() for r in requirements}


def test_pyproject_states_pythons_dependencies_extras_and_scripts():
    project = _pyproject()['project']
    # The core is the inference side (onnxruntime's environment: any Python >= 3.9, numpy 1
    # or 2); each MXNet extra adds what MXNet 1.9.1 needs (numpy < 1.24) and training's curves.
    assert project['requires-python'] == '>=3.9'
    assert sorted(project['dependencies']) == sorted(r for r in _requirements('requirements-onnx.txt')
                                                     if not r.startswith('onnxruntime'))
    extras = project['optional-dependencies']
    assert extras['cpu'] == ['mxnet==1.9.1', 'numpy<1.24', 'matplotlib>=3.5']
    assert extras['cu117'] == ['mxnet-cu117==1.9.1', 'numpy<1.24', 'matplotlib>=3.5']
    assert {'cu112', 'cu110', 'test', 'tensorboard', 'onnx', 'napari', 'bioimageio'} <= set(extras)
    assert extras['onnx-export'] == _requirements('requirements-onnx-export.txt')
    assert all(re.fullmatch(r'mxnet-cu\d+==1\.9\.1', extras[k][0]) and extras[k][1:] == extras['cpu'][1:]
               for k in extras if k.startswith('cu'))
    # The MXNet environment of the README (requirements.txt + requirements-base.txt) is the core
    # and the [cpu] extra: the same packages, numpy pinned below 1.24.
    assert _names(project['dependencies'] + extras['cpu']) == _names(_requirements('requirements-base.txt')
                                                                    + _requirements('requirements.txt'))
    assert 'numpy>=1.21,<1.24' in _requirements('requirements-base.txt')
    assert all(_names(extras[k]) >= {'onnxruntime'} for k in ('onnx', 'napari', 'bioimageio'))
    assert 'napari' in _names(extras['napari']) and 'bioimageio.core' in _names(extras['bioimageio'])
    assert project['entry-points']['napari.manifest'] == {'gluon_unet': 'gluon_unet.napari:napari.yaml'}
    scripts = project['scripts']
    assert scripts['gluon-unet'] == 'gluon_unet.cli:main'
    for command in ('train', 'predict', 'evaluate', 'export', 'launch', 'doctor', 'package'):
        module, _, function = scripts['gluon-unet-' + command].partition(':')
        assert module == 'gluon_unet.cli' and callable(getattr(gluon_unet.cli, function))
    assert _requirements('requirements.txt') == ['mxnet==1.9.1']


def test_constraints_pin_every_requirement_exactly():
    # CI installs with -c constraints.txt, so pip itself enforces the pins there; what a
    # user installs from the README without them may be newer, and must still pass.
    pins = dict(line.split('==') for line in _requirements('constraints.txt'))
    assert all(re.fullmatch(r'[0-9][0-9a-z.+]*', v) for v in pins.values()), pins
    wanted = set()
    for name in ('requirements.txt', 'requirements-base.txt', 'requirements-dev.txt'):
        for requirement in _requirements(name):
            wanted.add(re.split(r'[<>=!~\[ ]', requirement, maxsplit=1)[0].lower())
    assert wanted <= {k.lower() for k in pins}, sorted(wanted - {k.lower() for k in pins})
    with open(os.path.join(ROOT, '.ci', 'run')) as f:
        assert '-c constraints.txt' in f.read()


def test_horovod_is_pinned_and_ci_builds_it_as_the_file_says():
    # Horovod 0.28.1 is its last release; the build needs mxnet installed, no build
    # isolation and the framework flags: .ci/run must run the command the file documents.
    assert _requirements('requirements-horovod.txt') == ['horovod==0.28.1']
    with open(os.path.join(ROOT, 'requirements-horovod.txt')) as f:
        documented = f.read()
    with open(os.path.join(ROOT, '.ci', 'run')) as f:
        ci = f.read()
    command = '\n'.join(line for line in documented.splitlines() if line.startswith('#   '))  # indented: the command
    flags = re.findall(r'HOROVOD_WITH\w*=1', command)
    assert set(flags) == {'HOROVOD_WITH_MXNET=1', 'HOROVOD_WITH_GLOO=1', 'HOROVOD_WITHOUT_MPI=1',
                          'HOROVOD_WITHOUT_TENSORFLOW=1', 'HOROVOD_WITHOUT_PYTORCH=1'}
    assert all(flag in ci for flag in flags) and '--no-build-isolation' in ci
    assert ci.index('readme_commands.py') < ci.index('-r requirements-horovod.txt')  # mxnet first
    assert 'export GLUON_UNET_REQUIRE_HOROVOD=1' in ci  # its tests may not skip in CI
    pins = dict(line.split('==') for line in _requirements('constraints.txt'))
    assert pins['horovod'] == '0.28.1'


def _package_modules():
    """The package's files as a wheel names them: ``gluon_unet/cli/train.py``, ... - its
    modules and its data (recipes, the napari manifest, the shipped models with their cards,
    the lists of known ids and licences)."""
    found = []
    for folder, dirs, files in os.walk(os.path.join(ROOT, 'gluon_unet')):
        dirs[:] = [d for d in dirs if d != '__pycache__']
        found += [os.path.relpath(os.path.join(folder, f), ROOT).replace(os.sep, '/') for f in files
                  if f.endswith(('.py', '.json', '.yaml', '.txt', '.params', '.onnx', '.md'))]
    return sorted(found)


@pytest.mark.skipif(subprocess.run([sys.executable, '-c', 'import build'], capture_output=True,
                                   timeout=HANG_SECONDS).returncode,
                    reason='needs the build package (pip install build)')
def test_sdist_and_the_wheel_built_from_it_hold_what_installing_needs(tmp_path):
    # python -m build makes the sdist, then the wheel from the unpacked sdist: a file the
    # sdist leaves out is missing from the wheel too.
    done = subprocess.run([sys.executable, '-m', 'build', '--no-isolation', '--outdir', str(tmp_path), ROOT],
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    path = tmp_path / ('gluon_unet-%s.tar.gz' % gluon_unet.__version__)
    with tarfile.open(path) as tar:
        names = {n.split('/', 1)[1] for n in tar.getnames() if '/' in n}
        top = 'gluon_unet-%s/' % gluon_unet.__version__
        pkg_info = tar.extractfile(top + 'PKG-INFO').read().decode()
        requires = tar.extractfile(top + 'gluon_unet.egg-info/requires.txt').read().decode()
    for needed in ('pyproject.toml', 'setup.py', 'README.md', 'requirements-base.txt', 'requirements.txt',
                   'constraints.txt', 'gluon_unet/__main__.py', 'gluon_unet/cli/doctor.py',
                   'gluon_unet/data/io.py', 'bin/train', 'tests/conftest.py', 'pytest.ini',
                   # the recipes (package data), what the docs tests read and the scripts tests import
                   'gluon_unet/recipes/dsb2018.json', 'docs/reference/cli.md', 'gluon_unet/cli/reference.py',
                   'experiments/dsb2018/dsb_split.py', 'benchmarks/bench_train.py', 'gluon_unet/napari/napari.yaml',
                   # the shipped model: bin/predict --model nuclei from an installed package
                   'gluon_unet/models/nuclei/model-0000.params', 'gluon_unet/models/nuclei/model.onnx'):
        assert needed in names, needed
    assert not any('__pycache__' in n or n.endswith('.pyc') for n in names)
    assert 'Requires-Python: >=3.9' in pkg_info
    # requires.txt: the core requirements, then one [extra] section each; setuptools sorts
    # the lines of a section in some versions and not in others, so they are compared as sets.
    sections, name = {}, ''
    for line in requires.splitlines():
        if line.startswith('['):
            name = line.strip('[]')
        elif line:
            sections.setdefault(name, set()).add(line)
    assert 'numpy>=1.21' in sections[''] and not any(r.startswith('mxnet') for r in sections[''])
    assert {'mxnet-cu117==1.9.1', 'numpy<1.24'} <= sections['cu117']
    assert {'mxnet==1.9.1', 'numpy<1.24'} <= sections['cpu']
    # The wheel: every module and recipe of the package, nothing else, and the commands.
    wheel = tmp_path / ('gluon_unet-%s-py3-none-any.whl' % gluon_unet.__version__)
    with zipfile.ZipFile(wheel) as z:
        files = z.namelist()
        info = 'gluon_unet-%s.dist-info/' % gluon_unet.__version__
        entry_points = z.read(info + 'entry_points.txt').decode()
    assert sorted(f for f in files if not f.startswith(info)) == _package_modules()
    scripts = _pyproject()['project']['scripts']
    groups, group = {}, None
    for line in entry_points.splitlines():
        if line.startswith('['):
            group = line.strip('[]')
        elif ' = ' in line:
            groups.setdefault(group, []).append(line.split(' = '))
    assert sorted(groups['console_scripts']) == sorted([name, target] for name, target in scripts.items())
    assert groups['napari.manifest'] == [['gluon_unet', 'gluon_unet.napari:napari.yaml']]  # the plugin's manifest


def test_pip_install_dot_installs_the_package_and_its_commands(tmp_path):
    # What a user's "pip install ." does, in a clean copy of the files it reads (pip builds
    # in the tree it is given), without the dependencies (this Python has them): the
    # gluon-unet command answers from the installed files, outside any checkout.
    tree = tmp_path / 'tree'
    shutil.copytree(os.path.join(ROOT, 'gluon_unet'), str(tree / 'gluon_unet'),
                    ignore=shutil.ignore_patterns('__pycache__'))
    for name in ('pyproject.toml', 'setup.py', 'MANIFEST.in', 'README.md'):
        shutil.copy(os.path.join(ROOT, name), str(tree / name))
    target = tmp_path / 'installed'
    done = subprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet', '--no-deps', '--no-build-isolation',
                           '--no-index', '--target', str(target), str(tree)], capture_output=True, text=True,
                          timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    env = dict(os.environ, PYTHONPATH=str(target))
    version = subprocess.run([str(target / 'bin' / 'gluon-unet'), '--version'], capture_output=True, text=True,
                             env=env, cwd=str(tmp_path), timeout=HANG_SECONDS)
    assert version.returncode == 0 and version.stdout.strip() == gluon_unet.version_string(), version.stderr
    where = subprocess.run([sys.executable, '-c', 'import gluon_unet.cli, gluon_unet.recipes as r; '
                            'print(gluon_unet.cli.__file__); print(r.path("dsb2018"))'],
                           capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=HANG_SECONDS)
    module, recipe = where.stdout.split()
    assert module.startswith(str(target)) and recipe.startswith(str(target)) and os.path.isfile(recipe), where


def test_the_recipes_are_package_data(tmp_path):
    # build_py lays out what a wheel (and so pip install .) installs: --config NAME must
    # find its recipe there, not only in a checkout.
    done = subprocess.run([sys.executable, 'setup.py', '-q', 'build_py', '-d', str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    shipped = sorted(p.name for p in (tmp_path / 'gluon_unet' / 'recipes').glob('*.json'))
    from gluon_unet import recipes
    assert shipped == sorted(name + '.json' for name in recipes.names()) and 'dsb2018.json' in shipped
