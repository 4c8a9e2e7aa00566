"""experiments/dsb2018/dsb_grouped.py: the grouped validation that holds out whole kinds of
image (issue 49). Synthetic DSB trees only; no dependence on the real data."""
import csv
import os
import sys

import cv2
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments', 'dsb2018'))

import dsb_grouped  # noqa: E402

#: One image per group: kind, then the nuclei as (top, left, height, width) boxes in a 64x64
#: frame. Areas and touching chosen on either side of the thresholds (250 px, 700 px, 30 %).
SPECS = {
    'a_crowded': ('fluorescence', [(4, 4, 6, 6), (4, 10, 6, 6), (30, 30, 6, 6), (50, 50, 6, 6)]),  # 2 of 4 touch
    'b_medium': ('fluorescence', [(2, 2, 18, 18), (40, 40, 17, 17)]),  # 324 / 289 px
    'c_tissue_large': ('he', [(10, 10, 30, 30)]),  # 900 px
    'd_large': ('fluorescence', [(5, 5, 28, 28), (36, 36, 27, 27)]),  # 784 / 729 px
    'e_tissue_small': ('he', [(5, 5, 10, 10), (40, 40, 10, 10)]),
    'f_small': ('fluorescence', [(5, 5, 8, 8), (30, 30, 8, 8), (50, 10, 8, 8)]),
    'g_bright': ('brightfield', [(5, 5, 12, 12), (40, 30, 12, 12)]),
    'h_small': ('fluorescence', [(10, 40, 9, 9), (40, 10, 9, 9)]),
}
EXPECTED = {'a_crowded': 'fluo-crowded', 'b_medium': 'fluo-medium', 'c_tissue_large': 'tissue-large',
            'd_large': 'fluo-large', 'e_tissue_small': 'tissue-small', 'f_small': 'fluo-small',
            'g_bright': 'brightfield', 'h_small': 'fluo-small'}


def make_dsb(root, specs=SPECS, size=64):
    """A DSB layout tree: ``root/<id>/images/<id>.png`` and one mask PNG per nucleus."""
    rng = np.random.default_rng(0)
    for image_id, (kind, boxes) in specs.items():
        (root / image_id / 'images').mkdir(parents=True)
        (root / image_id / 'masks').mkdir()
        fg = np.zeros((size, size), bool)
        for k, (y, x, h, w) in enumerate(boxes):
            m = np.zeros((size, size), np.uint8)
            m[y:y + h, x:x + w] = 255
            fg |= m > 0
            cv2.imwrite(str(root / image_id / 'masks' / ('m%02d.png' % k)), m)
        noise = rng.integers(0, 8, (size, size))
        if kind == 'he':  # pink tissue, purple nuclei (OpenCV writes BGR)
            img = np.where(fg[..., None], [160, 60, 120], [220, 200, 230]) + noise[..., None]
        elif kind == 'brightfield':
            img = np.where(fg, 60, 200) + noise
        else:
            img = np.where(fg, 200, 10) + noise
        cv2.imwrite(str(root / image_id / 'images' / (image_id + '.png')), img.astype(np.uint8))
    return root


def test_group_rules_follow_stain_size_and_crowding_at_their_boundaries():
    g = dsb_grouped.group_of
    assert g('brightfield', 5000, 0.9) == 'brightfield'
    assert g('he', 700, 0.0) == 'tissue-large' and g('he', 699.5, 0.9) == 'tissue-small'
    assert g('fluorescence', 700, 0.9) == 'fluo-large'  # size first: large clumps are large
    assert g('fluorescence', 699.5, 0.3) == 'fluo-crowded'
    assert g('fluorescence', 249.5, 0.29) == 'fluo-small' and g('fluorescence', 250, 0.29) == 'fluo-medium'
    with pytest.raises(ValueError):
        g('colour', 100, 0)


