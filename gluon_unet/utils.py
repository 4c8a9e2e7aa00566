"""Small helpers shared across the package."""
import contextlib
import os
import tempfile


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path next to ``path``; rename it into place only on success.

    Whatever is written there (by ``mx.nd.save``, ``savefig``, ``cv2.imwrite``...)
    appears at ``path`` all at once, so a crash or Ctrl-C never leaves a half-written
    file that looks complete; on failure the temporary file is removed.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix='.tmp-', suffix=os.path.splitext(path)[1], dir=folder)
    os.close(fd)
    try:
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
