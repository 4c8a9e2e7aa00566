"""Nothing a user made is ever lost (issue 45): gluon_unet deletes or replaces only files it
wrote and recognises, an output never touches an input, a prediction folder records which
model wrote it, and bad inputs (NaN pixels, endless or too deep configs, damaged export
files) are one line naming the file."""
import json
import os
import resource
import subprocess
import sys

import numpy as np
import pytest

from gluon_unet.cli import evaluate_main, export_main
from gluon_unet.cli.train import config_from_args
from gluon_unet.data.io import read_image, read_labels, read_mask
from gluon_unet.training.loop import fit
from gluon_unet.errors import UserError
from gluon_unet.inference.batched import load_exported

from gluon_unet.cli import predict_main
from gluon_unet.paths import holds_run
from gluon_unet.training.run_folder import claim_run_folder

from conftest import BRIGHTNESS_SIDECAR, export_brightness_model, export_names, nuclei_png, run_cli, tiny_config
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPORT = export_names()
MANIFEST = 'gluon_unet-predictions.json'  # gluon_unet.paths.MANIFEST


def _snapshot(folder):
    out = {}
    for base, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(base, name), 'rb') as f:
                out[os.path.relpath(os.path.join(base, name), folder)] = f.read()
    return out


def _error_line(capsys):
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith('error: ') and 'Traceback' not in err, err
    return err


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    """A tiny trained run (1 epoch) whose export holds the searched post-processing."""
    cfg = tiny_config(tmp_path_factory.mktemp('trained'), epochs=1)
    fit(cfg, verbose=False)
    with open(os.path.join(cfg.output, 'export', 'model.json')) as f:
        assert isinstance(json.load(f).get('postprocess'), dict)
    return cfg.output


# -- 1. export --output ----------------------------------------------------------------------

def test_export_output_keeps_other_files_and_refuses_a_run_its_checkpoints_and_the_working_folder(
        run, tmp_path, capsys, monkeypatch):
    shared = tmp_path / 'models'
    shared.mkdir()
    (shared / 'notes.txt').write_text('mine')
    assert run_cli(export_main, [run, '--output', str(shared)]) == 0
    assert sorted(os.listdir(shared)) == EXPORT + ['notes.txt'] and (shared / 'notes.txt').read_text() == 'mine'
    # ... again over its own export: replaced file by file, still nothing else touched
    assert run_cli(export_main, [run, '--output', str(shared)]) == 0
    assert sorted(os.listdir(shared)) == EXPORT + ['notes.txt']
    before = _snapshot(run)
    for target, says in ((run, 'is a run folder'), (os.path.join(run, 'checkpoints'), 'holds checkpoints')):
        capsys.readouterr()
        assert run_cli(export_main, [run, '--output', target]) == 2
        assert says in _error_line(capsys)
    assert _snapshot(run) == before
    work = tmp_path / 'work'
    work.mkdir()
    (work / 'keep.txt').write_text('mine')
    monkeypatch.chdir(work)
    assert run_cli(export_main, [run, '--output', '.']) == 2
    assert 'working folder' in _error_line(capsys) and os.listdir(work) == ['keep.txt']
    # a folder whose model files are not a gluon_unet export is refused, not replaced
    foreign = tmp_path / 'foreign'
    foreign.mkdir()
    (foreign / 'model.json').write_text('{"mine": 1}')
    assert run_cli(export_main, [run, '--output', str(foreign)]) == 2
    assert 'did not write' in _error_line(capsys) and os.listdir(foreign) == ['model.json']


# -- 2. train --overwrite ----------------------------------------------------------------------

