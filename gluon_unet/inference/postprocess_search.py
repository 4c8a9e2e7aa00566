"""The post-processing search: the threshold, markers and minimum object size that score
best on a run's validation images, stored in its export for ``bin/predict``.

:func:`tune_on_maps` scores every setting of a grid on probability maps and true
instances (numpy only); :func:`tune_on_dataset` predicts the validation images whole,
as ``bin/predict`` will, and runs it - at the end of training, or again for a trained run
with ``bin/export --tune-postprocess`` (:func:`retune`). :func:`search_seconds` estimates
its time for ``--time-budget``.

On the inference side: it uses an export's geometry and the predictor, never the
training loop (training imports it, not the other way round).
"""
import dataclasses
import itertools
import time

import numpy as np

from ..data.targets import flow_map
from ..errors import UserError
from .batched import predict_image, second_map
from .postprocess import DEFAULT_MARKER, SECOND_MAPS, cut_scores, instances_from_maps

# The grids searched on the validation split after training (27 settings each): the
# foreground cut, the smallest object kept, and the markers' setting - the h of the
# distance watershed's h-maxima, the interior score a border model's marker needs, or how
# far a centre model's hill top rises above its valley.
TUNE_GRID = {'threshold': (0.4, 0.5, 0.6), 'h': (0.5, 1.0, 2.0), 'min_size': (0, 16, 48)}
TUNE_GRID_BORDER = {'threshold': (0.4, 0.5, 0.6), 'marker': (0.3, 0.5, 0.7), 'min_size': (0, 16, 48)}
TUNE_GRID_CENTRE = {'threshold': (0.4, 0.5, 0.6), 'marker': (0.05, 0.1, 0.2), 'min_size': (0, 16, 48)}
# A flow model's marker: the length its predicted direction needs for a pixel to follow it.
TUNE_GRID_FLOW = {'threshold': (0.4, 0.5, 0.6), 'marker': (0.1, 0.25, 0.5), 'min_size': (0, 16, 48)}
_GRIDS = {'centre': TUNE_GRID_CENTRE, 'flow': TUNE_GRID_FLOW}


# Each of those settings is also scored with objects of a low mean probability dropped
# (``min_score``): a column cut of the same IoU matrix, so nearly free.
# A two-map model's search also tries the distance watershed on its foreground (TUNE_GRID):
# a second map learned in a short run can split nuclei worse than the distance does.
TUNE_MIN_SCORES = (0.0, 0.75, 0.8, 0.85, 0.9)


#: The arm of :func:`search_arms` that labels with the random walker instead of the watershed.
RANDOM_WALKER = 'randomwalker'


def _searches(second, grid=None):
    """The (markers, grid) pairs :func:`tune_on_maps` searches in turn, for maps whose
    second map is ``second`` (one of :data:`SECOND_MAPS`; None = one map)."""
    if second:
        return [(second, grid or _GRIDS.get(second, TUNE_GRID_BORDER)),
                ('distance', TUNE_GRID)]
    return [(None, grid or TUNE_GRID)]


def _search_keys(markers):
    return ('threshold', 'marker' if markers in SECOND_MAPS else 'h', 'min_size')


def search_arms(second, grid=None):
    """``(markers, labellings)`` for each kind of markers :func:`tune_on_maps` tries on
    maps whose second map is ``second`` (one of :data:`SECOND_MAPS`; None or False = one
    map): how many times it labels each image with them (every setting of its grid, and
    the untuned default with the first; the min scores reuse a labelling). The kinds cost
    differently (a distance watershed about twice a border map's), so ``--time-budget``
    probes each."""
    arms = [[markers, int(np.prod([len(space[k]) for k in _search_keys(markers)]))]
            for markers, space in _searches(second, grid)]
    arms[0][1] += 1
    # The random walker from the winner's markers: one more labelling, slower than a flood.
    return [tuple(arm) for arm in arms] + [(RANDOM_WALKER, 1)]


def search_labelings(second, grid=None):
    """How many times :func:`tune_on_maps` labels each image (:func:`search_arms`, summed)."""
    return sum(n for _, n in search_arms(second, grid))


