"""The package's joints (issue 15): no import cycles, nothing changed by ``import gluon_unet``,
and logging that touches only its own handlers."""
import ast
import logging
import os
import subprocess
import sys

import pytest

from gluon_unet import reporting

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
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == str(len(names)), done.stderr[-2000:]


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
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        lines = [l for l in done.stderr.splitlines() if 'hello' in l]
        assert len(lines) == 1 and lines[0].startswith(prefix), done.stderr
        assert (tmp_path / mode / 'train.log').read_text().count('hello') == 1
