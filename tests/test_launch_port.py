"""``bin/launch --port P`` with P in use (issue 45, observation 10): one line naming the
port before any process starts - not ps-lite's 50-line "bind failed" traceback from the
scheduler, which does not say which port."""
import os
import socket
import sys

from gluon_unet.cli import launch_main

from conftest import ROOT, run_cli


def test_a_port_in_use_is_one_line_naming_it_before_anything_starts(tmp_path, capsys):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(('127.0.0.1', 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ['-n', '1', '-s', '1', '--port', str(port), '--grace', '2', '--',
                sys.executable, os.path.join(ROOT, 'bin', 'train'), '--kvstore', 'dist_sync', '--width', '4',
                '--depth', '2', '--size', '32', '--epochs', '1', '--synthetic-count', '8', '--workers', '0',
                '--no-progress', '--output', str(tmp_path / 'run')]
        code = run_cli(launch_main, argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2 and err.splitlines() == [err], captured
    assert '--port %d' % port in err and '127.0.0.1:%d' % port in err and 'address already in use' in err, err
    assert not captured.out and not (tmp_path / 'run').exists()  # no process of the job ran
