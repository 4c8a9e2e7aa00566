"""What every command's parser shares: one flag per config field, ``--version``, one-line
usage errors.

Each command's options are the fields of a config dataclass in a module free of numpy
(``TrainConfig`` in ``config.py``, ``PredictConfig`` in ``inference/configs.py``, ...):
:func:`add_fields` makes one flag per field (``batch_size`` -> ``--batch-size``), with the
field's help, its default shown once, and a metavar saying what the value is; the parsed
flags become the dataclass again (:func:`parse_configs`), whose own ``validate()`` refuses
bad values in one line naming the flag. So an option has one name and one default, and
no command writes its flags by hand.
"""
import argparse
import dataclasses
import functools
import contextlib
import os
import signal
import sys
import typing
import warnings

from .. import version_string
from ..errors import DEBUG_VARIABLE, Stopped, UserError, stop_signals, unexpected_error


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (flag and problem) and exit code 2."""

    def error(self, message):
        self.exit(2, '%s: error: %s\n' % (self.prog, message))


def add_version_flag(parser):
    """Give an argparse parser ``--version`` (prints :func:`~gluon_unet.version_string`, exit 0)."""

    class _Version(argparse.Action):
        def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
            super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

        def __call__(self, parser, namespace, values, option_string=None):
            print(version_string(), file=sys.stdout)
            parser.exit(0)

    parser.add_argument('--version', action=_Version, help='print the gluon_unet, mxnet and Python versions and exit')
    return parser


def command_parser(prog, description, epilog=None, usage=None):
    """A command's parser: one-line usage errors, ``--version``, ``--debug``, the
    description and examples printed as written."""
    parser = OneLineParser(prog=prog, usage=usage, description=description, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    # Read by the error boundary (reports_errors), not by the command.
    parser.add_argument('--debug', action='store_true', default=argparse.SUPPRESS,
                        help='on an unexpected error, print its traceback (also: GLUON_UNET_DEBUG=1)')
    return add_version_flag(parser)


def asks_version(argv):
    """Print the versions when ``argv`` holds ``--version`` (before any ``--``): answered
    before the command's modules (and mxnet) load. True when it did."""
    args = sys.argv[1:] if argv is None else list(argv)
    if '--version' in args[:args.index('--') if '--' in args else len(args)]:
        print(version_string())
        return True
    return False


def arg_type(tp):
    """The type a flag's value converts to: ``Optional[float]`` -> ``float``."""
    if typing.get_origin(tp) is typing.Union:
        tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
    return tp


def default_of(f):
    """A dataclass field's default (None when it has none)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def field_help(f, default, demo=None):
    """The help of a config field: its description, its default once (unless the
    description already says what the default means), its range when it has one, and the
    demo's value where ``demo`` (field name -> value) sets another one."""
    text = f.metadata.get('help', '')
    rng = f.metadata.get('within')
    limits = rng.words(arg_type(f.type) is int) if rng is not None else ''
    if 'default' in text or default is None or default == []:
        return '%s (%s)' % (text, limits) if limits else text
    shown = ('on' if default else 'off') if isinstance(default, bool) else repr(default) \
        if default == '' else str(default)
    shown += '; ' + limits if limits else ''
    value = (demo or {}).get(f.name)
    if value is not None and value != default:
        return '%s (default: %s; demo without --data: %s)' % (text, shown, value)
    return '%s (default: %s)' % (text, shown)


def config_flag(f, hints, metavars=None, demo=None, shown_choices=None):
    """``(names, add_argument keyword arguments)`` for the config field ``f``.

    A flag absent from the command line leaves no value (``argparse.SUPPRESS``): the
    dataclass's own default applies, or a ``--config`` file's value for ``bin/train``.
    ``metavars`` (field name -> placeholder) and ``shown_choices`` (field name -> allowed
    values shown but checked by the config's ``validate()``, not by argparse) are the
    caller's; the field's metadata (:func:`gluon_unet.config.option`) wins over both.
    """
    meta = f.metadata
    tp = arg_type(hints[f.name])
    kwargs = dict(default=argparse.SUPPRESS, help=field_help(f, default_of(f), demo))
    if meta.get('positional'):
        names = [f.name]
        kwargs['metavar'] = meta.get('metavar', f.name.upper())
        if meta.get('rest'):
            kwargs['nargs'] = argparse.REMAINDER
            return names, kwargs
    else:
        names = ([meta['short']] if 'short' in meta else []) + ['--' + meta.get('flag', f.name).replace('_', '-')]
        kwargs['dest'] = f.name
        if meta.get('required'):
            kwargs['required'] = True
    if tp is bool:
        kwargs['action'] = argparse.BooleanOptionalAction
        return names, kwargs
    kwargs['type'] = tp
    if 'choices' in meta:
        kwargs['choices'] = meta['choices']
    if 'metavar' in meta or 'choices' not in meta:
        shown = (shown_choices or {}).get(f.name)
        kwargs['metavar'] = meta.get('metavar') or ('{%s}' % ','.join(shown) if shown else None) or \
            (metavars or {}).get(f.name) or {int: 'N', float: 'X'}.get(tp) or f.name.upper()
    return names, kwargs


def add_fields(target, cls, names=None):
    """Add one flag per field of the config dataclass ``cls`` (those in ``names``, in
    that order) to a parser or argument group ``target``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for name in names or fields:
        flags, kwargs = config_flag(fields[name], hints)
        target.add_argument(*flags, **kwargs)
    return target


def config_parser(prog, cls, description, epilog=None, usage=None):
    """A command's parser (:func:`command_parser`) with one flag per field of ``cls``."""
    return add_fields(command_parser(prog, description, epilog, usage), cls)


