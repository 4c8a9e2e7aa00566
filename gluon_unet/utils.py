"""Small helpers shared across the package, and the one place every write passes.

Every file gluon_unet writes - checkpoints, exports, cache entries, CSVs, predictions,
the run folder's lock, ``config.json``, ``metrics.csv``, ``curves.png``, ``train.log`` -
passes :func:`write_point` once, and its failure becomes a :class:`~.errors.WriteError`:
one line naming the file and the cause. A test makes the Nth write fail with
:class:`WriteFaults` (in this process) or ``GLUON_UNET_FAIL_WRITE=N:ENOSPC`` (in a child).
"""
import contextlib
import errno
import os
import tempfile
import threading
import zlib


from .errors import WriteError, errno_words

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


# -- the one place every write passes ------------------------------------------------------

class WriteFaults:
    """Count the package's writes, or make the ``fail_at``-th one fail (for tests).

    Inside ``with WriteFaults(...) as faults:`` every :func:`write_point` appends its
    path to ``faults.paths``; the ``fail_at``-th (1-based) raises ``OSError(code)`` for
    that file, as the disk would. ``fail_at=None`` only counts.
    """

    _active = None
    _lock = threading.Lock()

    def __init__(self, fail_at=None, code=errno.ENOSPC):
        self.fail_at, self.code, self.paths = fail_at, code, []

    def hit(self, path):
        with self._lock:
            self.paths.append(path)
            fail = len(self.paths) == self.fail_at
        if fail:
            raise OSError(self.code, os.strerror(self.code), path)

    def __enter__(self):
        WriteFaults._active = self
        return self

    def __exit__(self, *exc):
        WriteFaults._active = None
        return False


#: The variable a child process reads its injected fault from: ``N:ENOSPC`` (N 1-based).
FAULT_ENV = 'GLUON_UNET_FAIL_WRITE'


def _env_faults():
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    if getattr(_env_faults, 'spec', None) != spec:  # parsed once per value
        n, _, name = spec.partition(':')
        _env_faults.spec, _env_faults.faults = spec, WriteFaults(int(n), getattr(errno, name or 'ENOSPC'))
    return _env_faults.faults


def write_point(path):
    """Called once for every file the package writes, before it becomes visible under
    ``path``: where :class:`WriteFaults` (or ``$GLUON_UNET_FAIL_WRITE``) makes a write
    fail. A no-op otherwise."""
    faults = WriteFaults._active or _env_faults()
    if faults is not None:
        faults.hit(path)


def write_failure(path, exc, folder=None):
    """The :class:`~.errors.WriteError` for ``exc``, raised while writing ``path``.

    An ``OSError`` carries its cause (``errno``). MXNet's writers (``nd.save``,
    ``export``) fail in C++ with ``FileStream.Write incomplete`` and no errno: the
    cause is read off the file system of ``folder`` (default: ``path``'s) - read-only,
    full (under 1 MiB free), or not writable for this user.
    """
    if isinstance(exc, WriteError):
        return exc
    code = getattr(exc, 'errno', None)
    if isinstance(exc, OSError) and code:
        return WriteError(path, errno_words(code), code)
    folder = folder or os.path.dirname(os.path.abspath(path))
    code = _file_system_errno(folder)
    if code:
        return WriteError(path, errno_words(code), code)
    from .errors import mxnet_message
    return WriteError(path, mxnet_message(exc, limit=120))


