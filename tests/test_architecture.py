"""The package's joints: no import cycles, imports that run down the layers (one folder
each: cli -> training -> inference -> shared -> machine -> base), argument parsing in the
CLI package only, modules and functions of a readable size, scripts that use public
names, nothing changed by ``import gluon_unet``, and logging that touches only its own
handlers."""
import ast
import logging
import os
import subprocess
import sys

import pytest

from gluon_unet import reporting
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, 'gluon_unet')


def _modules():
    """{'gluon_unet.x.y': path} for every module of the package."""
    found = {}
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if not d.startswith(('_', '.'))]
        for name in files:
            if name.endswith('.py'):
                rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].split(os.sep)
                if rel[-1] == '__init__':
                    rel = rel[:-1]
                found['.'.join(rel)] = os.path.join(folder, name)
    return found


def _resolve(module, is_package, level, name):
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name
    parts = module.split('.') if is_package else module.split('.')[:-1]
    base = parts[:len(parts) - (level - 1)]
    return '.'.join(base + ([name] if name else []))


def _import_graph(function_level=False):
    """module -> the package modules it imports at module level (``function_level``: the
    imports inside functions instead)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        top = set(tree.body)
        is_package = path.endswith('__init__.py')
        deps = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if (node in top) == function_level:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(module, is_package, node.level, node.module)
                # "from . import x" names a submodule; "from .x import y" the module x.
                targets = [base + '.' + a.name if base + '.' + a.name in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # gluon_unet.data.io.X -> the module
                    target = target.rpartition('.')[0]
                if target and target != module:
                    deps.add(target)
        graph[module] = deps
    return graph


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(node, path):
        state[node] = 'open'
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 'open':
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[node] = 'done'
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_module_level_imports_have_no_cycle():
    graph = _import_graph()
    assert 'gluon_unet.errors' in graph and len(graph) > 20
    # A package __init__ imports its submodules and they import siblings through it:
    # "gluon_unet.data.x -> gluon_unet.data" is not a cycle Python trips on.
    for module in graph:
        graph[module] = {d for d in graph[module] if not module.startswith(d + '.')}
    assert _cycle(graph) is None, ' -> '.join(_cycle(graph))


def test_function_level_imports_do_not_hide_a_cycle():
    # Imports inside functions are there to keep mxnet from loading (cli, devices) or to
    # load something optional late, never to break a cycle: with them added to the
    # module-level graph there is still none.
    graph = _import_graph()
    for module, deps in _import_graph(function_level=True).items():
        graph[module] |= deps
    for module in graph:
        graph[module] = {d for d in graph[module] if not module.startswith(d + '.')}
    assert _cycle(graph) is None, ' -> '.join(_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert _cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
    assert _cycle({'a': {'b'}, 'b': set()}) is None


def test_every_module_imports_in_a_fresh_interpreter():
    code = ('import importlib, os, sys\n'
            'before = dict(os.environ)\n'
            'import gluon_unet\n'
            'assert dict(os.environ) == before, "import gluon_unet changed os.environ"\n'
            'assert "mxnet" not in sys.modules, "import gluon_unet loaded mxnet"\n'
            'for name in sys.argv[1:]:\n'
            '    importlib.import_module(name)\n'
            'print(len(sys.argv) - 1)\n')
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop('OMP_NUM_THREADS', None)  # conftest's; the check is that nothing sets it
    names = sorted(_modules())
    done = subprocess.run([sys.executable, '-c', code] + names, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0 and done.stdout.strip() == str(len(names)), done.stderr[-2000:]



# -- layers: the folders are the layers --------------------------------------------------------

#: From the top down: a module may import its own layer and the layers below it, never one
#: above. The command line runs training, which ends in a post-processing search and an
#: export (inference); both read the shared modules (the model, its config and checkpoint
#: format, data, metrics), which read the machine (hardware, devices, process knobs); the
#: base (errors, writes, logging, which files are ours) is under everything.
LAYERS = ('cli', 'training', 'inference', 'shared', 'machine', 'base')
#: A folder is one layer.
FOLDERS = {'cli': 'cli', 'training': 'training', 'inference': 'inference', 'data': 'shared', 'recipes': 'shared', 'models': 'shared',
           'machine': 'machine', 'napari': 'cli'}  # the napari plugin: an entry point, like the command line
#: The few modules at the top level, each with its layer ('' is the package itself: its
#: public names are imported on first use, so it imports nothing of the package).
TOP_LEVEL = {'__main__': 'cli', 'config': 'shared', 'model': 'shared', 'checkpoint': 'shared', 'metrics': 'shared',
             '': 'base', 'errors': 'base', 'utils': 'base', 'paths': 'base', 'outputs': 'base', 'reporting': 'base'}


def _layer(module):
    name = module[len('gluon_unet.'):] if module.startswith('gluon_unet.') else ''
    if '.' not in name and name in TOP_LEVEL:
        return TOP_LEVEL[name]
    return FOLDERS.get(name.split('.')[0])


def _reachable(graph, start):
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def _layer_violations(graph, layer_of):
    """``['gluon_unet.x (inference) reaches gluon_unet.y (training)', ...]``: each module
    that reaches, directly or not, a module of a layer above its own."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    found = []
    for module in sorted(graph):
        layer = layer_of(module)
        if layer not in rank:
            continue
        bad = sorted(d for d in _reachable(graph, module) if rank.get(layer_of(d), len(LAYERS)) < rank[layer])
        found += ['%s (%s) reaches %s (%s)' % (module, layer, d, layer_of(d)) for d in bad]
    return found


