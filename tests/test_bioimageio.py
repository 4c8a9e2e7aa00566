"""The bioimage.io Model Zoo package (issue 62): ``gluon-unet package`` writes a zip that
bioimageio.spec validates and whose test bioimageio.core passes, in the environment
without MXNet ($GLUON_UNET_NAPARI_PYTHON, as tests/test_napari.py: skipped where it is
absent, failed under CI). The export is made here with MXNet; the parts that need no
onnxruntime are tested here directly."""
import contextlib
import io
import os
import subprocess
import zipfile

import cv2
import numpy as np
import pytest

from conftest import tiny_config
from test_napari import napari_python
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_there(args):
    """``args`` run by the napari environment's Python, this checkout first, no web access."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS='1', BIOIMAGEIO_PERFORM_IO_CHECKS='false')
    return subprocess.run([napari_python()] + args, capture_output=True, text=True, env=env, timeout=HANG_SECONDS,
                          cwd=ROOT)


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A small export (percentile normalization with denoise: what the spec cannot say
    exactly) and a validation-like image."""
    from gluon_unet.data.synthetic import synthetic_nuclei
    from gluon_unet.training.loop import fit
    pytest.importorskip('onnx')
    root = tmp_path_factory.mktemp('bioimageio')
    cfg = tiny_config(root, epochs=2, width=8, batch_norm=True, size=64, crop=32, normalize='percentile')
    fit(cfg, verbose=False)
    pictures, _, _ = synthetic_nuclei(1, size=100, seed=31)
    image = str(root / 'val.png')
    cv2.imwrite(image, pictures[0])
    return os.path.join(cfg.output, 'export'), image, root


def test_the_package_validates_and_its_test_passes(trained):
    export, image, root = trained
    out = str(root / 'nuclei.zip')
    done = run_there(['-m', 'gluon_unet', 'package', export, '--image', image, '--authors', 'Ada Lovelace, Lab',
                      '--output', out])
    assert done.returncode == 0, done.stderr
    assert 'the description is valid' in done.stdout and 'Denoise' in done.stdout, done.stdout
    with zipfile.ZipFile(out) as z:
        assert sorted(z.namelist()) == ['README.md', 'bioimageio.yaml', 'cover.png', 'model.json', 'model.onnx',
                                        'test_input.npy', 'test_output.npy']
        rdf, card = z.read('bioimageio.yaml').decode(), z.read('README.md').decode()
        sidecar = z.read('model.json').decode()
    # No path of this machine (the image, the run, its checkpoint), and the zip named as written.
    assert str(root) not in rdf + card + sidecar and 'unzip nuclei.zip -d nuclei-model' in card
    assert 'training_data' not in rdf  # generated nuclei: nothing to cite, no licence to guess
    for words in ('format_version: "0.5.4"', 'opset_version: 17', 'id: "scale_range"', 'halo: 4',
                  'id: "sigmoid"', 'name: "Ada Lovelace"'):
        assert words in rdf, words
    assert 'watershed' in card and 'Denoise' in card and 'gluon-unet predict --model' in card
    test = run_there(['-m', 'bioimageio.core', 'test', out])
    assert test.returncode == 0 and 'passed' in test.stdout, test.stdout[-3000:] + test.stderr[-2000:]
    assert 'Reproduce test outputs from test inputs (onnx)' in test.stdout
    # The same export again: replaced; the unzipped package is an export bin/predict runs.
    assert run_there(['-m', 'gluon_unet', 'package', export, '--image', image, '--authors', 'A', '--output',
                      out]).returncode == 0
    with zipfile.ZipFile(out) as z:
        z.extractall(str(root / 'unzipped'))
    predicted = run_there([os.path.join(ROOT, 'bin', 'predict'), '--model', str(root / 'unzipped'), '--input', image,
                           '--output', str(root / 'masks'), '--no-progress'])
    assert predicted.returncode == 0 and os.path.isfile(str(root / 'masks' / 'val_labels.png')), predicted.stderr


def test_outputs_keep_the_contract_in_one_line(trained, tmp_path):
    export, image, root = trained
    mine = tmp_path / 'mine.zip'
    mine.write_text('my notes')
    cases = [(str(mine), 'is not a zip gluon_unet wrote'),
             (os.path.join(export, 'x.zip'), 'lies inside EXPORT'),
             (str(tmp_path / 'x.txt'), 'a .zip file')]
    for output, words in cases:
        done = run_there(['-m', 'gluon_unet', 'package', export, '--image', image, '--authors', 'A', '--output',
                          output])
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1 and words in lines[0], done.stderr
    assert mine.read_text() == 'my notes' and sorted(os.listdir(export)) == sorted(
        ['model-0000.params', 'model-symbol.json', 'model.json', 'model.onnx'])
    done = run_there(['-m', 'gluon_unet', 'package', export, '--authors', 'A', '--output', str(tmp_path / 'p.zip')])
    assert done.returncode == 2 and '--image is needed' in done.stderr and not os.path.exists(tmp_path / 'p.zip')


