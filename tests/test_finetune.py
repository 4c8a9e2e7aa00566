"""``bin/train --init MODEL``: the weights it starts from, what it keeps and adapts, what it
refuses, what it records, and that resume, several contexts and the Python API work."""
import dataclasses
import json
import os
import shutil

import mxnet as mx
import numpy as np
import pytest

from conftest import run_cli, tiny_config
from gluon_unet import models
from gluon_unet.cli import train_main
from gluon_unet.config import _CHOICES, TrainConfig, setting
from gluon_unet.data.sampler import EpochSampler
from gluon_unet.errors import UserError
from gluon_unet.model import build_model
from gluon_unet.training import finetune
from gluon_unet.training.loop import fit


@pytest.fixture(scope='module')
def source(tmp_path_factory):
    """A tiny trained run (width 4, depth 2, 32 px, BatchNorm) with its export."""
    folder = tmp_path_factory.mktemp('source')
    cfg = tiny_config(folder, batch_norm=True, epochs=1, synthetic_count=16, output=str(folder / 'run'),
                      val_split=0.25, lr_schedule='cosine')
    fit(cfg, verbose=False)
    return str(folder / 'run')


def _forward(net, x):
    with mx.autograd.predict_mode():
        return net(mx.nd.array(x)).asnumpy()


def _exported(folder):
    prefix = os.path.join(folder, 'export', 'model')
    return mx.gluon.SymbolBlock.imports(prefix + '-symbol.json', ['data'], prefix + '-0000.params')


@pytest.mark.parametrize('kind', ['export', 'run-checkpoint'])
def test_the_model_starts_as_the_source_computes(source, tmp_path, kind):
    # A run folder starts from its export; without one, from checkpoints/best.ckpt.
    path = source
    if kind == 'run-checkpoint':
        path = str(tmp_path / 'run')
        shutil.copytree(os.path.join(source, 'checkpoints'), os.path.join(path, 'checkpoints'))
    src = finetune.find_source(path)
    assert src.kind == ('export' if kind == 'export' else 'checkpoint')
    net = build_model(src.config.model)
    net.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    x = np.random.default_rng(0).random((2, 1, 32, 32)).astype(np.float32)
    net(mx.nd.array(x))  # shapes
    assert finetune.load_source_weights(net, src, 1) == []
    for p in net.collect_params().values():  # the same weights on every device
        a, b = (d.asnumpy() for d in p.list_data())
        assert np.array_equal(a, b)
    np.testing.assert_allclose(_forward(net, x), _forward(_exported(source), x), rtol=1e-5, atol=1e-5)


def test_a_grey_model_gives_a_grey_colour_image_the_same_answer(source):
    src = finetune.find_source(source)
    model = dataclasses.replace(src.config.model, in_channels=3)
    net = build_model(model)
    net.initialize()
    grey = np.random.default_rng(1).random((1, 1, 32, 32)).astype(np.float32)
    net(mx.nd.array(np.repeat(grey, 3, axis=1)))
    notes = finetune.load_source_weights(net, src, 3)
    assert notes == ['first convolution adapted from 1 to 3 input channels']
    np.testing.assert_allclose(_forward(net, np.repeat(grey, 3, axis=1)), _forward(_exported(source), grey),
                               rtol=1e-4, atol=1e-5)


def test_another_target_gets_a_new_head_and_keeps_the_rest(source):
    src = finetune.find_source(source)
    net = build_model(dataclasses.replace(src.config.model, target='mask+contact'))
    net.initialize()
    net(mx.nd.zeros((1, 1, 32, 32)))
    notes = finetune.load_source_weights(net, src, 1)
    assert len(notes) == 1 and notes[0].startswith('new head: 2 output map(s) where the model had 1')
    saved = finetune.source_arrays(src)
    for name, p in net._collect_params_with_prefix().items():
        same = np.array_equal(p.data().asnumpy(), saved[name].asnumpy()) if p.shape == saved[name].shape else False
        assert same == (not name.startswith('head.')), name


