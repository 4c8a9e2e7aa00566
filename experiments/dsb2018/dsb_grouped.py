"""A grouped validation for DSB 2018 stage1_train: whole kinds of image are held out.

The random hold-out (``dsb_split.py``) draws its 67 images from the same pool as
training, so it cannot see how a recipe does on a kind of image it has never met; on an
unseen test set the ``dsb2018`` recipe scored 0.431 where the hold-out said 0.600 (issue
49). Here every image gets a *group* from its pixels and its masks, and a 3-fold
validation holds out whole groups: the model scored on a group never trained on any image
of it.

Groups (first rule that matches; the kind is :func:`dsb_split.image_kind`)::

    brightfield    grey image, bright background (median > 127)
    tissue-large   colour (H&E-like stained tissue), median nucleus area >= 700 px
    tissue-small   colour, median nucleus area < 700 px
    fluo-large     fluorescence, median nucleus area >= 700 px
    fluo-crowded   fluorescence, >= 30 % of the nuclei touch another one
    fluo-small     fluorescence, median nucleus area < 250 px
    fluo-medium    fluorescence, the rest (250-700 px, fewer than 30 % touching)

The median area is over the image's nuclei (its merged masks, as training reads them); a
nucleus *touches* another when one of its pixels is 8-adjacent to a pixel of the other.
700 px (a disc of 30 px across) is where the fluorescence areas thin out (26 images between
600 and 700 px, 6 between 700 and 900); 250 px splits the sparse small nuclei (mostly 256x256
frames) from the medium ones (half of them 696x520); 30 % touching marks the images whose
nuclei come in clumps, the kind the unseen test set saw merged.

Folds (each group held out in exactly one; training always keeps fluorescence and colour
groups, and one training run is an hour on 2 cores, so 3 folds = 3 hours per recipe)::

    fold 1: fluo-crowded, fluo-medium, tissue-large   (crowding and large tissue nuclei:
            the unseen test's two main failures, so fold 1 alone is the one-hour screen)
    fold 2: fluo-large, tissue-small
    fold 3: fluo-small, brightfield

Commands (run from the repository root; the data is read only, nothing is copied)::

    python experiments/dsb2018/dsb_grouped.py split [--data ROOT] [--check]
        compute the groups, print their table, write experiments/dsb2018/dsb_groups.tsv
        (--check: fail unless the recomputed file equals the committed one)
    python experiments/dsb2018/dsb_grouped.py fold K [--data ROOT] [--out /tmp/dsbgroups] [--csv]
        /tmp/dsbgroups/foldK/{train,heldout}/<id> symlink trees (the DSB layout, for
        bin/train --data and bin/predict --input / bin/evaluate --truth); --csv also writes
        train.csv / heldout.csv (image,mask columns) with merged 16-bit label masks in
        /tmp/dsbgroups/foldK/labels/
    python experiments/dsb2018/dsb_grouped.py score A=P1,P2,P3 B=Q1,Q2,Q3 [--truth ROOT]
                                                    [--random A=CSV --random B=CSV] [--bootstrap N]
        per group, the macro average over groups and the paired differences to the first
        run, with 95 % intervals over resamplings of the images within each group; each
        P is one fold's predictions: a bin/evaluate --csv file, or a bin/predict output
        folder (scored with bin/evaluate against --truth); --random adds the run's score on
        the random hold-out (a bin/evaluate --csv of dsb_holdout_ids.txt) beside it
"""
import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
# noqa: E402 below: the repository root and this folder are on the path now
import dsb_by_kind  # noqa: E402
import dsb_split  # noqa: E402
from gluon_unet.data import io  # noqa: E402
from gluon_unet.errors import UserError  # noqa: E402
from gluon_unet.utils import atomic_open, atomic_path  # noqa: E402

