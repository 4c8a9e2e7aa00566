"""One contract for what every command writes: ``train``, ``predict``, ``export``, ``evaluate``.

Before any work, each command

1. names its outputs and its inputs: :func:`check_apart` refuses an output that is, or
   lies inside, an input (the data, the model, the run it exports, the data cache), and
   one output that is, or lies inside, another output of the same command where that one
   writes its own files (``predict --rle`` naming one of predict's masks or its manifest);
2. locks each output for the whole command (:func:`lock_folder`, :func:`lock_file`): a
   second command writing the same folder or file at the same time stops with one line
   naming the process that holds it;
3. reads the output's record - who wrote what is there: a run folder's ``config.json``, an
   export's ``model.json`` (:func:`check_owner`), a prediction folder's manifest, a CSV's
   header (:func:`check_replaceable`) - and refuses to replace another run's, model's or
   user's files unless ``--overwrite`` says so (files gluon_unet did not write are never
   replaced: :mod:`gluon_unet.paths`);

and writes that record last, and true: a prediction manifest says ``complete`` only when
every image was written, else what stopped it (``SIGTERM after 4 of 10 images``).

This module imports nothing heavy (no mxnet, no numpy): every command and the ONNX
environment use it.
"""
import errno
import fcntl
import os
import socket
import time

from .errors import UserError, WriteError, errno_words
from .utils import write_errors, write_point

#: The lock file of an output folder (a run's stays: it names its holder for the next one).
LOCK_NAME = '.lock'


class OutputInUse(UserError):
    """Another process holds the lock of an output (:func:`lock_folder`, :func:`lock_file`)."""


class OutputLock:
    """An output (folder or file) locked by this process until :meth:`release`."""

    def __init__(self, path, fd, lock_path, created, keep_lock):
        self.path, self._fd, self._lock_path = path, fd, lock_path
        self._created, self._keep = created, keep_lock

    def release(self, discard_if_empty=False):
        """Unlock. The lock file goes unless it is to be kept (a run folder's); with
        ``discard_if_empty``, so do the folders this lock created, when nothing else
        was written there (bad input found after locking leaves no trace)."""
        if self._fd is None:
            return
        folder = os.path.dirname(self._lock_path)
        discard = discard_if_empty and self._created and \
            set(os.listdir(folder)) <= {os.path.basename(self._lock_path)}
        if not self._keep or discard:
            _remove(self._lock_path)  # while still locked: no one can hold the old inode
        os.close(self._fd)
        self._fd = None
        if discard:
            _remove_created(folder, self._created)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.release(discard_if_empty=exc_type is not None)