def _other_value(name, value):
    """A valid value of setting ``name`` other than ``value``."""
    if name in _CHOICES:
        return next(v for v in _CHOICES[name] if v != value)
    if name == 'predict_diameter':
        return 'auto' if value != 'auto' else 'range'
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2
    return value + 0.5


@pytest.mark.parametrize('name', finetune.KEPT)
def test_a_flag_contradicting_the_model_is_refused_naming_both(source, tmp_path, name):
    src = finetune.find_source(source)
    current = setting(src.config, name)
    value = _other_value(name, current)
    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **{name: value})) \
        if hasattr(cfg.model, name) else dataclasses.replace(cfg, **{name: value})
    with pytest.raises(UserError) as err:
        finetune.fine_tune_config(cfg, src, given={name})
    message = str(err.value)
    flag = '--' + name.replace('_', '-')
    assert message.startswith('%s %s contradicts --init ' % (flag, finetune.shown(value))), message
    assert 'trained with %s %s' % (flag, finetune.shown(current)) in message and '\n' not in message
    # The same value as the model's is no contradiction.
    same = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **{name: current})) \
        if hasattr(cfg.model, name) else dataclasses.replace(cfg, **{name: current})
    finetune.fine_tune_config(same, src, given={name})


def test_settings_come_from_the_model_then_fine_tune_defaults_then_what_you_chose(source, tmp_path):
    src = finetune.find_source(source)
    cfg = TrainConfig(data='somewhere', lr=0.01)
    merged = finetune.fine_tune_config(cfg, src)  # the Python API: chosen = what differs from the defaults
    assert merged.model == src.config.model
    assert merged.lr == 0.01  # chosen
    assert merged.epochs == finetune.FINE_TUNE_DEFAULTS['epochs'] and merged.val_split == 0.0
    assert merged.lr_schedule == src.config.lr_schedule == 'cosine'  # inherited
    assert merged.init == src.reference and merged.init.startswith(os.path.abspath(source) + '@sha256:')
    # Pinned to these weights: accepted; to others: refused.
    assert finetune.find_source(src.reference).digest == src.digest
    with pytest.raises(UserError, match='not the pinned sha256:00'):
        finetune.find_source(source + '@sha256:00')


def test_a_missing_damaged_or_foreign_model_is_one_line(source, tmp_path):
    (tmp_path / 'notes.txt').write_text('hello')
    (tmp_path / 'empty').mkdir()
    foreign = tmp_path / 'foreign'
    foreign.mkdir()
    (foreign / 'model.json').write_text('{"format": "something else"}')
    (foreign / 'model-0000.params').write_bytes(b'\0' * 64)
    (foreign / 'model-symbol.json').write_text('{}')
    onnx_only = tmp_path / 'onnx_only'
    onnx_only.mkdir()
    shutil.copy(os.path.join(source, 'export', 'model.json'), onnx_only / 'model.json')
    damaged = tmp_path / 'damaged'
    shutil.copytree(os.path.join(source, 'export'), damaged)
    with open(damaged / 'model-0000.params', 'r+b') as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    cases = {str(tmp_path / 'nope'): 'no such file or folder, and no shipped model of that name',
             'nuclei-v9': 'no such file or folder, and no shipped model of that name',
             str(tmp_path / 'notes.txt'): 'not a gluon_unet model',
             str(tmp_path / 'empty'): 'no model there',
             str(foreign): 'no training config: not a gluon_unet export',
             str(onnx_only): "fine-tuning needs the export's MXNet files",
             str(damaged): 'is damaged'}
    for value, words in cases.items():
        with pytest.raises(UserError) as err:
            finetune.find_source(value)
        assert words in str(err.value) and '\n' not in str(err.value), (value, str(err.value))


