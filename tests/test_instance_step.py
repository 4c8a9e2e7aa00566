"""One instance step: every caller that segments with an export (bin/predict, the napari
widget, the bioimage.io package's cover) goes through ``LoadedModel.instances``, which
applies the export's tuned post-processing - its split and markers included - unless a
setting is given."""
import ast
import os

import numpy as np
import pytest
from scipy import ndimage as ndi

import gluon_unet
from gluon_unet.inference import batched
from gluon_unet.inference.batched import loaded_model
from gluon_unet.inference.postprocess import instances_from_maps

#: The export's post-processing, as the search stores it: none of it a default.
TUNED = {'threshold': 0.4, 'min_size': 3, 'h': 0.7, 'marker': 0.3, 'markers': 'distance', 'split': 'randomwalker',
         'min_score': 0.2, 'score': 0.5, 'mode': 'tile', 'tta': True}


def _model():
    """A two-map (mask+contact) model whose search chose the distance markers and the walker."""
    meta = {'outputs': ['foreground', 'contact'], 'postprocess': dict(TUNED), 'threshold': 0.5}
    return loaded_model(None, meta, ['cpu(0)'], 1)


def _maps():
    yy, xx = np.mgrid[:32, :48]
    fg = sum(((yy - 16) ** 2 + (xx - cx) ** 2 <= 49).astype(np.float32) for cx in (12, 25, 40))
    return np.stack([ndi.gaussian_filter(np.clip(fg, 0, 1), 1), np.zeros((32, 48), np.float32)])


def _predict(model, maps):
    from gluon_unet.inference.predict import PredictConfig, _PredictionRun
    return _PredictionRun(model, [], 'unused', PredictConfig())._instances(maps)


def _napari(model, maps):
    from gluon_unet.napari.segmenter import Segmenter, Settings
    segmenter = object.__new__(Segmenter)  # the Segmenter of an ONNX export, without onnxruntime
    segmenter.model = model
    return segmenter.instances(maps, segmenter.resolved(Settings()))


def _cover(model, maps, monkeypatch):
    from gluon_unet.inference import bioimageio
    seen = {}

    def predicted(net, meta, image, ctxs, mode='auto', tta=False, **kw):
        seen.update(mode=mode, tta=tta)
        return maps
    monkeypatch.setattr(bioimageio, 'predict_image', predicted)
    objects = bioimageio.cover(model, np.zeros(maps.shape[1:] + (1,), np.uint8))[1]
    assert seen == {'mode': TUNED['mode'], 'tta': TUNED['tta']}  # predicted as the search's maps were
    return objects


@pytest.mark.parametrize('caller', ['predict', 'napari', 'cover'])
def test_every_caller_segments_with_the_exports_tuned_split_and_markers(caller, monkeypatch):
    model, maps = _model(), _maps()
    calls = []

    def recorded(m, **settings):
        calls.append(settings)
        return instances_from_maps(m, **settings)
    monkeypatch.setattr(batched, 'instances_from_maps', recorded)
    run = {'predict': _predict, 'napari': _napari}.get(caller) or (lambda a, b: _cover(a, b, monkeypatch))
    found = run(model, maps)  # the labels; the cover's object count
    assert len(calls) == 1
    expected = {k: v for k, v in TUNED.items() if k not in ('score', 'mode', 'tta')}
    assert calls[0] == expected
    labels = instances_from_maps(maps, **expected)
    assert labels.max() == 3
    np.testing.assert_array_equal(found, labels.max() if caller == 'cover' else labels)


def test_a_given_setting_wins_and_an_unknown_one_is_refused():
    model, maps = _model(), _maps()
    tuned = {k: v for k, v in TUNED.items() if k not in ('score', 'mode', 'tta')}
    plain = model.instances(maps, split='none', h=None)  # None: the model's own
    np.testing.assert_array_equal(plain, instances_from_maps(maps, **dict(tuned, split='none')))
    assert plain.max() == 1 and model.instances(maps).max() == 3  # the three touch: only a split parts them
    with pytest.raises(TypeError, match='splitt'):
        model.instances(maps, splitt='none')


def test_only_the_instance_step_and_the_search_call_the_post_processing_directly():
    # A new caller that built its own call would drop whatever the export adds next.
    allowed = {'inference/batched.py', 'inference/postprocess.py', 'inference/postprocess_search.py',
               'training/validation.py'}  # validation: the untuned per-epoch score, before any export
    root = os.path.dirname(gluon_unet.__file__)
    callers = set()
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith('.py'):
                path = os.path.join(folder, name)
                tree = ast.parse(open(path, encoding='utf-8').read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Call):
                        fn = node.func
                        called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, 'id', None)
                        if called in ('instances_from_maps', 'instances_from_prob'):
                            callers.add(os.path.relpath(path, root).replace(os.sep, '/'))
    assert callers - allowed == set()
