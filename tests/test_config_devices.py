"""Config validation, flag generation, device parsing: every bad value is one clear line."""
import json

import mxnet as mx
import pytest

from gluon_unet.cli.train import config_from_args, train_parser
from gluon_unet.config import ModelConfig, TrainConfig
from gluon_unet.machine.devices import make_contexts, parse_gpu_ids
from gluon_unet.errors import UserError


@pytest.mark.parametrize('spec, ids', [
    ('0-7', list(range(8))), ('0,2,5', [0, 2, 5]), ('0-3,6', [0, 1, 2, 3, 6]), ('all', list(range(8))),
    ('', []), ('none', []), (None, []), (' 1 , 1,0 ', [0, 1])])
def test_gpu_specs(spec, ids):
    assert parse_gpu_ids(spec, available=8) == ids


@pytest.mark.parametrize('spec, words', [
    ('0-8', ['no GPU 8', 'gpu 0-7']), ('x', ["'x'"]), ('3-1', ["'3-1'"]), ('-1', ['-1'])])
def test_gpu_spec_errors_name_the_problem(spec, words):
    with pytest.raises(UserError) as e:
        parse_gpu_ids(spec, available=8)
    msg = str(e.value)
    assert '\n' not in msg and msg.startswith('--gpus')
    for w in words:
        assert w in msg


def test_gpus_on_a_machine_without_gpu_is_a_clear_error():
    # This CPU build has no CUDA: asking for GPUs must say so, naming what exists.
    with pytest.raises(UserError, match='available: cpu'):
        make_contexts('0-1', 1)


def test_cpu_contexts():
    assert make_contexts('', 3) == [mx.cpu(0), mx.cpu(1), mx.cpu(2)]
    with pytest.raises(UserError, match='--cpus'):
        make_contexts('', 0)


def test_config_round_trips_through_json():
    cfg = TrainConfig(model=ModelConfig(width=8, depth=3, in_channels=3), batch_size=5, lr=0.01)
    again = TrainConfig.from_json(cfg.to_json())
    assert again == cfg
    assert json.loads(cfg.to_json())['model']['width'] == 8


@pytest.mark.parametrize('argv, flag', [
    (['--batch-size', '0'], '--batch-size'), (['--epochs', '-1'], '--epochs'), (['--width', '0'], '--width'),
    (['--depth', '9'], '--depth'), (['--size', '100'], '--size'), (['--optimizer', 'adagrad'], '--optimizer'),
    (['--loss', 'ce'], '--loss'), (['--val-split', '1.5'], '--val-split'), (['--lr', '0'], '--lr'),
    (['--channels', '2'], '--channels'), (['--data', '/no/such/dir'], '--data'),
    (['--lr-schedule', 'step', '--lr-steps', 'a,b'], '--lr-steps'), (['--kvstore', 'foo'], '--kvstore'),
    # argparse's float() takes these; a nan decay or rate would only show as a nan loss
    (['--weight-decay', 'nan'], '--weight-decay'), (['--lr', 'inf'], '--lr'), (['--lr', 'nan'], '--lr'),
    (['--clip-grad', 'inf'], '--clip-grad'), (['--weight-decay', '-1'], '--weight-decay')])
def test_bad_values_name_their_flag(argv, flag):
    args = vars(train_parser().parse_args(argv))
    args.pop('config')
    with pytest.raises(UserError) as e:
        config_from_args(args)
    assert flag in str(e.value) and '\n' not in str(e.value)


def test_flags_map_onto_config_and_demo_defaults_only_fill_gaps():
    args = vars(train_parser().parse_args(['--width', '12', '--no-augment', '--batch-size', '7']))
    args.pop('config')
    cfg = config_from_args(args)
    assert (cfg.model.width, cfg.augment, cfg.batch_size) == (12, False, 7)
    assert cfg.size == 64 and cfg.epochs == 12  # demo defaults (no --data)
    assert cfg.output is None  # fit() picks a new runs/demo-N folder


def test_config_file_then_flags(tmp_path):
    path = tmp_path / 'c.json'
    path.write_text(json.dumps({'epochs': 7, 'model': {'width': 24}, 'lr': 0.5}))
    args = vars(train_parser().parse_args(['--lr', '0.1']))
    args.pop('config')
    cfg = config_from_args(args, str(path))
    assert (cfg.epochs, cfg.model.width, cfg.lr) == (7, 24, 0.1)
    path.write_text(json.dumps({'epoch': 7}))
    with pytest.raises(UserError, match='unknown keys epoch'):
        config_from_args({}, str(path))
