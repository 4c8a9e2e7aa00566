"""Where a trained run loses DSB score, on its own validation images (never the hold-out).

The run's validation split is rebuilt from its checkpoint's config (the images its
post-processing search used), each image predicted whole as ``bin/predict --mode tile``
predicts it, and the probability maps kept in a file so every question below is asked
of the same maps::

    python experiments/dsb2018/dsb_val_analysis.py maps /tmp/gu13/v6 /tmp/gu14/v6_maps.npz [--tta] [--batch-stats]
    python experiments/dsb2018/dsb_val_analysis.py errors /tmp/gu14/v6_maps.npz     # what kind of error
    python experiments/dsb2018/dsb_val_analysis.py min-score /tmp/gu14/v6_maps.npz  # the min score's effect
    python experiments/dsb2018/dsb_val_analysis.py ensemble A.npz B.npz             # averaging two runs' maps
    python experiments/dsb2018/dsb_val_analysis.py scale /tmp/gu13/v6               # rescaling to the training diameter
    python experiments/dsb2018/dsb_val_analysis.py thresholds /tmp/gu14/v6_maps.npz # a threshold per image, at best
    python experiments/dsb2018/dsb_val_analysis.py object-filter /tmp/gu14/v6_maps.npz  # a learned filter vs the min score
    python experiments/dsb2018/dsb_val_analysis.py per-kind /tmp/gu14/v6_maps.npz   # a setting per image kind vs one for all
    python experiments/dsb2018/dsb_val_analysis.py markers /tmp/gu14/v6_maps.npz    # other watershed markers vs the distance
    python experiments/dsb2018/dsb_val_analysis.py oracles /tmp/gu14/v6_maps.npz    # outline or separation: which loses more
    python experiments/dsb2018/dsb_val_analysis.py centre /tmp/gu24/val_v22.npz     # a mask+centre model's markers

``maps --batch-stats`` normalizes with each image's own BatchNorm statistics instead of
the running ones (AdaBN: does a per-image normalization help images unlike the batch?).
``errors`` prints the score at each IoU threshold (boundary precision) and sorts the true
nuclei that found no match: merged with a neighbour, split, missed; ``min-score`` compares
the mean probability of matched and false objects and scores a few cuts; ``scale``
compares the image's own scale with rescaling by its *true* nucleus diameter (an
oracle: what a perfect ``--diameter`` could give) and by ``--diameter auto``;
``thresholds`` scores each image at its own best foreground threshold (an oracle: the most
that any per-image choice of outline could give over one global threshold);
``object-filter`` asks, cross-validated over the images, whether a logistic regression on
a few features of each object (mean / lowest probability, size, shape, neighbours) drops
false objects better than the one min-score cut does; ``per-kind`` asks whether the search
should choose a setting per image kind (fluorescence, brightfield, colour), ``markers``
whether markers from the probability itself (its confident cores, or the distance
weighted by it) split touching nuclei better than the distance watershed. Both score every
image under every setting of the search's grid and choose leave-one-image-out: each
image is scored with the setting chosen on the others, so no image picks its own.
``oracles`` splits the loss between the outline and the separation: the true
foreground separated by the run's own distance watershed (a perfect outline), and the
run's own foreground separated by the true nuclei (a perfect separation: the watershed of
its mask seeded by the true nuclei inside it; blobs without one are kept as objects).
``centre`` asks, of a ``mask+centre`` model's maps, which markers split best: the distance
watershed, the centre map's h-maxima (what the package does), its components above a
level, or the h-maxima of the distance times the centre map (leave-one-image-out too).
"""
import argparse
import ast
import contextlib
import functools
import os
import sys
from unittest import mock

import cv2
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))

from gluon_unet.errors import UserError  # noqa: E402
from gluon_unet.metrics import THRESHOLDS, dsb_image_score, dsb_score_from_iou, iou_matrix  # noqa: E402
from gluon_unet.inference.postprocess import instances_from_maps, object_scores  # noqa: E402

