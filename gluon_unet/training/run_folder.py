"""Run folders: one run per folder, held by a lock for the run's lifetime.

The policy (docs/reference/run-folder.md):

- Without ``--output``, every run gets a new folder: ``runs/unet``, then ``runs/unet-2``,
  ``runs/unet-3``... (``runs/demo...`` for the demo), like YOLO's ``exp2`` or Lightning's
  ``version_N``. ``--resume auto`` without ``--output`` continues the newest of them, and
  ``--resume PATH`` continues the run that checkpoint belongs to.
- An explicit ``--output`` that already holds a run is refused with one line offering
  ``--resume auto`` (continue it) or ``--overwrite`` (delete that run's files - only
  the files a run writes and gluon_unet recognises, :mod:`gluon_unet.paths` - and start
  over). A folder holds a run when it holds such files: a user's own ``predictions/``
  or ``export/`` with nothing of gluon_unet's in them does not count.
- While a run trains, ``<run>/.lock`` is locked (``flock``): a second process on the
  same folder stops with one line naming the holder. The OS drops the lock when the
  process dies, even on ``kill -9``, so a crashed run never blocks its own resume.
"""
import os

from ..errors import UserError
from ..outputs import OutputInUse, held_elsewhere, lock_folder
from ..paths import RUN_DIRS, holds_run, others_files, remove_files, remove_if_empty, remove_leftovers, run_files
from ..reporting import get_logger


def check_output_path(path, flag='--output'):
    """One-line errors for an ``--output`` that cannot become a folder we can write."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError('%s %s is a file, not a folder' % (flag, path))
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError('%s %s: %s is a file, so no folder can be made under it' % (flag, path, parent))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError('%s %s: %s is not writable' % (flag, path, parent))


def numbered_runs(base):
    """``base``, ``base-2``, ``base-3``... that exist, in order (up to the first gap)."""
    found = []
    for candidate in _candidates(base):
        if not os.path.exists(candidate):
            return found
        found.append(candidate)


def _candidates(base):
    k = 1
    while True:
        yield base if k == 1 else '%s-%d' % (base, k)
        k += 1


class RunFolder:
    """The folder a run writes to, locked until :meth:`release` (its ``.lock`` stays, naming
    the last holder). Use :func:`claim_run_folder` to get one."""

    def __init__(self, lock):
        self.path, self._lock = lock.path, lock

    def release(self, discard_if_empty=False):
        """Unlock; with ``discard_if_empty``, remove the folder if this run made it and
        wrote nothing there (bad input found after claiming it leaves no trace)."""
        self._lock.release(discard_if_empty=discard_if_empty)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.release(discard_if_empty=exc_type is not None)


def _lock(path):
    """The run folder ``path`` locked (created if needed), its ``.lock`` kept, and what a
    run or export killed half way left in it removed (:func:`~gluon_unet.paths.leftovers`)."""
    lock = lock_folder(path, '--output', 'run folder', keep_lock=True, holder='another run')
    # Ours now. Not predictions/ (bin/predict's, under its own lock), nor an export/ that
    # a bin/export holds: their writes in progress look the same.
    for sub in ('', 'checkpoints', 'demo_inputs', 'export'):
        if not (sub == 'export' and held_elsewhere(os.path.join(path, sub))):
            remove_leftovers(os.path.join(path, sub))
    return lock


def claim_run_folder(output, default_base, resume=None, overwrite=False):
    """Decide where a run writes, apply the policy above, and lock the folder.

    Parameters
    ----------
    output : str or None
        ``--output``; None picks a new numbered folder from ``default_base``.
    default_base : str
        E.g. ``'runs/unet'``.
    resume : str or None
        ``--resume`` (``'auto'`` or a checkpoint/run path).
    overwrite : bool
        ``--overwrite``: delete an existing run's files in ``output`` first.

    Returns
    -------
    RunFolder
        ``.path`` is the run folder; call ``.release()`` (or use ``with``) when done.
    """
    if overwrite and resume:
        raise UserError('--overwrite starts a run afresh and --resume continues one: give only one')
    if output is None and overwrite:
        raise UserError('--overwrite needs --output (without it, every run gets a new folder)')
    if output is None:
        output = default_output(default_base, resume)
    if output is not None:
        check_output_path(output)
        found = holds_run(output)
        if found and not resume and not overwrite:
            raise UserError('--output %s already holds a run (%s); continue it with --resume auto, start it '
                            'over with --overwrite, or choose another --output'
                            % (output, ', '.join(found)))
        if resume and resume != 'auto' and found and not _inside(resume, output):
            raise UserError('--resume %s: that checkpoint is not from the run in --output %s, which holds '
                            'another run; choose an empty --output' % (resume, output))
        lock = _lock(output)
        if overwrite:
            _remove_run_files(output)
        return RunFolder(lock)
    # A new numbered folder: the first free one we can lock (two runs started at the
    # same moment both see runs/unet free; the loser of the lock takes the next).
    for candidate in _candidates(default_base):
        check_output_path(candidate)
        if holds_run(candidate):
            continue
        try:
            lock = _lock(candidate)
        except OutputInUse:
            continue
        if holds_run(candidate):  # filled between our look and our lock
            lock.release()
            continue
        return RunFolder(lock)


def default_output(base, resume):
    """The folder of the run ``resume`` continues, or None for a new numbered one."""
    if not resume:
        return None
    if resume == 'auto':
        runs = [r for r in numbered_runs(base) if holds_run(r)]
        if not runs:
            raise UserError('--resume auto: no run to continue under %s*; give --output' % base)
        return runs[-1]
    path = os.path.normpath(resume)
    if os.path.isdir(path):
        return resume if holds_run(resume) else None
    # <run>/checkpoints/epochNNNN.ckpt -> <run>
    folder = os.path.dirname(path)
    if os.path.basename(folder) == 'checkpoints' and holds_run(os.path.dirname(folder)):
        return os.path.dirname(folder)
    return None


def _inside(path, folder):
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def _remove_run_files(folder):
    """``--overwrite``: delete the files the run wrote one by one, then its subfolders
    if that left them empty; anything else (a user's files, ``bin/predict``'s output,
    another run's export: :func:`~gluon_unet.paths.run_files`) stays and is named in one line."""
    remove_files(folder, run_files(folder))
    for name in RUN_DIRS:
        remove_if_empty(os.path.join(folder, name))
    kept = others_files(folder)
    if kept:
        get_logger().warning('--overwrite %s: kept what this run did not write: %s', folder, kept)