GROUPS_FILE = os.path.join(HERE, 'dsb_groups.tsv')
DEFAULT_OUT = '/tmp/dsbgroups'
#: Median nucleus area (px) from which an image's nuclei are large (colour and fluorescence).
LARGE_AREA = 700
#: Median nucleus area (px) under which a sparse fluorescence image's nuclei are small.
SMALL_AREA = 250
#: Share of touching nuclei from which a fluorescence image is crowded.
CROWDED = 0.3
#: Group -> (fold that holds it out, what defines it), in table order.
GROUPS = {
    'fluo-crowded': (1, 'fluorescence, >= %d %% of nuclei touch another' % round(CROWDED * 100)),
    'fluo-medium': (1, 'fluorescence, median nucleus area %d-%d px, < %d %% touching'
                    % (SMALL_AREA, LARGE_AREA, round(CROWDED * 100))),
    'tissue-large': (1, 'colour (stained tissue), median nucleus area >= %d px' % LARGE_AREA),
    'fluo-large': (2, 'fluorescence, median nucleus area >= %d px' % LARGE_AREA),
    'tissue-small': (2, 'colour (stained tissue), median nucleus area < %d px' % LARGE_AREA),
    'fluo-small': (3, 'fluorescence, median nucleus area < %d px, < %d %% touching'
                   % (SMALL_AREA, round(CROWDED * 100))),
    'brightfield': (3, 'grey, bright background (dark nuclei)'),
}
FOLDS = sorted({fold for fold, _ in GROUPS.values()})
COLUMNS = ('image_id', 'group', 'fold', 'kind', 'width', 'height', 'nuclei', 'median_area', 'touching',
           'density')


def group_of(kind, median_area, touching):
    """The group of one image (see the module doc).

    Parameters
    ----------
    kind : str
        ``'fluorescence'``, ``'brightfield'`` or ``'he'`` (:func:`dsb_split.image_kind`).
    median_area : float
        Median nucleus area in pixels.
    touching : float
        Share (0-1) of the image's nuclei that touch another nucleus.

    Returns
    -------
    str, a key of :data:`GROUPS`
    """
    if kind == 'brightfield':
        return 'brightfield'
    if kind == 'he':
        return 'tissue-large' if median_area >= LARGE_AREA else 'tissue-small'
    if kind != 'fluorescence':
        raise ValueError('unknown image kind %r' % (kind,))
    if median_area >= LARGE_AREA:
        return 'fluo-large'
    if touching >= CROWDED:
        return 'fluo-crowded'
    return 'fluo-small' if median_area < SMALL_AREA else 'fluo-medium'


def nucleus_stats(labels):
    """Number of nuclei, their median area and the share that touch another nucleus.

    Parameters
    ----------
    labels : (H, W) int array
        Instance labels, 0 = background.

    Returns
    -------
    (int, float, float)
        ``(0, 0.0, 0.0)`` for an image without nuclei.
    """
    labels = np.asarray(labels)
    areas = np.bincount(labels.ravel())[1:]
    ids = np.flatnonzero(areas) + 1
    if not len(ids):
        return 0, 0.0, 0.0
    touching = set()
    # The four neighbour offsets that, with their opposites, make up 8-adjacency.
    for a, b in ((labels[:, :-1], labels[:, 1:]), (labels[:-1, :], labels[1:, :]),
                 (labels[:-1, :-1], labels[1:, 1:]), (labels[:-1, 1:], labels[1:, :-1])):
        meet = (a != b) & (a > 0) & (b > 0)
        touching.update(np.unique(a[meet]).tolist())
        touching.update(np.unique(b[meet]).tolist())
    return len(ids), float(np.median(areas[ids - 1])), len(touching) / len(ids)


def image_features(data, image_id):
    """One image's row of :data:`COLUMNS` (without group and fold), from ``data/<id>/``."""
    folder = os.path.join(data, image_id)
    image = os.path.join(folder, 'images', image_id + '.png')
    mask_dir = os.path.join(folder, 'masks')
    masks = sorted(n for n in os.listdir(mask_dir) if io.is_image_file(n)) if os.path.isdir(mask_dir) else []
    if not masks:
        raise SystemExit('error: %s: no masks (the DSB layout has one PNG per nucleus in <id>/masks/)' % folder)
    try:
        labels = io.merge_object_masks([os.path.join(mask_dir, n) for n in masks])
    except UserError as e:
        raise SystemExit('error: %s' % e) from None
    nuclei, median_area, touching = nucleus_stats(labels)
    h, w = labels.shape
    return dict(image_id=image_id, kind=dsb_split.image_kind(image), width=w, height=h, nuclei=nuclei,
                median_area=median_area, touching=touching, density=nuclei / (h * w) * 1e6)


def compute_groups(data):
    """Rows of :data:`COLUMNS` for every ``data/<id>/images/<id>.png``, sorted by id."""
    ids = sorted(i for i in os.listdir(data) if os.path.isfile(os.path.join(data, i, 'images', i + '.png')))
    if not ids:
        raise SystemExit('error: --data %s: no <id>/images/<id>.png found (the DSB layout)' % data)
    rows = []
    for image_id in ids:
        row = image_features(data, image_id)
        row['group'] = group_of(row['kind'], row['median_area'], row['touching'])
        row['fold'] = GROUPS[row['group']][0]
        rows.append(row)
    return rows