def lock_folder(path, flag='--output', what='output folder', keep_lock=False, holder='another process'):
    """Create the folder ``path`` if needed and lock it for this process.

    Parameters
    ----------
    path : str
        The folder a command writes into.
    flag : str
        Its flag, for the messages (``'--output'``).
    what : str
        What it is, for the messages (``'run folder'``).
    keep_lock : bool
        Leave ``.lock`` in the folder after :meth:`OutputLock.release` (a run folder's:
        the next process to lock it finds who held it).
    holder : str
        What holds it when another process does, for the message (``'another run'``).

    Raises
    ------
    OutputInUse
        Another process holds it (the message names that process).
    UserError
        It cannot be created or locked.
    """
    created = _missing_top(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        _remove_created(path, created)
        raise UserError('%s %s: cannot create the %s (%s)' % (flag, path, what, errno_words(exc.errno))) from None
    return _lock(path, os.path.join(path, LOCK_NAME), flag, what, created, keep_lock, holder)


def lock_file(path, flag):
    """Lock the output file ``path`` (which may not exist yet) for this process: through
    ``.<name>.lock`` beside it, removed by :meth:`OutputLock.release`, its folder made if
    needed (and removed again if the command fails before writing into it). Raises
    :class:`OutputInUse` naming the holder when another process writes the same file."""
    folder, name = os.path.split(os.path.abspath(path))
    created = _missing_top(folder)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        _remove_created(folder, created)
        raise UserError('%s %s: cannot create its folder (%s)' % (flag, path, errno_words(exc.errno))) from None
    return _lock(path, os.path.join(folder, '.%s.lock' % name), flag, 'file', created, False)


def held_elsewhere(folder):
    """True when the lock of the output ``folder`` (:func:`lock_folder`) is held by another
    process - or by this one: ``flock`` tells open files apart, not processes."""
    try:
        fd = os.open(os.path.join(folder, LOCK_NAME), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def holder_of(lock_path):
    """``'pid 123 on host since ...'``: who holds (or last held) a lock file; '' if unknown."""
    try:
        with open(lock_path, 'rb') as f:
            return f.read(200).decode(errors='replace').strip()
    except OSError:
        return ''


def _lock(path, lock_path, flag, what, created, keep_lock, holder_words='another process'):
    # The lock file may be removed by its holder as it releases; a file opened just
    # before that removal locks an inode no one else will see, so the path is checked to
    # still be that file once locked, and the lock retried on a new one if not.
    for _ in range(20):
        try:
            new = not os.path.lexists(lock_path)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            _remove_created(path, created)
            raise UserError('%s %s: cannot lock the %s (%s)' % (flag, path, what, errno_words(exc.errno))) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = holder_of(lock_path)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                _remove_created(path, created)
                raise OutputInUse('%s %s is in use by %s (%s); wait for it to end or choose another %s'
                                  % (flag, path, holder_words, holder or 'unknown process', flag)) from None
            raise UserError('%s %s: cannot lock the %s (%s)' % (flag, path, what, exc.strerror)) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        break
    else:
        raise UserError('%s %s: cannot lock the %s (its lock file keeps changing)' % (flag, path, what))
    # Who holds it, for the other process's message. A kept lock (a run folder's) is the
    # command's first write: a full or read-only disk stops it here, before any work. A
    # transient lock locks without its text; the command's first real write says why.
    holder = ('pid %d on %s since %s\n' % (os.getpid(), socket.gethostname(),
                                           time.strftime('%Y-%m-%d %H:%M:%S'))).encode()
    try:
        with write_errors(lock_path):
            if keep_lock:
                write_point(lock_path)
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder, 0)
    except WriteError as exc:
        if keep_lock:
            if new:
                _remove(lock_path)
            os.close(fd)
            _remove_created(path, created)
            raise exc.add('nothing was written (%s %s)' % (flag, path)) from None
    return OutputLock(path, fd, lock_path, created, keep_lock)


def _missing_top(path):
    """The outermost folder of ``path`` that does not exist yet (None if it exists)."""
    created, top = None, os.path.abspath(path)
    while not os.path.isdir(top):
        created, top = top, os.path.dirname(top)
    return created


def _remove(path):
    try:
        os.remove(path)
    except OSError:
        pass


def _remove_created(path, created):
    """Remove ``path`` and its parents up to ``created`` (the outermost folder a lock
    made), each only while empty."""
    if not created:
        return
    folder = os.path.abspath(path)
    if not os.path.isdir(folder):  # a file's lock: from the folder it is in
        folder = os.path.dirname(folder)
    try:
        while True:
            os.rmdir(folder)
            if folder == created:
                break
            folder = os.path.dirname(folder)
    except OSError:
        pass


# -- inputs that are what their flag takes --------------------------------------------------------

def check_inputs(inputs):
    """Refuse, in one line, an input that is missing or is not the kind of path its flag
    takes: a FIFO, a device or a socket is never an image, a folder or a file to read
    (opening a FIFO to read it would wait forever).

    Parameters
    ----------
    inputs : iterable of (label, path, kinds)
        ``kinds``: what the flag takes, ``'file'``, ``'folder'`` or both (``'file|folder'``);
        a None path is skipped.
    """
    for label, path, kinds in inputs:
        if path is None:
            continue
        wanted = kinds.replace('|', ' or ')
        if not os.path.exists(path):
            raise UserError('%s %s: no such %s' % (label, path, wanted))
        kind = 'folder' if os.path.isdir(path) else 'file' if os.path.isfile(path) else None
        if kind is None:
            raise UserError('%s %s: is not a regular file or a folder (a FIFO, device or socket); give a %s'
                            % (label, path, wanted))
        if kind not in kinds.split('|'):
            raise UserError('%s %s: is a %s; give a %s' % (label, path, kind, wanted))


# -- outputs apart from inputs and from each other -------------------------------------------------

def check_apart(outputs, inputs, command, own=()):
    """Refuse, in one line, an output that is an input or lies inside an input folder,
    or an output that another output of the command writes.

    Paths are compared resolved (``realpath``: symbolic links, ``..``), and existing
    files by identity too (``samefile``: hard links, bind mounts).

    Parameters
    ----------
    outputs : iterable of (label, path)
        What ``command`` writes, e.g. ``('--rle', 'sub.csv')``; a None path is skipped.
        No two may be the same path.
    inputs : iterable of (label, path)
        What it reads: files and folders, e.g. ``('--input', 'images/')``.
    command : str
        The command, for the message (``'predict'``).
    own : iterable of (label, folder, is_own)
        Output folders and which of the names in them the command writes there
        (``is_own(name)``): another output inside such a folder must not be one of them.

    Raises
    ------
    UserError
        Naming the output, the input (or the other output) and what to do.
    """
    outputs = [(label, path) for label, path in outputs if path]
    inputs = [(label, path, os.path.realpath(path)) for label, path in inputs if path]
    for out_label, out in outputs:
        real = os.path.realpath(out)
        for in_label, path, in_real in inputs:
            if _same(out, path, real, in_real):
                raise UserError('%s %s is %s %s, which %s reads: an output never replaces an input; choose '
                                'another %s' % (out_label, out, in_label, path, command, out_label))
            if os.path.isdir(in_real) and real.startswith(in_real.rstrip(os.sep) + os.sep):
                raise UserError('%s %s lies inside %s %s, which %s reads: outputs never go into inputs; choose '
                                'another %s' % (out_label, out, in_label, path, command, out_label))
    for i, (label, out) in enumerate(outputs):
        for other_label, other in outputs[i + 1:]:
            if _same(out, other, os.path.realpath(out), os.path.realpath(other)):
                raise UserError('%s %s and %s %s are the same path: %s writes both; give them two paths'
                                % (label, out, other_label, other, command))
    for label, out in outputs:
        real = os.path.realpath(out)
        for folder_label, folder, is_own in own:
            inside = os.path.realpath(folder).rstrip(os.sep) + os.sep
            if real.startswith(inside) and is_own(os.path.relpath(real, inside)):
                raise UserError('%s %s is one of the files %s writes in %s %s; choose another %s'
                                % (label, out, command, folder_label, folder, label))


def _same(a, b, real_a, real_b):
    if real_a == real_b:
        return True
    try:
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


# -- who wrote what is there ----------------------------------------------------------------------

def check_replaceable(path, first_line, label, what):
    """Refuse, in one line, an output file named on the command line that exists but is not
    one gluon_unet wrote: ``what`` (e.g. 'a DSB submission') is recognised by its first
    line starting with ``first_line``."""
    if not path or not os.path.lexists(path):
        return
    head = b''
    if os.path.isfile(path):
        try:
            with open(path, 'rb') as f:
                head = f.readline(len(first_line) + 1)
        except OSError:
            pass
    if not head.startswith(first_line.encode()):
        raise UserError('%s %s exists and is not %s gluon_unet wrote (its first line does not start with %s); '
                        'choose another file, or move it' % (label, path, what, first_line))


def check_owner(flag, path, theirs, ours, what, overwrite):
    """Refuse, in one line, to replace the ``what`` (e.g. 'export') in ``path`` that its
    record says another source wrote, unless ``overwrite``.

    ``theirs`` / ``ours``: how the record names who wrote it (e.g. a run folder), or None
    for a record that does not say (older files: replaced only with ``overwrite``).
    """
    if theirs == ours or overwrite:
        return
    other = 'from %s' % theirs if theirs else 'whose source it does not record'
    raise UserError('%s %s holds an %s %s, not from %s; %s into another folder, or add --overwrite to replace it'
                    % (flag, path, what, other, ours, what))
