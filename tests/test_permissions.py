"""Run files and exports get the permissions the umask allows, like a plain open() or
mkdir() - not the 0600/0700 of tempfile.mkstemp/mkdtemp - so colleagues on shared
storage can read them (issue 12)."""
import os
import stat

import mxnet as mx
import pytest

from conftest import export_names
from gluon_unet import utils
from gluon_unet.checkpoint import save_checkpoint
from gluon_unet.inference.export import export_checkpoint
from gluon_unet.model import build_model
from gluon_unet.utils import atomic_open, atomic_path


@pytest.fixture(params=[(0o022, 0o644, 0o755), (0o077, 0o600, 0o700), (0o002, 0o664, 0o775)],
                ids=['umask022', 'umask077', 'umask002'])
def umask(request, monkeypatch):
    """Run the test under a umask; yields (umask, file mode, folder mode) expected."""
    mask, file_mode, dir_mode = request.param
    old = os.umask(mask)
    monkeypatch.setattr(utils, '_UMASK', None, raising=False)  # forget a umask read earlier
    try:
        yield mask, file_mode, dir_mode
    finally:
        os.umask(old)
        monkeypatch.setattr(utils, '_UMASK', None, raising=False)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_files_get_the_umask_mode(tmp_path, umask):
    _, file_mode, dir_mode = umask
    path = tmp_path / 'sub' / 'log.csv'
    with atomic_open(str(path)) as f:
        f.write('epoch\n1\n')
    assert path.read_text() == 'epoch\n1\n'
    assert oct(_mode(path)) == oct(file_mode)
    assert oct(_mode(tmp_path / 'sub')) == oct(dir_mode)
    # overwriting keeps atomicity (temp file + rename: no leftovers) and the mode
    with atomic_open(str(path)) as f:
        f.write('epoch\n2\n')
    assert oct(_mode(path)) == oct(file_mode) and os.listdir(tmp_path / 'sub') == ['log.csv']
    # atomic_path: whatever writes the temporary path (here MXNet) gets the same mode
    params = tmp_path / 'w.params'
    with atomic_path(str(params)) as tmp:
        mx.nd.save(tmp, {'w': mx.nd.zeros((2,))})
    assert oct(_mode(params)) == oct(file_mode)
    # a failed write leaves nothing behind
    with pytest.raises(ValueError):
        with atomic_open(str(tmp_path / 'x.txt')) as f:
            f.write('half')
            raise ValueError
    assert not (tmp_path / 'x.txt').exists()
    assert sorted(os.listdir(tmp_path)) == ['sub', 'w.params']


def test_export_folder_and_checkpoint_get_the_umask_mode(tiny, tmp_path, umask):
    _, file_mode, dir_mode = umask
    cfg = tiny()
    net = build_model(cfg.model)
    net.initialize(ctx=mx.cpu())
    net(mx.nd.zeros((1, 1, 32, 32)))
    ckpt = tmp_path / 'best.ckpt'
    save_checkpoint(str(ckpt), net, None, {'epoch': 1, 'config': cfg.to_dict()})
    assert oct(_mode(ckpt)) == oct(file_mode)
    out = tmp_path / 'run' / 'export'
    export_checkpoint(str(ckpt), str(out))
    assert oct(_mode(out)) == oct(dir_mode)
    assert sorted(os.listdir(out)) == export_names()
    assert {n: oct(_mode(out / n)) for n in os.listdir(out)} == {n: oct(file_mode) for n in os.listdir(out)}
    # re-exporting over an existing export: same modes, no temporary folder left
    export_checkpoint(str(ckpt), str(out))
    assert oct(_mode(out)) == oct(dir_mode) and sorted(os.listdir(tmp_path / 'run')) == ['export']
