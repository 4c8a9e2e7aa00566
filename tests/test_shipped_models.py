"""The models shipped in the package (issue 69): each one is a complete, intact export with
its card, listed by `gluon-unet models`, and taken by name wherever a model is taken."""
import json
import os

import cv2
import numpy as np
import pytest

from conftest import run_cli
from gluon_unet import models
from gluon_unet.cli import export_main, main, predict_main
from gluon_unet.inference.sidecar import (ONNX, PARAMS, SIDECAR, SYMBOL, read_sidecar, verify_export,
                                          weights_digest)

NAMES = models.names()


def test_nuclei_is_shipped_and_listed_one_line_each(capsys):
    assert 'nuclei' in NAMES
    assert main(['models']) == 0
    out = capsys.readouterr().out.splitlines()
    for name in NAMES:
        line = next(x for x in out if x.startswith(name + ' '))
        assert models.SHIPPED[name] in line and '[' in line  # its description and its scores
    assert main(['models', '--json']) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [m['name'] for m in listed] == NAMES and all(os.path.isdir(m['folder']) for m in listed)


@pytest.mark.parametrize('name', NAMES)
def test_a_shipped_model_is_an_intact_export_with_its_card(name):
    folder = models.folder(name)
    assert folder and sorted(os.listdir(folder)) == sorted([SYMBOL, PARAMS, ONNX, SIDECAR, 'README.md'])
    meta = read_sidecar(os.path.join(folder, SIDECAR))
    verify_export(meta, {n: os.path.join(folder, n) for n in (SYMBOL, PARAMS, ONNX)}, os.path.join(folder, SIDECAR))
    card = meta['card']
    for key in ('licence', 'data_licence', 'rebuild', 'scores_line', 'grouped', 'random_holdout', 'weak'):
        assert card.get(key), key
    # No path of the machine it was made on (the rebuild command names the split's own folders).
    described = json.dumps({k: v for k, v in card.items() if k != 'rebuild'})
    assert not any(p in described for p in ('/tmp', '/work', '/home', os.path.expanduser('~'))), described
    readme = open(os.path.join(folder, 'README.md')).read()
    assert card['rebuild'] in readme and 'CC0' in readme
    assert isinstance(meta.get('postprocess'), dict)  # searched, and bin/predict uses it


@pytest.mark.parametrize('name', NAMES)
def test_predict_by_name_segments_generated_nuclei_and_export_copies_it(name, tmp_path):
    from gluon_unet.data.synthetic import synthetic_nuclei
    # Sparse dark-background nuclei, as in fluorescence (a frame packed with bright blobs
    # reads as a brightfield image to --normalize auto, and is inverted).
    pictures, _, labels = synthetic_nuclei(3, size=160, seed=3, max_nuclei=15)
    os.mkdir(tmp_path / 'in')
    for i, picture in enumerate(pictures):
        cv2.imwrite(str(tmp_path / 'in' / ('n%d.png' % i)), picture)
    assert predict_main(['--model', name, '--input', str(tmp_path / 'in'), '--output', str(tmp_path / 'out'),
                         '--no-progress']) == 0
    for i in range(3):
        found = cv2.imread(str(tmp_path / 'out' / ('n%d_labels.png' % i)), cv2.IMREAD_UNCHANGED)
        true = labels[i].reshape(found.shape)
        iou = np.logical_and(found > 0, true > 0).sum() / np.logical_or(found > 0, true > 0).sum()
        assert iou > 0.8 and found.max() >= true.max() / 2, (i, iou, found.max(), true.max())
    # bin/export NAME --output DIR: the same weights, the same searched settings and card.
    assert run_cli(export_main, [name, '--output', str(tmp_path / 'copy')]) == 0
    assert weights_digest(str(tmp_path / 'copy' / 'model')) == weights_digest(os.path.join(models.folder(name), 'model'))
    ours, copy = (json.load(open(os.path.join(f, SIDECAR))) for f in (models.folder(name), str(tmp_path / 'copy')))
    assert copy['postprocess'] == ours['postprocess'] and copy['card'] == ours['card']
    # Written nowhere in the package: the shipped folder is read only.
    assert run_cli(export_main, [name]) == 2