def tune_on_maps(pairs, grid=None, base=None, second=None):
    """Choose the post-processing settings that score best on validation images.

    Parameters
    ----------
    pairs : sequence of ((H, W) or (K, H, W) float, (H, W) int)
        Probability maps (see :func:`instances_from_maps`) and the true instance labels,
        one pair per image.
    grid : dict, optional
        Candidate values of ``threshold``, ``min_size`` and ``h`` (default
        :data:`TUNE_GRID`), or ``marker`` instead of ``h`` for maps with a second map
        (default :data:`TUNE_GRID_BORDER`; their distance watershed is searched on
        :data:`TUNE_GRID` as well); each with every ``min_score`` of
        :data:`TUNE_MIN_SCORES` (or the grid's own ``min_score`` values).
    base : dict, optional
        The untuned settings, scored too and kept on ties (so tuning never reports a
        setting that does no better than the defaults).
    second : {None, 'border', 'centre', 'contact', 'flow'}
        What the maps after the foreground are (None: 'border' for two maps, as before other
        second maps existed; 'flow' for three).

    Returns
    -------
    dict
        ``threshold``, ``min_size``, ``h`` or ``marker``, ``min_score``, ``score`` (mean
        DSB score of the winner), ``base_score`` and ``images``; for two maps also
        ``markers`` (``second`` or 'distance', see :func:`instances_from_maps`).
    """
    if second is not None and second not in SECOND_MAPS:
        raise ValueError('second must be one of %s (got %r)' % (', '.join(SECOND_MAPS), second))
    k = len(pairs[0][0]) if pairs and np.ndim(pairs[0][0]) == 3 else 1
    second = (second or ('flow' if k == 3 else 'border')) if k > 1 else None
    searches = _searches(second, grid)
    if second:
        base = base or {'markers': second, 'threshold': 0.5, 'marker': DEFAULT_MARKER[second], 'min_size': 0}
    else:
        base = base or {'threshold': 0.5, 'h': 0.5, 'min_size': 0}

    def scores(setting, min_scores):
        """Mean score of ``setting`` with each of ``min_scores``: one labelling and one
        IoU matrix per image; a min score only drops columns (objects) of it."""
        total = np.zeros(len(min_scores))
        for m, t in pairs:
            m = np.asarray(m, np.float32)  # as bin/predict has them (a caller may keep float16)
            total += cut_scores(instances_from_maps(m, **setting), m if m.ndim == 2 else m[0], t, min_scores)
        return total / max(1, len(pairs))

    base = dict(base, min_score=base.get('min_score', 0.0))
    best_score = base_score = float(scores({k: v for k, v in base.items() if k != 'min_score'},
                                           [base['min_score']])[0])
    best = base
    for markers, space in searches:
        keys = _search_keys(markers)
        min_scores = tuple(space.get('min_score', TUNE_MIN_SCORES))
        for values in itertools.product(*(space[k] for k in keys)):
            setting = dict(zip(keys, values), **({'markers': markers} if markers else {}))
            for min_score, value in zip(min_scores, scores(setting, min_scores)):
                if dict(setting, min_score=min_score) != base and value > best_score + 1e-9:
                    best, best_score = dict(setting, min_score=min_score), float(value)
    # The instance step is a choice too: the random walker from the winner's markers (not
    # for a flow model's gathering, which has no flooding to replace).
    if best.get('markers') != 'flow':
        walker = dict({k: v for k, v in best.items() if k != 'min_score'}, split=RANDOM_WALKER)
        value = float(scores(walker, [best['min_score']])[0])
        if value > best_score + 1e-9:
            best, best_score = dict(walker, min_score=best['min_score']), value
    return dict(best, score=best_score, base_score=base_score, images=len(pairs))


SEARCH_MAX_IMAGES = 64  # the post-processing search's validation images, at most
SEARCH_MAX_PIXELS = 16 * 2 ** 20  # ... and their pixels
SEARCH_PROBE_FRACTION = 0.25  # --time-budget times the search's prediction on this share of its pixels


