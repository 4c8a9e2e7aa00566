"""The int8 variant of an export (issue 50): bin/export --int8 writes and records it,
bin/predict --precision int8 uses it, bad values fail in one line."""
import json
import os
import shutil

import cv2
import numpy as np
import pytest

from conftest import export_names, run_cli, tiny_config
from gluon_unet.cli import export_main, predict_main
from gluon_unet.data.synthetic import synthetic_nuclei
from gluon_unet.training.loop import fit
from gluon_unet.errors import UserError
from gluon_unet.inference.batched import load_exported
from gluon_unet.metrics import dsb_image_score
from gluon_unet.inference.predict import predict_paths

INT8_FILES = ['model-int8-0000.params', 'model-int8-symbol.json']


def _skip_unless_int8():
    from gluon_unet.machine.cpu import cpu_int8_support
    ok, reason = cpu_int8_support()
    if not ok:
        pytest.skip(reason)


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    """A tiny trained run with BatchNorm (the conv+BN+ReLU fusion int8 relies on); its
    validation split (9 images: with 3, the int8 ranges miss what new images reach and
    clip there) is what --int8 calibrates on."""
    _skip_unless_int8()
    cfg = tiny_config(tmp_path_factory.mktemp('int8'), width=8, batch_norm=True, epochs=15, lr=0.01,
                      synthetic_count=30, val_split=0.3)
    fit(cfg, verbose=False)
    return cfg


@pytest.fixture(scope='module')
def int8_export(run, tmp_path_factory):
    out = str(tmp_path_factory.mktemp('int8-export') / 'export')
    assert run_cli(export_main, [run.output, '--int8', '--output', out]) == 0
    return out


@pytest.fixture(scope='module')
def nuclei(tmp_path_factory):
    """Four synthetic nuclei images (PNG) and their instance labels."""
    folder = tmp_path_factory.mktemp('nuclei')
    images, _, labels = synthetic_nuclei(4, size=64, channels=1, seed=11)
    for i, image in enumerate(images):
        cv2.imwrite(str(folder / ('n%d.png' % i)), image)
    return str(folder), labels


def test_int8_export_writes_and_records_its_calibration(run, int8_export):
    assert sorted(os.listdir(int8_export)) == sorted(export_names() + INT8_FILES)
    meta = json.load(open(os.path.join(int8_export, 'model.json')))
    record = meta['int8']
    cal = record['calibration']
    from gluon_unet.data.prepare import build_datasets
    _, val = build_datasets(run)
    # The run's own split (9 images, one 32 px window each) but every 4th image, held out
    # for the check: the 4th and the 8th.
    held = [val.names[3], val.names[7]]
    assert cal['images'] == [n for n in val.names if n not in held] and cal['inputs'] == 7 and len(val) == 9
    assert (cal['calib_mode'], cal['input_shape'], cal['excluded_layers']) == ('naive', [1, 32, 32], [])
    # Only the transposed convolutions stay float32 (MXNet has no int8 Deconvolution).
    assert record['float32_layers'] == {'Deconvolution': run.model.depth}
    check = record['check']
    assert check['images'] == held and check['held_out'] and check['pixels'] == 2 * 32 * 32
    # At the threshold bin/predict uses: the one training's search chose, kept by bin/export.
    assert (check['threshold'], check['threshold_from']) == (meta['postprocess']['threshold'], 'postprocess.threshold')
    assert check['verdict'] == 'agrees' and check['problem'] == '' and check['images_lost'] == []
    assert 0 < check['foreground_float32'] and check['foreground_iou'] >= 0.8 and check['mask_disagreement'] <= 0.02
    assert abs(check['foreground_int8'] - check['foreground_float32']) <= 0.02
    assert 0 < check['max_probability_difference'] <= 0.2
    assert set(INT8_FILES) <= set(meta['digest'])
    # The float32 model is the plain export: no quantized operator in it.
    assert '_sg_mkldnn' not in open(os.path.join(int8_export, 'model-symbol.json')).read()


