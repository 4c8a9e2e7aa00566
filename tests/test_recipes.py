"""The named recipes shipped in gluon_unet/recipes: ``bin/train --config NAME --data DIR``."""
import json
import os
import subprocess
import sys

import pytest

from gluon_unet import recipes
from gluon_unet.cli.train import config_from_args
from gluon_unet.errors import UserError
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Keys that name a place on one machine: a recipe leaves them to the flags.
PATH_KEYS = {'data', 'masks', 'val_data', 'cache_dir', 'output', 'resume'}


def test_every_recipe_is_a_valid_config_that_names_no_path(tmp_path):
    assert {'dsb2018', 'dsb2018-gpu', 'keras-seed'} <= set(recipes.names())
    for name in recipes.names():
        with open(recipes.path(name)) as f:
            assert not PATH_KEYS & set(json.load(f)), name
        cfg = config_from_args({'data': str(tmp_path)}, name)
        assert cfg.data == str(tmp_path) and cfg.output is None and cfg.cache_dir is None, name


def test_dsb2018_is_the_recipe_the_quality_page_scores(tmp_path):
    # docs/quality.md gives the hold-out score of these settings (v36 in the scoring log):
    # a change here is a new recipe to score, not an edit.
    cfg = config_from_args({'data': str(tmp_path)}, 'dsb2018')
    m = cfg.model
    assert (m.in_channels, m.width, m.depth, m.target) == (1, 8, 5, 'mask')
    assert (cfg.crop, cfg.normalize, cfg.denoise, cfg.loss, cfg.lr, cfg.lr_schedule, cfg.ema) == \
        (256, 'auto', 0.0, 'bce_dice', 0.002, 'cosine', 0.99)
    assert (cfg.epochs, cfg.time_budget, cfg.val_split, cfg.batch_size, cfg.monitor) == \
        (100, 58, 0.05, 16, 'val_dsb')


@pytest.mark.parametrize('name', ['dsb2018', 'dsb2018-gpu'])
def test_the_dsb_recipes_search_the_post_processing_as_they_are_scored(tmp_path, name):
    # Their scores (the grouped validation, the shipped model) predict with --mode tile and
    # no TTA: the search chooses the settings on maps made that way (issue 70, rule 2).
    cfg = config_from_args({'data': str(tmp_path)}, name)
    assert (cfg.tune_postprocess, cfg.tune_mode, cfg.tune_tta) == (True, 'tile', False)


def test_flags_override_a_recipe_and_a_file_of_that_name_wins(tmp_path, monkeypatch):
    cfg = config_from_args({'data': str(tmp_path), 'epochs': 3, 'width': 12}, 'dsb2018')
    assert (cfg.epochs, cfg.model.width, cfg.model.depth) == (3, 12, 5)
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'dsb2018').write_text(json.dumps({'epochs': 7}))
    assert config_from_args({'data': str(tmp_path)}, 'dsb2018').epochs == 7  # the file, not the recipe


@pytest.mark.parametrize('given, name, message', [
    ({'data': '.'}, 'dsb2019', '--config dsb2019: no such file, and no recipe of that name (recipes: dsb2018'),
    ({'data': '.'}, 'some/dsb2018', '--config some/dsb2018: no such file'),
    ({}, 'dsb2018', '--config dsb2018: a recipe for your images; give them with --data'),
])
def test_an_unknown_recipe_or_one_without_data_is_one_line(given, name, message):
    with pytest.raises(UserError) as e:
        config_from_args(given, name)
    assert message in str(e.value) and '\n' not in str(e.value)


def test_bin_train_trains_a_recipe_on_your_data(tmp_path):
    import cv2
    from gluon_unet.data.synthetic import synthetic_nuclei
    images, masks, _ = synthetic_nuclei(8, size=32, channels=1, seed=0)
    for folder in ('im', 'mask'):
        (tmp_path / folder).mkdir()
    for i, (image, mask) in enumerate(zip(images, masks)):
        cv2.imwrite(str(tmp_path / 'im' / ('n%d.png' % i)), image)
        cv2.imwrite(str(tmp_path / 'mask' / ('n%d_mask.png' % i)), (mask > 0).astype('uint8') * 255)
    out = tmp_path / 'run'
    # The recipe as written, made tiny by flags: crop 32 suits its depth 5, one epoch.
    cmd = [sys.executable, os.path.join(ROOT, 'bin', 'train'), '--config', 'dsb2018',
           '--data', str(tmp_path / 'im'), '--masks', str(tmp_path / 'mask'), '--crop', '32', '--width', '4',
           '--epochs', '1', '--val-split', '0.25', '--workers', '0', '--no-tune-postprocess', '--no-progress',
           '--cache-dir', str(tmp_path / 'cache'), '--output', str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_SECONDS, cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with open(out / 'config.json') as f:
        saved = json.load(f)
    assert (saved['model']['depth'], saved['ema'], saved['normalize']) == (5, 0.99, 'auto')  # the recipe's
    assert (saved['crop'], saved['data'], saved['epochs']) == (32, str(tmp_path / 'im'), 1)  # the flags'
    assert (out / 'export' / 'model-symbol.json').is_file()