def format_rows(rows):
    """The text of a groups file: a header line, then one tab-separated line per image."""
    fmt = {'median_area': '%.1f', 'touching': '%.3f', 'density': '%.1f'}
    lines = ['\t'.join(COLUMNS)]
    for r in rows:
        lines.append('\t'.join(fmt.get(c, '%s') % r[c] for c in COLUMNS))
    return '\n'.join(lines) + '\n'


def read_groups(path):
    """``{image_id: row}`` from a groups file written by ``split``; one-line errors."""
    if not os.path.isfile(path):
        raise SystemExit('error: --groups %s: no such file (dsb_grouped.py split writes it)' % path)
    with open(path, newline='') as f:
        reader = csv.DictReader(f, delimiter='\t')
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise SystemExit('error: --groups %s: not a groups file (want the columns %s)'
                             % (path, ', '.join(COLUMNS)))
        out = {}
        for line, row in enumerate(reader, start=2):
            if row['group'] not in GROUPS or row['fold'] != str(GROUPS[row['group']][0]):
                raise SystemExit('error: --groups %s line %d: unknown group %r or a fold other than its own (%s)'
                                 % (path, line, row['group'], row['fold']))
            row['fold'] = int(row['fold'])
            out[row['image_id']] = row
    if not out:
        raise SystemExit('error: --groups %s: lists no image' % path)
    return out


def fold_ids(groups, fold):
    """``(train_ids, heldout_ids)`` of one fold, each sorted: every image of the groups the
    fold holds out is held out, every other image trains (the two never share an image,
    nor a group)."""
    if fold not in FOLDS:
        raise SystemExit('error: fold %s: the folds are %s' % (fold, ', '.join(map(str, FOLDS))))
    held = sorted(i for i, r in groups.items() if r['fold'] == fold)
    train = sorted(i for i, r in groups.items() if r['fold'] != fold)
    return train, held


def _random_holdout():
    """The random hold-out's ids (``dsb_holdout_ids.txt``), or an empty set without it."""
    if not os.path.isfile(dsb_split.IDS_FILE):
        return set()
    with open(dsb_split.IDS_FILE) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith('#')}


def group_table(groups, random_ids=()):
    """Markdown lines: per group its fold, image count, how many random hold-out images
    it has, what defines it and what its images look like."""
    random_ids = set(random_ids)
    lines = ['| group | held out in fold | images | in the random hold-out | defined by | median nucleus area '
             '(px, median of the images) | touching share | nuclei per Mpx | image sizes (w x h: count) |',
             '|---|---|---|---|---|---|---|---|---|']
    for name, (fold, definition) in GROUPS.items():
        rows = [r for r in groups.values() if r['group'] == name]
        if not rows:
            continue
        sizes = {}
        for r in rows:
            key = '%sx%s' % (r['width'], r['height'])
            sizes[key] = sizes.get(key, 0) + 1
        med = lambda c: float(np.median([float(r[c]) for r in rows]))  # noqa: E731
        lines.append('| %s | %d | %d | %d | %s | %.0f | %.2f | %.0f | %s |' % (
            name, fold, len(rows), sum(r['image_id'] in random_ids for r in rows), definition,
            med('median_area'), med('touching'), med('density'),
            ', '.join('%s: %d' % kv for kv in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])))))
    n_random = sum(i in random_ids for i in groups)
    lines.append('| all | | %d | %d | | | | | |' % (len(groups), n_random))
    for fold in FOLDS:
        train, held = fold_ids(groups, fold)
        lines.append('')
        lines.append('fold %d holds out %s: %d images held out, %d train'
                     % (fold, ', '.join(g for g, (f, _) in GROUPS.items() if f == fold), len(held), len(train)))
    return lines


# ----------------------------------------------------------------------------- fold data

def _clear_tool_folder(folder, what):
    """Remove ``folder`` if it holds only what this tool writes there (symlinks, or the
    label PNGs); anything else stops with an error rather than being deleted."""
    if not os.path.lexists(folder):
        return
    if not os.path.isdir(folder) or os.path.islink(folder):
        raise SystemExit('error: %s: exists and is not a folder this tool wrote; remove it or choose another --out'
                         % folder)
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        ok = os.path.islink(path) if what == 'links' else (name.endswith('.png') and os.path.isfile(path))
        if not ok:
            raise SystemExit('error: %s: holds %s, which this tool did not write; remove it or choose another --out'
                             % (folder, name))
    shutil.rmtree(folder)