def given(namespace, cls):
    """The fields of ``cls`` that the command line set (a dict)."""
    values = vars(namespace)
    return {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}


def parse_configs(parser, argv, *classes):
    """Parse ``argv`` into one instance of each config dataclass of ``classes`` (their
    defaults where a flag is absent), each validated when it has ``validate()``."""
    namespace = parser.parse_args(argv)
    configs = []
    for cls in classes:
        config = cls(**given(namespace, cls))
        configs.append(config.validate() if hasattr(config, 'validate') else config)
    return configs


def reports_errors(main):
    """Decorator for CLI entry points: the one error boundary of a command.

    A :class:`UserError` becomes ``error: <message>`` on stderr and its exit code;
    Ctrl-C exit 130 (a :class:`Terminated` SIGTERM 143); mxnet missing from this Python
    one line saying what to install; a library libmxnet.so cannot load one line naming
    it. Anything else - a bug - is one line too, exit 1, naming what failed: its traceback
    goes to the run's ``train.log`` when one is open, and to stderr with ``--debug`` or
    ``GLUON_UNET_DEBUG=1``. Never a traceback by default."""
    command = main.__name__[:-len('_main')] if main.__name__.endswith('_main') else main.__name__

    @functools.wraps(main)
    def wrapper(argv=None, **kwargs):
        try:
            with one_line_warnings():
                return main(argv, **kwargs)
        finally:
            if argv is None:  # the process's own command line: its exit comes next
                default_signals()
    return _boundary(wrapper, command)


def warning_line(message, category, filename, lineno, line=None):
    """A Python warning as the user reads it: ``warning: <message>``, one line - not the
    file, line number, category and source line of Python's format, which are for the
    programmer (``--debug`` does not change it: the message names what to do)."""
    text = ' '.join(str(message).split())
    return 'warning: %s%s\n' % (text, '' if issubclass(category, UserWarning) else ' (%s)' % category.__name__)


@contextlib.contextmanager
def one_line_warnings():
    """Within the block, Python warnings print as :func:`warning_line` (process-wide: set
    by the commands' error boundary, so it holds for every command)."""
    previous, warnings.formatwarning = warnings.formatwarning, warning_line
    try:
        yield
    finally:
        warnings.formatwarning = previous


def default_signals():
    """From now until the process ends, SIGINT, SIGTERM and SIGHUP (unless ignored, as under
    ``nohup``) take their default action: the process ends with that signal's status, and
    no Python handler runs in an interpreter that is shutting down (one that did, as
    ``bin/export --int8`` finished, aborted it: SIGABRT, "PyThreadState_Get ... finalizing").
    For a command whose work is done or given up; a signal now still ends the process at
    once, as a scheduler expects."""
    import threading
    if threading.current_thread() is threading.main_thread():
        for signum in stop_signals():
            signal.signal(signum, signal.SIG_DFL)


def _boundary(main, command):
    """The error boundary around an entry point (see :func:`reports_errors`)."""
    @functools.wraps(main)
    def wrapper(argv=None, **kwargs):
        try:
            # A pipe's buffered output is written here, not at exit, so that a reader that
            # closed early (`| head`) is met below rather than by the interpreter's shutdown;
            # argparse's --help and usage errors end in SystemExit, so those are flushed too.
            try:
                code = main(argv, **kwargs)
            except SystemExit:
                sys.stdout.flush()
                raise
            sys.stdout.flush()
            return code
        except BrokenPipeError as exc:
            if not _stdout_closed():
                print('error: %s' % unexpected_error(command, exc, _debugging(argv)), file=sys.stderr)
                return 1
            return _reader_gone(command)
        except UserError as exc:
            print('error: %s' % exc, file=sys.stderr)
            if getattr(exc, 'process_unusable', False):
                # MXNet's engine is stuck (a device failed while the others wait at
                # SyncBatchNorm's barrier): a normal exit would wait for it forever.
                sys.stderr.flush()
                os._exit(exc.exit_code)
            return exc.exit_code
        except Stopped as exc:
            print(exc.line, file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt as exc:
            signum = getattr(exc, 'signum', signal.SIGINT)
            print('interrupted' if signum == signal.SIGINT else 'interrupted by %s' % signal.Signals(signum).name,
                  file=sys.stderr)
            return 128 + signum
        except Exception as exc:  # noqa: BLE001 - the boundary: whatever it is, one line
            print('error: %s' % unexpected_error(command, exc, _debugging(argv)), file=sys.stderr)
            return 1
    return wrapper


def printed(text, command):
    """Print ``text`` to stdout now (buffer flushed); exit code 0, or 141 when stdout's
    reader has closed it, as the error boundary says it for the commands. For what prints
    outside a command's boundary (``gluon-unet --help``)."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        return _reader_gone(command)
    return 0


def _stdout_closed():
    """Whether standard output is a pipe whose reader has gone (its write end polls as an error)."""
    import select
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _reader_gone(command):
    """The reader of standard output closed it (``bin/evaluate ... | head``): stop quietly
    as a pipeline's writer does (exit 141, 128 + SIGPIPE), saying so on stderr if it is
    elsewhere. Everything the command had written to files is written; stdout is pointed
    at /dev/null so that the interpreter's last flush does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    try:
        print('%s: stopped writing: its standard output was closed (broken pipe)' % command, file=sys.stderr)
        sys.stderr.flush()
    except OSError:
        pass
    return 128 + int(signal.SIGPIPE)


def _debugging(argv):
    args = sys.argv[1:] if argv is None else list(argv)
    return '--debug' in args[:args.index('--') if '--' in args else len(args)] or \
        os.environ.get(DEBUG_VARIABLE, '') not in ('', '0')