SETTING_KEYS = ('threshold', 'min_size', 'h', 'marker', 'markers', 'min_score')


def validation_set(run):
    """(net, cfg, val_ds, meta) of a run folder: its best checkpoint's network and the
    validation split its config builds."""
    import mxnet as mx

    from gluon_unet.checkpoint import model_from_checkpoint
    from gluon_unet.data.prepare import build_datasets
    from gluon_unet.inference.export_run import resolve_run
    from gluon_unet.inference.sidecar import geometry
    ckpt, export_dir = resolve_run(run, None)
    net, cfg, _ = model_from_checkpoint(ckpt, [mx.cpu()])
    net.hybridize(static_alloc=True, static_shape=True)
    cfg.progress = False
    _, val_ds = build_datasets(cfg)
    return net, cfg, val_ds, geometry(cfg), export_dir


def predict_maps(net, meta, image, tta=False, scale=1.0):
    """Probability maps of one validation image (uint8 as the dataset holds it), at
    ``scale`` and mapped back."""
    import mxnet as mx

    from gluon_unet.inference.batched import predict_image
    h, w = image.shape[:2]
    if scale != 1.0:
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        image = cv2.resize(image, size, interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)
        image = image.reshape(size[1], size[0], -1)
    maps = predict_image(net, meta, image, [mx.cpu()], mode='tile', tta=tta, maps=True)
    if scale != 1.0:
        maps = np.stack([cv2.resize(m, (w, h), interpolation=cv2.INTER_LINEAR) for m in maps])
    return maps


def tuned_setting(export_dir):
    """The post-processing the run's export chose (its sidecar's ``postprocess``)."""
    import json
    with open(os.path.join(export_dir, 'model.json')) as f:
        tuned = json.load(f).get('postprocess') or {}
    return {k: tuned[k] for k in SETTING_KEYS if k in tuned}


def cmd_maps(args):
    import mxnet as mx
    net, cfg, val_ds, meta, export_dir = validation_set(args.run)
    arrays = {}
    # --batch-stats: the predictor enters predict_mode itself, so for this one question its
    # predict_mode is train_mode and BatchNorm normalizes with the statistics of each
    # image's own tiles instead of the running ones (AdaBN-like; the recipes have no dropout).
    swap = (mock.patch.object(mx.autograd, 'predict_mode', mx.autograd.train_mode) if args.batch_stats
            else contextlib.nullcontext())
    with swap:
        for i in range(len(val_ds)):
            image, _, labels = val_ds.raw(i)
            arrays['maps_%s' % val_ds.names[i]] = predict_maps(net, meta, image, args.tta).astype(np.float16)
            arrays['truth_%s' % val_ds.names[i]] = labels.astype(np.int32)
            arrays['group_%s' % val_ds.names[i]] = np.array(val_ds.groups[i] if val_ds.groups else '?')
    arrays['setting'] = np.array(repr(tuned_setting(export_dir)))
    np.savez_compressed(args.out, **arrays)
    print('%d validation images of %s -> %s' % (len(val_ds), args.run, args.out))


def load_maps(path):
    """{name: (maps float32, truth, group)} and the run's tuned setting."""
    if not os.path.isfile(path):
        raise SystemExit('error: %s: no such maps file (make it with: dsb_val_analysis.py maps RUN %s)'
                         % (path, path))
    data = np.load(path)
    names = [k[5:] for k in data.files if k.startswith('maps_')]
    images = {n: (data['maps_' + n].astype(np.float32), data['truth_' + n], str(data['group_' + n]))
              for n in names}
    return images, ast.literal_eval(str(data["setting"]))  # written by cmd_maps


def score(images, setting, maps_of=lambda n, m: m):
    return float(np.mean([dsb_image_score(instances_from_maps(maps_of(n, m), **setting), t)
                          for n, (m, t, _) in images.items()]))