def write_label_png(path, labels):
    """Write an instance label image as a 16-bit PNG (ids kept: bin/train reads a grey mask
    with more than two values as instances)."""
    if labels.max(initial=0) > np.iinfo(np.uint16).max:
        raise SystemExit('error: %s: more than 65535 nuclei' % path)
    import cv2
    with atomic_path(path) as tmp:
        if not cv2.imwrite(tmp, labels.astype(np.uint16)):
            raise SystemExit('error: %s: could not write the PNG' % path)


def materialize_fold(data, groups, fold, out, with_csv=False):
    """Write one fold's training and held-out data under ``out`` (nothing is copied).

    ``out/train/<id>`` and ``out/heldout/<id>`` are symlinks to ``data/<id>`` (the DSB
    layout: ``bin/train --data out/train``, ``bin/predict --input out/heldout``,
    ``bin/evaluate --truth out/heldout``). With ``with_csv``, also ``out/labels/<id>.png``
    (each image's masks merged into one 16-bit label image, mask file k -> id k as the DSB
    layout reads them) and ``out/train.csv``, ``out/heldout.csv`` with ``image,mask``
    columns relative to ``out`` (``bin/train --data out/train.csv``).

    Returns
    -------
    (train_ids, heldout_ids)
    """
    data = os.path.abspath(data)
    present = {i for i in os.listdir(data) if os.path.isdir(os.path.join(data, i, 'images'))}
    missing = sorted(set(groups) - present)
    if missing:
        raise SystemExit('error: --data %s: %d images of the groups file are not there (e.g. %s); is it '
                         'stage1_train?' % (data, len(missing), missing[0]))
    unknown = sorted(present - set(groups))
    if unknown:
        raise SystemExit('error: --data %s: %d images are in no group (e.g. %s); run dsb_grouped.py split on it'
                         % (data, len(unknown), unknown[0]))
    train, held = fold_ids(groups, fold)
    _clear_tool_folder(os.path.join(out, 'train'), 'links')
    _clear_tool_folder(os.path.join(out, 'heldout'), 'links')
    _clear_tool_folder(os.path.join(out, 'labels'), 'labels')
    for part, ids in (('train', train), ('heldout', held)):
        os.makedirs(os.path.join(out, part))
        for image_id in ids:
            os.symlink(os.path.join(data, image_id), os.path.join(out, part, image_id))
    if with_csv:
        os.makedirs(os.path.join(out, 'labels'))
        for part, ids in (('train', train), ('heldout', held)):
            with atomic_open(os.path.join(out, part + '.csv'), newline='') as f:
                writer = csv.writer(f)
                writer.writerow(['image', 'mask'])
                for image_id in ids:
                    mask_dir = os.path.join(data, image_id, 'masks')
                    masks = [os.path.join(mask_dir, n) for n in sorted(os.listdir(mask_dir)) if io.is_image_file(n)]
                    try:
                        labels = io.merge_object_masks(masks)
                    except UserError as e:
                        raise SystemExit('error: %s' % e) from None
                    write_label_png(os.path.join(out, 'labels', image_id + '.png'), labels)
                    image = os.path.join(data, image_id, 'images', image_id + '.png')
                    writer.writerow([os.path.relpath(image, os.path.abspath(out)),
                                     os.path.join('labels', image_id + '.png')])
    return train, held


# ----------------------------------------------------------------------------- scoring

def resampled_group_means(scores, groups, n, seed=0):
    """Each group's mean score over ``n`` resamplings of its own images.

    Parameters
    ----------
    scores : (F, I) array
        One row per run, one column per image (the same images in every row).
    groups : sequence of str
        Each image's group; a resampling draws, within each group, as many images as it
        has, with replacement (the same draw for every run, so differences are paired).
    n : int
    seed : int

    Returns
    -------
    dict
        group -> (F, n) array, in sorted group order.
    """
    scores, groups = np.asarray(scores, np.float64), np.asarray(groups)
    rng = np.random.default_rng(seed)
    out = {}
    for g in sorted(set(groups.tolist())):
        members = np.flatnonzero(groups == g)
        pick = rng.choice(members, size=(len(members), n))
        out[g] = scores[:, pick].mean(axis=1)
    return out


def macro_mean(scores, groups):
    """The mean over groups of each group's mean score: (F,) for (F, I) ``scores``."""
    scores, groups = np.asarray(scores, np.float64), np.asarray(groups)
    return np.mean([scores[:, groups == g].mean(axis=1) for g in sorted(set(groups.tolist()))], axis=0)


