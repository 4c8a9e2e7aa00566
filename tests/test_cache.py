"""The on-disk cache: reuse, invalidation, atomic writes, read-only fallback."""
import os

import cv2
import numpy as np
import pytest

import gluon_unet.data.readers as readers
from gluon_unet.data import load_dataset, synthetic_nuclei
from gluon_unet.data import cache as cache_mod
from gluon_unet.errors import UserError

N = 4


@pytest.fixture
def data(tmp_path):
    images, masks, _ = synthetic_nuclei(N, size=40, channels=1, seed=5)
    (tmp_path / 'im').mkdir()
    (tmp_path / 'mk').mkdir()
    for i in range(N):
        cv2.imwrite(str(tmp_path / 'im' / ('a%d.png' % i)), images[i])
        cv2.imwrite(str(tmp_path / 'mk' / ('a%d_mask.png' % i)), masks[i] * 255)
    return str(tmp_path / 'im'), str(tmp_path / 'mk'), str(tmp_path / 'cache')


@pytest.fixture
def counter(monkeypatch):
    """Counts decode_sample calls (in-process: workers=0)."""
    calls = []
    real = readers.decode_sample

    def counting(*args, **kw):
        calls.append(args[0].name)
        return real(*args, **kw)
    monkeypatch.setattr(readers, 'decode_sample', counting)
    return calls


def load(data, **kw):
    im, mk, cache = data
    kw.setdefault('cache_dir', cache)
    return load_dataset(im, mk, size=32, workers=0, progress=False, **kw)


def test_second_load_hits_cache_memmapped(data, counter):
    a = load(data)
    assert len(counter) == N
    b = load(data)
    assert len(counter) == N  # nothing decoded again
    assert isinstance(b.images, np.memmap) and isinstance(b.masks, np.memmap)
    assert not b.images.flags.writeable
    np.testing.assert_array_equal(np.asarray(a.images), np.asarray(b.images))
    np.testing.assert_array_equal(np.asarray(a.instances(2)), np.asarray(b.instances(2)))
    assert b.names == a.names and b.original_sizes == a.original_sizes == [(40, 40)] * N
    assert b.channels == a.channels == 1
    entries = [n for n in os.listdir(data[2]) if not n.startswith('.')]
    assert len(entries) == 1


@pytest.mark.parametrize('change', [dict(size=24), dict(channels=3), dict(crop=16)])
def test_other_options_rebuild(data, counter, change):
    load(data)
    kw = dict(change)
    im, mk, cache = data
    ds = load_dataset(im, mk, **dict(dict(size=32, workers=0, progress=False, cache_dir=cache), **kw))
    assert len(counter) == 2 * N
    if 'size' in kw:
        assert ds.images.shape[1] == 24
    if 'channels' in kw:
        assert ds.images.shape[-1] == 3 and ds.channels == 3
    if 'crop' in kw:
        assert ds.images[0].shape == (40, 40, 1)
    load(data)  # the first options' entry is still there
    assert len(counter) == 2 * N


def test_changed_file_rebuilds_and_prunes_stale(data, counter):
    load(data)
    im, mk, cache = data
    new = np.zeros((40, 40), np.uint8)
    new[5:15, 5:15] = 255
    path = os.path.join(mk, 'a1_mask.png')
    cv2.imwrite(path, new)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))  # mtime surely differs
    ds = load(data)
    assert len(counter) == 2 * N
    expect = cv2.resize((new > 0).astype(np.uint8), (32, 32), interpolation=cv2.INTER_NEAREST)
    np.testing.assert_array_equal(ds.masks[1], expect)
    entries = [n for n in os.listdir(cache) if not n.startswith('.')]
    assert len(entries) == 1  # the stale entry of the old files was removed


def test_interrupted_build_leaves_no_cache(data, monkeypatch):
    real = readers.decode_sample
    seen = []

    def failing(*args, **kw):
        seen.append(1)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return real(*args, **kw)
    monkeypatch.setattr(readers, 'decode_sample', failing)
    with pytest.raises(KeyboardInterrupt):
        load(data)
    cache = data[2]
    assert os.listdir(cache) == []  # neither an entry nor a temporary folder
    monkeypatch.setattr(readers, 'decode_sample', real)
    ds = load(data)
    assert len(ds) == N