def write_pairs(folder, count, size=32, seed=5):
    """``count`` generated nuclei images as the paired layout (name.png + name_mask.png)."""
    import cv2
    from gluon_unet.data.synthetic import synthetic_nuclei
    images, masks, _ = synthetic_nuclei(count, size=size, seed=seed)
    os.makedirs(folder)
    for i, (image, mask) in enumerate(zip(images, masks)):
        cv2.imwrite(os.path.join(folder, 'n%d.png' % i), image[..., 0])
        cv2.imwrite(os.path.join(folder, 'n%d_mask.png' % i), (mask.reshape(size, size) > 0).astype(np.uint8) * 255)
    return str(folder)


def test_train_init_records_its_source_resumes_and_runs_on_two_contexts(source, tmp_path, capsys):
    out = tmp_path / 'ft'
    data = write_pairs(tmp_path / 'pairs', 3)
    argv = ['--init', source, '--output', str(out), '--data', data, '--epochs', '3', '--epoch-samples',
            '16', '--batch-size', '8', '--workers', '0', '--cpus', '2', '--no-progress']
    code = run_cli(train_main, argv + ['--kvstore', 'local'])
    assert code == 0
    config = json.load(open(out / 'config.json'))
    src = finetune.find_source(source)
    assert config['init'] == src.reference and config['model'] == dataclasses.asdict(src.config.model)
    card = json.load(open(out / 'export' / 'model.json'))['card']
    assert card['init'] == {'model': 'run', 'shipped': False, 'digest': src.digest}
    assert json.load(open(out / 'export' / 'model.json'))['postprocess']['inherited'] == src.reference
    log = open(out / 'train.log').read()
    assert 'fine-tuning %s' % src.reference in log and '3 train / 0 val images, 2 steps per epoch' in log
    # --resume of the same command continues the fine-tuning run from its checkpoint.
    last = sorted(os.listdir(out / 'checkpoints'))
    os.remove(out / 'checkpoints' / [n for n in last if n.startswith('epoch')][-1])  # as if stopped in epoch 3
    code = run_cli(train_main, argv + ['--resume', 'auto'])
    assert code == 0
    assert 'resumed from' in open(out / 'train.log').read()
    # A flag against the model's architecture: one line, exit 2, no run folder left.
    code = run_cli(train_main, ['--init', source, '--width', '16', '--output', str(tmp_path / 'no')])
    err = capsys.readouterr().err
    assert code == 2 and 'error: --width 16 contradicts --init %s' % os.path.abspath(source) in err
    assert not (tmp_path / 'no').exists()


def test_python_api_takes_init(source, tmp_path):
    cfg = tiny_config(tmp_path, batch_norm=True, epochs=1, epoch_samples=8, synthetic_count=8)
    with pytest.raises(UserError, match='--width 8 contradicts'):  # what you chose and the model disagree
        fit(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, width=8)), init=source, verbose=False)
    history = fit(cfg, init=source, verbose=False)
    assert json.load(open(os.path.join(history.output, 'config.json')))['init'].startswith(os.path.abspath(source))


def test_epoch_samples_repeat_every_image_once_per_pass():
    sampler = EpochSampler(3, seed=1, epoch_length=10)
    order = sampler.order()
    assert len(order) == 10 and len(sampler) == 10
    assert sorted(order[:3]) == [0, 1, 2] and sorted(order[3:6]) == [0, 1, 2]
    assert sorted(np.bincount(order)) == [3, 3, 4]
    seeds = [s for _, s in sampler]
    assert len(set(seeds)) == 10  # each repeat augmented anew


def test_shipped_names_resolve_where_no_path_has_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in models.names():
        assert models.resolve(name) == models.folder(name) or models.folder(name) is None
        os.mkdir(name)  # a folder of yours with that name wins
        assert models.resolve(name) == name
    assert models.resolve('not-a-model') == 'not-a-model'
    assert models.split_reference('nuclei@sha256:ab') == ('nuclei', 'sha256:ab')
    assert models.split_reference('runs/a@b') == ('runs/a@b', None)


