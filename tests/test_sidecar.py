"""A broken model.json sidecar in an export folder: load_exported and bin/predict give
one line naming the file and what is wrong, exit 2 - never a traceback (issue 12)."""
import json
import os

import pytest

from gluon_unet.cli import predict_main
from gluon_unet.errors import UserError
from gluon_unet.inference.batched import load_exported
from gluon_unet.inference.predict import predict_paths

from conftest import export_brightness_model, nuclei_png, run_cli


# -- broken model.json ----------------------------------------------------------------------

BAD_SIDECARS = [
    ('[1, 2]', 'must hold a JSON object, not a list'),
    ('5', 'must hold a JSON object, not a number'),
    ('null', 'must hold a JSON object'),
    ('"model"', 'must hold a JSON object, not a string'),
    ('{"in_channels": 1,', 'not valid JSON'),
    ('', 'not valid JSON'),
    ('{"in_channels": 1, "train_size": 32, "multiple": 4, "config": 5}', "'config' must be an object"),
    ('{"in_channels": 1, "train_size": 32, "multiple": 4, "config": [1]}', "'config' must be an object"),
    ('{"in_channels": 1, "train_size": 32, "multiple": 4, "config": {"normalize": 7}}', "normalize"),
    ('{"in_channels": "one", "train_size": 32, "multiple": 4}', "'in_channels' must be a positive integer"),
    ('{"in_channels": 1, "train_size": -3, "multiple": 4}', "'train_size' must be a positive integer"),
    ('{"in_channels": 1, "train_size": 32, "multiple": 4, "threshold": "high"}', "'threshold' must be"),
    ('{"in_channels": 1, "train_size": 32, "multiple": 4, "resize_mode": 3}', "'resize_mode' must be"),
]


@pytest.mark.parametrize('text, words', BAD_SIDECARS)
def test_broken_sidecar_is_one_line_naming_the_file(tmp_path, capsys, text, words):
    model = export_brightness_model(str(tmp_path / 'model'), sidecar=text)
    sidecar = os.path.join(model, 'model.json')
    with pytest.raises(UserError, match='model.json') as info:
        load_exported(model)
    assert words in str(info.value) and sidecar in str(info.value) and '\n' not in str(info.value)
    (tmp_path / 'a.png').write_bytes(nuclei_png(0))
    code = run_cli(predict_main, ['--model', model, '--input', str(tmp_path / 'a.png'),
                               '--output', str(tmp_path / 'out'), '--no-progress'])
    err = capsys.readouterr().err
    assert code == 2 and err.count('\n') == 1 and 'Traceback' not in err, err
    assert sidecar in err and words in err
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('sidecar', [{'in_channels': 1, 'train_size': 32, 'multiple': 4, 'threshold': 0.5},
                                     {'in_channels': 1, 'threshold': None, 'config': None, 'normalize': None},
                                     {}, None])
def test_sidecar_without_config_still_works(tmp_path, sidecar):
    """Hand-made and older exports have no 'config' (or null keys, or no model.json at
    all): what is there is enough, the channels come from the first convolution."""
    model = export_brightness_model(str(tmp_path / 'model'), sidecar=None if sidecar is None else json.dumps(sidecar))
    (tmp_path / 'a.png').write_bytes(nuclei_png(0))
    records = predict_paths(model, str(tmp_path / 'a.png'), str(tmp_path / 'out'), progress=False)
    assert len(records) == 1 and records[0]['objects'] >= 1