def test_int8_variant_loads_quantized_and_predicts_labels_close_to_float32(int8_export, nuclei, tmp_path):
    import mxnet as mx
    nodes = json.load(open(os.path.join(int8_export, 'model-int8-symbol.json')))['nodes']
    assert any(n['op'] == '_sg_mkldnn_conv' and n['attrs'].get('quantized') == 'true' for n in nodes)
    # load_exported gives the int8 network: near float32's output, not equal to it (on
    # images like those it was calibrated on: out of its calibrated ranges int8 clips).
    folder, truth = nuclei
    x = mx.nd.array(np.stack([cv2.imread(os.path.join(folder, 'n%d.png' % i), 0)[None] / 255.0 for i in range(2)]))
    probs = {p: mx.nd.sigmoid(load_exported(int8_export, precision=p)[0](x)).asnumpy() for p in ('float32', 'int8')}
    diff = np.abs(probs['int8'] - probs['float32'])
    # 0.2-0.3 at a few pixels of images it was not calibrated on, ~0.01 on average.
    assert 0 < diff.max() <= 0.4 and diff.mean() <= 0.02
    out = {}
    for precision in ('float32', 'int8'):
        result = predict_paths(int8_export, folder, str(tmp_path / precision), precision=precision, progress=False)
        out[precision] = {r['id']: cv2.imread(r['labels'], cv2.IMREAD_UNCHANGED) for r in result}
    assert sorted(out['int8']) == sorted(out['float32']) == ['n0', 'n1', 'n2', 'n3']
    for i, key in enumerate(sorted(out['float32'])):
        a, b = out['float32'][key], out['int8'][key]
        # int8 moves probabilities by up to ~0.1 (the sidecar's figure on the held-out
        # validation images): only pixels near the threshold - object borders - may flip. 3 % of the
        # pixels is about one border ring of the ~10 nuclei of a 64 px image.
        assert ((a > 0) != (b > 0)).mean() <= 0.03
        # The instances as a whole: the int8 labels score within 0.1 of float32's DSB score
        # against the truth (one nucleus of ~10 split or merged differently moves it ~0.1).
        assert abs(dsb_image_score(b, truth[i]) - dsb_image_score(a, truth[i])) <= 0.1


def test_int8_and_float32_predictions_do_not_mix_in_one_folder(int8_export, nuclei, tmp_path):
    folder, _ = nuclei
    out = str(tmp_path / 'pred')
    predict_paths(int8_export, folder, out, progress=False)
    with pytest.raises(UserError, match='other settings: precision null -> "int8"'):
        predict_paths(int8_export, folder, out, precision='int8', progress=False)


def test_plain_export_removes_the_int8_variant_of_older_weights(run, nuclei, tmp_path, capsys):
    out = str(tmp_path / 'export')
    assert run_cli(export_main, [run.output, '--int8', '--output', out]) == 0
    assert set(INT8_FILES) <= set(os.listdir(out))
    assert run_cli(export_main, [run.output, '--output', out]) == 0
    assert sorted(os.listdir(out)) == export_names()
    capsys.readouterr()
    code = run_cli(predict_main, ['--model', out, '--input', nuclei[0], '--output', str(tmp_path / 'p'),
                                  '--precision', 'int8'])
    err = capsys.readouterr().err
    assert code == 2 and err.count('\n') == 1 and 'has no int8 variant' in err and 'bin/export RUN --int8' in err


@pytest.mark.parametrize('argv, words', [
    (['--int8', '--int8-inputs', '0'], '--int8-inputs must be an integer between 1 and 100000'),
    (['--int8-inputs', '4'], '--int8-inputs goes with --int8'),
    (['--int8-calibration', 'entropy'], '--int8-calibration goes with --int8'),
])
def test_bad_int8_export_flags_fail_in_one_line(run, tmp_path, capsys, argv, words):
    code = run_cli(export_main, [run.output, '--output', str(tmp_path / 'e')] + argv)
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count('\n') == 1, err
    assert not (tmp_path / 'e').exists()


