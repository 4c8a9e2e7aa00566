"""How problems reach the user: one line, never a traceback.

Anything the user can fix (a bad flag, a missing file, a corrupt image) is raised as
:class:`UserError`; the CLI entry points (:func:`reports_errors`) turn it into a single
line on stderr and a non-zero exit code. All five CLIs parse their flags with
:class:`OneLineParser`, so a usage error looks the same everywhere (one line, exit 2), and
:func:`mxnet_message` turns an MXNet error (a C++ traceback) into the line that says what
failed.

This module imports nothing from gluon_unet (and not mxnet), so any module may use it.
"""
import argparse
import functools
import os
import sys


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


def reports_errors(main):
    """Decorator for CLI entry points: a :class:`UserError` becomes ``error: <message>``
    on stderr and its exit code, Ctrl-C becomes exit 130 - never a traceback."""
    @functools.wraps(main)
    def wrapper(argv=None, **kwargs):
        try:
            return main(argv, **kwargs)
        except UserError as exc:
            print('error: %s' % exc, file=sys.stderr)
            if getattr(exc, 'process_unusable', False):
                # MXNet's engine is stuck (a device failed while the others wait at
                # SyncBatchNorm's barrier): a normal exit would wait for it forever.
                sys.stderr.flush()
                os._exit(exc.exit_code)
            return exc.exit_code
        except KeyboardInterrupt:
            print('interrupted', file=sys.stderr)
            return 130
    return wrapper


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (flag and problem) and exit code 2."""

    def error(self, message):
        self.exit(2, '%s: error: %s\n' % (self.prog, message))


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
