"""export_in_subprocess (the AMP runs' export) when gluon_unet is importable only through
the bin/ shims' sys.path: not installed, started outside the repo root (issue 12)."""
import os
import stat
import subprocess
import sys
import sysconfig

import mxnet as mx
import pytest

from conftest import export_names
from gluon_unet.checkpoint import save_checkpoint
from gluon_unet.inference.export import export_in_subprocess
from gluon_unet.model import build_model
from hang import HANG_SECONDS


def tiny_checkpoint(cfg, path):
    """A checkpoint of an untrained tiny model (what export needs: weights + config)."""
    net = build_model(cfg.model)
    net.initialize(ctx=mx.cpu())
    net(mx.nd.zeros((1, cfg.model.in_channels, cfg.size, cfg.size)))
    save_checkpoint(str(path), net, None, {'epoch': 1, 'config': cfg.to_dict()})
    return str(path)


@pytest.fixture
def not_installed(tmp_path, monkeypatch):
    """Make the export child an interpreter that cannot find gluon_unet by itself.

    The package is pip-installed in editable mode here (a .pth file + import hook), which
    would hide the bug: the child runs ``python -S`` (no .pth files) with only
    site-packages on its path, from a folder that is not the repo root, without
    PYTHONPATH - like a user's python where gluon_unet is not installed.
    """
    site = sorted({sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']})
    wrapper = tmp_path / 'python-not-installed'
    wrapper.write_text('#!/bin/sh\nPYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}%s" exec %s -S "$@"\n'
                       % (os.pathsep.join(site), sys.executable))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    elsewhere = tmp_path / 'elsewhere'
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv('PYTHONPATH', raising=False)
    monkeypatch.setattr(sys, 'executable', str(wrapper))
    # the simulation holds: this interpreter has mxnet but no gluon_unet
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    probe = subprocess.run([str(wrapper), '-c', 'import mxnet\nimport gluon_unet'], capture_output=True,
                           text=True, env=env, timeout=HANG_SECONDS)
    assert probe.returncode != 0 and "No module named 'gluon_unet'" in probe.stderr, probe.stderr
    return wrapper


def test_export_in_subprocess_finds_the_package_it_was_imported_from(tiny, tmp_path, not_installed,
                                                                      monkeypatch):
    best = tiny_checkpoint(tiny(), tmp_path / 'best.ckpt')
    monkeypatch.setenv('PYTHONPATH', str(tmp_path / 'kept'))  # an existing PYTHONPATH stays, after ours
    out = str(tmp_path / 'exported')
    prefix = export_in_subprocess(best, out)
    assert prefix == os.path.join(out, 'model')
    assert sorted(os.listdir(out)) == export_names()


def test_export_in_subprocess_failure_is_one_line_with_the_childs_error(tmp_path, not_installed):
    junk = tmp_path / 'junk.ckpt'
    junk.write_bytes(b'not a checkpoint')
    with pytest.raises(RuntimeError) as info:  # and a UserError: bin/train reports it in one line
        export_in_subprocess(str(junk), str(tmp_path / 'exported'))
    message = str(info.value)
    assert '\n' not in message and 'not a gluon_unet checkpoint' in message, message
    assert str(junk) in message and 'Traceback' not in message and 'error: error:' not in message
    assert not (tmp_path / 'exported').exists()


def test_the_export_child_sees_no_gpu(tmp_path, monkeypatch):
    # It exports on the CPU. With bin/train --gpus 4-7 this process runs with
    # CUDA_VISIBLE_DEVICES=4,5,6,7, which user_environ() leaves out, so a child that saw
    # GPUs would create its CUDA context on physical GPU 0.
    import gluon_unet.inference.export as export
    seen = {}

    def fake_run(cmd, **kwargs):
        seen.update(kwargs['env'])
        return subprocess.CompletedProcess(cmd, 0, '', '')

    monkeypatch.setattr(export.subprocess, 'run', fake_run)
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '4,5,6,7')
    export_in_subprocess(str(tmp_path / 'best.ckpt'), str(tmp_path / 'out'))
    assert seen['CUDA_VISIBLE_DEVICES'] == ''
