"""How problems reach the user: one line, never a traceback.

Anything the user can fix (a bad flag, a missing file, a corrupt image) is raised as
:class:`UserError`; the CLI entry points (:func:`gluon_unet.cli.common.reports_errors`,
with :func:`unexpected_error` for what no code foresaw) turn it into a single line on
stderr and a non-zero exit code (a usage error is one line too, exit 2:
``gluon_unet.cli.common.OneLineParser``), and :func:`mxnet_message` turns an MXNet error
(a C++ traceback) into the line that says what failed.

This module imports nothing from gluon_unet (and not mxnet), so any module may use it.
"""
import contextlib
import errno as _errno
import os
import re
import signal
import sys
import threading
import traceback


class UserError(Exception):
    """A problem with the user's input, reported as one line.

    Parameters
    ----------
    message : str
        What is wrong, naming the flag or file.
    exit_code : int
        Process exit code used by the CLI (2 = bad usage, like argparse).
    """

    def __init__(self, message, exit_code=2):
        super().__init__(message)
        self.exit_code = exit_code


class WriteError(UserError, OSError):
    """Writing a file failed (disk full, no permission, read-only file system...): one
    line naming the file and the cause, exit code 1.

    Also an ``OSError`` (with ``errno`` when the cause has one), so code that caught the
    ``OSError`` of a failed write still does.

    Parameters
    ----------
    path : str
        The file that could not be written (its final name, never a temporary one).
    cause : str
        What went wrong, in words: :func:`errno_words`.
    """

    def __init__(self, path, cause, errno=None):
        super().__init__('cannot write %s: %s' % (path, cause), exit_code=1)
        self.path, self.cause, self.errno = path, cause, errno

    def add(self, note):
        """Put ``note`` (what was kept, how to continue) after the message; returns self."""
        self.args = ('%s; %s' % (self.args[0], note),)
        return self


class DamagedFile(UserError):
    """A file whose content no longer matches the digest written with it (changed on
    disk since: a bad copy, storage errors, an edit in place), exit code 1."""

    def __init__(self, message, path):
        super().__init__(message, exit_code=1)
        self.path = path