def cmd_errors(args):
    images, setting = load_maps(args.maps)
    if args.min_score is not None:
        setting['min_score'] = args.min_score
    per_threshold, counts = [], np.zeros(6, np.int64)
    for m, t, _ in images.values():
        p = instances_from_maps(m, **setting)
        iou = iou_matrix(p, t)  # (true, predicted)
        tp = (iou[iou > 0.5][None] > THRESHOLDS[:, None]).sum(1)
        per_threshold.append(tp / np.maximum(iou.shape[0] + iou.shape[1] - tp, 1))
        joint = np.zeros((t.max() + 1, p.max() + 1), np.int64)
        np.add.at(joint, (t.ravel(), p.ravel()), 1)
        in_pred = joint[1:, 1:] / np.maximum(joint[1:].sum(1, keepdims=True), 1)  # share of truth k in pred j
        of_pred = joint[1:, 1:] / np.maximum(joint[:, 1:].sum(0, keepdims=True), 1)  # share of pred j in truth k
        matched = (iou > 0.5).any(1)
        covers_two = (in_pred > 0.5).sum(0) >= 2
        merged = ~matched & ((in_pred > 0.5) & covers_two[None]).any(1)
        split = ~matched & ~merged & ((of_pred > 0.5).sum(1) >= 2)
        missed = ~matched & ~merged & ~split & (joint[1:, 0] / np.maximum(joint[1:].sum(1), 1) > 0.5)
        false = ~(iou > 0.5).any(0) & (joint[0, 1:] / np.maximum(joint[:, 1:].sum(0), 1) > 0.5)
        counts += [len(matched), matched.sum(), merged.sum(), split.sum(), missed.sum(), false.sum()]
    curve = np.mean(per_threshold, 0)
    print('setting %s: DSB %.4f' % (setting, curve.mean()))
    print('score at each IoU threshold: ' + ' '.join('%.2f:%.3f' % x for x in zip(THRESHOLDS, curve)))
    other = counts[0] - counts[1:5].sum()
    print('true nuclei %d: matched %d; unmatched: merged with a neighbour %d, split %d, missed %d, other %d; '
          'predicted objects on background %d' % (tuple(counts[:5]) + (other, counts[5])))


def cmd_min_score(args):
    images, setting = load_maps(args.maps)
    base = {k: v for k, v in setting.items() if k != 'min_score'}
    matched, false = [], []
    for m, t, _ in images.values():
        p = instances_from_maps(m, **base)
        mean = object_scores(p, m[0])
        hit = (iou_matrix(p, t) > 0.5).any(0)
        matched += list(mean[hit])
        false += list(mean[~hit])
    print('objects with %s: %d matched, mean probability median %.3f; %d false, median %.3f (quartiles %s)'
          % (base, len(matched), np.median(matched), len(false), np.median(false),
             np.percentile(false, [25, 75]).round(3).tolist()))
    for s in args.cuts:
        print('min score %.2f: DSB %.4f' % (s, score(images, dict(base, min_score=s))))


def cmd_ensemble(args):
    runs = [load_maps(p) for p in args.maps]
    setting = runs[0][1]
    for path, (images, _) in zip(args.maps, runs):
        print('%s alone: %.4f' % (path, score(images, setting)))
    images = runs[0][0]
    mean = lambda n, m: np.mean([r[0][n][0][:1] for r in runs], axis=0)  # noqa: E731 (foreground maps)
    print('foreground maps averaged: %.4f (setting %s)' % (score(images, setting, mean), setting))