def _fake_run(folder):
    """A run folder by names and contents (no training), with the user's files among its own."""
    for rel, text in {'config.json': '{}', 'train.log': 'x', 'metrics.csv': 'x', 'curves.png': 'x',
                      'checkpoints/epoch0001.ckpt': 'x', 'checkpoints/best.ckpt': 'x',
                      'checkpoints/.tmp-abc.ckpt': 'x', 'checkpoints/mine.txt': 'mine',
                      'export/model-symbol.json': 'x', 'export/model-0000.params': 'x',
                      'export/model.json': '{"format": "gluon_unet-export-1"}', 'export/README.txt': 'mine',
                      'predictions/a_mask.png': 'x', 'predictions/a_labels.png': 'x',
                      'predictions/truth_mask.png': 'mine',
                      # the demo's: its inputs are the run's own demo_inputs
                      'predictions/' + MANIFEST: json.dumps({'format': 'gluon_unet-predictions-1',
                                                             'files': ['a_mask.png', 'a_labels.png', '../notes.txt'],
                                                             'inputs': {'a': str(folder / 'demo_inputs' /
                                                                                 'demo00.png')}}),
                      'demo_inputs/demo00.png': 'x', 'tb/events.out.tfevents.1.host': 'x', 'notes.txt': 'mine'}.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_overwrite_removes_only_the_files_a_run_wrote(tmp_path):
    out = tmp_path / 'R'
    _fake_run(out)
    claim_run_folder(str(out), 'unused', overwrite=True).release()
    left = sorted(os.path.relpath(os.path.join(b, n), out) for b, _, names in os.walk(out) for n in names)
    assert left == ['.lock', 'checkpoints/mine.txt', 'export/README.txt', 'notes.txt', 'predictions/truth_mask.png']


def test_a_folder_holding_only_the_users_own_predictions_and_export_holds_no_run(tmp_path):
    out = tmp_path / 'U'
    for rel in ('predictions/mine.png', 'export/model.json', 'checkpoints/notes.txt'):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text('mine')
    assert holds_run(str(out)) == []
    claim_run_folder(str(out), 'unused').release()  # not refused as "already holds a run"
    assert (out / 'export' / 'model.json').read_text() == 'mine'


# -- 3. export keeps the searched post-processing; a stopped search keeps the old export --------

def test_plain_export_keeps_the_post_processing_training_searched(run, tmp_path, capsys):
    path = os.path.join(run, 'export', 'model.json')
    with open(path) as f:
        searched = json.load(f)['postprocess']
    for argv, sidecar in (([run], path), ([run, '--output', str(tmp_path / 'e')], str(tmp_path / 'e' / 'model.json'))):
        assert run_cli(export_main, argv) == 0
        with open(sidecar) as f:
            meta = json.load(f)
        assert meta['postprocess'] == searched and 'searched on' in meta['card']['postprocess']['chosen']
    # searched for other weights: not carried over to these, and the user is told
    other = tmp_path / 'other'
    other.mkdir()
    for name in EXPORT:
        with open(os.path.join(run, 'export', name), 'rb') as f:
            data = bytearray(f.read())
        if name == 'model-0000.params':
            data[100] ^= 1  # inside the first array's bytes
        (other / name).write_bytes(bytes(data))
    lone = tmp_path / 'best.ckpt'  # a checkpoint outside its run: only --output's export to look at
    with open(os.path.join(run, 'checkpoints', 'best.ckpt'), 'rb') as f:
        lone.write_bytes(f.read())
    capsys.readouterr()
    # The export there is another source's (the run's): replacing it is asked for.
    assert run_cli(export_main, [str(lone), '--output', str(other), '--overwrite']) == 0
    assert 'searched for other weights' in capsys.readouterr().out
    with open(other / 'model.json') as f:
        assert 'postprocess' not in json.load(f)


_STOPPED_SEARCH = '''
import os, signal, sys, time
sys.path.insert(0, %r)
from gluon_unet import cli
from gluon_unet.inference import postprocess_search as search

def stopped(*args, **kwargs):  # the search, stopped part way
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)

search.tune_on_dataset = stopped
sys.exit(cli.export_main([sys.argv[1], '--tune-postprocess']))
'''


def test_sigterm_during_the_export_search_leaves_the_previous_export_intact(run):
    export = os.path.join(run, 'export')
    before = _snapshot(export)
    done = subprocess.run([sys.executable, '-c', _STOPPED_SEARCH % ROOT, run], capture_output=True, text=True,
                          timeout=HANG_SECONDS)
    assert _snapshot(export) == before
    assert done.returncode == 143, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip() and 'runtime:' not in line]
    assert len(lines) == 1 and 'SIGTERM' in lines[0] and 'keeps the export it had' in lines[0], done.stderr
    assert sorted(os.listdir(export)) == EXPORT  # no staging folder left