def test_without_onnxruntime_the_command_is_one_line(trained, tmp_path, capsys):
    from gluon_unet.cli import package_main
    export, image, _ = trained
    code = package_main([export, '--image', image, '--authors', 'A', '--output', str(tmp_path / 'p.zip')])
    err = capsys.readouterr().err
    assert code == 2 and err.count('\n') == 1 and 'onnxruntime is not installed' in err, err
    assert not os.listdir(tmp_path)


def test_the_description_says_the_normalization_in_the_specs_operations():
    from gluon_unet.inference.bioimageio import apply_preprocessing, limits, preprocessing, to_yaml
    import numpy as np
    ops, exact = preprocessing({'normalize': 'none'})
    assert [o['id'] for o in ops] == ['ensure_dtype', 'scale_linear', 'ensure_dtype'] and exact
    raw = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(1, 2, 3, 4) * 10
    assert np.allclose(apply_preprocessing(raw, ops), raw / 255.0)
    ops, exact = preprocessing({'normalize': 'percentile', 'normalize_denoise': 1.0})
    assert [o['id'] for o in ops] == ['ensure_dtype', 'scale_range', 'clip', 'ensure_dtype'] and not exact
    assert preprocessing({'normalize': 'percentile', 'normalize_denoise': 0})[1]
    assert any('hematoxylin' in text for text in limits({'normalize': 'stain'}))
    assert any('inverts' in text for text in limits({'normalize': 'auto'}))
    assert to_yaml({'a': [{'b': 1, 'c': ['x']}], 'd': {}}) == 'a:\n  - b: 1\n    c:\n      - "x"\nd: {}'


# -- what the description says, checked as bioimage.io checks it (issue 70) ------------------

def _dsb_ids(count):
    with open(os.path.join(ROOT, 'experiments', 'dsb2018', 'dsb_groups.tsv')) as f:
        return [line.split('\t')[0] for line in f.read().splitlines()[1:count + 1]]


def _export_meta(path, train=7, val=1, dsb=None, **config):
    data = {'path': path, 'train_images': train, 'val_images': val}
    if dsb is not None:
        data['dsb2018_ids'] = dsb
    return {'card': {'data': data, 'gluon_unet': '0.3.0'}, 'config': dict(config), 'in_channels': 1, 'classes': 1,
            'depth': 2, 'multiple': 4, 'train_size': 32, 'resize_mode': 'crop', 'normalize': 'none',
            'threshold': 0.5}


def _package_config(**flags):
    from gluon_unet.inference.bioimageio import PackageConfig
    return PackageConfig(**dict({'export': 'x', 'output': 'p.zip', 'authors': 'Ada Lovelace, Lab'}, **flags)).validate()


def test_the_training_data_is_what_the_user_says_or_the_dsb_data_by_its_ids_never_a_folder_name(tmp_path):
    from gluon_unet.errors import UserError
    from gluon_unet.inference.bioimageio import description, trained_on_dsb2018
    config = _package_config()
    # Folder names that say DSB, of data that is not (or not only) the DSB's: no training_data,
    # and no licence or citation borrowed from the model or the U-Net paper.
    for meta in (_export_meta('/data/dsb2018/stage1_train', dsb=0), _export_meta('/x/BBBC038 data science bowl'),
                 _export_meta('/x/stage1_train', dsb=7)):
        rdf = description(config, meta, {}, 'val.png', 32, trained_on_dsb2018(meta))
        assert 'training_data' not in rdf and len(rdf['cite']) == 1, rdf.get('training_data')
    # Every image one of the DSB's, wherever the folder lies and whatever it is called.
    meta = _export_meta('/home/me/my.data', dsb=8)
    rdf = description(config, meta, {}, 'val.png', 32, trained_on_dsb2018(meta))
    data = rdf['training_data']
    assert data['license'] == 'CC0-1.0' and data['cite'][0]['doi'] == '10.1038/s41592-019-0612-7'
    assert data['name'] == 'DSB 2018 stage1_train (BBBC038)' and rdf['cite'][1] == data['cite'][0]
    assert 'Ada' not in str(data['authors']) and rdf['license'] == 'CC-BY-4.0'
    # The user's own data: both flags, the data's authors default to --authors.
    config = _package_config(training_data_cite='Me et al. My nuclei (2024) doi:10.5281/zenodo.123',
                             training_data_license='cc-by-4.0')
    meta = _export_meta('/home/me/my.data')
    rdf = description(config, meta, {}, 'val.png', 32, False)
    data = rdf['training_data']
    assert data['cite'] == [{'text': 'Me et al. My nuclei (2024)', 'doi': '10.5281/zenodo.123'}]
    assert data['license'] == 'CC-BY-4.0' and data['authors'] == [{'name': 'Ada Lovelace', 'affiliation': 'Lab'}]
    assert rdf['name'] == 'gluon_unet nuclei U-Net (my-data)'  # the folder's '.' is not in a model name
    with pytest.raises(UserError, match='--training-data-license without --training-data-cite'):
        description(_package_config(training_data_license='MIT'), meta, {}, 'val.png', 32, False)