def cmd_scale(args):
    from gluon_unet.inference.scale import SCALE_LIMITS, SCALE_TOLERANCE, estimate_diameter
    net, cfg, val_ds, meta, export_dir = validation_set(args.run)
    setting = tuned_setting(export_dir)
    import json
    with open(os.path.join(export_dir, 'model.json')) as f:
        model_diameter = json.load(f).get('diameter')
    if not model_diameter:
        raise SystemExit('error: %s: the export records no training diameter (trained before it existed)' % args.run)
    rows = []
    for i in range(len(val_ds)):
        image, _, truth = val_ds.raw(i)
        native = predict_maps(net, meta, image)
        own = instances_from_maps(native, **setting)
        row = {'native': dsb_image_score(own, truth)}
        for name, d in (('oracle', estimate_diameter(truth)), ('auto', estimate_diameter(own))):
            f = float(np.clip(model_diameter / d, *SCALE_LIMITS)) if d else 1.0
            if abs(np.log(f)) < np.log(SCALE_TOLERANCE):
                row[name] = row['native']
            else:
                labels = instances_from_maps(predict_maps(net, meta, image, scale=f), **setting)
                row[name] = dsb_image_score(labels, truth)
        rows.append(row)
    print('model diameter %.1f px, %d validation images, setting %s' % (model_diameter, len(rows), setting))
    for name in ('native', 'oracle', 'auto'):
        print('%-7s DSB %.4f' % (name, np.mean([r[name] for r in rows])))


def cmd_thresholds(args):
    bad = [t for t in args.grid if not 0 < t < 1]
    if bad:
        raise SystemExit('error: --grid thresholds must be between 0 and 1 (got %s)' % bad[0])
    images, setting = load_maps(args.maps)
    grid = sorted(set(args.grid) | {setting.get('threshold', 0.5)})
    per = np.array([[dsb_image_score(instances_from_maps(m, **dict(setting, threshold=th)), t) for th in grid]
                    for m, t, _ in images.values()])
    print('setting %s, %d images' % (setting, len(per)))
    print('one threshold for all: ' + ' '.join('%.2f:%.4f' % x for x in zip(grid, per.mean(0))))
    preferring = np.bincount(per.argmax(1), minlength=len(grid))
    print('each image at its own best threshold (oracle): %.4f; images preferring each: %s'
          % (per.max(1).mean(), ' '.join('%.2f:%d' % x for x in zip(grid, preferring))))


OBJECT_FEATURES = ('mean', 'min', 'p10', 'log_area', 'log_rel_area', 'solidity', 'eccentricity', 'at_edge',
                   'neighbours', 'outline_mean', 'log_objects')


def object_features(labels, prob):
    """(K, len(OBJECT_FEATURES)) features of the objects 1..K of a sequentially numbered
    label image."""
    from scipy import ndimage as ndi
    from skimage.measure import regionprops
    n = int(labels.max())
    if n == 0:
        return np.zeros((0, len(OBJECT_FEATURES)))
    idx = np.arange(1, n + 1)
    mean = object_scores(labels, prob)  # what --min-score cuts on, so the two arms compare alike
    area = np.bincount(labels.ravel(), minlength=n + 1)[1:].astype(np.float64)
    outline = (ndi.grey_erosion(labels, size=3) != labels) | (ndi.grey_dilation(labels, size=3) != labels)
    outline_mean = np.nan_to_num(ndi.mean(prob, np.where(outline, labels, 0), idx), nan=0.5)
    neighbours = np.zeros(n)
    for a, b in ((labels[:, :-1], labels[:, 1:]), (labels[:-1], labels[1:])):
        touch = (a != b) & (a > 0) & (b > 0)
        pairs = np.unique(np.sort(np.stack([a[touch], b[touch]], 1), 1), axis=0)
        np.add.at(neighbours, pairs.ravel() - 1, 1)
    h, w = labels.shape
    rows = []
    for r in regionprops(labels):
        vals = prob[r.coords[:, 0], r.coords[:, 1]]
        y0, x0, y1, x1 = r.bbox
        i = r.label - 1
        rows.append([mean[i], vals.min(), np.percentile(vals, 10), np.log(area[i]),
                     np.log(area[i] / np.median(area)), r.solidity, r.eccentricity,
                     float(y0 == 0 or x0 == 0 or y1 == h or x1 == w), min(neighbours[i], 4), outline_mean[i],
                     np.log(n)])
    return np.array(rows)