@pytest.mark.parametrize('argv, words', [
    (['--precision', 'int8', '--providers', 'cpu'], 'drop --providers'),
    (['--precision', 'int8', '--gpus', '0'], 'drop --gpus'),
    (['--precision', 'int4'], "invalid choice: 'int4'"),
])
def test_bad_precision_fails_in_one_line(int8_export, nuclei, tmp_path, capsys, argv, words):
    code = run_cli(predict_main, ['--model', int8_export, '--input', nuclei[0], '--output', str(tmp_path / 'p')]
                   + argv)
    err = capsys.readouterr().err
    assert code == 2 and words in err and 'Traceback' not in err, err
    assert not (tmp_path / 'p').exists()


def test_int8_on_a_machine_that_cannot_run_it_is_one_line(run, int8_export, nuclei, tmp_path, capsys, monkeypatch):
    from gluon_unet.machine import cpu as hardware
    monkeypatch.setattr(hardware, 'cpu_int8_support', lambda: (False, 'this MXNet build has no oneDNN'))
    assert run_cli(export_main, [run.output, '--int8', '--output', str(tmp_path / 'e')]) == 2
    assert capsys.readouterr().err == 'error: --int8: this MXNet build has no oneDNN\n'
    assert not (tmp_path / 'e').exists()
    assert run_cli(predict_main, ['--model', int8_export, '--input', nuclei[0], '--output', str(tmp_path / 'p'),
                                   '--precision', 'int8']) == 2
    assert capsys.readouterr().err == 'error: --precision int8: this MXNet build has no oneDNN\n'


def test_int8_support_probe_names_the_cpu():
    from gluon_unet.machine.cpu import cpu_int8_support
    ok, reason = cpu_int8_support()
    assert isinstance(ok, bool) and 'int8' in reason
    if ok:
        assert 'runs int8 convolutions' in reason and ('VNNI' in reason or 'vnni' in reason)


# -- int8 that predicts nothing (issue 60, observation 4) -------------------------------------

def _export_files(folder):
    return {name: open(os.path.join(folder, name), 'rb').read() for name in os.listdir(folder)}


@pytest.fixture(scope='module')
def black_val_run(tmp_path_factory):
    """A tiny run on synthetic nuclei whose --val-data images are all black (one epoch:
    only its validation split matters here); their masks are not empty, which training
    refuses."""
    _skip_unless_int8()
    tmp = tmp_path_factory.mktemp('black')
    for sub in ('train', 'val'):
        os.makedirs(str(tmp / sub))
    images, masks, _ = synthetic_nuclei(12, size=32, channels=1, seed=3)
    for i, (image, mask) in enumerate(zip(images, masks)):
        cv2.imwrite(str(tmp / 'train' / ('n%d.png' % i)), image)
        cv2.imwrite(str(tmp / 'train' / ('n%d_mask.png' % i)), (mask > 0).astype(np.uint8) * 255)
    square = np.zeros((32, 32), np.uint8)
    square[8:16, 8:16] = 255
    for i in range(6):
        cv2.imwrite(str(tmp / 'val' / ('black%d.png' % i)), np.zeros((32, 32), np.uint8))
        cv2.imwrite(str(tmp / 'val' / ('black%d_mask.png' % i)), square)
    cfg = tiny_config(tmp, batch_norm=True, epochs=1, data=str(tmp / 'train'), val_data=str(tmp / 'val'),
                      cache_dir=str(tmp / 'cache'))
    fit(cfg, verbose=False)
    return cfg


