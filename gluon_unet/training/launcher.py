"""``bin/launch``: start a distributed training job on MXNet's parameter server (ps-lite).

MXNet's ``dist_*`` kvstores need three kinds of processes, told their role by the
environment (``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``,
``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``): one scheduler, the servers, the workers.
This launcher runs the same command in all of them - ``bin/train`` serves when its role
is server or scheduler - on 127.0.0.1 (``--launcher local``) or on the hosts of a
hostfile over ssh, prefixes every output line with the process's role and index, and
makes the job one unit: the first process to fail (or Ctrl-C / SIGTERM to the
launcher) stops all the others, SIGTERM then SIGKILL after ``--grace`` seconds, so a
job never hangs on a dead worker (ps-lite would wait for its gradients forever) and
leaves no process behind - on Linux even when the launcher itself is killed (``kill -9``,
an OOM kill): its children get SIGKILL from the kernel (:func:`dies_with_parent`).
"""
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from ..config import check_fields, option, within
from ..errors import UserError, errno_words, stop_signals
from ..machine.runtime import LOCAL_WORKERS, user_environ
from ..outputs import check_inputs

ROLES = ('scheduler', 'server', 'worker')


def free_port(host='127.0.0.1'):
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(port, host='127.0.0.1'):
    """Refuse ``--port`` in one line when something already listens on ``host:port``:
    the scheduler would fail after starting with ps-lite's "bind failed" traceback, which
    does not name the port. Bound the way ZeroMQ binds it (``SO_REUSEADDR``), so a port
    whose old connections linger in TIME_WAIT still counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError('--port %d: the scheduler cannot listen on %s:%d (%s); choose another port, or leave '
                            '--port out for a free one' % (port, host, port, errno_words(exc.errno))) from None


# What may reach ssh's argv as a host: names, IPv4/IPv6 addresses (with a %zone), user@.
# Nothing that ssh could take for an option (a leading '-': "-oProxyCommand=...") or a
# shell for code. Environment names go unquoted into the remote shell's command line.
_HOST = re.compile(r'^[A-Za-z0-9_.:%][A-Za-z0-9_.:%@-]*$')
_ENV_NAME = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*$')


def check_host(host, where):
    """``host`` unchanged if it is a host name (``[user@]name``); else a one-line UserError."""
    if not _HOST.match(host) or host.count('@') > 1 or host.startswith('@'):
        raise UserError('%s: %r is not a host name (letters, digits and . - _ : %% @ only, not starting '
                        'with -)' % (where, host))
    return host


def read_hostfile(path):
    """Host names from ``path``: one per line, ``#`` comments and blank lines ignored.

    A line may carry more words (``host slots=8``); only the first is used. A first word
    that is not a host name (an ssh option such as ``-oProxyCommand=...``, shell
    characters) stops the launch with the file and line number.
    """
    check_inputs([('--hostfile', path, 'file')])
    hosts = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                words = line.split('#')[0].split()
                if words:
                    hosts.append(check_host(words[0], '-H %s line %d' % (path, number)))
    except OSError as exc:
        raise UserError('-H %s: cannot read the hostfile (%s)' % (path, exc.strerror)) from None
    if not hosts:
        raise UserError('-H %s: no host names in the hostfile' % path)
    return hosts


def job_plan(num_workers, num_servers, hosts, root_uri, port, extra_env=None):
    """Who runs where, with which environment.

    The scheduler runs on ``hosts[0]`` (it must be reachable at ``root_uri``), servers and
    workers go round-robin over ``hosts``.

    Returns
    -------
    list of dict
        ``{'role', 'index', 'host', 'env'}`` - scheduler first, then servers, then workers.
    """
    base = {'DMLC_PS_ROOT_URI': root_uri, 'DMLC_PS_ROOT_PORT': str(port),
            'DMLC_NUM_SERVER': str(num_servers), 'DMLC_NUM_WORKER': str(num_workers)}
    base.update(extra_env or {})
    plan = [{'role': 'scheduler', 'index': 0, 'host': hosts[0]}]
    plan += [{'role': 'server', 'index': i, 'host': hosts[i % len(hosts)]} for i in range(num_servers)]
    plan += [{'role': 'worker', 'index': i, 'host': hosts[i % len(hosts)]} for i in range(num_workers)]
    for p in plan:
        p['env'] = dict(base, DMLC_ROLE=p['role'])
        if p['role'] == 'worker':
            # Workers on one machine share its cores: each takes its part of the OpenMP
            # threads (runtime.apply_runtime_defaults) instead of all of them.
            p['env'][LOCAL_WORKERS] = str(sum(q['role'] == 'worker' and q['host'] == p['host']
                                              for q in plan))
    return plan


def ssh_command(host, env, command, cwd, ssh='ssh'):
    """The argv that runs ``command`` on ``host`` with ``env``, in ``cwd``.

    ssh gives the remote side no signal when the connection drops, so the remote shell
    runs the command in the background and kills it when its stdin (held open by the
    launcher) closes: stopping the local ssh process stops the remote job too. The
    watchdog reads that stdin through fd 3: a non-interactive shell gives background
    commands /dev/null as stdin, which would end ``cat`` at once and kill the job as it
    starts.

    ``--`` ends ssh's options, so the host is never read as one; variable names must be
    shell names (they are not quoted), values, ``cwd`` and ``command`` are quoted.
    """
    check_host(host, 'ssh host')
    for name in env:
        if not _ENV_NAME.match(name):
            raise UserError('bin/launch: environment variable %r cannot be passed over ssh: not a shell '
                            'variable name (letters, digits, _; not starting with a digit); unset it'
                            % (name,))
    assignments = ' '.join('%s=%s' % (k, shlex.quote(v)) for k, v in sorted(env.items()))
    inner = 'cd %s && env %s %s' % (shlex.quote(cwd), assignments, ' '.join(shlex.quote(c) for c in command))
    remote = ('exec 3<&0; %s 3<&- & pid=$!; (cat <&3 >/dev/null; kill -TERM $pid 2>/dev/null; sleep 10; '
              'kill -KILL $pid 2>/dev/null) & wait $pid' % inner)
    return [ssh, '-o', 'BatchMode=yes', '-o', 'StrictHostKeyChecking=accept-new', '--', host,
            'sh -c %s' % shlex.quote(remote)]


def dies_with_parent():
    """A ``preexec_fn`` that makes the child get SIGKILL when the process that started it
    dies, however it dies (Linux's ``PR_SET_PDEATHSIG``; no handler of the launcher runs on
    ``kill -9``, so nothing else could stop them); None where there is no ``prctl``.

    libc is looked up here, before the fork: between fork and exec a child of a threaded
    process should only make plain calls."""
    import ctypes
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def child():
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG (linux/prctl.h)
        if os.getppid() != parent:  # the launcher died before the request was made
            os.kill(os.getpid(), signal.SIGKILL)
    return child


class Job:
    """The processes of one launch; ``run()`` returns the launcher's exit code."""

    def __init__(self, plan, argv_for, grace=10.0, out=None, poll=0.1):
        self.plan, self.argv_for, self.grace, self.poll = plan, argv_for, grace, poll
        self.out = out or sys.stdout.buffer
        self.procs, self.readers = [], []
        self._lock = threading.Lock()
        self._signum = None

    def _pump(self, proc, prefix):
        for line in iter(proc.stdout.readline, b''):
            with self._lock:
                self.out.write(prefix + line if line.endswith(b'\n') else prefix + line + b'\n')
                self.out.flush()
        proc.stdout.close()

    def start(self):
        for p in self.plan:
            argv, env, stdin = self.argv_for(p)
            # Own session = own process group: the launcher can signal a process with
            # all its children (data loader workers), and a Ctrl-C at the terminal
            # reaches only the launcher, which forwards it in order.
            # PR_SET_PDEATHSIG follows the thread that forks: the one that supervises to the end.
            proc = subprocess.Popen(argv, env=env, stdin=stdin, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=dies_with_parent())
            proc.spec = p
            self.procs.append(proc)
            prefix = ('[%s %d] ' % (p['role'], p['index']) if p['role'] != 'scheduler'
                      else '[scheduler] ').encode()
            t = threading.Thread(target=self._pump, args=(proc, prefix), daemon=True)
            t.start()
            self.readers.append(t)

    def _signal(self, procs, sig):
        for proc in procs:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _wait(self, procs, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(self.poll)
        return all(p.poll() is not None for p in procs)

    def _on_signal(self, signum, frame):
        self._signum = signum

    def stop(self, worker_signal=signal.SIGTERM):
        """Stop everything: workers get ``worker_signal`` (a forwarded Ctrl-C lets them
        save a checkpoint), servers and scheduler SIGTERM; SIGKILL after the grace period."""
        workers = [p for p in self.procs if p.spec['role'] == 'worker']
        others = [p for p in self.procs if p.spec['role'] != 'worker']
        self._signal([p for p in workers if p.poll() is None], worker_signal)
        self._wait(workers, self.grace)
        self._signal([p for p in others if p.poll() is None], signal.SIGTERM)
        self._wait(self.procs, min(self.grace, 5.0))
        self._signal(self.procs, signal.SIGKILL)  # whole groups: also orphaned grandchildren
        self._wait(self.procs, 5.0)

    def run(self):
        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in stop_signals():  # SIGHUP too: forwarded, the workers save and stop
                old[sig] = signal.signal(sig, self._on_signal)
        try:
            self.start()
            return self._supervise()
        finally:
            self._signal(self.procs, signal.SIGKILL)
            for t in self.readers:
                t.join(timeout=2.0)
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _supervise(self):
        workers = [p for p in self.procs if p.spec['role'] == 'worker']
        while True:
            if self._signum is not None:
                self._say('%s: stopping the job' % signal.Signals(self._signum).name)
                self.stop(self._signum)
                return 128 + self._signum
            failed = [p for p in self.procs if p.poll() not in (None, 0)]
            if failed:
                p = failed[0]
                code = p.returncode if p.returncode > 0 else 128 - p.returncode
                self._say('%s %d exited with code %s; stopping the job'
                          % (p.spec['role'], p.spec['index'], p.returncode))
                self.stop()
                return code
            if all(p.poll() == 0 for p in workers):
                # Servers and scheduler exit by themselves once every worker finished;
                # training succeeded either way, so a straggler is only reported.
                if not self._wait(self.procs, self.grace):
                    self._say('servers did not exit %.0f s after the workers; stopping them' % self.grace)
                    self.stop()
                return 0
            time.sleep(self.poll)

    def _say(self, text):
        with self._lock:
            self.out.write(('[launch] %s\n' % text).encode())
            self.out.flush()


@dataclass
class LaunchConfig:
    """A ``bin/launch`` job: its processes, where they run and the command they run; one
    field per flag (:mod:`gluon_unet.cli.launch`)."""
    num_workers: int = option(None, 'worker processes', short='-n', required=True, metavar='N',
                              within=within(1, 1024))
    num_servers: Optional[int] = option(None, 'parameter servers (default: as many as workers)', short='-s',
                                        metavar='N',
                                        within=within(1, 1024))
    launcher: str = option('local', 'local: every process on 127.0.0.1; ssh: on the hosts of -H',
                           choices=('local', 'ssh'))
    hostfile: Optional[str] = option(None, 'ssh: file with one host name per line', short='-H', metavar='HOSTFILE', path='in')
    port: int = option(0, 'scheduler port (default: a free one)', metavar='PORT',
                       within=within(0, 65535, note='(0 = a free one)'))
    interface: Optional[str] = option(None, 'network interface ps-lite binds to (e.g. eth0, ib0)',
                                      metavar='INTERFACE')
    grace: float = option(10.0, 'seconds between SIGTERM and SIGKILL when stopping the job', metavar='SECONDS',
                          within=within(0, 3600, note='(seconds)'))
    command: list = option([], '-- COMMAND ...', positional=True, rest=True, metavar='command')

    def validate(self):
        """Check the job in one line naming the flag; fills in ``num_servers`` and takes
        the ``--`` off ``command``."""
        command = self.command[1:] if self.command[:1] == ['--'] else self.command
        if not command:
            raise UserError('launch: no command given; put it after --, e.g. -- bin/train --kvstore dist_sync')
        check_fields(self)
        if self.num_servers is None:
            self.num_servers = self.num_workers
        if self.launcher == 'ssh' and not self.hostfile:
            raise UserError('--launcher ssh needs -H HOSTFILE')
        self.command = command
        return self


def check_program(program):
    """Refuse, in one line, a local job's command that cannot start: no such file, not
    executable, or not on PATH (it would fail in every process of the job at once)."""
    import shutil
    if os.sep in program:
        if not os.path.isfile(program):
            raise UserError('launch: the command %s does not exist' % program)
        if not os.access(program, os.X_OK):
            raise UserError('launch: the command %s is not executable (chmod +x, or run it through its '
                            'interpreter: -- python %s ...)' % (program, program))
    elif shutil.which(program) is None:
        raise UserError('launch: the command %s is not on PATH' % program)


def run_launch(config):
    """Run the job of ``config`` (a validated :class:`LaunchConfig`); returns the exit
    code (0 when every worker succeeded)."""
    # The user's settings travel to every process; defaults chosen for this machine do
    # not (bin/launch chooses none, but a caller of run_launch() may have: runtime.user_environ):
    # each bin/train of the job chooses its own on its host.
    extra = {k: v for k, v in user_environ().items() if k.startswith(('PS_', 'MXNET_', 'OMP_'))}
    if config.interface:
        extra['DMLC_INTERFACE'] = config.interface
    if config.launcher == 'local':
        check_program(config.command[0])
        # Bind ps-lite to loopback explicitly: left alone it picks the first
        # non-loopback interface, which may not exist (containers) or be firewalled.
        extra.update(DMLC_NODE_HOST='127.0.0.1')
        extra.setdefault('DMLC_INTERFACE', 'lo')
        if config.port:
            check_port_free(config.port)
        plan = job_plan(config.num_workers, config.num_servers, ['127.0.0.1'], '127.0.0.1',
                        config.port or free_port(), extra)

        def argv_for(p):
            return config.command, dict(user_environ(), **p['env']), subprocess.DEVNULL
    else:
        hosts = read_hostfile(config.hostfile)
        plan = job_plan(config.num_workers, config.num_servers, hosts, hosts[0],
                        config.port or free_port('0.0.0.0'), extra)
        cwd = os.getcwd()
        # Built before anything starts: a name ssh_command refuses stops the launch clean.
        argvs = [ssh_command(p['host'], p['env'], config.command, cwd) for p in plan]

        def argv_for(p):
            return argvs[plan.index(p)], None, subprocess.PIPE
    return Job(plan, argv_for, grace=config.grace).run()

