"""Rule 4 (issue 70): ``--overwrite`` replaces only what this command wrote. For every
command whose config dataclass has an ``overwrite`` field (found by walking the package,
so a new one fails here until it has a scenario), its output holds its own earlier output
beside files other commands and the user wrote; ``--overwrite`` must leave those byte for
byte and name them in one line."""
import dataclasses
import importlib
import json
import os
import pkgutil

import pytest

import gluon_unet
from conftest import export_brightness_model, nuclei_png, run_cli, tiny_config
from gluon_unet.cli import export_main, predict_main, train_main
from gluon_unet.paths import MANIFEST
from gluon_unet.training import fit

SKIP_PACKAGES = ('gluon_unet._moved', 'gluon_unet.napari')


def commands_with_overwrite():
    """The config dataclasses (by class name) that have an ``overwrite`` flag."""
    found = set()
    for info in pkgutil.walk_packages(gluon_unet.__path__, 'gluon_unet.'):
        if info.name.startswith(SKIP_PACKAGES):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == info.name and \
                    'overwrite' in {f.name for f in dataclasses.fields(value)}:
                found.add(value.__name__)
    return found


def _files(folder):
    return {os.path.relpath(os.path.join(base, n), folder): open(os.path.join(base, n), 'rb').read()
            for base, _, names in os.walk(folder) for n in names if not n.endswith('.lock')}


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    """Two tiny runs (each with its export) and a folder of images."""
    root = tmp_path_factory.mktemp('overwrite')
    runs = []
    for name in ('a', 'b'):
        cfg = tiny_config(root / name, epochs=1, tune_postprocess=False, synthetic_count=8, batch_size=4)
        fit(cfg, verbose=False)
        runs.append(cfg.output)
    images = root / 'images'
    images.mkdir()
    for i in range(3):
        (images / ('i%d.png' % i)).write_bytes(nuclei_png(i, size=32))
    return runs, str(images)


def _predict(model, images, out, *extra):
    assert run_cli(predict_main, ['--model', model, '--input', images, '--output', out, '--no-progress']
                   + list(extra)) == 0


def train_scenario(world, tmp_path):
    """bin/train --overwrite on a run whose predictions/ holds bin/predict's output."""
    (_, b), images = world
    run = str(tmp_path / 'run')
    argv = ['--output', run, '--size', '32', '--width', '4', '--depth', '2', '--epochs', '1', '--no-progress',
            '--synthetic-count', '8', '--batch-size', '4', '--no-tune-postprocess']
    assert run_cli(train_main, argv) == 0
    # bin/predict replaces the demo's predictions: another model on other images
    _predict(b, images, os.path.join(run, 'predictions'), '--overwrite')
    (tmp_path / 'run' / 'notes.txt').write_text('mine')
    return train_main, argv + ['--overwrite'], run, ['predictions/', 'notes.txt']


def predict_scenario(world, tmp_path):
    """bin/predict --overwrite on predictions by another model, beside a user's and an export's files."""
    (a, b), images = world
    out = tmp_path / 'pred'
    _predict(a, images, str(out))
    (out / 'notes.txt').write_text('mine')
    export_brightness_model(str(out / 'export'))  # a model kept beside its predictions
    return predict_main, ['--model', b, '--input', images, '--output', str(out), '--no-progress',
                          '--overwrite'], str(out), ['notes.txt', 'export/']


def export_scenario(world, tmp_path):
    """bin/export --overwrite on another run's export, beside bin/predict's output and a user's file."""
    (a, b), images = world
    out = tmp_path / 'exp'
    assert run_cli(export_main, [b, '--output', str(out)]) == 0
    _predict(b, images, str(out))  # predictions written into the export folder
    (out / 'README.txt').write_text('mine')
    return export_main, [a, '--output', str(out), '--overwrite'], str(out), ['README.txt', MANIFEST, 'i0_mask.png']


def package_scenario(world, tmp_path):
    pytest.importorskip('onnxruntime')  # the package is made where onnxruntime runs
    pytest.skip('the package --overwrite scenario runs in the napari environment (tests/test_bioimageio.py)')


SCENARIOS = {'TrainConfig': train_scenario, 'PredictConfig': predict_scenario, 'ExportConfig': export_scenario,
             'PackageConfig': package_scenario}


def test_every_command_with_overwrite_has_a_scenario():
    assert commands_with_overwrite() == set(SCENARIOS)


@pytest.mark.parametrize('command', sorted(SCENARIOS))
def test_overwrite_leaves_what_the_command_did_not_write_and_names_it(command, world, tmp_path, capsys, caplog):
    main, argv, out, others = SCENARIOS[command](world, tmp_path)
    before = _files(out)
    capsys.readouterr()
    caplog.clear()
    assert run_cli(main, argv) == 0, capsys.readouterr().err
    after = _files(out)
    said = capsys.readouterr()
    lines = [line for line in (said.out + said.err + caplog.text).splitlines() if 'kept what' in line]
    assert len(lines) == 1, said.out + said.err + caplog.text
    for other in others:
        assert other in lines[0], (other, lines[0])
        kept = {rel: data for rel, data in before.items() if rel == other or rel.startswith(other)}
        assert kept and all(after.get(rel) == data for rel, data in kept.items()), other


def test_train_overwrite_keeps_the_demo_from_replacing_bin_predicts_output(world, tmp_path):
    """The demo ends by predicting into <run>/predictions: never over bin/predict's output."""
    (_, b), images = world
    run = tmp_path / 'demo'
    argv = ['--output', str(run), '--size', '32', '--width', '4', '--depth', '2', '--epochs', '1', '--no-progress',
            '--synthetic-count', '8', '--batch-size', '4', '--no-tune-postprocess']
    assert run_cli(train_main, argv) == 0
    with open(run / 'predictions' / MANIFEST) as f:
        assert len(json.load(f)['files']) > 1  # the demo's own predictions
    assert run_cli(train_main, argv + ['--overwrite']) == 0  # its own: replaced
    _predict(b, images, str(run / 'predictions'), '--overwrite')
    theirs = _files(str(run / 'predictions'))
    assert run_cli(train_main, argv + ['--overwrite']) == 0
    assert _files(str(run / 'predictions')) == theirs
