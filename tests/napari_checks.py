"""The napari widget in a real (headless) viewer: run by tests/test_napari.py in the napari
environment ($GLUON_UNET_NAPARI_PYTHON, no MXNet) under xvfb-run, with pytest-qt and napari's
make_napari_viewer fixture. Not collected by the main suite (no test_ prefix): the exports and
images it uses are made there, with MXNet, and named in $GLUON_UNET_NAPARI_CASE (JSON).
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

CASE = json.loads(os.environ.get('GLUON_UNET_NAPARI_CASE', '{}'))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not CASE, reason='run by tests/test_napari.py, which makes the exports')


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """What napari's make_napari_viewer reads (``rep_call``), as napari's own conftest sets
    it; this module is also loaded as a plugin (``-p napari_checks``) for this hook."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, 'rep_' + report.when, report)


@pytest.fixture
def panel(make_napari_viewer, qtbot):
    """The widget as napari docks it from the plugin's manifest (entry point, npe2, factory)."""
    viewer = make_napari_viewer()
    _, widget = viewer.window.add_plugin_dock_widget('gluon_unet', 'Segment nuclei')
    return widget.native._gluon_unet_panel


def _errors():
    from napari.utils.notifications import NotificationSeverity, notification_manager
    return [n.message for n in notification_manager.records if n.severity == NotificationSeverity.ERROR]


def _segment(panel, qtbot, layer=None, timeout=60000):
    if layer is not None:
        panel.layer.value = layer
    panel.run()
    qtbot.waitUntil(lambda: panel.worker is None, timeout=timeout)


def _load(panel, qtbot, model):
    panel.model.value = model
    panel.load()
    qtbot.waitUntil(lambda: panel.worker is None, timeout=30000)


def _predict_labels(image, tmp_path, *flags):
    """bin/predict's labels of ``image`` with the same export, in this environment (onnxruntime)."""
    from gluon_unet.data.io import read_labels
    out = str(tmp_path / 'predicted')
    done = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'predict'), '--model', CASE['export'], '--input',
                           image, '--output', out, '--no-progress'] + list(flags), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    stem = os.path.splitext(os.path.basename(image))[0]
    return read_labels(os.path.join(out, stem + '_labels.png'))


@pytest.mark.parametrize('which', ['grey', 'colour'])
def test_the_widget_segments_an_image_layer_as_bin_predict_does(panel, qtbot, tmp_path, which):
    viewer, path = panel.viewer, CASE[which]
    layer = viewer.open(path)[0]
    _load(panel, qtbot, CASE['export'])
    meta = json.load(open(os.path.join(CASE['export'], 'model.json')))
    assert panel.threshold.value == pytest.approx(meta['postprocess']['threshold'])  # the export's own settings
    assert panel.min_size.value == meta['postprocess']['min_size'] and panel.diameter.value == 'none'
    panel.probability.value = True
    _segment(panel, qtbot, layer)
    labels = viewer.layers['%s nuclei' % layer.name]
    expected = _predict_labels(path, tmp_path)
    assert labels.data.shape == expected.shape and labels.data.max() >= 3
    np.testing.assert_array_equal(labels.data, expected)
    assert viewer.layers['%s probability' % layer.name].data.shape == expected.shape
    assert panel.result.predicted and 'nuclei in' in panel.status.value and not _errors()
    # Only the post-processing changed: the maps are reused, the labels are bin/predict's with that flag.
    panel.threshold.value, panel.min_size.value = 0.7, 4
    _segment(panel, qtbot)
    assert not panel.result.predicted and 'post-processing only' in panel.status.value
    np.testing.assert_array_equal(viewer.layers['%s nuclei' % layer.name].data,
                                  _predict_labels(path, tmp_path, '--threshold', '0.7', '--min-size', '4',
                                                  '--overwrite'))
    assert len([n for n in viewer.layers if n.name.endswith('nuclei')]) == 1  # updated, not added again


def test_progress_and_cancel(panel, qtbot):
    viewer = panel.viewer
    viewer.add_image(np.random.default_rng(0).integers(0, 255, (900, 900), dtype=np.uint8), name='big')
    _load(panel, qtbot, CASE['export'])
    panel.tta.value = True
    seen = []
    panel.run()
    panel.worker.yielded.connect(lambda step: seen.append(step) or (len(seen) == 2 and panel.cancel()))
    qtbot.waitUntil(lambda: panel.worker is None, timeout=60000)
    assert seen and seen[-1][0] < seen[-1][1]  # stopped part-way
    assert 'big nuclei' not in [layer.name for layer in viewer.layers]
    assert panel.status.value.startswith('cancelled') and not _errors()
    assert panel.run_button.enabled and not panel.cancel_button.enabled


def _broken(tmp_path):
    """Exports that cannot run here: each with words its message must hold."""
    no_onnx = tmp_path / 'no-onnx'
    no_onnx.mkdir()
    for name in ('model-symbol.json', 'model-0000.params', 'model.json'):
        shutil.copy(os.path.join(CASE['export'], name), str(no_onnx / name))
    damaged = tmp_path / 'damaged'
    shutil.copytree(CASE['export'], str(damaged))
    with open(str(damaged / 'model.onnx'), 'r+b') as f:
        f.seek(200)
        f.write(b'\x00\x01\x02\x03')
    empty = tmp_path / 'empty'
    empty.mkdir()
    return {str(no_onnx): 'has no model.onnx', str(damaged): 'damaged', str(empty): 'no exported model there'}


def test_bad_exports_and_layers_are_one_line_messages_not_tracebacks(panel, qtbot, tmp_path, capfd):
    viewer = panel.viewer
    grey = viewer.open(CASE['grey'])[0]
    for model, words in _broken(tmp_path).items():
        before = len(_errors())
        _load(panel, qtbot, model)
        _segment(panel, qtbot, grey)
        assert len(_errors()) > before and words in _errors()[-1], (model, _errors()[-1:])
    _load(panel, qtbot, CASE['two_channels'])  # a model of 2 input channels: a grey image does not fit
    _segment(panel, qtbot, grey)
    assert 'the model takes 2' in _errors()[-1]
    _load(panel, qtbot, CASE['export'])
    stack = viewer.add_image(np.zeros((3, 64, 64), np.uint8), name='stack')
    _segment(panel, qtbot, stack)
    assert '2-D image' in _errors()[-1] and 'stack' in _errors()[-1]
    panel.diameter.value = 'big'
    _segment(panel, qtbot, grey)
    assert 'diameter' in _errors()[-1]
    assert [layer.name for layer in viewer.layers] == [grey.name, 'stack']  # nothing added
    assert all('\n' not in message for message in _errors())
    assert 'Traceback' not in capfd.readouterr().err