def test_the_dsb_data_of_an_older_export_is_recognised_by_the_ids_in_its_folder(tmp_path):
    from gluon_unet.inference.bioimageio import trained_on_dsb2018
    png = cv2.imencode('.png', (np.arange(64, dtype=np.uint8).reshape(8, 8)))[1].tobytes()
    for folder, ids in (('plain', ['im%d' % i for i in range(3)]), ('mine', _dsb_ids(3))):
        for sid in ids:
            (tmp_path / folder / sid / 'images').mkdir(parents=True)
            (tmp_path / folder / sid / 'masks').mkdir()
            (tmp_path / folder / sid / 'images' / (sid + '.png')).write_bytes(png)
            (tmp_path / folder / sid / 'masks' / 'm.png').write_bytes(png)
    assert trained_on_dsb2018(_export_meta(str(tmp_path / 'mine'), train=2, val=1))
    assert not trained_on_dsb2018(_export_meta(str(tmp_path / 'plain'), train=2, val=1))
    assert not trained_on_dsb2018(_export_meta(str(tmp_path / 'mine'), train=5, val=1))  # not what it trained on
    assert not trained_on_dsb2018(_export_meta(str(tmp_path / 'gone'), train=2, val=1))


def test_a_run_records_how_many_of_its_images_are_the_dsb_data():
    from gluon_unet.data.prepare import data_fingerprint

    class Samples(list):
        """What data_fingerprint reads of a dataset: its length, names, images and masks."""
        def __init__(self, names):
            super().__init__(names)
            self.names, self.images = names, [np.zeros((4, 4), np.uint8)] * len(names)
            self.masks = self.images
    ids = _dsb_ids(3)
    assert data_fingerprint(Samples(ids[:2]), Samples(['my_image']))['dsb2018_ids'] == 2
    assert data_fingerprint(Samples(ids), None)['dsb2018_ids'] == 3
    assert data_fingerprint(Samples([ids[0][:63] + 'g', ids[1][:40]]), None)['dsb2018_ids'] == 0  # not ids


def test_the_package_shows_no_local_path_and_names_its_zip_as_written():
    from gluon_unet.inference.bioimageio import description, model_card, public_sidecar
    meta = _export_meta('/home/me/secret/stage1_train', dsb=8, data='/home/me/secret/stage1_train',
                        output='/home/me/runs/a', cache_dir='/home/me/.cache/gluon_unet', masks=None)
    meta['source'] = {'run': '/home/me/runs/a', 'checkpoint': '/home/me/runs/a/checkpoints/best.ckpt'}
    rdf = description(_package_config(), meta, {}, 'img7.png', 32, True)
    card = model_card(rdf, meta, {'max_diff': 0.0, 'threshold': 0.5, 'same': 1.0}, 3, 'my nuclei.zip',
                      'DSB 2018 stage1_train (BBBC038)')
    zipped = public_sidecar(meta, True)
    for text in (to_text(rdf), card, to_text(zipped)):
        assert '/home/me' not in text, text
    assert "unzip 'my nuclei.zip' -d 'my nuclei-model'" in card and 'model.zip' not in card
    assert zipped['source'] == {'run': 'a', 'checkpoint': 'best.ckpt'} and zipped['card']['data']['dsb2018_ids'] == 8


def to_text(value):
    import json
    return json.dumps(value)


def test_every_field_bioimageio_constrains_is_one_line_naming_its_flag_before_anything_is_written(tmp_path):
    from gluon_unet.cli import package_main
    export = tmp_path / 'exp'
    export.mkdir()
    (export / 'model.onnx').write_bytes(b'not read before the flags are checked')
    import json
    with open(export / 'model.json', 'w') as f:
        json.dump(dict(_export_meta('/x/my.data'), format='gluon_unet-export-1', onnx={'opset': 17}), f)
    out = tmp_path / 'p.zip'
    cases = [(['--name', 'my.model'], '--name'), (['--name', 'nuc'], '--name'), (['--license', 'Apache'], '--license'),
             (['--authors', 'Lab/Ada'], '--authors'), (['--training-data', 'x' * 129], '--training-data'),
             (['--training-data-cite', 'My data, no link'], '--training-data-cite'),
             (['--training-data-cite', 'My data doi:10.1234/x'], '--training-data-license'),
             (['--training-data-license', 'CC0'], '--training-data-license'),
             (['--training-data-authors', 'a\\b', '--training-data-license', 'MIT'], '--training-data-authors')]
    for words, flag in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = package_main([str(export), '--output', str(out), '--authors', 'A'] + words)
        lines = err.getvalue().strip().splitlines()
        assert code == 2 and len(lines) == 1 and flag in lines[0], (words, err.getvalue())
        assert sorted(os.listdir(tmp_path)) == ['exp']
