"""The package's logger: the console, and a run's ``train.log`` (:func:`setup_logging`).

What else a run leaves for people, ``metrics.csv`` and ``curves.png``, is
:mod:`gluon_unet.training.recorder`'s."""
import contextlib
import logging
import os
import sys

from .errors import errno_words
from .utils import write_errors, write_point

LOGGER_NAME = 'gluon_unet'


# Marks the handlers setup_logging() added, so a later call replaces those and no others.
_OWN = '_gluon_unet_handler'


def setup_logging(run_dir=None, verbose=True):
    """The package logger, writing INFO lines to stderr and (when ``run_dir`` is given)
    appending them to ``run_dir/train.log``.

    It adds its own handlers only, replacing those of an earlier call (``fit()`` calls it
    once before the run folder is known, then again), and leaves other handlers and
    ``propagate`` alone: records still reach the application's logging configuration.
    When the application has configured the root logger (``logging.basicConfig``, a
    test runner), the lines reach stderr through it, so no stderr handler is added, and
    no line is printed twice. ``verbose=False``: nothing on stderr from gluon_unet.
    """
    log = logging.getLogger(LOGGER_NAME)
    log.setLevel(logging.INFO)
    for h in [h for h in log.handlers if getattr(h, _OWN, False)]:
        log.removeHandler(h)
        h.close()
    fmt = logging.Formatter('%(asctime)s %(message)s', '%H:%M:%S')
    handlers = []
    if verbose and not logging.getLogger().handlers:
        handlers.append(logging.StreamHandler(sys.stderr))
    if run_dir:
        path = os.path.join(run_dir, 'train.log')
        with write_errors(path):
            os.makedirs(run_dir, exist_ok=True)
            write_point(path)
            handlers.append(_RunLogHandler(path))
    if not handlers:
        # Handled, so Python's last-resort handler does not print warnings to stderr.
        handlers.append(logging.NullHandler())
    for h in handlers:
        h.setFormatter(fmt)
        setattr(h, _OWN, True)
        log.addHandler(h)
    return log


def log_to_files(message):
    """Write ``message`` to the package logger's files only (a run's ``train.log``): a
    line the command prints on stderr itself, such as how a run stopped, so the log ends
    as the console did without the console showing it twice."""
    log = logging.getLogger(LOGGER_NAME)
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, message, (), None)
    for h in log.handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(record)


class _RunLogHandler(logging.FileHandler):
    """``train.log``: a line that cannot be written (disk full, folder turned read-only)
    is said once on stderr, in one line, and training goes on - logging's own handler
    would print a traceback for every line. The checkpoints that follow stop the run
    if the folder really cannot be written."""

    _warned = False

    def handleError(self, record):
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            return super().handleError(record)
        if not self._warned:
            self._warned = True
            print('warning: cannot write %s: %s; its lines are not saved until it can be written again'
                  % (self.baseFilename, errno_words(exc.errno) if exc.errno else exc), file=sys.stderr)
        return None


@contextlib.contextmanager
def root_logger_untouched():
    """Run a library call that logs with the module-level ``logging.info`` (MXNet's
    ``amp.init``, its ONNX converter) without it configuring the root logger: Python's
    ``logging.info`` calls ``basicConfig`` when the root has no handler, after which every
    gluon_unet line was printed twice. A handler on the root for the call, and the root's
    level as it was."""
    root, quiet = logging.getLogger(), logging.NullHandler()
    level = root.level
    root.addHandler(quiet)
    try:
        yield
    finally:
        root.removeHandler(quiet)
        root.setLevel(level)


def get_logger():
    return logging.getLogger(LOGGER_NAME)