def _file_system_errno(folder):
    """Why nothing can be written in ``folder`` (EROFS, ENOSPC, EACCES), or None."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if st.f_bavail * st.f_frsize < 2 ** 20:
        return errno.ENOSPC
    if not os.access(folder, os.W_OK | os.X_OK):
        return errno.EACCES
    return None


def _is_mxnet_error(exc):
    return any(c.__name__ == 'MXNetError' for c in type(exc).__mro__)


@contextlib.contextmanager
def write_errors(path, folder=None):
    """Within the block, an ``OSError`` or MXNet error becomes the one-line
    :class:`~.errors.WriteError` for ``path`` (a string, or a callable giving it then)."""
    try:
        yield
    except (WriteError, KeyboardInterrupt):
        raise
    except Exception as exc:
        if not (isinstance(exc, OSError) or _is_mxnet_error(exc)):
            raise
        raise write_failure(path() if callable(path) else path, exc, folder) from None


def check_writable(path, flag, is_file=False):
    """Refuse, in one line before any work, an output ``path`` (a folder, or with
    ``is_file`` a file, written or replaced atomically) whose nearest existing folder
    cannot be written: ``flag`` names the option."""
    folder = os.path.abspath(path)
    if is_file:
        folder = os.path.dirname(folder)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        err = WriteError(folder, 'it is a file, so no folder can be made under it', errno.ENOTDIR)
    elif not os.access(folder, os.W_OK | os.X_OK):
        code = _file_system_errno(folder) or errno.EACCES
        err = WriteError(folder, errno_words(code), code)
    else:
        return
    err.args = ('%s %s: %s' % (flag, path, err.args[0]),)
    raise err


@contextlib.contextmanager
def atomic_path(path, shown=None):
    """Yield a temporary path next to ``path``; rename it into place only on success.

    Whatever is written there (by ``mx.nd.save``, ``savefig``, ``cv2.imwrite``...)
    appears at ``path`` all at once, so a crash or Ctrl-C never leaves a half-written
    file that looks complete; on failure the temporary file is removed.

    The file gets the permissions a plain ``open()`` would give it (0o666 minus the
    umask), not the owner-only 0o600 of ``tempfile.mkstemp``, so colleagues sharing the
    storage can read the run; an existing ``path`` is replaced with that mode too.

    A failure to write (an ``OSError``, or MXNet's ``FileStream.Write incomplete``) is a
    :class:`~.errors.WriteError` naming ``path`` (or ``shown``, where the file will be seen:
    e.g. an export's staging folder is moved into place later) and the cause; ``path``
    keeps what it held.
    """
    folder = os.path.dirname(os.path.abspath(path))
    shown = shown or path
    tmp = None
    try:
        with write_errors(shown, folder):
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix='.tmp-', suffix=os.path.splitext(path)[1], dir=folder)
            os.close(fd)
            os.chmod(tmp, file_mode())
            yield tmp
            write_point(shown)
            os.replace(tmp, path)
    finally:
        if tmp is not None and os.path.lexists(tmp):
            try:
                os.remove(tmp)
            except OSError:  # the folder turned read-only: nothing more can be done here
                pass


@contextlib.contextmanager
def atomic_open(path, mode='w', shown=None, **kwargs):
    """``open()`` for writing through :func:`atomic_path`."""
    with atomic_path(path, shown) as tmp:
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
# -- content digests --------------------------------------------------------------------------
#
# Checkpoints, exports and cache entries carry a CRC-32 of their content, checked when
# they are read: damage that keeps a file's size (a bad copy, storage errors, an edit in
# place) must stop a run, not train or predict silently. CRC-32 finds every burst error
# up to 32 bits and any other damage with probability 1 - 2**-32; it guards against
# accidents, not against someone forging a file. zlib's runs at ~4 GB/s on one core (sha256
# with SHA-NI ~1.7 GB/s, blake2b ~0.9 GB/s): checking a width-64 checkpoint with its Adam
# state (355 MB) adds ~0.16 s to its ~0.15 s load, a DSB cache at 256 px (332 MB) ~0.09 s
# (benchmarks/bench_digest.py).

#: The digest algorithm's name, stored with every digest (another one can follow).
DIGEST = 'crc32'


def crc32_of(chunks, crc=0):
    """CRC-32 of the concatenated ``chunks`` (bytes, or arrays: their raw bytes, C order),
    continuing from ``crc``; as 8 hex digits use ``'%08x' % value``."""
    for chunk in chunks:
        if not isinstance(chunk, (bytes, bytearray, memoryview)):  # an array: numpy only here (--help needs none)
            import numpy as np
            chunk = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
        crc = zlib.crc32(chunk, crc)
    return crc


def file_crc32(path, block=16 * 2 ** 20):
    """CRC-32 of the bytes of the file ``path``, read in ``block``-sized pieces."""
    crc = 0
    with open(path, 'rb') as f:
        while True:
            piece = f.read(block)
            if not piece:
                return crc
            crc = zlib.crc32(piece, crc)
