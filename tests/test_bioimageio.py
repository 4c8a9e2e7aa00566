"""The bioimage.io Model Zoo package (issue 62): ``gluon-unet package`` writes a zip that
bioimageio.spec validates and whose test bioimageio.core passes, in the environment
without MXNet ($GLUON_UNET_NAPARI_PYTHON, as tests/test_napari.py: skipped where it is
absent, failed under CI). The export is made here with MXNet; the parts that need no
onnxruntime are tested here directly."""
import os
import subprocess
import zipfile

import cv2
import pytest

from conftest import tiny_config
from test_napari import napari_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_there(args, timeout=600):
    """``args`` run by the napari environment's Python, this checkout first, no web access."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS='1', BIOIMAGEIO_PERFORM_IO_CHECKS='false')
    return subprocess.run([napari_python()] + args, capture_output=True, text=True, env=env, timeout=timeout,
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