def _read_evaluate_csv(path, shown=None, objects=None):
    """``{image_id: dsb}`` of one ``bin/evaluate --csv`` file (``shown``: the name to warn
    with); one-line errors. ``objects``, a dict, gets ``{image_id: (true, predicted)}``
    object counts where the file has them."""
    if not os.path.isfile(path):
        raise SystemExit('error: %s: no such file (bin/evaluate --csv writes it)' % path)
    with open(path, newline='') as f:
        reader = csv.DictReader(f)
        missing = {'image_id', 'dsb'} - set(reader.fieldnames or ())
        if missing:
            raise SystemExit('error: %s: not a bin/evaluate --csv file (no column %s)'
                             % (path, ', '.join(sorted(missing))))
        out, missing = {}, []
        for line, row in enumerate(reader, start=2):
            try:
                out[row['image_id']] = float(row['dsb'])
            except (TypeError, ValueError):
                raise SystemExit('error: %s line %d: dsb %r is not a number' % (path, line, row['dsb'])) from None
            if row.get('status') == 'missing':
                missing.append(row['image_id'])
            if objects is not None and row.get('true_objects') and row.get('pred_objects'):
                objects[row['image_id']] = (int(row['true_objects']), int(row['pred_objects']))
    if not out:
        raise SystemExit('error: %s: scores no image' % path)
    if missing:  # bin/evaluate's rule (and the challenge's): no prediction scores 0; said, not hidden
        print('warning: %s: %d images have no prediction and score 0 (e.g. %s)' % (shown or path, len(missing),
                                                                                   missing[0]), file=sys.stderr)
    return out


#: What bin/predict and bin/evaluate put after an image id in a prediction's name.
_PRED_SUFFIXES = ('_labels', '_label', '_instances', '_mask', '_pred', '_prediction', '')


def _predicted_ids(folder, known):
    """The known image ids that have a prediction file in ``folder`` (``<id>.png``,
    ``<id>_labels.png``...; overlays are not predictions)."""
    found = set()
    for name in os.listdir(folder):
        stem = os.path.splitext(name)[0]
        if not io.is_image_file(name) or stem.endswith('_overlay'):
            continue
        for suffix in _PRED_SUFFIXES:
            if stem.endswith(suffix) and stem[:len(stem) - len(suffix)] in known:
                found.add(stem[:len(stem) - len(suffix)])
                break
    return found


def _fold_of(path, ids, groups):
    """The one fold whose held-out images ``ids`` are, or exit naming ``path``."""
    unknown = sorted(set(ids) - set(groups))
    if unknown:
        raise SystemExit('error: %s: %d images are not in the groups file (e.g. %s)' % (path, len(unknown), unknown[0]))
    folds = sorted({groups[i]['fold'] for i in ids})
    if len(folds) != 1:
        raise SystemExit('error: %s: holds images of folds %s; each file or folder must hold one fold\'s held-out '
                         'images, predicted by the model trained without them (dsb_grouped.py fold K)'
                         % (path, ', '.join(map(str, folds))))
    return folds[0]


def _evaluate_folder(folder, truth, groups, objects=None):
    """Score one fold's prediction folder with ``bin/evaluate`` against ``truth`` (a DSB
    root holding at least that fold's held-out images): ``{image_id: dsb}``."""
    if truth is None:
        raise SystemExit('error: %s is a prediction folder: give --truth (the stage1_train root) to score it, '
                         'or pass bin/evaluate --csv files' % folder)
    ids = _predicted_ids(folder, set(groups))
    if not ids:
        raise SystemExit('error: %s: no prediction named after an image of the groups file' % folder)
    fold = _fold_of(folder, ids, groups)
    _, held = fold_ids(groups, fold)
    missing = [i for i in held if not os.path.isdir(os.path.join(truth, i, 'masks'))]
    if missing:
        raise SystemExit('error: --truth %s: no %s/masks/ (and %d more); want the stage1_train root'
                         % (truth, missing[0], len(missing) - 1))
    with tempfile.TemporaryDirectory(prefix='dsb_grouped-') as tmp:
        # bin/evaluate scores every truth image it is given: a tree of just this fold's
        # held-out images makes an image the model did not predict count as 0.
        os.makedirs(os.path.join(tmp, 'truth'))
        for image_id in held:
            os.symlink(os.path.abspath(os.path.join(truth, image_id)), os.path.join(tmp, 'truth', image_id))
        out = os.path.join(tmp, 'scores.csv')
        cmd = [sys.executable, os.path.join(ROOT, 'bin', 'evaluate'), '--pred', folder,
               '--truth', os.path.join(tmp, 'truth'), '--csv', out]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ['exit %d' % done.returncode])[-1]
            raise SystemExit('error: bin/evaluate on %s failed: %s' % (folder, last))
        return _read_evaluate_csv(out, shown=folder, objects=objects)