def test_nucleus_stats_count_touching_by_8_adjacency_not_by_gaps():
    labels = np.zeros((20, 20), np.int32)
    labels[0:3, 0:3] = 1
    labels[3:6, 3:6] = 2  # meets 1 only at a corner: touching (8-adjacent)
    labels[10:13, 0:3] = 3
    labels[10:13, 4:8] = 4  # one background column between 3 and 4: not touching
    labels[15:20, 15:20] = 5
    assert dsb_grouped.nucleus_stats(labels) == (5, 9.0, 2 / 5)
    assert dsb_grouped.nucleus_stats(np.zeros((4, 4), np.int32)) == (0, 0.0, 0.0)


def test_split_is_deterministic_and_check_catches_a_changed_file(tmp_path, capsys):
    data = make_dsb(tmp_path / 'data')
    first, second = tmp_path / 'g1.tsv', tmp_path / 'g2.tsv'
    assert dsb_grouped.main(['split', '--data', str(data), '--groups', str(first)]) == 0
    assert dsb_grouped.main(['split', '--data', str(data), '--groups', str(second)]) == 0
    assert first.read_text() == second.read_text()
    groups = dsb_grouped.read_groups(str(first))
    assert {i: r['group'] for i, r in groups.items()} == EXPECTED  # every id in exactly one group
    assert dsb_grouped.main(['split', '--data', str(data), '--groups', str(first), '--check']) == 0
    out = capsys.readouterr().out
    assert '| fluo-small | 3 | 2 |' in out and 'fold 1 holds out fluo-crowded, fluo-medium, tissue-large' in out
    first.write_text(first.read_text().replace('\tfluo-small\t3\t', '\tfluo-medium\t1\t', 1))
    with pytest.raises(SystemExit, match='differ from .* in 1 images'):
        dsb_grouped.main(['split', '--data', str(data), '--groups', str(first), '--check'])


def _assert_no_leak(groups):
    """Every fold: train and held-out partition the ids, and each group lies on one side."""
    held_somewhere = set()
    for fold in dsb_grouped.FOLDS:
        train, held = dsb_grouped.fold_ids(groups, fold)
        assert not set(train) & set(held) and set(train) | set(held) == set(groups)
        for name in {r['group'] for r in groups.values()}:
            members = {i for i, r in groups.items() if r['group'] == name}
            assert members <= set(held) or members <= set(train), (fold, name)
        held_somewhere |= set(held)
    assert held_somewhere == set(groups)  # every image is held out once


def test_committed_groups_hold_out_whole_groups_and_cover_the_random_hold_out():
    groups = dsb_grouped.read_groups(dsb_grouped.GROUPS_FILE)
    _assert_no_leak(groups)
    with open(os.path.join(ROOT, 'experiments', 'dsb2018', 'dsb_holdout_ids.txt')) as f:
        assert {line.strip() for line in f if line.strip()} <= set(groups)
    # Training always keeps a fluorescence group and a colour group.
    for fold in dsb_grouped.FOLDS:
        train, _ = dsb_grouped.fold_ids(groups, fold)
        assert {groups[i]['kind'] for i in train} >= {'fluorescence', 'he'}


