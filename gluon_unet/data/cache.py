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
write access - or when writing fails (a full disk) - the loader warns in one line and
runs without a cache.

Every array's CRC-32 is stored in ``meta.json`` and checked when the entry is opened: an
entry damaged on disk since (a bad copy, storage errors, an edit in place) is rebuilt,
never trained on, with one line saying so. Entries written before the digests are
rebuilt once for the same reason: nothing could tell them from damaged ones.
"""
import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings

import numpy as np

from ..errors import UserError, errno_words
from ..utils import DIGEST, crc32_of, dir_mode, write_errors, write_point

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


def load(cache_dir, key, verify=True, report=True):
    """Open the entry ``key`` in ``cache_dir``.

    With ``verify`` (the default) every array is read once and checked against the CRC-32
    written with it; a damaged entry, or one written before digests, is reported in one
    line (unless ``report`` is False) and treated as missing (the caller rebuilds it).

    Returns
    -------
    CacheEntry or None
        None when there is no complete, intact entry for this key.
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
            if verify and not intact(fname, spec, arrays[name], report):
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return CacheEntry(path, meta, arrays)


def intact(fname, spec, array, report=True):
    """Whether ``array`` (read from ``fname``) matches the digest in its ``spec``; with
    ``report``, says why not in one line."""
    stored = spec.get(DIGEST)
    if stored is None:
        if report:
            log.warning('cache %s was written before content digests; rebuilding it once', os.path.dirname(fname))
        return False
    if '%08x' % crc32_of([array]) != stored:
        if report:
            log.warning('cache %s is damaged: its content does not match the digest written with it; rebuilding '
                        'the entry (nothing was trained on it)', fname)
        return False
    return True


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
        self._files, self._specs, self._crcs = {}, {}, {}

    def append(self, name, arr):
        """Append ``arr`` to the flat array ``name`` (dtype fixed by the first call)."""
        arr = np.ascontiguousarray(arr)
        f = self._files.get(name)
        with write_errors(os.path.join(self.final, name + '.bin'), self.cache_dir):
            if f is None:
                write_point(os.path.join(self.final, name + '.bin'))
                f = self._files[name] = open(os.path.join(self.tmp, name + '.bin'), 'wb')
                self._specs[name], self._crcs[name] = [arr.dtype.str, 0], 0
            elif np.dtype(self._specs[name][0]) != arr.dtype:
                raise ValueError('cache array %s: dtype %s after %s' % (name, arr.dtype, self._specs[name][0]))
            arr.tofile(f)
        self._specs[name][1] += arr.size
        self._crcs[name] = crc32_of([arr], self._crcs[name])

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
        for name, f in self._files.items():
            with write_errors(os.path.join(self.final, name + '.bin'), self.cache_dir):
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
            arrays[name] = {'dtype': dtype, 'shape': list(shape), DIGEST: '%08x' % self._crcs.get(name, 0)}
        meta = dict(meta, key=self.key, source=self.source, arrays=arrays, version=CACHE_VERSION)
        with write_errors(os.path.join(self.final, 'meta.json'), self.cache_dir):
            with open(os.path.join(self.tmp, 'meta.json'), 'w') as f:
                json.dump(meta, f)
            write_point(os.path.join(self.final, 'meta.json'))
        try:
            os.replace(self.tmp, self.final)
        except OSError:
            # The folder exists: a broken entry (truncated by hand, disk full) is replaced;
            # a valid one was committed by another process meanwhile and is equivalent.
            if load(self.cache_dir, self.key, report=False) is None:
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
        cause = errno_words(e.errno) if e.errno else str(e)
        no_cache('cache folder %s is not writable (%s)' % (cache_dir, cause))
        return None


class CacheWarning(UserWarning):
    """The data loads without a cache (``bin/train`` shows only the log line, once)."""


def no_cache(why):
    """Say, in one line (a :class:`CacheWarning` and the log), that the data loads without
    a cache because of ``why`` (e.g. a :class:`~gluon_unet.errors.WriteError`)."""
    msg = '%s; loading without a cache (the data is decoded in memory)' % why
    warnings.warn(msg, CacheWarning, stacklevel=3)
    log.warning(msg)


def file_digest(files):
    """Hash of the file list with mtimes and sizes (tells stale entries of one source)."""
    return _digest(fingerprint(files))