def test_the_scale_is_kept_crops_stay_crops_of_any_size_a_resized_model_keeps_its_size():
    def source(**values):
        return finetune.Source('m', 'export', '/m/model', TrainConfig(**values), 'sha256:0')
    cropped = source(crop=256)
    assert finetune.fine_tune_config(TrainConfig(crop=128), cropped, given={'crop'}).crop == 128
    assert finetune.fine_tune_config(TrainConfig(), cropped, given=set()).crop == 256
    with pytest.raises(UserError, match='--crop 0 contradicts --init m, trained on native-resolution crops'):
        finetune.fine_tune_config(TrainConfig(crop=0), cropped, given={'crop'})
    resized = source(size=96)
    assert finetune.fine_tune_config(TrainConfig(), resized, given=set()).size == 96
    for flags in ({'size': 128}, {'crop': 64}):
        with pytest.raises(UserError, match='contradicts --init m, trained resized to --size 96'):
            finetune.fine_tune_config(TrainConfig(**flags), resized, given=set(flags))
    with pytest.raises(UserError, match='--channels 2 with --init m .1 channels.: only 1 <-> 3'):
        finetune.fine_tune_config(TrainConfig(model=dataclasses.replace(TrainConfig().model, in_channels=2)),
                                  source(model=dataclasses.replace(TrainConfig().model, in_channels=1)),
                                  given={'in_channels'})


def test_with_validation_images_the_fine_tune_is_compared_with_its_source(source, tmp_path):
    """The --init model is scored on the validation images before the first step; the card
    keeps that score, a resumed run keeps it, and the log warns exactly when the best epoch
    does not beat it."""
    out = tmp_path / 'ft'
    data = write_pairs(tmp_path / 'pairs', 4)
    argv = ['--init', source, '--output', str(out), '--data', data, '--val-split', '0.5', '--epochs', '2',
            '--epoch-samples', '8', '--batch-size', '4', '--workers', '0', '--no-progress', '--no-tune-postprocess']
    assert run_cli(train_main, argv) == 0
    log = open(out / 'train.log').read()
    assert 'before fine-tuning, %s on the 2 validation images: val_iou ' % os.path.abspath(source) in log
    meta = json.load(open(out / 'export' / 'model.json'))
    before = meta['card']['init']['val_before']
    assert set(before) >= {'val_iou', 'val_loss'}
    best = meta['card']['best_metrics']
    monitor = json.load(open(out / 'config.json'))['monitor']
    worse = not best[monitor] > before[monitor]  # val_iou and val_dsb: higher is better
    assert ('the fine-tune does not beat' in log) == worse, (best, before)
    # --resume: the score from before the fine-tune comes back from the checkpoint.
    last = [n for n in sorted(os.listdir(out / 'checkpoints')) if n.startswith('epoch')][-1]
    os.remove(out / 'checkpoints' / last)
    assert run_cli(train_main, argv + ['--resume', 'auto']) == 0
    assert json.load(open(out / 'export' / 'model.json'))['card']['init']['val_before'] == before


@pytest.mark.parametrize('mode, before, after, warned', [('max', 0.5, 0.6, False), ('max', 0.5, 0.5, True),
                                                         ('max', 0.5, 0.4, True), ('min', 0.5, 0.4, False),
                                                         ('min', 0.5, 0.6, True)])
def test_the_warning_says_when_the_source_was_better(mode, before, after, warned):
    from gluon_unet.training.recorder import init_comparison
    line = init_comparison({'val_iou': before}, {'val_iou': after}, 'val_iou', mode, 'nuclei@sha256:ab')
    assert bool(line) == warned
    if warned:
        assert 'does not beat nuclei' in line and 'val_iou %.4f at its best epoch, %.4f before' % (after, before) in line
    assert init_comparison({}, {'val_iou': after}, 'val_iou', mode, 'nuclei') is None