def test_fold_writes_trees_and_a_csv_that_train_reads_as_the_same_nuclei(tmp_path, capsys):
    from gluon_unet.data import load_dataset
    data = make_dsb(tmp_path / 'data')
    groups_file = str(tmp_path / 'groups.tsv')
    dsb_grouped.main(['split', '--data', str(data), '--groups', groups_file])
    out = tmp_path / 'out'
    assert dsb_grouped.main(['fold', '1', '--data', str(data), '--groups', groups_file, '--out', str(out),
                             '--csv']) == 0
    fold = out / 'fold1'
    held = sorted(os.listdir(fold / 'heldout'))
    assert held == ['a_crowded', 'b_medium', 'c_tissue_large']
    assert sorted(os.listdir(fold / 'train')) == sorted(set(SPECS) - set(held))
    with open(fold / 'train.csv', newline='') as f:
        rows = list(csv.DictReader(f))
    assert all(not os.path.isabs(r['image']) for r in rows)  # relative to the CSV, as the layout reads them
    # What bin/train reads (native resolution, as the dsb2018 recipe's crops): the same images
    # and the same nuclei, ids included, from the CSV as from the DSB tree.
    from_csv = load_dataset(str(fold / 'train.csv'), crop=32, workers=0, cache_dir=False, progress=False)
    from_tree = load_dataset(str(fold / 'train'), crop=32, workers=0, cache_dir=False, progress=False)
    assert from_csv.layout == 'csv' and from_tree.layout == 'dsb'
    assert list(from_csv.names) == list(from_tree.names) == sorted(set(SPECS) - set(held))
    for i in range(len(from_tree)):
        for a, b in zip(from_csv.raw(i), from_tree.raw(i)):
            np.testing.assert_array_equal(a, b)
        assert from_tree.instances(i).max() == len(SPECS[from_tree.names[i]][1])
    # Another fold into the same --out replaces the links; a file the tool did not write stops it.
    assert dsb_grouped.main(['fold', '1', '--data', str(data), '--groups', groups_file, '--out', str(out)]) == 0
    (fold / 'train' / 'notes.txt').write_text('mine')
    with pytest.raises(SystemExit, match='notes.txt, which this tool did not write'):
        dsb_grouped.main(['fold', '1', '--data', str(data), '--groups', groups_file, '--out', str(out)])
    assert (fold / 'train' / 'notes.txt').read_text() == 'mine'


def _groups(spec):
    """A groups dict from {group: [image ids]} (kinds made up to match)."""
    kind = {'tissue-large': 'he', 'tissue-small': 'he', 'brightfield': 'brightfield'}
    return {i: {'image_id': i, 'group': g, 'fold': dsb_grouped.GROUPS[g][0], 'kind': kind.get(g, 'fluorescence')}
            for g, ids in spec.items() for i in ids}


def test_macro_weighs_groups_equally_and_resamples_only_within_groups():
    # fluo-crowded: four perfect images, tissue-large: two zeros -> micro 4/6, macro 1/2; the
    # scores are constant within each group, so a resampling within groups cannot move them.
    groups = _groups({'fluo-crowded': ['a', 'b', 'c', 'd'], 'tissue-large': ['e', 'f']})
    ids = sorted(groups)
    a = {i: (1.0 if groups[i]['group'] == 'fluo-crowded' else 0.0) for i in ids}
    b = {i: v * 0.9 + 0.1 for i, v in a.items()}  # better by 0.1 on tissue, worse by 0.0 elsewhere
    lines = dsb_grouped.score_table([('A', a), ('B', b)], groups, n=1000)
    text = '\n'.join(lines)
    assert '| **macro over 2 groups** | 6 | 0.500 (0.500 to 0.500) | 0.550 (0.550 to 0.550) | ' \
           '+0.050 (+0.050 to +0.050), 1.00 above 0 |' in text
    assert '| all images (micro mean) | 6 | 0.667 (0.667 to 0.667) |' in text
    assert '| tissue-large (fold 1) | 2 | 0.000 (0.000 to 0.000) | 0.100 (0.100 to 0.100) |' in text


def test_bootstrap_interval_of_a_coin_group_has_the_binomial_width():
    groups = _groups({'fluo-small': ['i%03d' % k for k in range(400)]})
    scores = [[k % 2 for k in range(400)]]
    means = dsb_grouped.resampled_group_means(scores, [groups[i]['group'] for i in sorted(groups)], 4000)
    lo, hi = dsb_by_kind_interval(means['fluo-small'][0])
    half = 1.96 * np.sqrt(0.25 / 400)  # 0.049
    assert abs(lo - (0.5 - half)) < 0.008 and abs(hi - (0.5 + half)) < 0.008


def dsb_by_kind_interval(values):
    import dsb_by_kind
    return dsb_by_kind.interval(values)


