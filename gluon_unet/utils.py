"""Small helpers shared across the package."""
import contextlib
import os
import tempfile
import threading

#: The process umask, read once by :func:`umask` (None until then).
_UMASK = None
_UMASK_LOCK = threading.Lock()


def umask():
    """The process umask, read once and cached.

    Python can only read the umask by setting it, so it is set to a restrictive 0o077
    for the instant it takes (a file another thread creates meanwhile is at worst
    private, never world-writable) and restored at once.
    """
    global _UMASK
    if _UMASK is None:
        with _UMASK_LOCK:
            if _UMASK is None:
                mask = os.umask(0o077)
                os.umask(mask)
                _UMASK = mask
    return _UMASK


def file_mode():
    """The mode ``open()`` gives a new file: 0o666 minus the umask (0o644 for umask 022)."""
    return 0o666 & ~umask()


def dir_mode():
    """The mode ``os.mkdir()`` gives a new folder: 0o777 minus the umask (0o755 for 022)."""
    return 0o777 & ~umask()


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path next to ``path``; rename it into place only on success.

    Whatever is written there (by ``mx.nd.save``, ``savefig``, ``cv2.imwrite``...)
    appears at ``path`` all at once, so a crash or Ctrl-C never leaves a half-written
    file that looks complete; on failure the temporary file is removed.

    The file gets the permissions a plain ``open()`` would give it (0o666 minus the
    umask), not the owner-only 0o600 of ``tempfile.mkstemp``, so colleagues sharing the
    storage can read the run; an existing ``path`` is replaced with that mode too.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix='.tmp-', suffix=os.path.splitext(path)[1], dir=folder)
    os.close(fd)
    try:
        os.chmod(tmp, file_mode())
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def atomic_open(path, mode='w', **kwargs):
    """``open()`` for writing through :func:`atomic_path`."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, **kwargs) as f:
            yield f


def read_json(path, label, max_bytes):
    """Parse the JSON file ``path``, refusing in one line what cannot be a small JSON file.

    ``label`` names it in messages (e.g. ``'--config cfg.json'``). Only a regular file of
    at most ``max_bytes`` is read (``/dev/zero`` or a FIFO would be read forever), and a
    document nested too deeply for the parser is an error, not a ``RecursionError``.

    Raises
    ------
    UserError
        Missing, not a regular file, too large, unreadable, not UTF-8, not JSON.
    """
    import json
    import stat

    from .errors import UserError
    try:
        info = os.stat(path)
    except OSError as exc:
        raise UserError('%s: cannot read it (%s)' % (label, exc.strerror or exc)) from None
    if not stat.S_ISREG(info.st_mode):
        raise UserError('%s: not a regular file (a JSON file is needed)' % label)
    if info.st_size > max_bytes:
        raise UserError('%s: %d bytes, more than the %d a file like this can hold' % (label, info.st_size, max_bytes))
    try:
        with open(path, 'rb') as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:  # grew since the stat
            raise UserError('%s: more than %d bytes, more than a file like this can hold' % (label, max_bytes))
        text = data.decode('utf-8')
    except OSError as exc:
        raise UserError('%s: cannot read it (%s)' % (label, exc.strerror or exc)) from None
    except UnicodeDecodeError as exc:
        raise UserError('%s: not UTF-8 text (%s)' % (label, exc)) from None
    try:
        return json.loads(text)
    except RecursionError:
        raise UserError('%s: JSON nested too deeply to read' % label) from None
    except ValueError as exc:
        raise UserError('%s: not valid JSON (%s)' % (label, exc)) from None
