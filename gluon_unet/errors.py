"""How problems reach the user: one line, never a traceback.

Anything the user can fix (a bad flag, a missing file, a corrupt image) is raised as
:class:`UserError`; the CLI entry points (:func:`reports_errors`) turn it into a single
line on stderr and a non-zero exit code. All five CLIs parse their flags with
:class:`OneLineParser`, so a usage error looks the same everywhere (one line, exit 2).

This module imports nothing from gluon_unet (and not mxnet), so any module may use it.
"""
import argparse
import functools
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
    def wrapper(argv=None):
        try:
            return main(argv)
        except UserError as exc:
            print('error: %s' % exc, file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            print('interrupted', file=sys.stderr)
            return 130
    return wrapper


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (flag and problem) and exit code 2."""

    def error(self, message):
        self.exit(2, '%s: error: %s\n' % (self.prog, message))