def errno_words(code):
    """``'no space left on device (ENOSPC)'``: an errno in words, with its name."""
    name = _errno.errorcode.get(code)
    words = os.strerror(code)
    words = words[0].lower() + words[1:] if words else 'error %s' % code
    return '%s (%s)' % (words, name) if name else words


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGINT) turned into an exception by :func:`signals_raise`, so that
    ``finally`` blocks run (temporary files are removed) before the process ends.

    A ``KeyboardInterrupt``: code that cleans up after Ctrl-C does so here too.
    """

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stopped(KeyboardInterrupt):
    """A command stopped by a signal, with the one line that says so and what is kept.

    A ``KeyboardInterrupt``, not an ``Exception``: raised from a signal handler, it may
    surface inside a library's code, and a library's ``except Exception`` (MXNet's deferred
    initialization re-raises whatever it catches as a ValueError) must not turn a stop into
    another error. The error boundary prints ``line`` and returns ``exit_code``.
    """

    def __init__(self, line, exit_code):
        super().__init__(line)
        self.line, self.exit_code = line, exit_code


def stop_signals(*signums):
    """``signums`` (default SIGINT and SIGTERM) and SIGHUP: a closed terminal or an ended
    ssh session is a stop like SIGTERM, the work saved and said - unless this process
    ignores SIGHUP (started with ``nohup``: asked to outlive the terminal)."""
    signums = signums or (signal.SIGINT, signal.SIGTERM)
    return tuple(signums) + (() if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,))


@contextlib.contextmanager
def signals_raise(signums=None):
    """Within the block, the signals ``signums`` (default SIGTERM and SIGHUP,
    :func:`stop_signals`) raise :class:`Terminated` in the main thread (Python's default
    for them ends the process at once, leaving temporary files behind). Forked children
    that inherited the handler take the default action. Does nothing outside the main
    thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = stop_signals(signal.SIGTERM) if signums is None else signums
    owner = os.getpid()

    def handle(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Terminated(signum)

    old = {sig: signal.signal(sig, handle) for sig in signums}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


#: Environment variable that shows the traceback of an unexpected error (as ``--debug``).
DEBUG_VARIABLE = 'GLUON_UNET_DEBUG'


#: The modules of the package's dependencies (pyproject.toml) -> what pip installs them as.
REQUIRED = {'numpy': 'numpy', 'cv2': 'opencv-python-headless', 'skimage': 'scikit-image', 'scipy': 'scipy',
            'tifffile': 'tifffile', 'tqdm': 'tqdm'}


def unexpected_error(command, exc, debug=False):
    """The one line for an exception no code foresaw, after saving its traceback.

    mxnet missing from this Python, and a shared library ``libmxnet.so`` cannot load, are
    said as what to install; anything else is named as a bug in gluon_unet, with where its
    traceback is: the open ``train.log`` (a run's), or stderr now when ``debug``."""
    if isinstance(exc, ModuleNotFoundError) and (exc.name or '').split('.')[0] == 'mxnet':
        return ('%s needs MXNet, which is not installed in this Python (%s): pip install -r requirements.txt '
                '(requirements-cu117.txt for GPUs); bin/predict runs an export\'s model.onnx without it'
                % (command, sys.executable))
    top = (getattr(exc, 'name', None) or '').split('.')[0]
    if isinstance(exc, ModuleNotFoundError) and top in REQUIRED:
        return ('%s needs %s, which is not installed in this Python (%s): pip install %s (or pip install -r '
                'requirements.txt)' % (command, REQUIRED[top], sys.executable, REQUIRED[top]))
    if isinstance(exc, OSError) and library_load_error(exc) is not None:
        return library_load_error(exc)
    text = ' '.join(str(exc).split())
    what = '%s: %s' % (type(exc).__name__, text[:200] + ('...' if len(text) > 200 else '')) if text else \
        type(exc).__name__
    trace = ''.join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    logs = _log_files()
    for path in logs:
        try:
            with open(path, 'a') as f:
                f.write('unexpected error in %s:\n%s' % (command, trace))
        except OSError:
            pass
    if debug:
        sys.stderr.write(trace)
        where = 'its traceback is above'
    elif logs:
        where = 'its traceback is in %s (or run again with --debug)' % logs[0]
    else:
        where = 'run again with --debug (or %s=1) to see where' % DEBUG_VARIABLE
    return '%s failed: %s; this is a bug in gluon_unet, please report it: %s' % (command, what, where)


def _log_files():
    """The files the package logger writes to (a run's ``train.log``), if any."""
    import logging
    return [h.baseFilename for h in logging.getLogger('gluon_unet').handlers
            if isinstance(h, logging.FileHandler)]


_MISSING_LIBRARY = re.compile(r'(lib[\w.+-]+?\.so[\d.]*): cannot open shared object file')
# What provides the shared libraries libmxnet.so of a CUDA wheel loads (MXNet 1.9.x
# CMakeLists.txt: CUDA::cudart, cublas, cufft, cusolver, curand, nvrtc, nvToolsExt, the
# driver's libcuda, cuDNN, NCCL); the wheel itself holds none of them (tools/pip/setup.py
# packages libmxnet.so, and libgfortran / libopenblas where the build has them).
_PROVIDERS = (
    ('libcuda.', 'the NVIDIA driver, which a CUDA build of mxnet needs even to import: install the driver (in '
                 'Docker: --gpus all with the NVIDIA Container Toolkit), or the CPU build (pip install mxnet==1.9.1)'),
    ('libcudnn', 'cuDNN 8 for CUDA 11: the CUDA wheels of mxnet do not ship it; install it (README, GPUs), or the '
                 'CPU build (pip install mxnet==1.9.1)'),
    ('libnccl', 'NCCL 2 for CUDA 11: the CUDA wheels of mxnet do not ship it; install it (README, GPUs), or the '
                'CPU build (pip install mxnet==1.9.1)'),
    ('libcu', 'the CUDA 11 runtime libraries (11.7 for mxnet-cu117): the CUDA wheels of mxnet do not ship them; '
              'install them (README, GPUs), or the CPU build (pip install mxnet==1.9.1)'),
    ('libnv', 'the CUDA 11 runtime libraries (11.7 for mxnet-cu117): the CUDA wheels of mxnet do not ship them; '
              'install them (README, GPUs), or the CPU build (pip install mxnet==1.9.1)'),
    ('libquadmath', 'libquadmath, which the mxnet wheels need and may not ship (GPL): apt-get install libquadmath0 '
                    '(yum install libquadmath)'),
)


def library_load_error(exc):
    """One line for an ``OSError`` raised while ``import mxnet`` loads ``libmxnet.so``
    and a library it needs is missing (``libcudnn.so.8: cannot open shared object
    file``): which library, what provides it, what to do. None for any other OSError."""
    match = _MISSING_LIBRARY.search(str(exc))
    frames = traceback.extract_tb(exc.__traceback__)
    if match is None or not any(os.path.basename(os.path.dirname(f.filename)) == 'mxnet' for f in frames):
        return None
    library = match.group(1)
    provider = next((text for prefix, text in _PROVIDERS if library.startswith(prefix)),
                    'install it with your system\'s package manager')
    return 'mxnet cannot load: %s is missing; it comes with %s' % (library, provider)


# Lines of an MXNet error message that locate the failure rather than describe it.
_TRACE_LINES = ('Traceback', 'File ', '[bt]', 'Stack trace')


def mxnet_message(exc, limit=200):
    """The line of an MXNet error that says what failed, for a one-line message.

    ``str(MXNetError)`` is a C++ traceback: ``Traceback (most recent call last):``, then
    ``File "../src/...", line N``, then the cause (``MXNetError: Check failed: ...``);
    older builds put the cause first and ``[bt]`` stack lines after it. This returns the
    last line that is neither, without the ``MXNetError:`` prefix, at most ``limit``
    characters; the exception's type name when there is no such line. Works on any
    exception (a plain message is its own last line).
    """
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if not line.startswith(_TRACE_LINES):
            return line.replace('MXNetError: ', '')[:limit]
    return type(exc).__name__
