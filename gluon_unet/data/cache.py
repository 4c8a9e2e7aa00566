"""On-disk cache of decoded, preprocessed arrays.

A cache entry is a folder ``<cache_dir>/<key>/`` of raw little-endian arrays
(``images.bin``, ``masks.bin``, ...) and a ``meta.json`` describing their dtypes and
shapes. The key hashes the file list with every file's mtime and size, the
preprocessing options and :data:`CACHE_VERSION`, so changing a file, an option or the
decoding code gives a new key: a cache built with other options is never reused.

Loading memory-maps the arrays (``np.memmap(mode='r')``): opening a cache of any size
costs milliseconds and the OS pages data in (and out) as the loader touches it, so
memory stays bounded for large sets, and forked DataLoader workers share the pages.

Writing is atomic: the entry is built in a temporary sibling folder and renamed into
place with ``os.replace`` only once complete, so an interrupted build (Ctrl-C, a corrupt
file, a full disk) never leaves a half cache that a later run would trust. Without
write access the loader warns and runs without a cache.
"""
import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings

import numpy as np

from ..errors import UserError
from ..utils import dir_mode

#: Bump when decoding or preprocessing changes, so old caches are not reused.
CACHE_VERSION = 2  # 2: image kinds in the meta, denoise before the percentile stretch
log = logging.getLogger(__name__)


def fingerprint(files):
    """``[(abs path, mtime_ns, size), ...]`` of ``files``; a missing file is a UserError."""
    out = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError as e:
            raise UserError('%s: cannot read (%s)' % (f, e.strerror or e)) from None
        out.append((os.path.abspath(f), st.st_mtime_ns, st.st_size))
    return out


def _digest(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(',', ':')).encode()).hexdigest()


def cache_key(files, options, version=CACHE_VERSION, files_hash=None):
    """Hex key of a cache entry.

    Parameters
    ----------
    files : list of str
        Every input file, in the order the samples use them.
    options : dict
        JSON-serializable preprocessing options (size, crop, channels, ...).
    version : int
        Code version; see :data:`CACHE_VERSION`.
    files_hash : str, optional
        :func:`file_digest` of ``files`` if already computed (saves a second stat pass).

    Returns
    -------
    key : str
        Changes when any file's path, mtime or size, any option or the version changes.
    """
    if files_hash is None:
        files_hash = file_digest(files)
    return _digest({'files': files_hash, 'options': options, 'version': version})


def default_cache_dir(data_path=None):
    """``$XDG_CACHE_HOME/gluon_unet`` (``~/.cache/gluon_unet``), whatever the data.

    Never a folder inside the user's data: a data set is often shared, read-only or
    under version control, and a hidden cache there surprises its owner. Entries are
    keyed by the files' paths, sizes and times, so one cache serves every data set.
    """
    base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return os.path.join(base, 'gluon_unet')


class CacheEntry:
    """A loaded cache entry: ``meta`` (dict) and read-only memory-mapped ``arrays``."""

    def __init__(self, path, meta, arrays):
        self.path, self.meta, self.arrays = path, meta, arrays


def load(cache_dir, key):
    """Open the entry ``key`` in ``cache_dir``.

    Returns
    -------
    CacheEntry or None
        None when there is no complete entry for this key.
    """
    if not cache_dir:
        return None
    path = os.path.join(cache_dir, key[:24])
    try:
        with open(os.path.join(path, 'meta.json')) as f:
            meta = json.load(f)
        if meta.get('key') != key:
            return None
        arrays = {}
        for name, spec in meta['arrays'].items():
            fname = os.path.join(path, name + '.bin')
            shape = tuple(spec['shape'])
            if os.path.getsize(fname) != int(np.prod(shape)) * np.dtype(spec['dtype']).itemsize:
                log.warning('cache %s: %s has the wrong size; rebuilding', path, name)
                return None
            if int(np.prod(shape)) == 0:
                arrays[name] = np.zeros(shape, spec['dtype'])
            else:
                arrays[name] = np.memmap(fname, dtype=spec['dtype'], mode='r', shape=shape)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return CacheEntry(path, meta, arrays)


