"""bin/export --tune-postprocess / --int8 read a run's data as --resume does: where the run
was made (its relative --data never resolved against the current folder), and only while
it is still the images the run trained on (its data fingerprint)."""
import os

import pytest

from conftest import nuclei_png, run_cli, tiny_config
from gluon_unet.cli import export_main
from gluon_unet.data.prepare import run_data_config, training_cwd
from gluon_unet.training import fit


def _one_line(capsys):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and 'Traceback' not in err, err
    return lines[0]


@pytest.fixture(scope='module')
def relative_run(tmp_path_factory):
    """A tiny run trained from ``home`` on ``data/`` and ``--output runs/a``, both relative."""
    home = tmp_path_factory.mktemp('home')
    data = home / 'data'
    data.mkdir()
    for i in range(6):
        png = nuclei_png(i, size=32)
        (data / ('i%d.png' % i)).write_bytes(png)
        (data / ('i%d_mask.png' % i)).write_bytes(png)
    before = os.getcwd()
    os.chdir(str(home))
    try:
        cfg = tiny_config(home, data='data', output=os.path.join('runs', 'a'), cache_dir='cache', epochs=1,
                          val_split=0.34, tune_postprocess=False, batch_size=4)
        fit(cfg, verbose=False)
    finally:
        os.chdir(before)
    return home


def _skip_unless_int8(flag):
    if flag == '--int8':
        from gluon_unet.errors import UserError
        from gluon_unet.inference.export_int8 import check_support
        try:
            check_support('--int8')
        except UserError as exc:
            pytest.skip(str(exc))


@pytest.mark.parametrize('flag', ['--tune-postprocess', '--int8'])
def test_a_runs_relative_data_is_read_where_the_run_was_made(relative_run, tmp_path, monkeypatch, capsys, flag):
    _skip_unless_int8(flag)
    elsewhere = tmp_path / 'elsewhere'
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # no data/ here: today's tree read ./data and failed
    run = str(relative_run / 'runs' / 'a')
    code, err = run_cli(export_main, [run, flag, '--output', str(tmp_path / 'x')]), capsys.readouterr().err
    # A one-epoch model may quantize too coarsely for int8's check: that check ran on the
    # run's data, which is what this test is about.
    assert code == 0 or (flag == '--int8' and 'the int8 variant disagrees with float32' in err), err
    assert not os.path.exists(elsewhere / 'cache')  # the run's relative --cache-dir, too


@pytest.mark.parametrize('flag', ['--tune-postprocess', '--int8'])
def test_export_refuses_data_that_changed_since_training(relative_run, tmp_path, monkeypatch, capsys, flag):
    _skip_unless_int8(flag)
    mask = relative_run / 'data' / 'i5_mask.png'
    kept = mask.read_bytes()
    mask.write_bytes(nuclei_png(99, size=32))  # other pixels, same name and size
    try:
        out = tmp_path / 'x'
        assert run_cli(export_main, [str(relative_run / 'runs' / 'a'), flag, '--output', str(out)]) == 2
        line = _one_line(capsys)
        assert line.startswith("error: export %s: the run's data changed since it trained" % flag), line
        assert not out.exists()  # refused before anything was written
    finally:
        mask.write_bytes(kept)


def test_export_names_the_data_that_is_gone(relative_run, tmp_path, capsys):
    data = relative_run / 'data'
    os.rename(data, relative_run / 'moved')
    try:
        assert run_cli(export_main, [str(relative_run / 'runs' / 'a'), '--tune-postprocess',
                                     '--output', str(tmp_path / 'x')]) == 2
        assert "the run's --data %s is gone" % data in _one_line(capsys)
    finally:
        os.rename(relative_run / 'moved', data)


@pytest.mark.parametrize('output, run, expected', [
    ('runs/a', '/home/u/proj/runs/a', '/home/u/proj'),
    ('./runs/a/', '/home/u/proj/runs/a', '/home/u/proj'),
    ('a', '/home/u/proj/a', '/home/u/proj'),
    ('runs/a', '/home/u/proj/moved/b', None),   # moved: its --output says nothing
    ('../runs/a', '/home/u/runs/a', None),      # '..': cannot be undone from the run's place
    ('/abs/runs/a', '/abs/runs/a', None),
])
def test_an_old_run_without_a_recorded_cwd_is_read_gracefully(output, run, expected):
    meta = {'config': {'output': output}}
    assert training_cwd(meta, os.path.join(run, 'checkpoints', 'best.ckpt')) == expected
    assert training_cwd(dict(meta, cwd='/where'), os.path.join(run, 'checkpoints', 'best.ckpt')) == '/where'


def test_run_data_config_leaves_absolute_paths_and_resolves_relative_ones(tmp_path):
    (tmp_path / 'data').mkdir()
    cfg = tiny_config(tmp_path, data='data', val_data=str(tmp_path / 'v'), cache_dir=None)
    resolved = run_data_config(cfg, {'cwd': str(tmp_path), 'config': {}}, str(tmp_path / 'run' / 'x.ckpt'))
    assert resolved.data == str(tmp_path / 'data') and resolved.val_data == str(tmp_path / 'v')
    assert resolved.cache_dir is None and cfg.data == 'data'  # the given config is left as it was
