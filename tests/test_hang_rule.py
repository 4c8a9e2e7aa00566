"""Every subprocess a test starts and waits for is guarded against a hang by the one bound
in tests/hang.py: a fixed 60 or 120 s guard fails a correct test on a busy CI machine, and
a missing one lets a hang block CI for its whole allowance."""
import ast
import glob
import os

import pytest

from hang import HANG_SECONDS

HERE = os.path.dirname(os.path.abspath(__file__))
# The calls that start a process and wait for it to end.
WAITS_FOR_A_PROCESS = {('subprocess', 'run'), ('subprocess', 'call'), ('subprocess', 'check_call'),
                       ('subprocess', 'check_output'), (None, 'run_in_own_group')}


def _waits(tree):
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = ((f.value.id if isinstance(f.value, ast.Name) else '?', f.attr) if isinstance(f, ast.Attribute)
                else (None, f.id) if isinstance(f, ast.Name) else None)
        if name in WAITS_FOR_A_PROCESS:
            yield node


def _problems(source):
    found = []
    for call in _waits(ast.parse(source)):
        own_group = isinstance(call.func, ast.Name)  # run_in_own_group: HANG_SECONDS unless told
        timeout = next((kw.value for kw in call.keywords if kw.arg == 'timeout'),
                       call.args[1] if own_group and len(call.args) > 1 else None)
        if timeout is None and not own_group and not any(kw.arg is None for kw in call.keywords):  # **kw may carry it
            found.append('line %d: no timeout' % call.lineno)
        elif timeout is not None and not (isinstance(timeout, ast.Name) and timeout.id == 'HANG_SECONDS'):
            found.append('line %d: timeout=%s, not HANG_SECONDS' % (call.lineno, ast.unparse(timeout)))
    return found


@pytest.mark.parametrize('path', sorted(glob.glob(os.path.join(HERE, '*.py'))), ids=os.path.basename)
def test_every_wait_for_a_subprocess_uses_the_one_hang_bound(path):
    with open(path) as f:
        assert _problems(f.read()) == []


def test_the_rule_sees_what_breaks_it():
    assert _problems('import subprocess\nsubprocess.run(["x"], timeout=120)\n') == [
        'line 2: timeout=120, not HANG_SECONDS']
    assert _problems('import subprocess\nsubprocess.check_output(["x"])\n') == ['line 2: no timeout']
    assert _problems('run_in_own_group(["x"], timeout=60)\n') == ['line 1: timeout=60, not HANG_SECONDS']
    assert _problems('run_in_own_group(["x"], 30)\n') == ['line 1: timeout=30, not HANG_SECONDS']
    assert _problems('run_in_own_group(["x"])\n') == []  # its default is HANG_SECONDS
    assert _problems('import subprocess\nsubprocess.run(["x"], timeout=HANG_SECONDS)\n') == []


def test_the_bound_is_a_hang_not_a_speed_limit():
    assert HANG_SECONDS >= 600