def test_every_module_is_in_a_layer_folder_or_named_at_the_top():
    missing = [m for m in _modules() if _layer(m) is None]
    assert not missing, 'modules in no layer (put them in a layer folder, or name a top-level one in TOP_LEVEL): %s' \
        % ', '.join(missing)
    assert set(FOLDERS.values()) | set(TOP_LEVEL.values()) == set(LAYERS)
    on_disk = {name for name in os.listdir(PACKAGE) if not name.startswith(('_', '.'))
               and os.path.isdir(os.path.join(PACKAGE, name))}
    assert on_disk == set(FOLDERS), 'a folder of gluon_unet/ with no layer, or a layer with no folder'


def test_imports_run_down_the_layers():
    # Function-level imports count too: they run as soon as the function does.
    graph = _import_graph()
    for module, deps in _import_graph(function_level=True).items():
        graph[module] |= deps
    assert not _layer_violations(graph, _layer), '\n'.join(_layer_violations(graph, _layer))


def test_the_layer_check_finds_an_arrow_the_wrong_way():
    layers = {'i': 'inference', 'j': 'inference', 't': 'training', 's': 'shared', 'm': 'machine'}
    graph = {'i': {'j'}, 'j': {'s', 't'}, 't': {'i'}, 's': {'m'}, 'm': set()}
    assert _layer_violations(graph, layers.get) == ['i (inference) reaches t (training)',
                                                    'j (inference) reaches t (training)']
    assert _layer_violations({'t': {'i', 's'}, 'i': {'s'}, 's': {'m'}, 'm': set()}, layers.get) == []
    assert _layer_violations({'m': {'s'}, 's': set()}, layers.get) == ['m (machine) reaches s (shared)']
    assert _layer('gluon_unet.training.loop') == 'training' and _layer('gluon_unet.data.io') == 'shared'
    assert _layer('gluon_unet.model') == 'shared' and _layer('gluon_unet') == 'base'
    assert _layer('gluon_unet.newmodule') is None


# -- only the CLI parses arguments --------------------------------------------------------------