def fit_logistic(x, y, l2=1e-2, steps=50):
    """Newton's method for an L2-regularized logistic regression on standardized
    features; returns ``predict(x) -> probability``."""
    mu, sd = x.mean(0), x.std(0) + 1e-6
    design = lambda v: np.c_[np.ones(len(v)), (v - mu) / sd]  # noqa: E731
    z, wt = design(x), np.zeros(x.shape[1] + 1)
    for _ in range(steps):
        q = 1 / (1 + np.exp(-z @ wt))
        hess = (z * (q * (1 - q))[:, None]).T @ z + l2 * np.eye(len(wt))
        wt -= np.linalg.solve(hess, z.T @ (q - y) + l2 * wt)
    return lambda v: 1 / (1 + np.exp(-design(v) @ wt))


def cmd_object_filter(args):
    images, setting = load_maps(args.maps)
    if not 2 <= args.folds <= len(images):
        raise SystemExit('error: --folds must be 2 to %d, the number of images in %s (got %d)'
                         % (len(images), args.maps, args.folds))
    base = {k: v for k, v in setting.items() if k != 'min_score'}
    items = []  # (features, IoU matrix) per image, objects as the setting without min score finds them
    for m, t, _ in images.values():
        p = instances_from_maps(m, **base)
        items.append((object_features(p, m[0]), iou_matrix(p, t)))
    mean_score = lambda sel, keep: np.mean([dsb_score_from_iou(iou[:, keep(f)]) for f, iou in sel])  # noqa: E731
    order = np.random.RandomState(0).permutation(len(items))
    folds = [order[k::args.folds] for k in range(args.folds)]
    scores = {'none': [], 'min score': [], 'learned filter': []}
    for held in folds:
        train = [items[i] for i in order if i not in held]
        test = [items[i] for i in held]
        cut = max(np.arange(0.5, 0.96, 0.025), key=lambda c: mean_score(train, lambda f: f[:, 0] >= c))
        x = np.concatenate([f for f, _ in train])
        hit = np.concatenate([iou.max(0) if iou.shape[0] else np.zeros(iou.shape[1]) for _, iou in train]) > 0.5
        predict = fit_logistic(x, hit.astype(np.float64))
        p_cut = max(np.arange(0.05, 0.96, 0.05), key=lambda c: mean_score(train, lambda f: predict(f) >= c))
        for name, keep in (('none', lambda f: np.ones(len(f), bool)), ('min score', lambda f: f[:, 0] >= cut),
                           ('learned filter', lambda f: predict(f) >= p_cut)):
            scores[name] += [dsb_score_from_iou(iou[:, keep(f)]) for f, iou in test]
    print('setting %s without its min score, %d images, %d-fold over images' % (base, len(items), args.folds))
    for name, s in scores.items():
        print('%-14s DSB %.4f' % (name, np.mean(s)))


def setting_scores(images, settings, label_fn, jobs=1):
    """(images, settings x min scores) DSB scores: every image labelled by
    ``label_fn(maps, setting)`` for each setting, then cut at each of the search's min
    scores (``search.TUNE_MIN_SCORES``)."""
    items = [(m, t) for m, t, _ in images.values()]
    work = functools.partial(_image_row, settings=settings, label_fn=label_fn)
    if jobs > 1:
        from multiprocessing import Pool
        with Pool(jobs) as pool:
            return np.array(pool.map(work, items))
    return np.array([work(item) for item in items])


def _image_row(item, settings, label_fn):
    from gluon_unet.inference.postprocess import cut_scores
    from gluon_unet.inference.postprocess_search import TUNE_MIN_SCORES
    m, t = item
    return [score for setting in settings for score in cut_scores(label_fn(m, setting), m[0], t, TUNE_MIN_SCORES)]


def leave_one_out(scores, groups=None):
    """Each image's score under the column chosen on the other images (of its own group
    when ``groups`` are given; an image alone in its group gets the choice of all the
    others)."""
    n = len(scores)
    out = np.empty(n)
    for i in range(n):
        others = np.arange(n) != i
        if groups is not None and (others & (groups == groups[i])).any():
            others &= groups == groups[i]
        out[i] = scores[i, scores[others].mean(0).argmax()]
    return out