class CacheWriter:
    """Build a cache entry in a temporary folder; :meth:`commit` renames it into place.

    Use as a context manager: leaving the block without :meth:`commit` (an exception)
    deletes the temporary folder. Arrays are appended sample by sample with
    :meth:`append`, so nothing needs to fit in memory.
    """

    def __init__(self, cache_dir, key, source=None):
        self.cache_dir, self.key, self.source = cache_dir, key, source
        self.final = os.path.join(cache_dir, key[:24])
        self.tmp = tempfile.mkdtemp(prefix='.tmp-%s-' % key[:8], dir=cache_dir)
        os.chmod(self.tmp, dir_mode())  # mkdtemp's 0700 would hide a shared cache from colleagues
        self._files, self._specs = {}, {}

    def append(self, name, arr):
        """Append ``arr`` to the flat array ``name`` (dtype fixed by the first call)."""
        arr = np.ascontiguousarray(arr)
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(os.path.join(self.tmp, name + '.bin'), 'wb')
            self._specs[name] = [arr.dtype.str, 0]
        elif np.dtype(self._specs[name][0]) != arr.dtype:
            raise ValueError('cache array %s: dtype %s after %s' % (name, arr.dtype, self._specs[name][0]))
        arr.tofile(f)
        self._specs[name][1] += arr.size

    def commit(self, shapes, meta):
        """Write ``meta.json`` and move the entry into place.

        Parameters
        ----------
        shapes : dict
            ``name -> shape`` of every appended array (sizes must match what was written).
        meta : dict
            JSON-serializable information stored with the arrays.

        Returns
        -------
        str : the entry's folder.
        """
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        arrays = {}
        for name, shape in shapes.items():
            dtype, count = self._specs.get(name, [np.dtype(np.uint8).str, 0])
            if int(np.prod(shape)) != count:
                raise ValueError('cache array %s: shape %s but %d values written' % (name, shape, count))
            if name not in self._files:
                open(os.path.join(self.tmp, name + '.bin'), 'wb').close()
            arrays[name] = {'dtype': dtype, 'shape': list(shape)}
        meta = dict(meta, key=self.key, source=self.source, arrays=arrays, version=CACHE_VERSION)
        with open(os.path.join(self.tmp, 'meta.json'), 'w') as f:
            json.dump(meta, f)
        try:
            os.replace(self.tmp, self.final)
        except OSError:
            # The folder exists: a broken entry (truncated by hand, disk full) is replaced;
            # a valid one was committed by another process meanwhile and is equivalent.
            if load(self.cache_dir, self.key) is None:
                shutil.rmtree(self.final, ignore_errors=True)
                try:
                    os.replace(self.tmp, self.final)
                except OSError:
                    shutil.rmtree(self.tmp, ignore_errors=True)
            else:
                shutil.rmtree(self.tmp, ignore_errors=True)
        self._prune()
        return self.final

    def _prune(self):
        """Delete older entries of the same source (their files changed): they can never hit again...

        ...unless the files change back, which is rare enough not to keep them around.
        Entries of the same files with other options are kept (switching --size back and
        forth should not rebuild).
        """
        if self.source is None:
            return
        mine = self.source
        for n in os.listdir(self.cache_dir):
            p = os.path.join(self.cache_dir, n)
            if p == self.final or n.startswith('.'):
                continue
            try:
                with open(os.path.join(p, 'meta.json')) as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                continue
            old = meta.get('source') or {}
            if old.get('data') == mine.get('data') and old.get('files') != mine.get('files'):
                shutil.rmtree(p, ignore_errors=True)

    def abort(self):
        for f in self._files.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if os.path.isdir(self.tmp):
            self.abort()
        return False


def open_writer(cache_dir, key, source=None):
    """A :class:`CacheWriter`, or None with a warning when ``cache_dir`` is not writable."""
    try:
        os.makedirs(cache_dir, exist_ok=True)
        return CacheWriter(cache_dir, key, source)
    except OSError as e:
        msg = 'cache folder %s is not writable (%s); loading without a cache' % (cache_dir, e.strerror or e)
        warnings.warn(msg, stacklevel=2)
        log.warning(msg)
        return None


def file_digest(files):
    """Hash of the file list with mtimes and sizes (tells stale entries of one source)."""
    return _digest(fingerprint(files))