def tune_on_dataset(net, ctxs, dataset, meta, batch_size, max_images=SEARCH_MAX_IMAGES,
                        max_pixels=SEARCH_MAX_PIXELS, mode='auto', tta=False):
    """Search the post-processing settings (:data:`TUNE_GRID`) that give the best
    DSB score on the validation split with ``net`` as it is (the best checkpoint's
    weights, loaded by the caller). Never the hold-out: only ``dataset`` is read.

    The validation images are scored whole, predicted the way ``bin/predict`` predicts
    them (``meta``: :func:`sidecar.geometry`; a model trained on crops sees blended tiles),
    not as the training-time crops validation uses: crops cut nuclei at their edges and
    lack the tiles' context, and the settings they choose need not suit whole images
    (measured on a DSB run: chosen on crops, border markers scored 0.504 on the whole
    validation images, where the distance watershed scored 0.529). ``mode`` and ``tta`` are
    ``bin/predict``'s ``--mode`` and ``--tta``: tiles blend overlapping windows and TTA
    averages 8 flips, both smooth the maps, and the threshold and h that suit them can
    differ (on a DSB run's 60 validation images predicted with ``--mode tile --tta``: 0.547
    with the setting chosen on ``auto`` maps, 0.556 with the one chosen on those maps -
    but 0.596 against 0.587 on the hold-out the other way round: 60 images do not tell
    such settings apart).

    At most ``max_images`` images, and no more once ``max_pixels`` are gathered (an image
    larger than that alone is cut to its central ``max_pixels``): the maps are kept
    (float16) and each setting is scored on all of them, so the search's memory and time
    follow the pixel count (DSB's 60 validation images are 10.4 Mpx: about two minutes of
    one core).

    Returns
    -------
    dict
        :func:`tune_on_maps`'s result, plus ``seconds``.
    """
    t0 = time.time()
    pairs = []
    for image, labels in search_images(dataset, max_images, max_pixels):
        maps = predict_image(net, meta, image, ctxs, mode=mode, tta=tta, batch_size=batch_size, maps=True)
        pairs.append((maps.astype(np.float16), labels))
    result = tune_on_maps(pairs, second=second_map(meta))
    result['seconds'] = time.time() - t0
    if mode != 'auto' or tta:  # what bin/predict compares its own --mode / --tta with
        result.update(mode=mode, tta=tta)
    return result


def search_images(dataset, max_images=SEARCH_MAX_IMAGES, max_pixels=SEARCH_MAX_PIXELS):
    """The (uint8 image, instance labels) pairs :func:`tune_on_dataset` scores, in
    order: the first ``max_images`` validation images, until ``max_pixels`` are gathered."""
    pixels = 0
    for i in range(min(len(dataset), max_images)):
        image, _, labels = dataset.raw(i)
        if labels.size > max_pixels:  # one huge image: its central part, at most the whole budget
            window = _central_window(labels.shape, max_pixels)
            image, labels = image[window], labels[window]
        if pixels and pixels + labels.size > max_pixels:
            return
        pixels += labels.size
        if image.dtype != np.uint8:  # float images given through the API (already scaled to 0..1)
            image = np.clip(image * 255 + 0.5, 0, 255).astype(np.uint8)
        yield image, labels


def search_seconds(net, ctxs, dataset, meta, batch_size, mode='auto', tta=False, second=None,
                   probe_fraction=SEARCH_PROBE_FRACTION, clock=None):
    """Estimated wall seconds of :func:`tune_on_dataset` on ``dataset``, for
    ``--time-budget`` to keep aside.

    The search predicts each of its images once, then labels them all once per setting
    (:func:`search_arms`: 28 for a one-map model; for a two-map model whose
    ``second`` map is 'border', 'centre' or 'contact', 28 with its markers and 27 with the
    distance watershed). So the probe predicts its first images up to ``probe_fraction``
    of the pixels, as the search predicts them, and labels and scores all of them once
    with each kind of markers, on their true masks (a network after one epoch draws no
    nuclei like those the trained one will); :func:`search_estimate` scales that
    up. On DSB's 60 validation images the probe takes a twelfth of the search.

    Returns
    -------
    (float, int, int)
        The estimate, the images predicted by the probe and the images the search scores.
    """
    clock = clock or time.monotonic
    images = list(search_images(dataset))
    total = sum(labels.size for _, labels in images)
    probe, pixels = [], 0
    for image, labels in images:
        if probe and pixels >= probe_fraction * total:
            break
        probe.append(image)
        pixels += labels.size
    if probe:  # untimed: the first prediction at the tiles' shapes builds their graph, once
        predict_image(net, meta, probe[0], ctxs, mode=mode, tta=tta, batch_size=batch_size)
    t0 = clock()
    for image in probe:
        predict_image(net, meta, image, ctxs, mode=mode, tta=tta, batch_size=batch_size, maps=True)
    t1 = clock()
    arms, seconds = search_arms(second), []
    for markers, _ in arms:  # what the search does for each setting: label, match, score
        split = 'watershed'
        if markers == RANDOM_WALKER:  # from the first arm's markers; a flow model's walker, from the distance
            split, markers = RANDOM_WALKER, 'distance' if arms[0][0] == 'flow' else arms[0][0]
        for _, labels in images:
            fg = (labels > 0).astype(np.float32)
            found = instances_from_maps(_stand_in_maps(fg, labels, second), markers=markers, split=split)
            cut_scores(found, fg, labels, [0.5])
        seconds.append(clock())
    spent = np.diff([t1] + seconds)
    estimate = search_estimate(t1 - t0, pixels, total, [(float(s), n) for (_, n), s in zip(arms, spent)])
    return estimate, len(probe), len(images)