def read_run(spec, groups, truth=None, objects=None):
    """One run ``NAME=PATH[,PATH...]``: ``(name, {image_id: dsb})`` over whole folds.

    Each PATH is one fold's held-out predictions: a ``bin/evaluate --csv`` file or a
    ``bin/predict`` output folder. A file that mixes folds, misses some of its fold's
    images or repeats a fold is refused. ``objects``, a dict, gets each image's
    ``(true, predicted)`` object counts.
    """
    name, sep, paths = spec.partition('=')
    if not sep:
        name, paths = None, spec
    paths = [p for p in paths.split(',') if p]
    if not paths:
        raise SystemExit('error: run %r: no file or folder' % spec)
    if name is None:
        name = os.path.splitext(os.path.basename(os.path.normpath(paths[0])))[0]
    scores, seen = {}, {}
    for path in paths:
        one = (_evaluate_folder(path, truth, groups, objects) if os.path.isdir(path)
               else _read_evaluate_csv(path, objects=objects))
        fold = _fold_of(path, one, groups)
        if fold in seen:
            raise SystemExit('error: run %s: %s and %s both hold fold %d' % (name, seen[fold], path, fold))
        seen[fold] = path
        _, held = fold_ids(groups, fold)
        lacking = sorted(set(held) - set(one))
        if lacking:
            raise SystemExit('error: %s: fold %d holds out %d images, %d of them not scored here (e.g. %s)'
                             % (path, fold, len(held), len(lacking), lacking[0]))
        scores.update(one)
    return name, scores


def _cell(value, lo=None, hi=None, signed=False):
    f = '%+.3f' if signed else '%.3f'
    if lo is None:
        return f % value
    return (f + ' (' + f + ' to ' + f + ')') % (value, lo, hi)


def score_table(runs, groups, random=None, n=10000, seed=0):
    """Markdown lines: per group, the macro average over groups and the micro mean, each
    run's score and each later run's paired difference to the first, with 95 % intervals
    over ``n`` resamplings of the images within each group (``n`` = 0: no intervals).

    Parameters
    ----------
    runs : list of (name, {image_id: dsb})
        Every run must score the same images (whole folds).
    groups : dict
        ``read_groups``.
    random : dict, optional
        name -> {image_id: dsb} on the random hold-out, for the runs that have one.
    n, seed : int
    """
    random = random or {}
    first, ref = runs[0]
    ids = sorted(ref)
    for name, s in runs[1:]:
        if sorted(s) != ids:
            raise SystemExit('error: runs %s and %s score different images (other folds); the paired difference '
                             'needs the same ones' % (first, name))
    names = [name for name, _ in runs]
    scores = np.array([[s[i] for i in ids] for _, s in runs])
    gid = [groups[i]['group'] for i in ids]
    present = [g for g in GROUPS if g in set(gid)]
    folds = sorted({groups[i]['fold'] for i in ids})
    boot = resampled_group_means(scores, gid, n, seed) if n else None
    gid_a = np.asarray(gid)

    def row(label, count, values, draws):
        cells = ['%s' % label, '%d' % count]
        for k in range(len(runs)):
            cells.append(_cell(values[k], *(dsb_by_kind.interval(draws[k]) if draws is not None else ())))
        for k in range(1, len(runs)):
            d = values[k] - values[0]
            if draws is None:
                cells.append(_cell(d, signed=True))
            else:
                dd = draws[k] - draws[0]
                cells.append(_cell(d, *dsb_by_kind.interval(dd), signed=True) + ', %.2f above 0' % np.mean(dd > 0))
        return '| ' + ' | '.join(cells) + ' |'

    lines = ['Grouped validation: folds %s (%d of %d groups, %d images)%s.' % (
        ', '.join(map(str, folds)), len(present), len(GROUPS), len(ids),
        ', 95 %% intervals over %d resamplings of the images within each group' % n if n else ''), '',
        '| group | images | ' + ' | '.join(names) + ''.join(' | %s - %s' % (nm, first) for nm in names[1:]) + ' |',
        '|---|---|' + '---|' * (2 * len(runs) - 1)]
    for g in present:
        sel = gid_a == g
        lines.append(row('%s (fold %d)' % (g, GROUPS[g][0]), int(sel.sum()), scores[:, sel].mean(axis=1),
                         boot[g] if boot else None))
    macro = macro_mean(scores, gid)
    macro_draws = np.mean([boot[g] for g in present], axis=0) if boot else None
    lines.append(row('**macro over %d groups**' % len(present), len(ids), macro, macro_draws))
    # The micro mean weighs groups by their counts (fluo-small alone is a third): shown
    # for comparison with the random hold-out's number, which is a micro mean too.
    micro_draws = None
    if boot:
        micro_draws = sum(boot[g] * int((gid_a == g).sum()) for g in present) / len(ids)
    lines.append(row('all images (micro mean)', len(ids), scores.mean(axis=1), micro_draws))
    if random:
        lines += _random_lines(names, random, groups, n, seed)
    return lines