def test_int8_calibration_on_black_validation_images_is_refused(black_val_run, tmp_path, capsys):
    out = tmp_path / 'e'
    capsys.readouterr()
    code = run_cli(export_main, [black_val_run.output, '--int8', '--output', str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count('\n') == 1 and 'Traceback' not in err, err
    assert err.startswith('error: export --int8: the 5 calibration inputs (from the validation images black0, black1, '
                          'black2, ...) carry no signal') and 'between grey levels 0 and 0' in err
    assert 'export without --int8' in err
    assert not out.exists()  # refused before anything was written


def test_int8_record_is_measured_at_the_searched_threshold_on_held_out_images(run, tmp_path, monkeypatch):
    import mxnet as mx
    from gluon_unet.data.prepare import build_datasets
    from gluon_unet.inference import postprocess_search
    from gluon_unet.inference.batched import predict_image
    # A search that chooses 0.35, so the training threshold (0.5) cannot pass for it.
    searched = {'threshold': 0.35, 'h': 0.5, 'min_size': 0, 'min_score': 0.0, 'score': 0.3, 'base_score': 0.2,
                'images': 9, 'seconds': 0.0}
    monkeypatch.setattr(postprocess_search, 'tune_on_dataset', lambda *a, **k: dict(searched))
    out = str(tmp_path / 'export')
    assert run_cli(export_main, [run.output, '--int8', '--tune-postprocess', '--output', out]) == 0
    meta = json.load(open(os.path.join(out, 'model.json')))
    check = meta['int8']['check']
    assert meta['postprocess']['threshold'] == check['threshold'] == 0.35
    assert check['threshold_from'] == 'postprocess.threshold' and check['verdict'] == 'agrees'
    # On images calibration never saw: the run's 4th and 8th validation images.
    _, val = build_datasets(run)
    assert check['images'] == [val.names[3], val.names[7]] and check['held_out']
    assert not set(check['images']) & set(meta['int8']['calibration']['images'])
    # Its foreground figures are bin/predict's at 0.35 on those images, float32 and int8.
    for precision in ('float32', 'int8'):
        net = load_exported(out, precision=precision)[0]
        maps = [predict_image(net, meta, val.raw(i)[0], [mx.cpu()]) for i in (3, 7)]
        assert check['foreground_' + precision] == pytest.approx(np.mean([m > 0.35 for m in maps]), abs=1e-6)


def test_int8_that_loses_the_nuclei_is_refused_and_the_export_kept(run, tmp_path, capsys, monkeypatch):
    from gluon_unet.inference import export_int8
    out = str(tmp_path / 'export')
    assert run_cli(export_main, [run.output, '--int8', '--output', out]) == 0
    before = _export_files(out)
    # Calibrated on inputs 20 x dimmer than the images (as a split of faint images would
    # be): int8 clips every brighter pixel and finds no nuclei.
    real = export_int8.calibration_inputs

    def dim(*args, **kwargs):
        inputs, images = real(*args, **kwargs)
        return inputs * 0.05, images
    monkeypatch.setattr(export_int8, 'calibration_inputs', dim)
    capsys.readouterr()
    code = run_cli(export_main, [run.output, '--int8', '--output', out])
    err = capsys.readouterr().err
    assert code == 1 and err.count('\n') == 1 and 'Traceback' not in err, err
    assert err.startswith('error: export --int8: the int8 variant disagrees with float32 on 2 held-out validation '
                          'images at threshold ') and 'foreground int8 0.00 %' in err, err
    assert '(almost) no foreground on' in err and 'export folder is left as it was' in err
    assert _export_files(out) == before  # the float32 and int8 files and model.json as they were


def test_predict_warns_about_int8_it_cannot_trust(int8_export, nuclei, tmp_path, capsys):
    def predict(model, name):
        capsys.readouterr()
        code = run_cli(predict_main, ['--model', model, '--input', nuclei[0], '--output', str(tmp_path / name),
                                      '--precision', 'int8', '--no-progress'])
        return code, capsys.readouterr().err
    assert predict(int8_export, 'good') == (0, '')  # checked, agrees: nothing to say
    meta = json.load(open(os.path.join(int8_export, 'model.json')))

    def with_record(name, change):
        model = str(tmp_path / ('model-' + name))
        shutil.copytree(int8_export, model)
        with open(os.path.join(model, 'model.json'), 'w') as f:
            json.dump(dict(meta, int8=change(dict(meta['int8']))), f)
        return model
    cases = [
        # an export made before the check existed
        ('old', lambda r: {k: v for k, v in r.items() if k != 'check'}, 'never checked against float32'),
        # one write_export marked (bin/export refuses these)
        ('bad', lambda r: dict(r, check=dict(r['check'], verdict='disagrees', problem='foreground IoU 0 %')),
         'disagrees with float32 (foreground IoU 0 %)'),
        # its post-processing searched again after the check
        ('moved', lambda r: dict(r, check=dict(r['check'], threshold=0.9)), 'checked at threshold 0.9')]
    for name, change, words in cases:
        model = with_record(name, change)
        code, err = predict(model, name)
        assert code == 0 and err.startswith('warning: --precision int8: ') and err.count('\n') == 1, err
        assert words in err, err
    # float32 predictions of the same export say nothing about int8
    capsys.readouterr()
    assert run_cli(predict_main, ['--model', model, '--input', nuclei[0], '--output', str(tmp_path / 'f32'),
                                  '--no-progress']) == 0
    assert capsys.readouterr().err == ''


def test_int8_of_a_run_too_small_to_hold_images_out_says_so(run, nuclei, tmp_path, capsys, monkeypatch):
    from gluon_unet.inference import export_int8
    monkeypatch.setattr(export_int8, 'HOLD_OUT_EVERY', 10)  # 9 validation images: none held out
    out = str(tmp_path / 'export')
    capsys.readouterr()
    assert run_cli(export_main, [run.output, '--int8', '--output', out]) == 0
    assert 'unverified: measured on the calibration images: the run has 9 validation images, too few to hold any ' \
           'out (it takes 10)' in capsys.readouterr().out
    record = json.load(open(os.path.join(out, 'model.json')))['int8']
    check = record['check']
    assert (check['verdict'], check['held_out'], check['on']) == ('unverified', False, 'the calibration images')
    assert check['images'] == record['calibration']['images'] and len(check['images']) == 9
    code = run_cli(predict_main, ['--model', out, '--input', nuclei[0], '--output', str(tmp_path / 'p'),
                                  '--precision', 'int8', '--no-progress'])
    err = capsys.readouterr().err
    assert code == 0 and err.count('\n') == 1 and 'agreement with float32 is unverified: measured on the ' \
        'calibration images' in err, err


def test_int8_check_verdicts():
    """The bounds, on made-up maps (numpy only): int8 agreeing, finding nothing or
    foreground everywhere; no image held out; float32 finding (almost) nothing."""
    from gluon_unet.inference.export_int8 import Int8Calibration, agreement
    ref = np.zeros((32, 32), np.float32)
    ref[8:16, 8:16] = 0.9  # 64 px of foreground (6 %)

    def verdict(got, held_out=True, reference=ref):
        cal = Int8Calibration(None, [], check_images=[], held_out=held_out, validation_images=9,
                              maps=[('a', reference, got)])
        return agreement(cal, 0.5)
    same = verdict(ref + 0.02)
    assert (same['verdict'], same['foreground_iou'], same['mask_disagreement']) == ('agrees', 1.0, 0.0)
    lost = verdict(ref * 0.5)  # every probability halved: nothing crosses 0.5
    assert lost['verdict'] == 'disagrees' and lost['foreground_int8'] == 0 and lost['images_lost'] == ['a']
    assert 'foreground IoU with float32 0 %' in lost['problem']
    assert '(almost) no foreground on 1 image' in lost['problem']
    everywhere = verdict(np.full_like(ref, 0.9))
    assert everywhere['verdict'] == 'disagrees'
    assert 'masks differ on 93.8 % of the pixels (> 5 %)' in everywhere['problem']
    assert verdict(ref, held_out=False)['verdict'] == 'unverified'
    empty = verdict(np.zeros_like(ref), reference=np.zeros_like(ref))
    assert empty['verdict'] == 'unverified' and 'too little to compare' in empty['problem']
    speck = np.zeros_like(ref)
    speck[0, 0] = 0.9  # one pixel where float32 has none: no overlap, but nothing to refuse over
    assert verdict(speck, reference=np.zeros_like(ref))['verdict'] == 'unverified'
