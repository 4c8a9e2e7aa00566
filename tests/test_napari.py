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
import sys

import cv2
import numpy as np
import pytest

from conftest import tiny_config
from hang import HANG_SECONDS

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
            'two_channels': str(root / 'two'), 'mxnet_python': sys.executable}


def test_the_widget_in_a_headless_napari_viewer(case):
    python, prefix = napari_python(), display_prefix()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, 'tests')]), GLUON_UNET_NAPARI_CASE=json.dumps(case), OMP_NUM_THREADS='1',
               QT_QPA_PLATFORM='xcb')
    done = subprocess.run(prefix + [python, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-rs', '--noconftest', '-p', 'napari_checks',
                                    os.path.join(ROOT, 'tests', 'napari_checks.py')],
                          capture_output=True, text=True, env=env, timeout=HANG_SECONDS, cwd=ROOT)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    summary = [line for line in done.stdout.splitlines() if ' passed' in line]
    assert summary and 'skipped' not in summary[-1] and 'failed' not in summary[-1], tail
    assert int(summary[-1].split(' passed')[0].split()[-1]) == 8, tail


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


def test_fine_tune_pairs_are_what_bin_train_reads_and_never_replace_yours(tmp_path):
    from gluon_unet.data.io import read_image, read_mask
    from gluon_unet.errors import UserError
    from gluon_unet.napari import finetune
    image = np.random.default_rng(0).integers(0, 255, (20, 24, 1), dtype=np.uint8)
    labels = np.zeros((20, 24), np.int32)
    labels[2:6, 2:6], labels[6:9, 2:6] = 1, 300  # touching nuclei, an id over 255
    folder = tmp_path / 'pairs'
    path = finetune.save_pair(str(folder), 'cells a', image, labels)
    assert os.path.basename(path) == 'cells_a.png'
    np.testing.assert_array_equal(read_image(path)[..., 0], image[..., 0])
    mask, inst = read_mask(str(folder / 'cells_a_mask.png'))
    np.testing.assert_array_equal(inst, labels) and np.testing.assert_array_equal(mask, labels > 0)
    # The widget's own pair of that image is replaced; a file of yours of that name is not.
    assert finetune.save_pair(str(folder), 'cells a', image, labels) == path
    (folder / 'b.png').write_bytes(b'yours')
    assert os.path.basename(finetune.save_pair(str(folder), 'b', image, labels)) == 'b-2.png'
    assert (folder / 'b.png').read_bytes() == b'yours'
    for bad, words in ((np.zeros((20, 24)), 'empty'), (np.ones((3, 3)), 'do not match'),
                       (np.full((20, 24), 70000), '0 to 65535')):
        with pytest.raises(UserError, match=words):
            finetune.save_pair(str(folder), 'c', image, bad)
    argv = finetune.train_command('/py', str(tmp_path / 'm'), str(folder),
                                  finetune.next_output(str(folder)))
    assert argv[:5] == ['/py', '-m', 'gluon_unet', 'train', '--init'] and argv[-2] == str(tmp_path / 'pairs-runs' /
                                                                                      'finetune-1')


def test_fine_tune_runner_reports_epochs_and_stops_the_training_on_cancel(tmp_path):
    import sys
    import time
    from gluon_unet.napari import finetune
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: (print('SIGTERM: stopped', flush=True), sys.exit(143)))\n"
              "print('12:00:00 time budget: 5 of --epochs 20 fit; the LR schedule now ends with epoch 5', flush=True)\n"
              "for e in range(1, 6):\n    print('12:00:01 epoch %d | loss 0.1' % e, flush=True)\n"
              "    time.sleep(0.3 if e < 3 else 30)\n")
    runner = finetune.run_training([sys.executable, '-c', script], str(tmp_path / 'log' / 'a.log'), poll=0.05)
    seen = []
    for step in runner:
        seen.append(step)
        if step[0] == 3:
            break
    started = time.time()
    runner.close()  # what the widget's Cancel does
    assert time.time() - started < 10 and (3, 5) in seen
    log = open(tmp_path / 'log' / 'a.log').read()
    assert 'epoch 3' in log
    done = finetune.run_training([sys.executable, '-c', "print('12:00:01 epoch 1 | x'); import sys; sys.exit(3)"],
                                 str(tmp_path / 'b.log'))
    try:
        while True:
            next(done)
    except StopIteration as stop:
        assert stop.value == (3, '12:00:01 epoch 1 | x')