def _grid_settings():
    import itertools

    from gluon_unet.inference.postprocess_search import TUNE_GRID
    keys = ('threshold', 'h', 'min_size')
    return [dict(zip(keys, v)) for v in itertools.product(*(TUNE_GRID[k] for k in keys))]


def _grid_labels(m, setting):  # at module level: --jobs sends it to other processes
    return instances_from_maps(m, **setting)


def cmd_per_kind(args):
    images, _ = load_maps(args.maps)
    groups = np.array([g for _, _, g in images.values()])
    per = setting_scores(images, _grid_settings(), _grid_labels, args.jobs)
    one, own = leave_one_out(per), leave_one_out(per, groups)
    print('%d images; each scored with the setting chosen on the others (leave-one-image-out)' % len(per))
    print('%-13s %3s %10s %10s' % ('kind', 'n', 'one for all', 'per kind'))
    for kind in sorted(set(groups)) + ['all']:
        sel = groups == kind if kind != 'all' else np.ones(len(groups), bool)
        print('%-13s %3d %10.4f %10.4f' % (kind, sel.sum(), one[sel].mean(), own[sel].mean()))


def _core_markers(prob, threshold, min_size, core):
    """Markers: the components of ``prob > core``; flooding downhill in the probability:
    the package's border markers with a border map of zeros."""
    from gluon_unet.inference.postprocess import instances_from_prob
    return instances_from_prob(prob, threshold=threshold, min_size=min_size, boundary=np.zeros_like(prob),
                               marker=core)


def _distance_times_prob(prob, threshold, min_size, h):
    """The distance watershed on the distance times the probability (smoothed like the
    package's, sigma 1): a nucleus' dim rim and a dim neck between two count less."""
    from scipy import ndimage as ndi
    from skimage.segmentation import watershed

    from gluon_unet.inference.postprocess import h_maxima_markers, keep_orphans
    mask = instances_from_maps(prob, threshold=threshold, min_size=min_size, split='none') > 0
    elevation = ndi.gaussian_filter(ndi.distance_transform_edt(mask) * prob, 1.0)
    return keep_orphans(watershed(-elevation, h_maxima_markers(elevation, mask, h), mask=mask), mask)


def _variant_labels(m, setting):
    kind, setting = setting['markers'], {k: v for k, v in setting.items() if k != 'markers'}
    if kind == 'distance':
        return instances_from_maps(m, **setting)
    fn = _core_markers if kind == 'core' else _distance_times_prob
    return fn(m[0], **setting)


def cmd_markers(args):
    images, _ = load_maps(args.maps)
    base = [dict(s, markers='distance') for s in _grid_settings()]
    sizes = (0, 16)
    core = [{'markers': 'core', 'threshold': t, 'core': c, 'min_size': ms}
            for t in (0.5, 0.6) for c in (0.8, 0.9, 0.95, 0.98) for ms in sizes]
    weighted = [{'markers': 'distance x prob', 'threshold': t, 'h': h, 'min_size': ms}
                for t in (0.5, 0.6) for h in (0.5, 1.0, 2.0) for ms in sizes]
    arms = {'distance (the search)': base, 'probability cores': core, 'distance x prob': weighted}
    per = {name: setting_scores(images, settings, _variant_labels, args.jobs) for name, settings in arms.items()}
    print('%d images; best setting on all of them / each scored with the one chosen on the others' % len(images))
    for name, scores in per.items():
        print('%-24s %.4f / %.4f' % (name, scores.mean(0).max(), leave_one_out(scores).mean()))
    everything = np.concatenate(list(per.values()), 1)
    print('%-24s %.4f / %.4f' % ('all three together', everything.mean(0).max(), leave_one_out(everything).mean()))