def object_lines(names, objects, groups):
    """Markdown lines: objects predicted per true nucleus, summed over each group, per run
    (below 1: clumps merged or nuclei missed; above 1: nuclei cut into pieces or false
    objects). ``objects``: one ``{image_id: (true, predicted)}`` per name."""
    present = [g for g in GROUPS if any(groups[i]['group'] == g for o in objects for i in o)]
    lines = ['', 'Objects predicted per true nucleus (sums over each group):', '',
             '| group | ' + ' | '.join(names) + ' |', '|---|' + '---|' * len(names)]
    for g in present:
        cells = []
        for o in objects:
            counts = [c for i, c in o.items() if groups[i]['group'] == g]
            true = sum(t for t, _ in counts)
            cells.append('%.2f' % (sum(p for _, p in counts) / true) if true else '-')
        lines.append('| %s (fold %d) | %s |' % (g, GROUPS[g][0], ' | '.join(cells)))
    return lines


def _random_lines(names, random, groups, n, seed):
    """The random hold-out rows: each run's mean there, resampled within kinds as
    ``dsb_by_kind.py --bootstrap`` does (the same intervals), paired when the ids match."""
    have = [nm for nm in names if nm in random]
    ids = sorted(random[have[0]])
    for nm in have[1:]:
        if sorted(random[nm]) != ids:
            raise SystemExit('error: --random files of %s and %s score different images' % (have[0], nm))
    unknown = sorted(set(ids) - set(groups))
    if unknown:
        raise SystemExit('error: --random %s: %d images are not in the groups file (e.g. %s)'
                         % (have[0], len(unknown), unknown[0]))
    scores = np.array([[random[nm][i] for i in ids] for nm in have])
    kinds = [groups[i]['kind'] for i in ids]
    draws = dsb_by_kind.bootstrap_means(scores, kinds, n, seed) if n else None
    cells = ['random hold-out (micro mean, trained on the rest)', '%d' % len(ids)]
    base = have.index(names[0]) if names[0] in have else None
    for nm in names:
        if nm not in random:
            cells.append('-')
            continue
        k = have.index(nm)
        cells.append(_cell(scores[k].mean(), *(dsb_by_kind.interval(draws[k]) if n else ())))
    for nm in names[1:]:
        if nm not in random or base is None:
            cells.append('-')
            continue
        k = have.index(nm)
        d = scores[k].mean() - scores[base].mean()
        if n:
            dd = draws[k] - draws[base]
            cells.append(_cell(d, *dsb_by_kind.interval(dd), signed=True) + ', %.2f above 0' % np.mean(dd > 0))
        else:
            cells.append(_cell(d, signed=True))
    return ['| ' + ' | '.join(cells) + ' |']


# ----------------------------------------------------------------------------- commands

def _check_data(data):
    if not os.path.isdir(data):
        raise SystemExit('error: --data %s: no such folder (the DSB 2018 stage1_train root)' % data)


def cmd_split(args):
    _check_data(args.data)
    rows = compute_groups(args.data)
    text = format_rows(rows)
    if args.check:
        if not os.path.isfile(args.groups):
            raise SystemExit('error: --groups %s: no such file to check against' % args.groups)
        with open(args.groups) as f:
            committed = f.read()
        if committed != text:
            old = {line.split('\t')[0]: line for line in committed.splitlines()[1:]}
            new = {line.split('\t')[0]: line for line in text.splitlines()[1:]}
            diff = sorted(i for i in set(old) | set(new) if old.get(i) != new.get(i))
            raise SystemExit('error: the recomputed groups differ from %s in %d images (e.g. %s)'
                             % (args.groups, len(diff), diff[0] if diff else 'the header'))
    else:
        with atomic_open(args.groups) as f:
            f.write(text)
    groups = read_groups(args.groups)
    for line in group_table(groups, _random_holdout()):
        print(line)
    print('\n%s %s' % ('checked' if args.check else 'wrote', args.groups))
    return 0


