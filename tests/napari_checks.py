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
from hang import HANG_SECONDS

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
    qtbot.waitUntil(lambda: panel.worker is None, timeout=30000)  # the shipped model it opened on
    panel.model.value = model
    panel.load()
    qtbot.waitUntil(lambda: panel.worker is None, timeout=30000)


def _predict_labels(image, tmp_path, *flags):
    """bin/predict's labels of ``image`` with the same export, in this environment (onnxruntime)."""
    from gluon_unet.data.io import read_labels
    out = str(tmp_path / 'predicted')
    done = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'predict'), '--model', CASE['export'], '--input',
                           image, '--output', out, '--no-progress'] + list(flags), capture_output=True, text=True,
                          timeout=HANG_SECONDS)
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
    probability = viewer.layers['%s probability' % layer.name]
    assert probability.data.shape == expected.shape
    # the default view: outlines, the probability hidden under the labels
    assert labels.contour > 0 and not probability.visible
    assert list(viewer.layers).index(probability) < list(viewer.layers).index(labels)
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


def _fine_tune(panel, qtbot, timeout=300000):
    panel.fine_tune()
    qtbot.waitUntil(lambda: panel.worker is None and panel._then is None, timeout=timeout)


def _infos():
    from napari.utils.notifications import NotificationSeverity, notification_manager
    return [n.message for n in notification_manager.records if n.severity == NotificationSeverity.INFO]


def test_fine_tune_saves_the_corrected_pair_trains_in_the_mxnet_python_and_loads_the_new_model(panel, qtbot,
                                                                                              tmp_path):
    import cv2
    viewer = panel.viewer
    seen_errors = len(_errors())
    layer = viewer.open(CASE['grey'])[0]
    _load(panel, qtbot, CASE['export'])
    _segment(panel, qtbot, layer)
    labels = viewer.layers['%s nuclei' % layer.name]
    corrected = np.array(labels.data)
    corrected[corrected == corrected.max()] = 0  # the user erases one object
    corrected[:6, :6] = corrected.max() + 1  # and paints another
    labels.data = corrected
    pairs = tmp_path / 'pairs'
    panel.pairs.value, panel.python.value = str(pairs), CASE['mxnet_python']
    seen = []
    panel.progress.changed.connect(lambda v: seen.append(v))
    _fine_tune(panel, qtbot)
    assert not _errors()[seen_errors:], _errors()[seen_errors:]
    stem = os.path.splitext(os.path.basename(CASE['grey']))[0]
    np.testing.assert_array_equal(cv2.imread(str(pairs / (stem + '_mask.png')), cv2.IMREAD_UNCHANGED), corrected)
    assert cv2.imread(str(pairs / (stem + '.png')), cv2.IMREAD_UNCHANGED).shape == corrected.shape
    export = str(tmp_path / 'pairs-runs' / 'finetune-1' / 'export')
    card = json.load(open(os.path.join(export, 'model.json')))['card']
    assert card['init']['digest'] and card['data']['train_images'] == 1
    qtbot.waitUntil(lambda: panel.worker is None and panel.segmenter is not None
                    and panel.segmenter.path == export, timeout=30000)
    assert panel._path() == export and seen and max(seen) >= 1
    assert _infos()[-1].startswith('fine-tuned: ')
    # Again on the same image: its pair is replaced, not added; a new run folder.
    _segment(panel, qtbot, layer)
    _fine_tune(panel, qtbot)
    assert sorted(os.listdir(pairs)) == sorted([stem + '.png', stem + '_mask.png', 'gluon_unet-pairs.json'])
    assert os.path.isdir(tmp_path / 'pairs-runs' / 'finetune-2' / 'export') and not _errors()[seen_errors:]


def test_fine_tune_without_mxnet_saves_the_pair_and_shows_the_command(panel, qtbot, tmp_path):
    viewer = panel.viewer
    seen_errors = len(_errors())
    layer = viewer.open(CASE['grey'])[0]
    _load(panel, qtbot, CASE['export'])
    _segment(panel, qtbot, layer)
    (tmp_path / 'pairs').mkdir()
    mine = tmp_path / 'pairs' / ('%s.png' % layer.name)
    mine.write_bytes(b'a file of yours')  # never written over
    panel.pairs.value, panel.python.value = str(tmp_path / 'pairs'), str(tmp_path / 'no-python')
    _fine_tune(panel, qtbot)
    assert not _errors()[seen_errors:] and mine.read_bytes() == b'a file of yours'
    assert os.path.isfile(tmp_path / 'pairs' / ('%s-2_mask.png' % layer.name))
    message = _infos()[-1]
    assert 'not an executable file' in message and 'gluon_unet train --init %s --data %s' % (
        os.path.abspath(CASE['export']), tmp_path / 'pairs') in message and panel.command in message
    assert not os.path.exists(tmp_path / 'pairs-runs')
    # Nothing to train on: one line.
    viewer.layers.remove('%s nuclei' % layer.name)
    panel.fine_tune()
    assert 'segment %r first' % layer.name in _errors()[-1]


def test_fine_tune_can_be_cancelled(panel, qtbot, tmp_path):
    viewer = panel.viewer
    seen_errors = len(_errors())
    layer = viewer.open(CASE['grey'])[0]
    _load(panel, qtbot, CASE['export'])
    _segment(panel, qtbot, layer)
    panel.pairs.value, panel.python.value = str(tmp_path / 'pairs'), CASE['mxnet_python']
    panel.fine_tune()
    qtbot.waitUntil(lambda: panel.status.value.startswith('fine-tuning') or (panel.worker is None and panel._then
                                                                              is None), timeout=120000)
    assert panel.status.value.startswith('fine-tuning '), (panel.status.value, _errors(), _infos())
    panel.worker.yielded.connect(lambda step: step[0] and panel.cancel())
    qtbot.waitUntil(lambda: panel.worker is None, timeout=300000)
    assert 'fine-tuning cancelled' in _infos()[-1] and not _errors()[seen_errors:]
    run = tmp_path / 'pairs-runs' / 'finetune-1'
    assert os.listdir(run / 'checkpoints') and not (run / 'export').exists()
    assert panel.run_button.enabled and panel.finetune_button.enabled


def test_the_widget_opens_on_the_shipped_model(panel, qtbot):
    from gluon_unet import models
    seen_errors = len(_errors())
    assert panel.choice.value == 'nuclei' and models.folder('nuclei')
    qtbot.waitUntil(lambda: panel.segmenter is not None, timeout=30000)
    assert panel.segmenter.path == models.folder('nuclei') and not _errors()[seen_errors:]
    layer = panel.viewer.open(CASE['grey'])[0]
    _segment(panel, qtbot, layer)
    assert panel.viewer.layers['%s nuclei' % layer.name].data.max() >= 1 and not _errors()[seen_errors:]
