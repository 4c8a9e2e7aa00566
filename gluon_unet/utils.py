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