def _argv_uses(tree):
    """Line numbers where a module imports argparse or reads ``sys.argv``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split('.')[0] == 'argparse' for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module == 'argparse' or (
                node.module == 'sys' and any(a.name == 'argv' for a in node.names))):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == 'argv' and isinstance(node.value, ast.Name) \
                and node.value.id == 'sys':
            lines.append(node.lineno)
    return lines


def test_only_the_cli_package_parses_arguments():
    # The library takes the values it uses; gluon_unet/cli/ turns command lines into configs.
    found = []
    for module, path in _modules().items():
        if module == 'gluon_unet.cli' or module.startswith('gluon_unet.cli.'):
            continue
        with open(path) as f:
            found += ['%s:%d' % (os.path.relpath(path, ROOT), n) for n in _argv_uses(ast.parse(f.read(), path))]
    assert not found, 'argparse or sys.argv outside gluon_unet/cli/: %s' % ', '.join(found)


def test_the_argument_check_sees_each_way_in():
    for source in ('import argparse', 'from argparse import ArgumentParser', 'import sys\nx = sys.argv[1:]',
                   'from sys import argv'):
        assert _argv_uses(ast.parse(source)), source
    assert not _argv_uses(ast.parse('import sys\nsys.exit(0)'))


# -- modules of a readable size ----------------------------------------------------------------

#: A module longer than this says why it is one module, in a docstring paragraph that
#: begins with REASON.
MAX_LINES = 500
REASON = 'Why one module:'


def test_no_module_is_long_without_saying_why():
    long = []
    for module, path in sorted(_modules().items()):
        with open(path) as f:
            text = f.read()
        docstring = ast.get_docstring(ast.parse(text, path)) or ''
        lines = text.count('\n')
        if lines > MAX_LINES and not any(p.startswith(REASON) for p in docstring.split('\n\n')):
            long.append('%s (%d lines)' % (os.path.relpath(path, ROOT), lines))
    assert not long, 'over %d lines with no "%s" paragraph in the docstring: %s' % (MAX_LINES, REASON,
                                                                                 ', '.join(long))


#: A function longer than this (its docstring and comments included) says why it is one
#: function, in a docstring paragraph that begins with FUNCTION_REASON.
MAX_FUNCTION_LINES = 80
FUNCTION_REASON = 'Why one function:'


def _long_functions(tree, path):
    """``['path:line name (N lines)', ...]``: functions over :data:`MAX_FUNCTION_LINES`
    whose docstring gives no reason."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            docstring = ast.get_docstring(node) or ''
            if lines > MAX_FUNCTION_LINES and not any(p.startswith(FUNCTION_REASON) for p in docstring.split('\n\n')):
                found.append('%s:%d %s (%d lines)' % (path, node.lineno, node.name, lines))
    return found


def test_no_function_is_long_without_saying_why():
    found = []
    for module, path in sorted(_modules().items()):
        with open(path) as f:
            found += _long_functions(ast.parse(f.read(), path), os.path.relpath(path, ROOT))
    assert not found, 'over %d lines with no "%s" paragraph in the docstring: %s' % (
        MAX_FUNCTION_LINES, FUNCTION_REASON, ', '.join(found))