def _stand_in_maps(fg, labels, second):
    """Stand-in maps for the search probe, doing a search's work on them: a second map that
    seeds one marker per blob (no border or contact line: every blob's interior is its
    marker; or a centre map high on the whole foreground), or a flow model's true flows
    (every pixel followed to its centre)."""
    if second == 'flow':
        return np.concatenate([fg[None], flow_map(labels)])
    if second:
        return np.stack([fg, fg if second == 'centre' else np.zeros_like(fg)])
    return fg


def _central_window(shape, max_pixels):
    """Slices of the central part of an image of ``shape`` (H, W, ...) with at most
    ``max_pixels`` pixels and the image's aspect ratio."""
    scale = min(1.0, (max_pixels / float(shape[0] * shape[1])) ** 0.5)
    h, w = max(1, int(shape[0] * scale)), max(1, int(shape[1] * scale))
    y, x = (shape[0] - h) // 2, (shape[1] - w) // 2
    return slice(y, y + h), slice(x, x + w)


def retune(checkpoint, export_dir, ctxs=None, mode='auto', tta=False, cfg=None):
    """Search the post-processing again for a trained run, on its own validation split,
    and store the result in its export (``bin/export --tune-postprocess``): for exports
    made before the search (or before it knew a setting), without retraining.

    The run's data and split are rebuilt from the checkpoint's config (the same
    validation images the run used; never a hold-out), or from ``cfg`` (that config with
    its paths resolved where the run trained), scored whole as at the end of
    training, predicted with ``mode`` and ``tta`` (``--tune-mode``, ``--tune-tta``).

    Returns
    -------
    dict
        :func:`tune_on_dataset`'s result (also written to the export's sidecar).
    """
    import mxnet as mx

    from ..checkpoint import model_from_checkpoint
    from ..data.prepare import build_datasets, run_data_config
    from .sidecar import geometry, update_sidecar
    ctxs = ctxs or [mx.cpu()]
    net, saved, meta = model_from_checkpoint(checkpoint, ctxs)
    # Given: the run's config with its paths resolved where it trained (bin/export's).
    cfg = dataclasses.replace(cfg or run_data_config(saved, meta, checkpoint))
    if cfg.model.classes != 1:
        raise UserError('export --tune-postprocess: the post-processing search is for binary models (--classes 1)')
    cfg.progress = False
    _, val_ds = build_datasets(cfg)
    if val_ds is None or not len(val_ds):
        raise UserError('export --tune-postprocess: the run has no validation images (--val-split 0 and no '
                        '--val-data) to choose the post-processing on')
    net.hybridize(static_alloc=True, static_shape=True)
    tuned = tune_on_dataset(net, ctxs, val_ds, geometry(cfg), cfg.batch_size, mode=mode, tta=tta)
    update_sidecar(export_dir, {'postprocess': tuned})
    return tuned


def search_estimate(predict_seconds, predicted_pixels, search_pixels, labelings):
    """Seconds the post-processing search will take, from a probe of it.

    The search predicts each of its images once, then labels all of them once per
    setting it tries. The probe predicts some of them (``predicted_pixels`` of the
    ``search_pixels``) and labels all of them once with each kind of markers the search
    uses: its prediction time is scaled by the pixels, each labelling time by the number
    of settings that label that way.

    Parameters
    ----------
    predict_seconds : float
        The probe's time for predicting ``predicted_pixels``.
    predicted_pixels, search_pixels : int
        Pixels the probe predicted, and all the pixels the search will use.
    labelings : sequence of (float, int)
        For each kind of markers: the probe's seconds for one labelling of all the
        search's images, and how many labellings of that kind the search does
        (:func:`search_arms`).
    """
    predict = predict_seconds * float(search_pixels) / predicted_pixels if predicted_pixels > 0 else 0.0
    return predict + sum(seconds * count for seconds, count in labelings)


def tune_postprocess(pairs, grid=None, base=None, second=None):
    """Deprecated name (gluon_unet 0.2) of :func:`tune_on_maps`; removed in 0.4.0."""
    import warnings
    warnings.warn('tune_postprocess is now tune_on_maps (gluon_unet 0.3.0); the old name goes in 0.4.0',
                  DeprecationWarning, stacklevel=2)
    return tune_on_maps(pairs, grid=grid, base=base, second=second)
