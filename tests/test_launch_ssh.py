"""bin/launch --launcher ssh: what goes from the hostfile and the environment into ssh's
argv and the remote shell must be a host name, a variable name, a quoted value - never an
ssh option or shell code."""
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gluon_unet.training import launcher as launch
from gluon_unet.cli import launch_main
from gluon_unet.errors import UserError

SSH_OPTIONS = ['ssh', '-o', 'BatchMode=yes', '-o', 'StrictHostKeyChecking=accept-new']


def _hostfile(tmp_path, text):
    path = tmp_path / 'hosts'
    path.write_text(text)
    return str(path)


def _remote_words(argv):
    """The words of the command the remote shell runs: ``cd DIR && env K=V ... CMD ...``."""
    remote = shlex.split(argv[-1])
    assert remote[:2] == ['sh', '-c'] and len(remote) == 3, remote
    assert remote[2].startswith('exec 3<&0; '), remote[2]
    return shlex.split(remote[2][len('exec 3<&0; '):].split(' 3<&- & pid=$!;')[0])


class NoJob:
    """Stands in for launch.Job: a rejected launch must not start anything."""

    def __init__(self, *args, **kwargs):
        raise AssertionError('the job was started')


def test_an_option_in_the_hostfile_is_refused_with_its_file_and_line(tmp_path):
    path = _hostfile(tmp_path, '# cluster\nnode1\n-oProxyCommand=touch /tmp/pwned\n')
    with pytest.raises(UserError) as info:
        launch.read_hostfile(path)
    message = str(info.value)
    assert '\n' not in message and info.value.exit_code == 2
    assert path in message and 'line 3' in message and '-oProxyCommand' in message, message


@pytest.mark.parametrize('host', ['-oProxyCommand=x', '-p2222', 'node1;touch', 'a|b', '$(id)', '`id`',
                                  'a&b', "node'1", 'node"1', 'a>b', 'a\\b', '*', 'a(b)', '~x', 'a!b'])
def test_hosts_that_are_not_host_names_are_refused(tmp_path, host):
    path = _hostfile(tmp_path, 'node0\n%s slots=2\n' % host)
    with pytest.raises(UserError, match='line 2'):
        launch.read_hostfile(path)


def test_ordinary_host_names_pass(tmp_path):
    hosts = ['node1', 'gpu-07.cluster.example.org', 'alice@node2', '10.0.0.7', 'fe80::1%eth0', 'Node_3']
    path = _hostfile(tmp_path, '\n'.join(h + ' slots=8  # comment' for h in hosts) + '\n')
    assert launch.read_hostfile(path) == hosts


def test_bin_launch_refuses_the_hostfile_in_one_line_and_starts_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, 'Job', NoJob)
    path = _hostfile(tmp_path, '-oProxyCommand=touch /tmp/pwned\n')
    assert launch_main(['-n', '1', '--launcher', 'ssh', '-H', path, '--', 'true']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith('error: -H %s line 1: ' % path), err


def test_the_host_follows_a_double_dash_in_the_ssh_argv():
    argv = launch.ssh_command('node2', {'DMLC_ROLE': 'worker'}, ['bin/train'], '/repo')
    assert argv[:5] == SSH_OPTIONS
    assert argv[5:7] == ['--', 'node2'] and len(argv) == 8, argv
    # Also for a host that did not come through read_hostfile.
    with pytest.raises(UserError, match='not a host name'):
        launch.ssh_command('-oProxyCommand=x', {}, ['bin/train'], '/repo')


@pytest.mark.parametrize('name', ['BAD NAME', 'X;touch /tmp/p', '1X', 'A-B', '$(id)', '', 'A=B'])
def test_an_environment_name_that_is_not_a_shell_name_is_refused(name):
    with pytest.raises(UserError) as info:
        launch.ssh_command('node1', {name: '1', 'DMLC_ROLE': 'worker'}, ['bin/train'], '/repo')
    assert '\n' not in str(info.value) and 'environment variable' in str(info.value)


def test_bin_launch_refuses_a_bad_environment_name_before_starting(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, 'Job', NoJob)
    monkeypatch.setenv('MXNET_X;touch /tmp/pwned;Y', '1')  # forwarded: MXNET_ prefix
    path = _hostfile(tmp_path, 'node1\n')
    assert launch_main(['-n', '1', '--launcher', 'ssh', '-H', path, '--', 'true']) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'MXNET_X;touch' in err, err


VALUES = ["a b", "it's", 'say "hi"', '$HOME `id` $(id) ;&|<>', 'tab\tand\nnewline', '', '-x', '*']


def test_values_cwd_and_command_survive_quoting():
    env = {'MXNET_V%d' % i: v for i, v in enumerate(VALUES)}
    argv = launch.ssh_command('node1', env, ['bin/train', '--output', "runs/a b's"], "/my repo/it's")
    words = _remote_words(argv)
    assert words[:4] == ['cd', "/my repo/it's", '&&', 'env']
    assert words[4:4 + len(env)] == ['%s=%s' % kv for kv in sorted(env.items())]
    assert words[4 + len(env):] == ['bin/train', '--output', "runs/a b's"]


@pytest.fixture
def fake_ssh(tmp_path):
    """An ssh that runs locally: it checks the options end with ``--`` before the host,
    then does what ssh does with the words after it - joins them with spaces and hands
    them to a shell, whose stdin is the connection's."""
    fake = tmp_path / 'fake_ssh'
    fake.write_text(textwrap.dedent('''\
        #!%s
        import subprocess, sys
        argv = sys.argv[1:]
        cut = argv.index('--')
        assert all(a.startswith('-') or argv[i - 1] == '-o' for i, a in enumerate(argv[:cut])), argv
        host, words = argv[cut + 1], argv[cut + 2:]
        sys.exit(subprocess.call(['sh', '-c', ' '.join(words)]))
    ''' % sys.executable))
    fake.chmod(0o755)
    return str(fake)


def _start(argv):
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)


def _end(proc):
    proc.stdin.close()  # the remote watchdog ends with its stdin ...
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # ... and its grace-period sleep with this
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def test_a_shell_receives_exactly_the_values(tmp_path, fake_ssh):
    # Also: the job runs to its end while the connection stays open (the remote watchdog
    # must not mistake a background job's /dev/null stdin for a closed connection).
    cwd = tmp_path / "work dir's"
    cwd.mkdir()
    out = tmp_path / 'seen.json'
    env = {'MXNET_V%d' % i: v for i, v in enumerate(VALUES)}
    dump = ('import json, os, sys; json.dump({"cwd": os.getcwd(), "argv": sys.argv[1:], "env": '
            '{k: v for k, v in os.environ.items() if k.startswith("MXNET_V")}}, open(%r, "w"))' % str(out))
    proc = _start(launch.ssh_command('node1', env, [sys.executable, '-c', dump, 'a b', "c'd"], str(cwd),
                                     ssh=fake_ssh))
    try:
        assert proc.wait(timeout=60) == 0
    finally:
        _end(proc)
    seen = json.loads(out.read_text())
    assert seen == {'cwd': str(cwd), 'argv': ['a b', "c'd"], 'env': env}


def test_closing_the_connection_stops_the_remote_command(tmp_path, fake_ssh):
    proc = _start(launch.ssh_command('node1', {}, ['sleep', '60'], str(tmp_path), ssh=fake_ssh))
    try:
        time.sleep(1.0)
        assert proc.poll() is None, 'the remote command ended while the connection was open'
        proc.stdin.close()
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        _end(proc)