def test_the_function_length_check_counts_lines():
    body = '\n'.join('    x = %d' % i for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(ast.parse('def f():\n' + body), 'm.py') == ['m.py:1 f (81 lines)']
    assert _long_functions(ast.parse('def f():\n' + body.split('\n', 1)[1]), 'm.py') == []
    reason = '    """Long.\n\n    %s it is a table."""\n' % FUNCTION_REASON
    assert _long_functions(ast.parse('def f():\n' + reason + body), 'm.py') == []


# -- scripts use the public API ------------------------------------------------------------------

def _private_uses(tree):
    """``[(line, name), ...]``: names with a leading underscore that a script takes from
    gluon_unet - imported (``from gluon_unet.x import _y``, ``gluon_unet._x``) or read off
    a gluon_unet module it imported (``x._y``)."""
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or '').split('.')[0] == 'gluon_unet':
            parts = node.module.split('.')
            found += [(node.lineno, node.module) for p in parts if p.startswith('_') and not p.startswith('__')]
            for alias in node.names:
                if alias.name.startswith('_'):
                    found.append((node.lineno, alias.name))
                modules.add(alias.asname or alias.name)  # may be a module (from gluon_unet import x)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split('.')[0] == 'gluon_unet':
                    found += [(node.lineno, alias.name) for p in alias.name.split('.') if p.startswith('_')]
                    modules.add(alias.asname or alias.name.split('.')[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith('_') and not node.attr.startswith('__'):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append((node.lineno, node.attr))
    return found


def test_benchmarks_and_experiments_use_only_public_names():
    found = []
    for folder in ('benchmarks', 'experiments'):
        for parent, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in sorted(files):
                if name.endswith('.py'):
                    path = os.path.join(parent, name)
                    with open(path) as f:
                        tree = ast.parse(f.read(), path)
                    found += ['%s:%d %s' % (os.path.relpath(path, ROOT), line, what)
                              for line, what in _private_uses(tree)]
    assert not found, 'private gluon_unet names in scripts (give them a public name): %s' % ', '.join(found)


def test_the_private_name_check_sees_each_way_in():
    for source in ('from gluon_unet.inference.export import _resolve_run', 'from gluon_unet import cache\ncache._intact = 1',
                   'import gluon_unet.data.cache as c\nc._intact()', 'from gluon_unet._x import y'):
        assert _private_uses(ast.parse(source)), source
    assert not _private_uses(ast.parse('from gluon_unet import cache\nimport os\nos._exit(0)\ncache.intact()'))

# -- logging ----------------------------------------------------------------------------------

@pytest.fixture
def package_logger():
    """The package logger, restored after the test (handlers, level, propagate)."""
    log = logging.getLogger(reporting.LOGGER_NAME)
    saved = list(log.handlers), log.level, log.propagate
    yield log
    for h in [h for h in log.handlers if h not in saved[0]]:
        log.removeHandler(h)
        h.close()
    log.setLevel(saved[1])
    log.propagate = saved[2]


def test_setup_logging_replaces_only_its_own_handlers(tmp_path, package_logger):
    theirs = logging.NullHandler()
    package_logger.addHandler(theirs)
    log = reporting.setup_logging(str(tmp_path / 'a'))
    assert log is package_logger and theirs in log.handlers and log.propagate
    log = reporting.setup_logging(str(tmp_path / 'b'))  # fit() calls it twice
    log.info('hello')
    assert theirs in log.handlers
    files = [h for h in log.handlers if isinstance(h, logging.FileHandler)]
    assert len(files) == 1, log.handlers  # the first call's file handler is gone: no duplicate lines
    assert (tmp_path / 'b' / 'train.log').read_text().count('hello') == 1
    assert 'hello' not in (tmp_path / 'a' / 'train.log').read_text()
    reporting.setup_logging(None, verbose=False)
    assert theirs in log.handlers and not any(isinstance(h, logging.FileHandler) for h in log.handlers)


def test_setup_logging_prints_each_line_once(tmp_path):
    # Stand-alone (no root handlers): its own stderr handler; under an application's
    # logging.basicConfig: through the application's handler only, never twice.
    code = ('import logging, sys\n'
            'from gluon_unet.reporting import setup_logging\n'
            'if sys.argv[1] == "configured":\n'
            '    logging.basicConfig(format="app %(message)s", level=logging.WARNING)\n'
            'log = setup_logging(sys.argv[2])\n'
            'log = setup_logging(sys.argv[2])\n'
            'log.info("hello")\n')
    env = dict(os.environ, PYTHONPATH=ROOT)
    for mode, prefix in (('alone', ''), ('configured', 'app ')):
        done = subprocess.run([sys.executable, '-c', code, mode, str(tmp_path / mode)], env=env,
                              capture_output=True, text=True, timeout=HANG_SECONDS)
        assert done.returncode == 0, done.stderr
        lines = [l for l in done.stderr.splitlines() if 'hello' in l]
        assert len(lines) == 1 and lines[0].startswith(prefix), done.stderr
        assert (tmp_path / mode / 'train.log').read_text().count('hello') == 1
