"""Training data that cannot mean what the run would report is one line and exit 2,
before a run folder exists (issue 70, rule 1): two samples with one name, two images
sharing one mask, every mask empty (an empty prediction scores val DSB 1.0), and
validation images that are training images. Each in every layout it can occur in."""
import os
import shutil

import cv2
import numpy as np
import pytest

from conftest import nuclei_png, run_cli
from gluon_unet.cli import train_main
from gluon_unet.data.layouts import discover
from gluon_unet.errors import UserError


def _image(folder, name, seed):
    (folder / name).write_bytes(nuclei_png(seed, 32))


def _mask(folder, name, seed, empty=False):
    image = cv2.imdecode(np.frombuffer(nuclei_png(seed, 32), np.uint8), cv2.IMREAD_GRAYSCALE)
    cv2.imwrite(str(folder / name), np.zeros_like(image) if empty else (image > image.mean()).astype(np.uint8) * 255)


def _paired(root, seeds, empty=False):
    root.mkdir()
    for s in seeds:
        _image(root, 'n%d.png' % s, s)
        _mask(root, 'n%d_mask.png' % s, s, empty)
    return root


def _train(tmp_path, capsys, *words):
    argv = ['--epochs', '1', '--size', '32', '--width', '4', '--depth', '2', '--no-progress', '--workers', '0',
            '--output', str(tmp_path / 'run'), '--cache-dir', str(tmp_path / 'cache')] + list(words)
    code = run_cli(train_main, argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


def _same_name_paired(root):
    _paired(root, [1, 2])
    _image(root, 'n1.tif', 1)  # n1.png and n1.tif: one name
    return str(root)


def _same_name_csv(root):
    root.mkdir()
    (root / 'x').mkdir()
    for s, where in ((1, root), (2, root / 'x')):
        _image(where, 'a.png', s)
        _mask(where, 'a_mask.png', s)
    (root / 'pairs.csv').write_text('image,mask\na.png,a_mask.png\nx/a.png,x/a_mask.png\n')
    return str(root / 'pairs.csv')


def _shared_mask_csv(root):
    root.mkdir()
    for s in (1, 2):
        _image(root, 'i%d.png' % s, s)
    _mask(root, 'm.png', 1)
    (root / 'pairs.csv').write_text('image,mask\ni1.png,m.png\ni2.png,./m.png\n')
    return str(root / 'pairs.csv')


CASES = [('same name, paired', _same_name_paired, 'named'), ('same name, csv', _same_name_csv, 'named'),
         ('one mask for two images, csv', _shared_mask_csv, 'both pair with the mask')]


@pytest.mark.parametrize('make, words', [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_sample_is_one_image_and_its_own_mask(tmp_path, capsys, make, words):
    data = make(tmp_path / 'data')
    with pytest.raises(UserError, match=words):
        discover(data)
    code, err = _train(tmp_path, capsys, '--data', data)
    assert code == 2 and len(err) == 1 and words in err[0] and 'Traceback' not in err[0], err
    assert not os.path.exists(tmp_path / 'run')


@pytest.mark.parametrize('flag', ['--data', '--val-data'])
def test_every_mask_empty_is_refused(tmp_path, capsys, flag):
    empty = _paired(tmp_path / 'empty', [1, 2, 3], empty=True)
    good = _paired(tmp_path / 'good', [4, 5, 6])
    words = ['--data', str(empty)] if flag == '--data' else ['--data', str(good), '--val-data', str(empty)]
    code, err = _train(tmp_path, capsys, *words)
    assert code == 2 and len(err) == 1 and flag in err[0] and 'every mask' in err[0], err
    assert not os.path.exists(tmp_path / 'run')


@pytest.mark.parametrize('how', ['equal', 'overlapping', 'copied'])
def test_validation_images_are_never_training_images(tmp_path, capsys, how):
    data = _paired(tmp_path / 'data', [1, 2, 3])
    if how == 'equal':
        val = data
    else:
        val = _paired(tmp_path / 'val', [7, 8])
        shutil.copy(data / 'n2.png', val / ('n2.png' if how == 'overlapping' else 'other.png'))
        shutil.copy(data / 'n2_mask.png', val / ('n2_mask.png' if how == 'overlapping' else 'other_mask.png'))
    code, err = _train(tmp_path, capsys, '--data', str(data), '--val-data', str(val))
    assert code == 2 and len(err) == 1 and '--val-data' in err[0] and 'also in --data' in err[0], err
    assert not os.path.exists(tmp_path / 'run')
