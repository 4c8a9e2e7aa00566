"""A reader that closes standard output early (``bin/evaluate ... | head``) stops a command
quietly, as a pipeline's writer: exit 141 (128 + SIGPIPE), one line on stderr saying so,
no traceback, no "this is a bug" - and what it wrote to files is written.

The cases come from the command table (every command's ``--version``, the overview), each
with Python's stdout buffered (a pipe's default: the write fails at the last flush) and
unbuffered (``PYTHONUNBUFFERED=1``: it fails at the print), plus ``bin/evaluate``'s table,
long enough to fail in the middle of printing, with its CSV checked."""
import os
import subprocess
import sys

import cv2
import numpy as np
import pytest

from gluon_unet import cli
from test_evaluate import squares, write_dsb_truth
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [[command, '--version'] for command in cli.COMMANDS] + [['--version'], ['--help']]


def run_into_closed_pipe(args, unbuffered):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop('PYTHONUNBUFFERED', None)
    if unbuffered:
        env['PYTHONUNBUFFERED'] = '1'
    try:
        return subprocess.run([sys.executable, '-m', 'gluon_unet'] + args, cwd=ROOT, env=env, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=HANG_SECONDS)
    finally:
        os.close(write_end)


def assert_stopped_quietly(done):
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 141, (done.returncode, done.stderr)
    assert len(lines) == 1 and 'standard output was closed' in lines[0], done.stderr
    assert 'Traceback' not in done.stderr and 'bug' not in done.stderr


@pytest.mark.parametrize('unbuffered', [False, True], ids=['buffered', 'unbuffered'])
@pytest.mark.parametrize('args', CASES, ids=[' '.join(c) for c in CASES])
def test_a_closed_stdout_stops_every_command_quietly(args, unbuffered):
    assert_stopped_quietly(run_into_closed_pipe(args, unbuffered))


@pytest.mark.parametrize('unbuffered', [False, True], ids=['buffered', 'unbuffered'])
def test_evaluate_writes_its_csv_before_the_table_meets_the_closed_pipe(tmp_path, unbuffered):
    ids = ['image%03d' % i for i in range(120)]  # a table of ~20 kB: more than a pipe's buffer
    write_dsb_truth(str(tmp_path / 'truth'), ids)
    (tmp_path / 'pred').mkdir()
    for image_id in ids:
        cv2.imwrite(str(tmp_path / 'pred' / (image_id + '.png')), squares().astype(np.uint16))
    done = run_into_closed_pipe(['evaluate', '--pred', str(tmp_path / 'pred'), '--truth', str(tmp_path / 'truth'),
                                 '--csv', str(tmp_path / 'scores.csv')], unbuffered)
    assert_stopped_quietly(done)
    with open(tmp_path / 'scores.csv') as f:
        assert len(f.read().splitlines()) == 1 + len(ids)
