"""The output contract (gluon_unet/outputs.py) where the hostile round broke it: an export
never replaces another run's export unasked and two exports never share a folder at once;
predict --rle never names one of predict's own outputs; a prediction manifest says
``complete`` only when every image was written."""
import json
import os
import signal

import pytest

from conftest import export_brightness_model, nuclei_png, run_cli, tiny_config
from gluon_unet.cli import export_main, predict_main
from gluon_unet.outputs import lock_folder
from gluon_unet.paths import MANIFEST
from gluon_unet.training import fit


def _snapshot(folder):
    return {name: open(os.path.join(folder, name), 'rb').read() for name in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, name))}


def _error_line(capsys):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and 'Traceback' not in err, err
    return lines[0]


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """Two tiny trained runs, each with its own export."""
    found = []
    for name in ('a', 'b'):
        cfg = tiny_config(tmp_path_factory.mktemp(name), epochs=1, tune_postprocess=False)
        fit(cfg, verbose=False)
        found.append(cfg.output)
    return found


def _source(export):
    with open(os.path.join(export, 'model.json')) as f:
        return json.load(f).get('source')


def test_an_export_never_replaces_another_runs_export_unasked(runs, tmp_path, capsys):
    a, b = runs
    a_export = os.path.join(a, 'export')
    assert _source(a_export)['run'] == os.path.realpath(a)  # training's own export records its run
    before = _snapshot(a_export)
    assert run_cli(export_main, [b, '--output', a_export]) == 2
    line = _error_line(capsys)
    assert line.startswith('error: --output %s holds an export from %s' % (a_export, os.path.realpath(a)))
    assert '--overwrite' in line and _snapshot(a_export) == before
    assert run_cli(export_main, [a]) == 0  # the run's own export, again: no question asked
    assert run_cli(export_main, [b, '--output', a_export, '--overwrite']) == 0  # asked for
    assert _source(a_export)['run'] == os.path.realpath(b)
    assert not os.path.exists(os.path.join(a_export, '.lock'))  # the lock goes with the command


def test_an_export_of_unknown_source_is_replaced_only_at_its_runs_default_place(runs, tmp_path, capsys):
    a, b = runs
    old = tmp_path / 'old'
    assert run_cli(export_main, [b, '--output', str(old)]) == 0
    with open(old / 'model.json') as f:
        meta = json.load(f)
    del meta['source']  # as gluon_unet 0.2 wrote it
    with open(old / 'model.json', 'w') as f:
        json.dump(meta, f)
    assert run_cli(export_main, [b, '--output', str(old)]) == 2
    assert 'whose source it does not record' in _error_line(capsys)
    assert run_cli(export_main, [b, '--output', str(old), '--overwrite']) == 0


def test_two_exports_never_write_one_folder_at_once(runs, tmp_path, capsys):
    a, _ = runs
    out = tmp_path / 'shared'
    with lock_folder(str(out)):  # another export (or predict) holds it
        assert run_cli(export_main, [a, '--output', str(out)]) == 2
        line = _error_line(capsys)
        assert 'is in use by another process (pid %d' % os.getpid() in line, line
        assert os.listdir(out) == ['.lock']
    assert run_cli(export_main, [a, '--output', str(out)]) == 0
    assert '.lock' not in os.listdir(out)


@pytest.fixture
def images(tmp_path):
    folder = tmp_path / 'images'
    folder.mkdir()
    for i in range(10):
        (folder / ('i%d.png' % i)).write_bytes(nuclei_png(i))
    return str(folder)


@pytest.mark.parametrize('name', ['i0_mask.png', 'i3_labels.png', MANIFEST])
def test_predict_rle_is_never_one_of_predicts_own_outputs(tmp_path, images, capsys, name):
    model = export_brightness_model(str(tmp_path / 'export'))
    out = tmp_path / 'out'
    argv = ['--model', model, '--input', images, '--output', str(out), '--no-progress']
    assert run_cli(predict_main, argv + ['--rle', str(out / name)]) == 2
    assert 'is one of the files predict writes in --output' in _error_line(capsys)
    assert not out.exists()
    assert run_cli(predict_main, argv + ['--rle', str(out / 'submission.csv')]) == 0  # a file of its own
    with open(out / MANIFEST) as f:
        assert 'submission.csv' in json.load(f)['files']


def test_the_manifest_says_complete_only_when_every_image_was_written(tmp_path, images, monkeypatch, capsys):
    from gluon_unet.inference import predict
    model = export_brightness_model(str(tmp_path / 'export'))
    out = tmp_path / 'out'
    real, written = predict.write_image_outputs, []

    def write_then_stop(*args, **kwargs):
        result = real(*args, **kwargs)
        written.append(True)
        if len(written) == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return result
    monkeypatch.setattr(predict, 'write_image_outputs', write_then_stop)
    assert run_cli(predict_main, ['--model', model, '--input', images, '--output', str(out), '--no-progress',
                                  '--batch-size', '1']) == 128 + signal.SIGTERM
    with open(out / MANIFEST) as f:
        manifest = json.load(f)
    done = len([n for n in manifest['files'] if n.endswith('_mask.png')])
    assert manifest['complete'] is False and 4 <= done < 10, manifest
    assert manifest['stopped'] == 'SIGTERM after %d of 10 images' % done
    monkeypatch.setattr(predict, 'write_image_outputs', real)
    # The same command again finishes the job, and says so.
    assert run_cli(predict_main, ['--model', model, '--input', images, '--output', str(out), '--no-progress']) == 0
    with open(out / MANIFEST) as f:
        manifest = json.load(f)
    assert manifest['complete'] is True and 'stopped' not in manifest and len(manifest['files']) == 20


def test_a_validation_folder_without_masks_names_val_data(tmp_path, capsys):
    from gluon_unet.cli import train_main
    data, val = tmp_path / 'data', tmp_path / 'val'
    for folder in (data, val):
        folder.mkdir()
    for i in range(4):
        png = nuclei_png(i)
        (data / ('i%d.png' % i)).write_bytes(png)
        (data / ('i%d_mask.png' % i)).write_bytes(png)
        (val / ('v%d.png' % i)).write_bytes(png)  # images, no masks
    assert run_cli(train_main, ['--data', str(data), '--val-data', str(val), '--output', str(tmp_path / 'run'),
                                '--epochs', '1', '--size', '32', '--width', '4', '--depth', '2', '--no-progress',
                                '--cache-dir', str(tmp_path / 'cache')]) == 2
    line = _error_line(capsys)
    assert line.startswith('error: --val-data %s: images but no masks' % val), line
    assert '--masks' not in line  # --val-data has no mask folder of its own
    assert not (tmp_path / 'run').exists()