# -- 4. outputs never touch inputs -------------------------------------------------------------

def test_an_output_never_replaces_or_goes_into_an_input(run, tmp_path, capsys, tiny):
    model = export_brightness_model(str(tmp_path / 'model'))
    images = tmp_path / 'images'
    images.mkdir()
    (images / 'a.png').write_bytes(nuclei_png(1))
    (images / 'b.png').write_bytes(nuclei_png(2))
    before = _snapshot(tmp_path)
    for argv in (['--input', str(images), '--rle', str(images / 'a.png')],  # over an input image
                 ['--input', str(images / 'a.png'), '--rle', str(images / 'a.png')],
                 ['--input', str(images), '--rle', os.path.join(model, 'model.json')],  # over the model
                 ['--input', str(images), '--output', str(images)]):
        argv = ['--model', model, '--output', str(tmp_path / 'out'), '--no-progress'] + argv
        assert run_cli(predict_main, argv) == 2
        assert 'which predict reads' in _error_line(capsys)
    os.symlink(str(images / 'b.png'), str(tmp_path / 'link.csv'))  # through a link too
    assert run_cli(predict_main, ['--model', model, '--input', str(images), '--output', str(tmp_path / 'out'),
                                  '--rle', str(tmp_path / 'link.csv'), '--no-progress']) == 2
    assert '--rle' in _error_line(capsys)
    assert run_cli(evaluate_main, ['--pred', str(images), '--truth', str(images), '--csv',
                                   str(images / 'scores.csv')]) == 2
    assert 'which evaluate reads' in _error_line(capsys)
    os.remove(str(tmp_path / 'link.csv'))
    assert _snapshot(tmp_path) == before
    # an output file named on the command line replaces only one gluon_unet wrote
    own, scores = tmp_path / 'own.csv', tmp_path / 'scores.csv'
    own.write_text('id,notes\n')
    scores.write_text('mine\n')
    assert run_cli(predict_main, ['--model', model, '--input', str(images), '--output', str(tmp_path / 'out'),
                                  '--rle', str(own), '--no-progress']) == 2
    assert 'not a DSB submission' in _error_line(capsys) and own.read_text() == 'id,notes\n'
    assert run_cli(evaluate_main, ['--pred', str(images), '--truth', str(images), '--csv', str(scores)]) == 2
    assert 'not a table of scores' in _error_line(capsys) and scores.read_text() == 'mine\n'
    for _ in range(2):  # its own submission, replaced
        assert run_cli(predict_main, ['--model', model, '--input', str(images), '--output', str(tmp_path / 'out'),
                                      '--rle', str(tmp_path / 'sub.csv'), '--no-progress']) == 0
    before = _snapshot(tmp_path)
    # training into its own data folder would feed the run's files to the next run
    for output in (images, images / 'runs' / 'a'):
        with pytest.raises(UserError, match='--output .* which train reads'):
            fit(tiny(data=str(images), output=str(output)), verbose=False)
    assert _snapshot(tmp_path) == before


# -- 10. prediction folders: which model wrote what ----------------------------------------------

