"""Post-processing chosen on the validation split after training, stored in the export."""
import json
import os

import numpy as np
import pytest

from gluon_unet.inference import predict as predict_mod
from gluon_unet.training.loop import fit
from gluon_unet.errors import UserError
from gluon_unet.inference.batched import load_model
from gluon_unet.inference.postprocess_search import TUNE_GRID, tune_on_maps
from gluon_unet.paths import MANIFEST
from conftest import nuclei_png

import mxnet as mx


def _disc(shape, cy, cx, r):
    yy, xx = np.mgrid[:shape[0], :shape[1]]
    return (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r


def _nuclei(centres, value, radius=7):
    """(prob, truth) of 64 px discs at ``centres`` with foreground probability ``value``."""
    truth = np.zeros((64, 64), np.int32)
    prob = np.full((64, 64), 0.05, np.float32)
    for k, (cy, cx) in enumerate(centres, start=1):
        truth[_disc(truth.shape, cy, cx, radius)] = k
        prob[_disc(truth.shape, cy, cx, radius)] = value
    return prob, truth


def test_the_search_finds_the_threshold_and_min_size_the_data_needs():
    rng = np.random.RandomState(0)
    pairs = []
    for _ in range(4):
        prob, truth = _nuclei([(16, 16), (16, 46), (46, 30)], 0.9)
        # Speckles at 0.55: the default cut of 0.5 turns each into a false nucleus.
        for y, x in rng.randint(2, 62, size=(6, 2)):
            if truth[y, x] == 0:
                prob[y - 1:y + 1, x - 1:x + 1] = 0.55
        pairs.append((prob, truth))
    result = tune_on_maps(pairs, grid=dict(TUNE_GRID, min_score=(0.0,)))
    assert result['score'] > result['base_score']
    assert result['threshold'] >= 0.6 or result['min_size'] >= 16
    assert result['images'] == 4
    # with the min score among the choices, the speckles (mean 0.55) may go that way instead
    result = tune_on_maps(pairs)
    assert result['score'] == 1.0 and (result['threshold'] >= 0.6 or result['min_size'] >= 16
                                       or result['min_score'] > 0.55)


def test_the_search_drops_faint_blobs_by_their_mean_probability_and_scores_what_it_reports():
    """Faint blobs too large for any min size and too bright for any threshold of the grid
    are dropped by the min score; the reported score is what the chosen setting gives."""
    from gluon_unet.metrics import dsb_image_score
    from gluon_unet.inference.postprocess import instances_from_maps
    pairs = []
    for k in range(3):
        prob, truth = _nuclei([(14, 14), (14, 48), (48, 14)], 0.97)
        prob[_disc(truth.shape, 46, 46, 8 + k)] = 0.7  # debris: not a nucleus
        pairs.append((prob, truth))
    result = tune_on_maps(pairs)
    assert result['base_score'] < 0.8 and result['score'] == 1.0
    assert 0.7 < result['min_score'] <= 0.97
    setting = {k: result[k] for k in ('threshold', 'h', 'min_size', 'min_score')}
    assert np.mean([dsb_image_score(instances_from_maps(m, **setting), t) for m, t in pairs]) == result['score']
    assert tune_on_maps(pairs, grid=dict(TUNE_GRID, min_score=(0.0,)))['score'] < 1.0


def test_fit_stores_the_tuned_settings_and_predict_uses_them(tiny, tmp_path, monkeypatch):
    history = fit(tiny(epochs=2, val_split=0.25), verbose=False)
    meta = json.load(open(os.path.join(history.output, 'export', 'model.json')))
    tuned = meta['postprocess']
    assert set(tuned) >= {'threshold', 'h', 'min_size', 'min_score', 'score', 'base_score', 'images'}
    assert tuned['images'] == 6 and tuned['score'] >= tuned['base_score']
    model = load_model(history.output, [mx.cpu()])
    assert (model.threshold, model.min_size, model.h, model.min_score) == (
        tuned['threshold'], tuned['min_size'], tuned['h'], tuned['min_score'])
    seen = {}
    import gluon_unet.inference.batched as batched_mod  # the one instance step (LoadedModel.instances)
    real = batched_mod.instances_from_maps

    def spy(prob, **kw):
        seen.update(kw)
        return real(prob, **kw)

    monkeypatch.setattr(batched_mod, 'instances_from_maps', spy)
    from gluon_unet.data.synthetic import synthetic_nuclei
    import cv2
    os.makedirs(str(tmp_path / 'in'))
    cv2.imwrite(str(tmp_path / 'in' / 'a.png'), synthetic_nuclei(1, size=32, channels=1, seed=5)[0][0])
    predict_mod.predict_paths(history.output, str(tmp_path / 'in'), str(tmp_path / 'out'), progress=False)
    assert (seen['threshold'], seen['min_size'], seen['h'], seen['min_score']) == (
        tuned['threshold'], tuned['min_size'], tuned['h'], tuned['min_score'])
    predict_mod.predict_paths(history.output, str(tmp_path / 'in'), str(tmp_path / 'o2'), progress=False,
                              threshold=0.7, min_size=3, min_score=0.25)
    assert (seen['threshold'], seen['min_size'], seen['min_score']) == (0.7, 3, 0.25)  # flags still win
    predict_mod.predict_paths(history.output, str(tmp_path / 'in'), str(tmp_path / 'o3'), progress=False,
                              h=3.0, markers='distance')
    assert (seen['h'], seen['markers']) == (3.0, 'distance')  # every tuned setting can be overridden
    with pytest.raises(UserError, match='^--markers border needs a mask[+]border model'):
        predict_mod.predict_paths(history.output, str(tmp_path / 'in'), str(tmp_path / 'o4'), progress=False,
                                  markers='border')
    assert not os.path.exists(str(tmp_path / 'o4'))


def test_the_search_scores_whole_validation_images_predicted_like_bin_predict(tiny, monkeypatch):
    """A model trained on crops is tuned on its validation images whole (tiled, as
    bin/predict sees them), scored against their whole instance labels - not on the
    training-time crops, whose settings need not suit whole images."""
    from gluon_unet.inference import postprocess_search as search
    seen = []
    real = search.predict_image

    def spy(net, meta, image, ctxs, **kw):
        seen.append((image.shape, meta['resize_mode'], meta['train_size']))
        return real(net, meta, image, ctxs, **kw)

    monkeypatch.setattr(search, 'predict_image', spy)
    from gluon_unet.data.synthetic import synthetic_dataset
    train_ds, val_ds = synthetic_dataset(12, 64, channels=1, seed=1), synthetic_dataset(6, 64, channels=1, seed=2)
    history = fit(tiny(epochs=1, size=64, crop=32), train_ds, val_ds, verbose=False)
    tuned = json.load(open(os.path.join(history.output, 'export', 'model.json')))['postprocess']
    assert tuned['images'] == 6 and len(seen) == 6
    assert all(shape[:2] == (64, 64) and mode == 'crop' and side == 32 for shape, mode, side in seen), seen


def test_no_tuning_when_switched_off(tiny):
    history = fit(tiny(epochs=1, val_split=0.25, tune_postprocess=False), verbose=False)
    assert 'postprocess' not in json.load(open(os.path.join(history.output, 'export', 'model.json')))


def test_export_can_choose_the_post_processing_again_without_retraining(tiny):
    """bin/export --tune-postprocess: the same search as at the end of training, on the
    run's own validation split, written into the export."""
    from gluon_unet.cli import export_main
    history = fit(tiny(epochs=1, val_split=0.25, tune_postprocess=False, target='mask+border', loss='bce_dice'),
                  verbose=False)
    sidecar = os.path.join(history.output, 'export', 'model.json')
    meta = json.load(open(sidecar))
    assert 'postprocess' not in meta
    assert meta['card']['postprocess'] == {'threshold': 0.5, 'normalize': 'none', 'target': 'mask+border',
                                           'instances': 'marker watershed from the interiors',
                                           'chosen': 'the training config (no search)'}
    assert export_main([history.output, '--tune-postprocess']) == 0
    meta = json.load(open(sidecar))
    tuned = meta['postprocess']
    assert tuned['images'] == 6 and tuned['markers'] in ('border', 'distance')
    assert tuned['score'] >= tuned['base_score']
    # The card now tells what bin/predict will do: the searched markers and threshold.
    card = meta['card']['postprocess']
    assert card['threshold'] == tuned['threshold'] and card['target'] == 'mask+border'
    assert card['instances'] == {'border': 'marker watershed from the interiors',
                                 'distance': 'marker watershed on the distance transform'}[tuned['markers']]
    assert card['chosen'].startswith('searched on 6 validation images: threshold %.2f' % tuned['threshold'])


def test_a_config_saved_before_the_denoise_existed_reproduces_that_run():
    from gluon_unet.config import TrainConfig
    saved = TrainConfig(normalize='auto').to_dict()
    del saved['denoise']
    assert TrainConfig.from_dict(saved).denoise == 0.0
    assert TrainConfig.from_dict(TrainConfig().to_dict()).denoise == 1.0


def test_export_tune_postprocess_without_validation_images_is_one_line(tiny, capsys):
    from gluon_unet.cli import export_main
    history = fit(tiny(epochs=1, val_split=0.0), verbose=False)
    assert export_main([history.output, '--tune-postprocess']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'no validation images' in err[0]


def test_the_search_stops_gathering_images_at_its_pixel_budget(tiny, monkeypatch):
    import mxnet as mx
    from gluon_unet.data.synthetic import synthetic_dataset
    from gluon_unet.inference.postprocess_search import tune_on_dataset
    from gluon_unet.inference.sidecar import geometry
    from gluon_unet.training.step import build_network
    cfg = tiny(size=64, crop=32)
    net = build_network(cfg, [mx.cpu()])
    val_ds = synthetic_dataset(5, 64, channels=1, seed=2)
    assert tune_on_dataset(net, [mx.cpu()], val_ds, geometry(cfg), 4, max_pixels=2 * 64 * 64)['images'] == 2
    assert tune_on_dataset(net, [mx.cpu()], val_ds, geometry(cfg), 4, max_pixels=10)['images'] == 1
    assert tune_on_dataset(net, [mx.cpu()], val_ds, geometry(cfg), 4, max_images=3)['images'] == 3
    # An image larger than the budget alone is cut to its centre, labels and image alike.
    from gluon_unet.inference import postprocess_search as search
    shapes, real = [], search.predict_image

    def spy(net, meta, image, ctxs, **kw):
        shapes.append(image.shape)
        return real(net, meta, image, ctxs, **kw)

    monkeypatch.setattr(search, 'predict_image', spy)
    assert tune_on_dataset(net, [mx.cpu()], val_ds, geometry(cfg), 4, max_pixels=32 * 32)['images'] == 1
    assert shapes == [(32, 32, 1)]
    assert search._central_window((100, 40), 1000) == (slice(25, 75), slice(10, 30))


def test_the_search_predicts_with_the_mode_and_tta_predict_will_use_and_says_so(tiny, monkeypatch, capsys):
    """--tune-mode / --tune-tta (and bin/export --tune-postprocess --mode M --tta): the
    search scores maps predicted that way, the export records it, and bin/predict notes
    when its own --mode / --tta differ."""
    from gluon_unet.inference import postprocess_search as search
    from gluon_unet.cli import export_main
    from gluon_unet.inference.postprocess import settings_text
    calls = []
    real = search.predict_image

    def spy(net, meta, image, ctxs, **kw):
        calls.append((kw.get('mode', 'auto'), kw.get('tta', False)))
        return real(net, meta, image, ctxs, **kw)

    monkeypatch.setattr(search, 'predict_image', spy)
    history = fit(tiny(epochs=1, val_split=0.25, tune_mode='tile', tune_tta=True), verbose=False)
    sidecar = os.path.join(history.output, 'export', 'model.json')
    tuned = json.load(open(sidecar))['postprocess']
    assert tuned['mode'] == 'tile' and tuned['tta'] is True and calls == [('tile', True)] * tuned['images'] and calls
    assert settings_text(tuned).endswith('(chosen on maps predicted with --mode tile --tta)')
    meta = json.load(open(sidecar))
    assert predict_mod.tuning_note(meta, 'tile', True) == ''
    note = predict_mod.tuning_note(meta, 'auto', False)
    assert 'chosen on validation maps predicted with --mode tile --tta, these predictions use --mode auto' in note
    assert note.endswith('(`bin/export RUN --tune-postprocess --mode auto` searches on maps like these)')
    # bin/predict without --mode / --tta predicts the way the post-processing was chosen.
    images = os.path.join(history.output, 'demo_in')
    os.makedirs(images)
    with open(os.path.join(images, 'a.png'), 'wb') as f:
        f.write(nuclei_png(0))
    out = os.path.join(history.output, 'pred')
    predict_mod.predict_paths(history.output, images, out, progress=False)
    settings = json.load(open(os.path.join(out, MANIFEST)))['settings']
    assert (settings['mode'], settings['tta']) == ('tile', True) and not capsys.readouterr().err
    # Searched again without --mode / --tta: the way the run searched (its --tune-mode/--tune-tta).
    calls.clear()
    assert export_main([history.output, '--tune-postprocess']) == 0
    tuned = json.load(open(sidecar))['postprocess']
    assert (tuned['mode'], tuned['tta']) == ('tile', True) and calls == [('tile', True)] * tuned['images']
    # The default way, asked for: nothing recorded, and tile/TTA predictions get the note.
    calls.clear()
    assert export_main([history.output, '--tune-postprocess', '--mode', 'auto', '--no-tta']) == 0
    tuned = json.load(open(sidecar))['postprocess']
    assert 'tta' not in tuned and 'mode' not in tuned and calls == [('auto', False)] * tuned['images']
    assert predict_mod.tuning_note(json.load(open(sidecar)), 'auto', False) == ''
    assert '--tune-postprocess --mode tile --tta`' in predict_mod.tuning_note(json.load(open(sidecar)), 'tile', True)
    assert export_main([history.output, '--tune-postprocess', '--mode', 'whole', '--tta']) == 0
    tuned = json.load(open(sidecar))['postprocess']
    assert (tuned['mode'], tuned['tta']) == ('whole', True)
    capsys.readouterr()
    # --mode / --tta without the search, or a bad mode: one line, exit 2, the export untouched.
    before = open(sidecar).read()
    for argv, words in (([history.output, '--tta'], '--tta goes with --tune-postprocess'),
                        ([history.output, '--mode', 'tile'], '--mode goes with --tune-postprocess'),
                        ([history.output, '--tune-postprocess', '--mode', 'tiles'], '--mode')):
        try:
            code = export_main(argv)
        except SystemExit as exc:  # argparse's usage errors exit (bin/export: one line, 2)
            code = exc.code
        assert code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert open(sidecar).read() == before


def test_a_sidecar_whose_tta_or_mode_is_bad_is_refused(tmp_path):
    from conftest import BRIGHTNESS_SIDECAR, export_brightness_model
    from gluon_unet.inference.sidecar import read_sidecar
    for bad, words in (({'tta': 'yes'}, "'postprocess' 'tta' must be true or false"),
                       ({'mode': 'tiles'}, "'postprocess' 'mode' must be one of auto, resize, tile, whole")):
        folder = export_brightness_model(str(tmp_path / next(iter(bad))), dict(BRIGHTNESS_SIDECAR, postprocess=bad))
        with pytest.raises(UserError, match=words):
            read_sidecar(os.path.join(folder, 'model.json'))


def test_the_tune_mode_choices_are_predicts_modes():
    # config.py spells them out (it stays free of numpy/OpenCV, which tiling imports).
    from gluon_unet.config import _CHOICES
    from gluon_unet.inference.tiling import MODES
    assert _CHOICES['tune_mode'] == MODES
