"""The napari plugin (issue 62): its widget in a real, headless napari viewer.

napari runs where MXNet does not (Python 3.12, numpy 2, onnxruntime), so the widget's tests
(tests/napari_checks.py: pytest-qt and napari's make_napari_viewer fixture) run in a second
environment - ``$GLUON_UNET_NAPARI_PYTHON``, a Python with ``pip install -e ".[napari,bioimageio]"``
(gluon_unet installed, so napari finds the plugin's manifest), which .ci/run builds - under
``xvfb-run`` (Qt's offscreen platform alone has no OpenGL for napari's canvas). The exports
and images they use are made here with MXNet. They skip where that environment is absent,
and fail instead under CI. The plugin's parts that need neither napari nor Qt are tested
here directly.
"""
import json
import os
import shutil
import subprocess

import cv2
import numpy as np
import pytest

from conftest import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIABLE = 'GLUON_UNET_NAPARI_PYTHON'


def napari_python():
    """The napari environment's Python, else skip (fail under CI=true, where .ci/run builds it)."""
    python = os.environ.get(VARIABLE)
    if python and os.access(python, os.X_OK):
        return python
    why = ('no napari environment: set %s to a Python 3.12 with pip install -e ".[napari,bioimageio]" and without '
           'mxnet (.ci/run builds one)' % VARIABLE)
    if os.environ.get('CI') == 'true':
        pytest.fail(why)
    pytest.skip(why)


def display_prefix():
    """``xvfb-run -a`` where there is no display (napari's canvas needs an X server)."""
    if os.environ.get('DISPLAY'):
        return []
    if shutil.which('xvfb-run'):
        return ['xvfb-run', '-a']
    why = 'no display and no xvfb-run: apt-get install xvfb (docs/how-to/napari-bioimageio.md lists the packages)'
    if os.environ.get('CI') == 'true':
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope='module')
def case(tmp_path_factory):
    """A small trained export (mask, tiled at 32 px, model.onnx), a random 2-channel one,
    and a grey and a colour image of generated nuclei larger than a tile."""
    import mxnet as mx
    from gluon_unet.config import ModelConfig, TrainConfig
    from gluon_unet.data.synthetic import synthetic_nuclei
    from gluon_unet.inference.export import export_block
    from gluon_unet.model import build_model
    from gluon_unet.training.loop import fit
    pytest.importorskip('onnx')
    root = tmp_path_factory.mktemp('napari')
    cfg = tiny_config(root, epochs=3, width=8, batch_norm=True, size=64, crop=32)
    fit(cfg, verbose=False)
    pictures, _, _ = synthetic_nuclei(2, size=120, seed=21)
    grey, colour = str(root / 'grey.png'), str(root / 'colour.png')
    cv2.imwrite(grey, pictures[0])
    tint = np.stack([pictures[1][..., 0], pictures[1][..., 0] // 2, pictures[1][..., 0] // 3], axis=-1)
    cv2.imwrite(colour, tint[..., ::-1])
    two = TrainConfig(model=ModelConfig(in_channels=2, width=4, depth=2), size=32)
    mx.random.seed(0)
    net = build_model(two.model)
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 2, 32, 32)))
    export_block(net, two, str(root / 'two'), onnx=True)
    return {'export': os.path.join(cfg.output, 'export'), 'grey': grey, 'colour': colour,
            'two_channels': str(root / 'two')}


def test_the_widget_in_a_headless_napari_viewer(case):
    python, prefix = napari_python(), display_prefix()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, 'tests')]), GLUON_UNET_NAPARI_CASE=json.dumps(case), OMP_NUM_THREADS='1',
               QT_QPA_PLATFORM='xcb')
    done = subprocess.run(prefix + [python, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-rs', '--noconftest', '-p', 'napari_checks',
                                    os.path.join(ROOT, 'tests', 'napari_checks.py')],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    summary = [line for line in done.stdout.splitlines() if ' passed' in line]
    assert summary and 'skipped' not in summary[-1] and 'failed' not in summary[-1], tail
    assert int(summary[-1].split(' passed')[0].split()[-1]) == 4, tail


def test_the_plugin_imports_nothing_of_napari_or_qt_until_used():
    # The package (MXNet environment included) imports the plugin's modules without napari.
    import sys
    import gluon_unet.napari.segmenter  # noqa: F401
    import gluon_unet.napari.widget  # noqa: F401
    assert not any(name == 'napari' or name.startswith(('napari.', 'qtpy', 'magicgui')) for name in sys.modules)


def test_the_manifest_names_the_widget_factory_and_ships_as_package_data():
    tomllib = pytest.importorskip('tomllib')  # Python 3.11+
    from gluon_unet.napari import widget
    with open(os.path.join(ROOT, 'pyproject.toml'), 'rb') as f:
        project = tomllib.load(f)
    assert project['project']['entry-points']['napari.manifest'] == {'gluon_unet': 'gluon_unet.napari:napari.yaml'}
    assert project['tool']['setuptools']['package-data']['gluon_unet.napari'] == ['napari.yaml']
    with open(os.path.join(ROOT, 'gluon_unet', 'napari', 'napari.yaml')) as f:
        manifest = f.read()
    assert 'name: gluon_unet\n' in manifest and 'python_name: gluon_unet.napari.widget:SegmentWidget' in manifest
    assert callable(widget.SegmentWidget)


def test_layer_data_becomes_what_bin_predict_reads():
    from gluon_unet.errors import UserError
    from gluon_unet.napari.segmenter import layer_image
    rgba = np.zeros((8, 9, 4), np.uint8)
    rgba[..., 0] = 200
    assert layer_image(rgba, True, 'a').shape == (8, 9, 3) and layer_image(rgba, True, 'a')[0, 0, 0] == 200
    grey16 = np.arange(72, dtype=np.uint16).reshape(8, 9) * 100
    out = layer_image(grey16, False, 'b')
    assert out.shape == (8, 9, 1) and out.dtype == np.uint8 and out.max() == 255
    for data, rgb, words in ((np.zeros((3, 8, 8)), False, '2-D'), (np.full((4, 4), np.nan), False, 'NaN'),
                             (np.zeros((4, 4), object), False, 'not an image')):
        with pytest.raises(UserError, match=words):
            layer_image(data, rgb, 'c')