def test_a_prediction_folder_holds_one_models_predictions(tmp_path, capsys):
    first = export_brightness_model(str(tmp_path / 'first'))
    second = export_brightness_model(str(tmp_path / 'second'), dict(BRIGHTNESS_SIDECAR, threshold=0.9))
    # other weights: the second model is another model even with the same settings
    import mxnet as mx
    params = mx.nd.load(os.path.join(second, 'model-0000.params'))
    mx.nd.save(os.path.join(second, 'model-0000.params'), {k: v * 2 for k, v in params.items()})
    images = tmp_path / 'images'
    images.mkdir()
    for i in range(2):
        (images / ('i%d.png' % i)).write_bytes(nuclei_png(i))
    out = tmp_path / 'out'

    def predict(model, *extra):
        return run_cli(predict_main, ['--model', model, '--input', str(images), '--output', str(out),
                                      '--no-progress'] + list(extra))
    assert predict(first, '--overlay') == 0
    before = _snapshot(out)
    assert predict(second) == 2
    assert 'another model' in _error_line(capsys) and _snapshot(out) == before
    with open(out / MANIFEST) as f:
        manifest = json.load(f)
    assert manifest['model']['export'] == first and len(manifest['files']) == 6 and manifest['complete']
    assert predict(first, '--threshold', '0.7') == 2  # the same model with other settings
    assert 'threshold 0.5 -> 0.7' in _error_line(capsys) and _snapshot(out) == before
    assert predict(first) == 0  # the same model again replaces its own files; the overlays stay its own
    assert sorted(os.listdir(out)) == sorted(before)
    assert predict(second, '--overwrite') == 0  # no overlay of the first model is left behind
    assert sorted(os.listdir(out)) == [MANIFEST, 'i0_labels.png', 'i0_mask.png', 'i1_labels.png', 'i1_mask.png']
    with open(out / MANIFEST) as f:
        assert json.load(f)['model']['export'] == second
    # a file gluon_unet did not write is never replaced, --overwrite or not
    mine = tmp_path / 'mine'
    mine.mkdir()
    (mine / 'i0_mask.png').write_text('truth')
    for extra in ([], ['--overwrite']):
        assert run_cli(predict_main, ['--model', first, '--input', str(images), '--output', str(mine),
                                      '--no-progress'] + extra) == 2
        assert 'i0_mask.png' in _error_line(capsys) and os.listdir(mine) == ['i0_mask.png']


# -- 10. smaller findings ----------------------------------------------------------------------

@pytest.mark.parametrize('value', [np.nan, np.inf])
def test_float_tiffs_with_nan_or_infinite_pixels_are_refused_naming_the_file(tmp_path, value):
    import tifffile
    path = str(tmp_path / 'x.tif')
    image = np.random.RandomState(0).rand(8, 8).astype(np.float32)
    for bad in (np.full((8, 8), value, np.float32), np.where(image > 0.9, value, image).astype(np.float32)):
        tifffile.imwrite(path, bad)
        for read in (read_image, read_mask, read_labels):
            with pytest.raises(UserError, match=r'x\.tif: \d+ of 64 pixels are NaN or infinite'):
                read(path)


def test_a_config_nested_too_deep_or_endless_is_one_line(tmp_path):
    deep = tmp_path / 'deep.json'
    deep.write_text('{"lr": ' + '[' * 100000 + ']' * 100000 + '}')
    with pytest.raises(UserError, match='deep.json: JSON nested too deeply'):
        config_from_args({}, str(deep))

    def limit_memory():  # the unfixed reader would fill the memory with zeros
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    done = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'train'), '--config', '/dev/zero'],
                          capture_output=True, text=True, timeout=HANG_SECONDS, preexec_fn=limit_memory,
                              cwd=str(tmp_path))
    assert done.returncode == 2 and done.stderr.count('\n') == 1, done.stderr
    assert '--config /dev/zero: not a regular file' in done.stderr
    big = tmp_path / 'big.json'
    big.write_text(' ' * (2 << 20) + '{}')
    with pytest.raises(UserError, match='big.json: .* bytes, more than'):
        config_from_args({}, str(big))


def test_a_damaged_export_file_is_named_without_guessing_another_architecture(tmp_path):
    model = export_brightness_model(str(tmp_path / 'model'))
    params = os.path.join(model, 'model-0000.params')
    with open(params, 'rb') as f:
        good = f.read()
    for damaged in (good[:len(good) // 2], b'\0' * 16 + good[16:]):
        with open(params, 'wb') as f:
            f.write(damaged)
        with pytest.raises(UserError) as info:
            load_exported(model)
        assert str(info.value).startswith(params + ' is damaged or truncated') and 'architecture' not in str(info.value)
    with open(params, 'wb') as f:
        f.write(good)
    symbol = os.path.join(model, 'model-symbol.json')
    with open(symbol) as f:
        text = f.read()
    with open(symbol, 'w') as f:
        f.write(text[:len(text) // 2])
    with pytest.raises(UserError, match=r'model-symbol\.json is damaged or truncated'):
        load_exported(model)