def _centre_level(maps, threshold, min_size, level):
    """Markers: the components of the centre map above ``level`` (not its h-maxima)."""
    from gluon_unet.inference.postprocess import keep_orphans, level_markers
    from skimage.segmentation import watershed
    mask = instances_from_maps(maps[0], threshold=threshold, min_size=min_size, split='none') > 0
    markers, elevation = level_markers(maps[1], mask, level)
    return keep_orphans(watershed(elevation, markers, mask=mask), mask)


def _distance_times_centre(maps, threshold, min_size, h):
    """The distance watershed on the foreground's distance transform times the centre map
    (smoothed like the package's, sigma 1): the learned valley between two touching nuclei
    cuts the distance's single hill where their union has no neck."""
    from scipy import ndimage as ndi
    from skimage.segmentation import watershed

    from gluon_unet.inference.postprocess import h_maxima_markers, keep_orphans
    mask = instances_from_maps(maps[0], threshold=threshold, min_size=min_size, split='none') > 0
    elevation = ndi.gaussian_filter(ndi.distance_transform_edt(mask) * maps[1], 1.0)
    return keep_orphans(watershed(-elevation, h_maxima_markers(elevation, mask, h), mask=mask), mask)


def _centre_labels(m, setting):
    kind, setting = setting['markers'], {k: v for k, v in setting.items() if k != 'markers'}
    if kind in ('distance', 'centre'):
        return instances_from_maps(m, markers=kind, **setting)
    return (_centre_level if kind == 'centre level' else _distance_times_centre)(m, **setting)


