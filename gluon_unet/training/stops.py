"""How a training run stops early, and what it keeps: Ctrl-C / SIGTERM during an epoch
(:class:`StopFlag`: the step finishes, a resumable checkpoint is saved) or after the last
one (:class:`AfterTraining`: the search stops, the export finishes), and a write that
fails (:func:`on_write_error`): each ends in one line saying what is intact and which
command continues (:func:`kept_note`).
"""
import contextlib
import os
import signal
import threading

from ..checkpoint import list_checkpoints
from ..errors import Stopped, WriteError, stop_signals
from ..inference.export import ExportError


class Interrupted(Stopped):
    """Ctrl-C / SIGTERM / SIGHUP: training stopped, saying what it keeps; ``exit_code`` is
    128 + the signal (130, 143, 129)."""


class StopFlag:
    """Set by SIGINT/SIGTERM/SIGHUP (:func:`~gluon_unet.errors.stop_signals`); the loop
    checks it after each step."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in stop_signals():
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:  # a second Ctrl-C: the user really wants out
            raise KeyboardInterrupt
        self.signum = signum

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


class AfterTraining:
    """SIGINT/SIGTERM after the last epoch: the post-processing search is stopped at once
    (it writes nothing), the export is finished first (a second signal stops it too).
    Either way the run ends with :class:`Interrupted` saying that training is complete
    and which command finishes the job - never silently, never with a traceback."""

    def __init__(self, cfg, recorder, state, pending=None):
        self.cfg, self.recorder, self.state = cfg, recorder, state
        self.stage, self.signum, self._old, self._pid = 'search', None, {}, os.getpid()
        self.pending = pending  # a signal that came as the epochs ended: honoured first

    def __enter__(self):
        if self.pending is not None:
            raise Interrupted('%s as the last epoch (%d) ended: %s'
                              % (signal.Signals(self.pending).name, self.state.epoch,
                                 kept_note(self.cfg, complete=True, unexported=True)), 128 + self.pending)
        if threading.current_thread() is threading.main_thread() and self.recorder.enabled:
            self._old = {sig: signal.signal(sig, self._handle) for sig in stop_signals()}
        return self

    def exporting(self):
        """The search is over; the export begins."""
        self.stage = 'export'

    def _handle(self, signum, frame):
        if os.getpid() != self._pid:  # a forked child that inherited the handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.stage == 'export' and self.signum is None:
            self.signum = signum  # finished first: a half-replaced export would be worse
            return
        self.signum = signum
        raise Interrupted('%s during the %s after the last epoch (%d): %s'
                          % (signal.Signals(signum).name,
                             'post-processing search' if self.stage == 'search' else 'export',
                             self.state.epoch, kept_note(self.cfg, complete=True, unexported=True)), 128 + signum)

    def __exit__(self, exc_type, exc, tb):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}
        if exc_type is None and self.signum is not None:
            raise Interrupted('%s during the export after the last epoch (%d): the export was finished first; '
                              'the run is complete (%s)' % (signal.Signals(self.signum).name, self.state.epoch,
                                                           os.path.join(self.cfg.output, 'export')),
                              128 + self.signum)
        return False


@contextlib.contextmanager
def on_write_error(cfg, complete):
    """A :class:`~.errors.WriteError` in the block - or, after the epochs, a failed
    export in a subprocess - says what the run keeps (:func:`kept_note`)."""
    try:
        yield
    except WriteError as exc:
        raise exc.add(kept_note(cfg, complete)) from None
    except ExportError as exc:
        if not complete:
            raise
        exc.args = ('%s; %s' % (exc.args[0], kept_note(cfg, complete)),)
        raise exc from None


def kept_note(cfg, complete, unexported=False):
    """What a run stopped by a failed write or a signal keeps, and how to go on (a note
    for its one-line error); ``unexported``: say that the export was not written."""
    folder = os.path.join(cfg.output, 'checkpoints')
    if complete:
        best = os.path.join(folder, 'best.ckpt')
        return ('training is complete and its checkpoints are intact (best: %s)%s; finish with %s, or the same '
                'bin/train command with --resume auto'
                % (best, ', the export was not written' if unexported else '', finish_command(cfg)))
    found = list_checkpoints(folder) if os.path.isdir(folder) else []
    if not found:
        return 'no checkpoint had been written yet'
    return 'the last good checkpoint %s is intact: once the folder can be written, continue with --resume auto' \
        % found[-1]


def finish_command(cfg):
    """The command that does what a run does after its last epoch: the search (when the
    run does one) and the export."""
    command = 'bin/export %s' % cfg.output
    if cfg.tune_postprocess:
        command += ' --tune-postprocess'
        command += ' --mode %s' % cfg.tune_mode if cfg.tune_mode != 'auto' else ''
        command += ' --tta' if cfg.tune_tta else ''
    return command