def cmd_fold(args):
    _check_data(args.data)
    groups = read_groups(args.groups)
    out = os.path.join(args.out, 'fold%d' % args.fold)
    train, held = materialize_fold(args.data, groups, args.fold, out, with_csv=args.csv)
    names = ', '.join(g for g, (f, _) in GROUPS.items() if f == args.fold)
    print('fold %d holds out %s: %d train, %d held out -> %s/{train,heldout}%s'
          % (args.fold, names, len(train), len(held), out, ' and train.csv, heldout.csv' if args.csv else ''))
    data_arg = os.path.join(out, 'train.csv') if args.csv else os.path.join(out, 'train')
    print('next:\n  bin/train --config dsb2018 --data %s --output runs/g%d\n'
          '  bin/predict --model runs/g%d --input %s --output /tmp/preds/g%d --mode tile --tta\n'
          '  python experiments/dsb2018/dsb_grouped.py score NAME=/tmp/preds/g1,/tmp/preds/g2,/tmp/preds/g3 '
          '--truth %s' % (data_arg, args.fold, args.fold, os.path.join(out, 'heldout'), args.fold, args.data))
    return 0


def cmd_score(args):
    if args.bootstrap < 0 or 0 < args.bootstrap < 100:
        raise SystemExit('error: --bootstrap must be 0 (off) or at least 100 resamplings (got %d)' % args.bootstrap)
    if args.truth is not None and not os.path.isdir(args.truth):
        raise SystemExit('error: --truth %s: no such folder (the stage1_train root)' % args.truth)
    groups = read_groups(args.groups)
    objects = [{} for _ in args.run]
    runs = [read_run(spec, groups, args.truth, o) for spec, o in zip(args.run, objects)]
    names = [name for name, _ in runs]
    if len(set(names)) != len(names):
        raise SystemExit('error: two runs are named %s; name them NAME=...' % sorted(n for n in names
                                                                                     if names.count(n) > 1)[0])
    random = {}
    for spec in args.random:
        name, sep, path = spec.partition('=')
        if not sep or name not in names:
            raise SystemExit('error: --random %s: want NAME=CSV with NAME one of the runs (%s)'
                             % (spec, ', '.join(names)))
        random[name] = _read_evaluate_csv(path)
    lines = score_table(runs, groups, random, args.bootstrap)
    if all(len(o) == len(s) for o, (_, s) in zip(objects, runs)):
        lines += object_lines(names, objects, groups)
    for line in lines:
        print(line)
    return 0


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = p.add_subparsers(dest='command', required=True)
    s = sub.add_parser('split', help='compute the groups of every image and write the groups file')
    s.add_argument('--data', default=dsb_split.DEFAULT_DATA, help='DSB stage1_train root (read only)')
    s.add_argument('--groups', default=GROUPS_FILE, help='groups file to write (or compare with --check)')
    s.add_argument('--check', action='store_true', help='fail unless the recomputed groups equal --groups')
    s.set_defaults(func=cmd_split)
    f = sub.add_parser('fold', help='one fold\'s train and held-out data as symlink trees (and CSVs)')
    f.add_argument('fold', type=int, help='the fold to hold out: %s' % ', '.join(map(str, FOLDS)))
    f.add_argument('--data', default=dsb_split.DEFAULT_DATA, help='DSB stage1_train root (read only)')
    f.add_argument('--groups', default=GROUPS_FILE)
    f.add_argument('--out', default=DEFAULT_OUT, help='the fold goes to OUT/foldK (default %s)' % DEFAULT_OUT)
    f.add_argument('--csv', action='store_true',
                   help='also write train.csv and heldout.csv (image,mask) with merged 16-bit label masks')
    f.set_defaults(func=cmd_fold)
    c = sub.add_parser('score', help='per group, macro average and paired differences of prediction sets')
    c.add_argument('run', nargs='+', metavar='NAME=PATH[,PATH...]',
                   help='one run: each PATH one fold\'s held-out predictions, a bin/evaluate --csv file or a '
                        'bin/predict output folder (needs --truth); the first run is the reference')
    c.add_argument('--truth', help='the stage1_train root, to score prediction folders')
    c.add_argument('--random', action='append', default=[], metavar='NAME=CSV',
                   help='the run\'s bin/evaluate --csv on the random hold-out (dsb_holdout_ids.txt), shown beside')
    c.add_argument('--groups', default=GROUPS_FILE)
    c.add_argument('--bootstrap', type=int, default=10000, metavar='N',
                   help='resamplings for the 95%% intervals (default 10000; 0 = none)')
    c.set_defaults(func=cmd_score)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == '__main__':
    sys.exit(main())