def test_unwritable_cache_dir_warns_and_loads(data, tmp_path, counter):
    blocker = tmp_path / 'file'
    blocker.write_text('not a folder')  # works as root too, unlike chmod
    with pytest.warns(UserWarning, match='not writable.*without a cache'):
        ds = load(data, cache_dir=str(blocker / 'cache'))
    assert len(ds) == N and not isinstance(ds.images, np.memmap)
    assert ds.images.shape == (N, 32, 32, 1)


def test_corrupt_cache_entry_is_rebuilt(data, counter):
    load(data)
    cache = data[2]
    entry = [n for n in os.listdir(cache) if not n.startswith('.')][0]
    with open(os.path.join(cache, entry, 'images.bin'), 'r+b') as f:
        f.truncate(10)
    ds = load(data)
    assert len(counter) == 2 * N
    assert ds.images.shape == (N, 32, 32, 1)


def test_key_depends_on_everything(tmp_path):
    f = tmp_path / 'a.png'
    f.write_bytes(b'x')
    k = cache_mod.cache_key([str(f)], {'size': 32})
    assert k == cache_mod.cache_key([str(f)], {'size': 32})
    assert k != cache_mod.cache_key([str(f)], {'size': 64})
    assert k != cache_mod.cache_key([str(f)], {'size': 32}, version=cache_mod.CACHE_VERSION + 1)
    f.write_bytes(b'xy')
    assert k != cache_mod.cache_key([str(f)], {'size': 32})


def test_workers_give_same_arrays(data):
    a = load(data, cache_dir=False)
    im, mk, _ = data
    b = load_dataset(im, mk, size=32, workers=2, progress=False, cache_dir=False)
    np.testing.assert_array_equal(a.images, b.images)
    np.testing.assert_array_equal(a.masks, b.masks)


def test_cache_entries_get_the_umask_mode_so_a_shared_cache_is_readable(data, monkeypatch):
    import stat
    from gluon_unet import utils
    old = os.umask(0o022)
    monkeypatch.setattr(utils, '_UMASK', None, raising=False)
    try:
        load(data)
    finally:
        os.umask(old)
        monkeypatch.setattr(utils, '_UMASK', None, raising=False)
    entry = [os.path.join(data[2], n) for n in os.listdir(data[2]) if not n.startswith('.')][0]
    assert stat.S_IMODE(os.stat(entry).st_mode) == 0o755
    for name in os.listdir(entry):
        assert stat.S_IMODE(os.stat(os.path.join(entry, name)).st_mode) == 0o644, name


def test_load_options_object_and_keywords_read_the_same_entry(data, counter):
    from gluon_unet.data import LoadOptions
    im, mk, cache = data
    opts = LoadOptions(size=32, workers=0, progress=False, cache_dir=cache)
    a = load_dataset(im, mk, opts)
    b = load_dataset(im, mk, size=32, workers=0, progress=False, cache_dir=cache)
    assert len(counter) == N and a.names == b.names   # the second load hit the first one's entry
    c = load_dataset(im, mk, opts, crop=16)            # keywords override fields of the object
    assert len(counter) == 2 * N and c.original_sizes == [(40, 40)] * N and opts.crop == 0
    with pytest.raises(TypeError):
        load_dataset(im, mk, opts, colour=True)


@pytest.mark.parametrize('field, value, flag', [('channels', 2, '--channels'), ('normalize', 'x', '--normalize'),
                                                ('crop', -1, '--crop'), ('size', 0, '--size')])
def test_load_options_name_the_flag(field, value, flag):
    from gluon_unet.data import LoadOptions
    with pytest.raises(UserError, match='^%s ' % flag):
        LoadOptions(**{field: value}).validate()


def test_the_default_cache_is_in_the_users_cache_folder_not_in_the_data(data, monkeypatch, tmp_path):
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
    im, mk, _ = data
    load_dataset(im, mk, size=32, workers=0, progress=False)  # cache_dir not given
    assert os.listdir(str(tmp_path / 'xdg' / 'gluon_unet'))
    assert not [n for n in os.listdir(os.path.dirname(im)) if 'cache' in n]
    assert cache_mod.default_cache_dir() == str(tmp_path / 'xdg' / 'gluon_unet')