def cmd_centre(args):
    images, _ = load_maps(args.maps)
    if any(m.ndim != 3 or len(m) != 2 for m, _, _ in images.values()):
        raise SystemExit('error: %s: not the maps of a two-map (mask+centre) model' % args.maps)
    sizes, thresholds = (0, 16), (0.4, 0.5, 0.6)
    arms = {
        'distance (the search)': [dict(s, markers='distance') for s in _grid_settings()],
        'centre h-maxima': [{'markers': 'centre', 'threshold': t, 'marker': d, 'min_size': ms}
                            for t in thresholds for d in (0.02, 0.05, 0.1, 0.2) for ms in sizes],
        'centre level': [{'markers': 'centre level', 'threshold': t, 'level': v, 'min_size': ms}
                         for t in thresholds for v in (0.2, 0.3, 0.4, 0.5) for ms in sizes],
        'distance x centre': [{'markers': 'distance x centre', 'threshold': t, 'h': h, 'min_size': ms}
                              for t in thresholds for h in (0.25, 0.5, 1.0) for ms in sizes]}
    per = {name: setting_scores(images, settings, _centre_labels, args.jobs) for name, settings in arms.items()}
    print('%d images; best setting on all of them / each scored with the one chosen on the others' % len(images))
    for name, scores in per.items():
        from gluon_unet.inference.postprocess_search import TUNE_MIN_SCORES
        best = scores.mean(0).argmax()
        setting = dict(arms[name][best // len(TUNE_MIN_SCORES)], min_score=TUNE_MIN_SCORES[best % len(TUNE_MIN_SCORES)])
        print('%-24s %.4f / %.4f   best: %s' % (name, scores.mean(0).max(), leave_one_out(scores).mean(), setting))
    everything = np.concatenate(list(per.values()), 1)
    print('%-24s %.4f / %.4f' % ('all together', everything.mean(0).max(), leave_one_out(everything).mean()))


def oracle_labels(maps, truth, setting):
    """The labellings ``oracles`` scores: the run's own, the true foreground's connected
    components, the true foreground split by the run's distance watershed, and the run's
    foreground split by the true nuclei."""
    from scipy import ndimage as ndi
    from skimage.measure import label
    from skimage.segmentation import watershed

    from gluon_unet.inference.postprocess import keep_orphans
    fg = truth > 0
    perfect = fg.astype(np.float32)[None]
    if maps.ndim == 3 and len(maps) == 2:  # a two-map model's own second map seeds its watershed
        perfect = np.concatenate([perfect, maps[1:]])
    ours = instances_from_maps(maps, **setting)
    mask = instances_from_maps(maps, **dict(setting, split='none')) > 0
    seeds = np.where(mask, truth, 0).astype(np.int32)
    split_by_truth = keep_orphans(watershed(-ndi.distance_transform_edt(mask), seeds, mask=mask), mask)
    return {'ours': ours,
            'true foreground, components': label(fg, connectivity=1),
            'true foreground, our watershed': instances_from_maps(perfect, **dict(setting, min_size=0, min_score=0)),
            'our foreground, true split': split_by_truth}


def cmd_oracles(args):
    images, setting = load_maps(args.maps)
    table = {}
    for m, t, _ in images.values():
        for name, labels in oracle_labels(m, t, setting).items():
            table.setdefault(name, []).append(dsb_image_score(labels, t))
    print('%d images, setting %s' % (len(images), setting))
    for name, scores in table.items():
        print('%-31s DSB %.4f' % (name, np.mean(scores)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = p.add_subparsers(dest='cmd', required=True)
    a = sub.add_parser('maps', help="predict a run's validation images and keep the maps")
    a.add_argument('run')
    a.add_argument('out')
    a.add_argument('--tta', action='store_true')
    a.add_argument('--batch-stats', action='store_true',
                   help="BatchNorm on each image's own statistics instead of the running ones")
    a = sub.add_parser('errors', help='score per IoU threshold and the kinds of error')
    a.add_argument('maps')
    a.add_argument('--min-score', type=float, default=None, help="override the run's min score")
    a = sub.add_parser('min-score', help="mean probability of matched and false objects; a few cuts")
    a.add_argument('maps')
    a.add_argument('--cuts', type=float, nargs='+', default=[0.0, 0.75, 0.8, 0.85, 0.88, 0.9])
    a = sub.add_parser('ensemble', help="average several runs' foreground maps")
    a.add_argument('maps', nargs='+')
    a = sub.add_parser('scale', help='own scale vs rescaled by the true / measured diameter')
    a.add_argument('run')
    a = sub.add_parser('thresholds', help='each image at its own best threshold (an oracle)')
    a.add_argument('maps')
    a.add_argument('--grid', type=float, nargs='+', default=[0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    a = sub.add_parser('object-filter', help='a learned object filter against the min score, cross-validated')
    a.add_argument('maps')
    a.add_argument('--folds', type=int, default=5)
    for name, what in (('per-kind', 'a setting per image kind against one for all, leave-one-image-out'),
                       ('markers', 'markers from the probability against the distance watershed')):
        a = sub.add_parser(name, help=what)
        a.add_argument('maps')
        a.add_argument('--jobs', type=int, default=1, help='processes (each image is scored on its own)')
    a = sub.add_parser('oracles', help='a perfect outline or a perfect separation: which loses more')
    a.add_argument('maps')
    a = sub.add_parser('centre', help="a mask+centre model's markers: h-maxima, levels, distance x centre")
    a.add_argument('maps')
    a.add_argument('--jobs', type=int, default=1, help='processes (each image is scored on its own)')
    args = p.parse_args(argv)
    if getattr(args, 'jobs', 1) < 1:
        raise SystemExit('error: --jobs must be >= 1 (got %d)' % args.jobs)
    try:
        {'maps': cmd_maps, 'errors': cmd_errors, 'min-score': cmd_min_score, 'ensemble': cmd_ensemble,
         'scale': cmd_scale, 'thresholds': cmd_thresholds, 'object-filter': cmd_object_filter,
         'per-kind': cmd_per_kind, 'markers': cmd_markers, 'oracles': cmd_oracles,
         'centre': cmd_centre}[args.cmd](args)
    except UserError as e:  # a run folder that is not one: one line, not a traceback
        raise SystemExit('error: %s' % e)


if __name__ == '__main__':
    main()
