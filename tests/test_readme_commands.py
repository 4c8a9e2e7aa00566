"""The README's quick-start demo and the multi-node guide's loopback command, run as
written (plus flags that make them tiny), so the documents cannot drift from what the code
does.

The commands are read out of README.md and docs/how-to/multi-node.md, not copied here: if
a document changes them, these tests run the new ones; if it no longer has them, the
tests say so.
"""
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from conftest import pids_with
from hang import HANG_SECONDS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))
README = os.path.join(ROOT, 'README.md')
MULTI_NODE = os.path.join(ROOT, 'docs', 'how-to', 'multi-node.md')


def _section(title, path=README):
    """The text of the document's ``## <title>`` section."""
    with open(path) as f:
        text = f.read()
    match = re.search(r'^## %s[^\n]*\n(.*?)(?=^##+ |\Z)' % re.escape(title), text, re.M | re.S)
    if not match:
        pytest.fail('%s has no "## %s" section any more: update %s'
                    % (os.path.relpath(path, ROOT), title, __file__))
    return match.group(1)


def _shell_commands(section):
    """Commands of the section's ```bash blocks: comments dropped, continuation lines
    joined, ``a && b`` split in two."""
    commands = []
    for block in re.findall(r'^```bash\n(.*?)^```', section, re.M | re.S):
        for line in block.replace('\\\n', ' ').splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index('&&') if '&&' in words else len(words)
                commands.append(words[:cut])
                words = words[cut + 1:]
    return [c for c in commands if c]


def _find(title, wanted, describe, path=README):
    found = [c for c in _shell_commands(_section(title, path)) if wanted(c)]
    if len(found) != 1:
        pytest.fail('%s "## %s": expected one %s, found %s; update %s'
                    % (os.path.relpath(path, ROOT), title, describe, [' '.join(c) for c in found], __file__))
    return found[0]


def _run(argv, marker):
    """Run ``argv`` from the repository root with ``python`` on PATH being this
    interpreter; stop it (and every process carrying ``marker``) after HANG_SECONDS."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get('PATH', ''))
    env = {k: v for k, v in env.items() if not k.startswith('DMLC_')}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # bin/launch stops its job on SIGTERM ...
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
        pytest.fail('%s: timed out after %ds:\n%s'
                    % (' '.join(argv), HANG_SECONDS, out.decode(errors='replace')[-3000:]))
    finally:
        # ... whose processes run in sessions of their own: none may outlive the test.
        deadline = time.time() + 10
        while pids_with(marker) and time.time() < deadline:
            time.sleep(0.2)
        for pid in pids_with(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return proc.returncode, out.decode(errors='replace')


def _tiny(output):
    return ['--epochs', '1', '--synthetic-count', '32', '--output', output, '--no-progress']


def _assert_exported_and_predicted(output, code, log, argv):
    assert code == 0, '%s exited with %s:\n%s' % (' '.join(argv), code, log[-4000:])
    assert os.path.isfile(os.path.join(output, 'export', 'model-symbol.json')), log[-3000:]
    predictions = os.path.join(output, 'predictions')
    assert os.path.isdir(predictions) and os.listdir(predictions), log[-3000:]


def test_quick_start_demo_runs_as_written(tmp_path):
    command = _find('Quick start', lambda c: c[1:2] == ['bin/train'],
                    'demo command "python bin/train"')
    assert command == ['python', 'bin/train'], 'the quick start demo should need no flags: %s' % command
    output = str(tmp_path / 'demo')
    argv = command + _tiny(output)
    code, log = _run(argv, output)
    _assert_exported_and_predicted(output, code, log, argv)
    # Each line once: a library call logging through the root logger (MXNet's ONNX converter,
    # amp.init) configures it, and every later line was printed twice.
    assert log.count('demo: segmented') == 1 and 'INFO:gluon_unet' not in log, log[-2000:]


def test_several_machines_loopback_command_runs_as_written(tmp_path):
    command = _find('One machine, several processes',
                    lambda c: c[:1] == ['bin/launch'] and '--launcher' not in c and 'bin/train' in c,
                    'loopback command "bin/launch -n 2 -s 1 -- bin/train --kvstore dist_sync ..." '
                    '(bin/launch without --launcher ssh)', path=MULTI_NODE)
    assert command[command.index('bin/train') - 1] == '--', command
    output = str(tmp_path / 'dist')
    argv = command + _tiny(output)
    code, log = _run(argv, output)
    _assert_exported_and_predicted(output, code, log, argv)


def test_ci_runs_the_quick_start_commands_it_reads_from_the_readme():
    # .ci/run runs, in a fresh .venv, exactly the lines .ci/readme_commands.py prints: the
    # quick start's two commands (install and demo; install the test tools and test).
    done = subprocess.run([sys.executable, os.path.join(ROOT, '.ci', 'readme_commands.py')], capture_output=True,
                          text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith('python3 -m venv .venv && ') and lines[0].endswith('python bin/train')
    assert lines[1].endswith('pip install -r requirements-dev.txt && python -m pytest -q')
    assert [shlex.split(c) for line in lines for c in line.split(' && ')] == [
        c for c in _shell_commands(_section('Quick start'))]
    with open(os.path.join(ROOT, '.ci', 'run')) as f:
        ci = f.read()
    assert 'python3 .ci/readme_commands.py' in ci and 'bash -c "$command"' in ci