def _write_scores(path, scores, objects=None):
    with open(path, 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(['image_id', 'dsb', 'iou', 'dice', 'true_objects', 'pred_objects', 'status'])
        for i, v in sorted(scores.items()):
            w.writerow([i, v, v, v, *(objects or {}).get(i, (1, 1)), 'ok'])


def test_score_refuses_a_file_that_mixes_folds_or_misses_images_and_keeps_the_random_number(tmp_path, capsys):
    groups = {i: dict(r, kind='fluorescence') for i, r in
              _groups({'fluo-crowded': ['a', 'b'], 'fluo-large': ['c'], 'fluo-small': ['d', 'e']}).items()}
    gfile = tmp_path / 'groups.tsv'
    gfile.write_text(dsb_grouped.format_rows([dict(r, width=8, height=8, nuclei=1, median_area=1, touching=0,
                                                   density=1) for _, r in sorted(groups.items())]))
    f1, f2, f3 = tmp_path / 'f1.csv', tmp_path / 'f2.csv', tmp_path / 'f3.csv'
    _write_scores(f1, {'a': 0.5, 'b': 0.7})
    _write_scores(f2, {'c': 0.2})
    _write_scores(f3, {'d': 0.9, 'e': 0.8})
    mixed = tmp_path / 'mixed.csv'
    _write_scores(mixed, {'a': 0.5, 'b': 0.7, 'c': 0.2})  # a model that saw neither fold? it cannot be one fold's
    with pytest.raises(SystemExit, match='holds images of folds 1, 2'):
        dsb_grouped.main(['score', 'A=%s' % mixed, '--groups', str(gfile)])
    short = tmp_path / 'short.csv'
    _write_scores(short, {'a': 0.5})
    with pytest.raises(SystemExit, match='2 images, 1 of them not scored here'):
        dsb_grouped.main(['score', 'A=%s' % short, '--groups', str(gfile)])
    rand = tmp_path / 'random.csv'
    _write_scores(rand, {'b': 0.6, 'd': 0.4})
    assert dsb_grouped.main(['score', 'A=%s,%s,%s' % (f1, f2, f3), '--groups', str(gfile),
                             '--random', 'A=%s' % rand, '--bootstrap', '0']) == 0
    out = capsys.readouterr().out
    assert '| **macro over 3 groups** | 5 | 0.550 |' in out  # (0.6 + 0.2 + 0.85) / 3, micro 0.62
    assert '| random hold-out (micro mean, trained on the rest) | 2 | 0.500 |' in out
    # objects per true nucleus are sums over the group, not means of per-image ratios
    _write_scores(f1, {'a': 0.5, 'b': 0.7}, objects={'a': (10, 4), 'b': (2, 4)})
    assert dsb_grouped.main(['score', 'A=%s,%s,%s' % (f1, f2, f3), 'B=%s,%s,%s' % (f1, f2, f3),
                             '--groups', str(gfile), '--bootstrap', '0']) == 0
    out = capsys.readouterr().out
    assert '| fluo-crowded (fold 1) | 0.67 | 0.67 |' in out and '| fluo-small (fold 3) | 1.00 | 1.00 |' in out


def test_score_evaluates_prediction_folders_against_the_truth(tmp_path, capsys):
    data = make_dsb(tmp_path / 'data')
    gfile = str(tmp_path / 'groups.tsv')
    dsb_grouped.main(['split', '--data', str(data), '--groups', gfile])
    pred = tmp_path / 'pred'
    pred.mkdir()
    from gluon_unet.data import io
    for image_id in ('d_large', 'e_tissue_small'):  # fold 2: perfect predictions
        masks = sorted(str(p) for p in (data / image_id / 'masks').iterdir())
        cv2.imwrite(str(pred / (image_id + '_labels.png')), io.merge_object_masks(masks).astype(np.uint16))
    capsys.readouterr()
    assert dsb_grouped.main(['score', 'P=%s' % pred, '--truth', str(data), '--groups', gfile,
                             '--bootstrap', '0']) == 0
    assert '| **macro over 2 groups** | 2 | 1.000 |' in capsys.readouterr().out
    os.remove(str(pred / 'e_tissue_small_labels.png'))  # no prediction: 0, as bin/evaluate scores it, and said
    assert dsb_grouped.main(['score', 'P=%s' % pred, '--truth', str(data), '--groups', gfile,
                             '--bootstrap', '0']) == 0
    out, err = capsys.readouterr()
    assert '| tissue-small (fold 2) | 1 | 0.000 |' in out and '1 images have no prediction and score 0' in err
