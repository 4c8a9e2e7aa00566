"""The measuring parts of the benchmark tools (benchmarks/: bench_train.py, budget_lr_replay.py, ...) and of
the DSB experiment's scripts (experiments/dsb2018/: dsb_by_kind.py, dsb_val_analysis.py, ...) that decide what
a figure means."""
import os
import sys
import threading

import numpy as np
import pytest

from conftest import pids_with

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
sys.path.insert(0, os.path.join(ROOT, 'experiments', 'dsb2018'))

import bench_train  # noqa: E402
import procstat  # noqa: E402
import budget_lr_replay  # noqa: E402
import dsb_by_kind  # noqa: E402
import dsb_val_curves  # noqa: E402


def test_thread_busy_shares_of_wall_time_busiest_first():
    tck = os.sysconf('SC_CLK_TCK')
    before = {'1': ('python', 0), '2': ('python', 10 * tck), '3': ('omp', 0)}
    after = {'1': ('python', 2 * tck), '2': ('python', 11 * tck), '3': ('omp', 0), '4': ('new', tck // 2)}
    busy = procstat.thread_busy(before, after, wall=2.0)
    # thread 1: 2 s in 2 s; thread 2: 1 s; thread 4 started meanwhile: 0.5 s; idle thread 3 left out
    assert busy == [(1.0, 'python'), (0.5, 'python'), ((tck // 2) / tck / 2.0, 'new')]


def test_busiest_threads_is_the_median_per_rank_over_repetitions():
    reps = [[(0.9, 'a'), (0.5, 'b')], [(0.8, 'a')], [(1.0, 'a'), (0.7, 'b'), (0.1, 'c')]]
    assert bench_train.busiest_threads(reps) == [0.9, 0.5, 0.0]
    table = bench_train.format_threads([{'setup': 'ours x2', 'width': 16, 'threads_busy': [0.9, 0.5]}])
    assert 'ours x2' in table and '0.90 0.50' in table and 'sum 1.40' in table


def test_paired_ratio_cancels_a_machine_that_changes_speed_between_repetitions():
    # The machine runs 1.0x, 0.6x, 1.2x as fast in repetitions 1-3; b is always 10 % faster.
    speed = [1.0, 0.6, 1.2]
    a, b = [10 * s for s in speed], [11 * s for s in speed]
    assert bench_train.paired_ratio(b, a) == pytest.approx(1.1)
    rows = [{'setup': 'old x2', 'width': 16, 'dp_overhead_paired': 0.128, 'new_vs_old_paired': 1.05}]
    text = bench_train.format_paired(rows)
    assert '+12.8%' in text and 'ours x2' in text and '1.050x' in text


def test_old_must_hold_a_package(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_train.main(['--old', str(tmp_path), '--configs', '16:32:2'])
    assert stop.value.code == 2 and 'no gluon_unet/__init__.py' in capsys.readouterr().err


def test_thread_ticks_sees_this_process_threads():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name='waiter')
    worker.start()
    try:
        ticks = procstat.thread_ticks()
        assert str(threading.get_native_id()) in ticks and str(worker.native_id) in ticks
        assert all(t >= 0 for _, t in ticks.values())
    finally:
        stop.set()
        worker.join()


def _save_maps(path, images, setting):
    arrays = {'setting': np.array(repr(setting))}
    for name, (prob, truth) in images.items():
        arrays.update({'maps_' + name: prob[None], 'truth_' + name: truth, 'group_' + name: np.array('fluorescence')})
    np.savez(path, **arrays)


def test_val_analysis_sorts_unmatched_nuclei_into_merged_split_missed(tmp_path, capsys):
    """experiments/dsb2018/dsb_val_analysis.py errors: the kinds of error it reports are the ones drawn."""
    import numpy as np
    import dsb_val_analysis

    truth = np.zeros((64, 64), np.int32)
    prob = np.zeros((64, 64), np.float32)
    truth[4:14, 4:14] = 1; prob[4:14, 4:14] = 0.95            # matched
    truth[20:30, 4:12] = 2; truth[20:30, 12:20] = 3           # two nuclei ...
    prob[20:30, 4:20] = 0.95                                  # ... predicted as one rectangle: merged
    truth[40:56, 40:56] = 4                                   # one nucleus ...
    prob[40:56, 40:47] = prob[40:56, 49:56] = 0.95            # ... predicted as two halves: split
    truth[4:14, 40:50] = 5                                    # not predicted at all: missed
    prob[50:60, 4:14] = 0.7                                   # a faint false object on background
    path = str(tmp_path / 'maps.npz')
    _save_maps(path, {'a': (prob, truth)}, {'threshold': 0.5, 'h': 2.0, 'min_size': 0})
    dsb_val_analysis.main(['errors', path])
    out = capsys.readouterr().out
    assert ('true nuclei 5: matched 1; unmatched: merged with a neighbour 2, split 1, missed 1, other 0; '
            'predicted objects on background 1') in out, out
    dsb_val_analysis.main(['min-score', path, '--cuts', '0', '0.8'])
    out = capsys.readouterr().out
    # the faint object goes at 0.8: one false object fewer
    scores = [float(line.split()[-1]) for line in out.splitlines() if line.startswith('min score')]
    assert len(scores) == 2 and scores[1] > scores[0], out


def test_val_analysis_threshold_oracle_picks_each_images_own_outline(tmp_path, capsys):
    """dsb_val_analysis.py thresholds: an image annotated loosely wants a low cut, one
    annotated tightly the usual one; only a per-image choice gets both right."""
    import dsb_val_analysis

    loose_truth, loose = np.zeros((40, 40), np.int32), np.zeros((40, 40), np.float32)
    loose_truth[10:22, 10:22] = 1
    loose[10:22, 10:22] = 0.35; loose[12:20, 12:20] = 0.9       # confident core, faint halo
    tight_truth, tight = np.zeros((40, 40), np.int32), np.zeros((40, 40), np.float32)
    tight_truth[10:20, 10:20] = 1
    tight[6:24, 6:24] = 0.35; tight[10:20, 10:20] = 0.9          # the halo is not nucleus here
    path = str(tmp_path / 'maps.npz')
    _save_maps(path, {'loose': (loose, loose_truth), 'tight': (tight, tight_truth)},
               {'threshold': 0.5, 'h': 2.0, 'min_size': 0})
    dsb_val_analysis.main(['thresholds', path, '--grid', '0.3', '0.5'])
    out = capsys.readouterr().out
    assert 'one threshold for all: 0.30:0.5000 0.50:0.5000' in out, out
    assert 'own best threshold (oracle): 1.0000; images preferring each: 0.30:1 0.50:1' in out, out


def test_val_analysis_object_filter_learns_what_the_min_score_cannot_see(tmp_path, capsys):
    """dsb_val_analysis.py object-filter: false objects as confident as the true ones but of
    another shape are left by the min score and dropped by the learned filter."""
    import dsb_val_analysis

    images = {}
    for i in range(6):
        truth, prob = np.zeros((64, 64), np.int32), np.zeros((64, 64), np.float32)
        for k, (y, x) in enumerate(((4, 4), (4, 30), (30, 4))):
            truth[y:y + 10, x:x + 10] = k + 1
            prob[y:y + 10, x:x + 10] = 0.95
        prob[30 + i % 3:50, 30:34] = prob[46:50, 30:50 - i % 2] = 0.95   # an L: no nucleus there
        images['im%d' % i] = (prob, truth)
    path = str(tmp_path / 'maps.npz')
    _save_maps(path, images, {'threshold': 0.5, 'h': 2.0, 'min_size': 0, 'min_score': 0.8})
    dsb_val_analysis.main(['object-filter', path, '--folds', '2'])
    scores = dict(line.rsplit(' DSB ', 1) for line in capsys.readouterr().out.splitlines() if ' DSB ' in line)
    scores = {k.strip(): float(v) for k, v in scores.items()}
    assert scores['none'] == scores['min score'] == 0.75, scores   # 3 matched, 1 false per image
    assert scores['learned filter'] == 1.0, scores
    for argv, message in ((['object-filter', path, '--folds', '7'], '--folds must be 2 to 6'),
                          (['thresholds', path, '--grid', '5'], '--grid thresholds must be between 0 and 1'),
                          (['errors', str(tmp_path / 'none.npz')], 'none.npz: no such maps file')):
        with pytest.raises(SystemExit, match=message):
            dsb_val_analysis.main(argv)


def test_dsb_by_kind_averages_per_kind_and_refuses_what_is_not_a_score_file(tmp_path, capsys):
    kinds = tmp_path / 'kinds.tsv'
    kinds.write_text('a\tfluorescence\ttrain\nb\tfluorescence\tholdout\nc\the\tholdout\n')
    scores = tmp_path / 'run.csv'
    scores.write_text('image_id,dsb,iou\na,0.2,0.5\nb,0.6,0.7\nc,0.1,0.3\nother,1.0,1.0\n')
    dsb_by_kind.main([str(scores), '--kinds', str(kinds)])
    # 'other' has no kind and is left out; brightfield has no image here
    assert '| run.csv | 0.400 (2) | - | 0.100 (1) | 0.300 (3) | 0.500 |' in capsys.readouterr().out
    (tmp_path / 'notes.txt').write_text('just text\n')
    (tmp_path / 'foreign.csv').write_text('image_id,dsb,iou\nzzz,0.5,0.5\n')
    (tmp_path / 'ids.txt').write_text('a\nb\n')   # hold-out ids, not kinds
    for argv, message in (([str(tmp_path / 'gone.csv')], 'gone.csv: no such file'),
                          ([str(tmp_path / 'notes.txt')], 'notes.txt: not a bin/evaluate --csv file'),
                          ([str(tmp_path / 'foreign.csv')], 'foreign.csv: none of its images is in the kinds file'),
                          ([str(scores), '--kinds', str(tmp_path / 'nope.tsv')], '--kinds .*nope.tsv: no such file'),
                          ([str(scores), '--kinds', str(tmp_path / 'ids.txt')], '--kinds .*ids.txt: line 1 has no kind')):
        with pytest.raises(SystemExit, match=message):
            dsb_by_kind.main(argv if '--kinds' in argv else argv + ['--kinds', str(kinds)])
    assert capsys.readouterr().out == ''   # a bad file stops before any table is printed


def test_dsb_by_kind_bootstrap_keeps_each_kinds_count_and_pairs_the_files(tmp_path, capsys):
    # Stratified: the lone H&E image is in every resampling, once, so with fluorescence
    # scoring 0 every resampled mean is exactly 1/3.
    means = dsb_by_kind.bootstrap_means([[0.0, 0.0, 1.0]], ['fluorescence', 'fluorescence', 'he'], 500)
    assert means.shape == (1, 500) and np.allclose(means, 1 / 3)
    # Unstratified spread shows: two fluorescence images scoring 0 and 1 resample to 0, 0.5 or 1.
    means = dsb_by_kind.bootstrap_means([[0.0, 1.0]], ['fluorescence'] * 2, 2000)
    assert set(np.round(means[0], 6)) == {0.0, 0.5, 1.0}
    assert dsb_by_kind.interval(means[0]) == (0.0, 1.0)
    kinds = tmp_path / 'kinds.tsv'
    kinds.write_text('a\tfluorescence\nb\tfluorescence\nc\the\nd\the\n')
    first, second, other = tmp_path / 'one.csv', tmp_path / 'two.csv', tmp_path / 'other.csv'
    first.write_text('image_id,dsb,iou\na,0.2,0.5\nb,0.6,0.7\nc,0.1,0.3\nd,0.5,0.3\n')
    # The second file scores every image 0.1 higher, listed in another order: the paired
    # difference is 0.1 in every resampling, though each mean alone varies.
    second.write_text('image_id,dsb,iou\nd,0.6,0.3\nc,0.2,0.3\nb,0.7,0.7\na,0.3,0.5\n')
    dsb_by_kind.main([str(first), str(second), '--kinds', str(kinds), '--bootstrap', '1000'])
    out = capsys.readouterr().out
    assert '1000 stratified resamplings of the 4 images' in out
    assert '| two.csv | 0.450 | ' in out and '| +0.100 | +0.100 - +0.100 | 1.00 |' in out
    line = [x for x in out.splitlines() if x.startswith('| one.csv | 0.350 | ')][0]
    lo, hi = (float(v) for v in line.split('|')[3].split(' - '))
    assert lo < 0.35 < hi
    # A file given twice is paired with itself (by position, not name): a difference of 0.
    dsb_by_kind.main([str(first), str(first), '--kinds', str(kinds), '--bootstrap', '1000'])
    rows = [x for x in capsys.readouterr().out.splitlines() if x.startswith('| one.csv | 0.350 | ')]
    assert len(rows) == 2 and rows[0].endswith('|  |  |  |'), rows
    assert rows[1].endswith('| +0.000 | +0.000 - +0.000 | 0.00 |'), rows
    other.write_text('image_id,dsb,iou\na,0.2,0.5\nb,0.6,0.7\n')
    for argv, message in (([str(first), str(other), '--bootstrap', '1000'], 'one.csv and .*other.csv score '
                                                                             'different images'),
                          ([str(first), '--bootstrap', '5'], '--bootstrap must be 0 .off. or at least 100')):
        with pytest.raises(SystemExit, match=message):
            dsb_by_kind.main(argv + ['--kinds', str(kinds)])
    assert capsys.readouterr().out == ''


def test_val_curves_measure_the_swings_after_the_first_epochs():
    rows = [{'val_iou': v, 'val_dsb': d} for v, d in
            [(0.1, 0.0), (0.9, 0.1), (0.5, 0.2), (0.8, 0.5), (0.7, 0.4), (0.75, 0.45)]]
    st = dsb_val_curves.curve_stats(rows, skip=2, last=3)
    assert st['max_iou_drop'] == pytest.approx(0.1)  # 0.8 -> 0.7; the 0.9 -> 0.5 drop is skipped
    assert st['best_dsb'] == 0.5 and st['best_epoch'] == 4 and st['last_dsb'] == 0.45
    assert st['dsb_std'] == pytest.approx(np.std([0.5, 0.4, 0.45]))


def _budget_run(folder, logged, log='08:00:00 training on 1 device(s), 10 steps per epoch\n'):
    import json
    folder.mkdir()
    (folder / 'config.json').write_text(json.dumps({'lr': 1.0, 'lr_schedule': 'cosine', 'warmup_epochs': 1.0}))
    (folder / 'metrics.csv').write_text('epoch,lr\n' + ''.join('%d,%r\n' % (e + 1, v) for e, v in enumerate(logged)))
    (folder / 'train.log').write_text(log)
    return str(folder)


def test_budget_lr_replay_measures_the_rate_a_moving_plan_gave(tmp_path, capsys):
    import math
    from gluon_unet.config import TrainConfig
    cfg = TrainConfig(lr=1.0, lr_schedule='cosine', warmup_epochs=1.0)
    ideal = budget_lr_replay.ideal_rates(cfg, 5, 10)
    # a cosine fitted to 5 epochs, warmed up over the first: 1 at epoch 1, 0 at epoch 5
    assert ideal == pytest.approx([1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2, 0.0])
    steady = _budget_run(tmp_path / 'steady', ideal)
    moved = _budget_run(tmp_path / 'moved', [ideal[0], ideal[1], 0.4, ideal[3], 0.0])  # epoch 3 ran 20 % low
    budget_lr_replay.main([steady, moved])
    out = capsys.readouterr().out.splitlines()
    assert 'largest LR difference 0 %' in out[0] and 'summed |difference| 0.0 %' in out[0]
    assert 'largest LR difference 20 %' in out[2]
    assert 'summed |difference| %.1f %%' % (100 * 0.1 / sum(ideal)) in out[2]
    assert out[3].split(': ')[1].split()[2] == '0.80'
    with pytest.raises(SystemExit, match='nolog.*steps per epoch'):
        budget_lr_replay.main([_budget_run(tmp_path / 'nolog', ideal, log='')])


def _fake_package(root, make_loader_body):
    pkg = root / 'gluon_unet' / 'data'
    pkg.mkdir(parents=True)
    (root / 'gluon_unet' / '__init__.py').write_text('')
    (pkg / '__init__.py').write_text('import os, signal, time\n\ndef synthetic_dataset(n, size):\n'
                                     '    return list(range(n))\n\ndef make_loader(ds, **kw):\n' + make_loader_body)


def test_stress_loader_exit_counts_a_hung_run_and_leaves_no_process(tmp_path):
    import stress_loader_exit
    _fake_package(tmp_path / 'ok', '    return []\n')
    # A "loader" that leaves a child behind which ignores SIGTERM, and never returns.
    _fake_package(tmp_path / 'hangs', '    if os.fork() == 0:\n        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n'
                                      '    time.sleep(3600)\n')
    assert stress_loader_exit.run_once(str(tmp_path / 'ok'), timeout=60)[:2] == (False, 0)
    hung, code, err = stress_loader_exit.run_once(str(tmp_path / 'hangs'), timeout=8)
    assert hung and 'make_loader' in err  # the stack it was asked for at the time-out
    left = pids_with(str(tmp_path / 'hangs'))
    assert not left, 'processes left behind: %s' % left


def test_stress_loader_exit_refuses_bad_values(tmp_path, capsys):
    import stress_loader_exit
    for argv, says in ((['--old', str(tmp_path)], 'no gluon_unet/__init__.py'), (['--runs', '0'], '--runs 0'),
                       (['--timeout', '3'], '--timeout 3')):
        with pytest.raises(SystemExit) as stop:
            stress_loader_exit.main(argv)
        assert stop.value.code == 2 and says in capsys.readouterr().err


def _save_kinds(path, images):
    arrays = {'setting': np.array(repr({'threshold': 0.5, 'h': 0.5, 'min_size': 0}))}
    for name, (prob, truth, kind) in images.items():
        arrays.update({'maps_' + name: prob[None], 'truth_' + name: truth, 'group_' + name: np.array(kind)})
    np.savez(path, **arrays)


def test_val_analysis_per_kind_chooses_each_kinds_setting_on_its_other_images(tmp_path, capsys):
    """dsb_val_analysis.py per-kind: one kind annotated with the faint halo, one without;
    a setting per kind, chosen leave-one-image-out, gets both right, one for all neither."""
    import dsb_val_analysis

    images = {}
    for i in range(2):
        loose_truth, loose = np.zeros((40, 40), np.int32), np.zeros((40, 40), np.float32)
        loose_truth[10:22, 10:22] = 1
        loose[10:22, 10:22] = 0.45; loose[12:20, 12:20] = 0.95   # the halo is nucleus here
        tight_truth, tight = np.zeros((40, 40), np.int32), np.zeros((40, 40), np.float32)
        tight_truth[12:20, 12:20] = 1
        tight[6:26, 6:26] = 0.45; tight[12:20, 12:20] = 0.95      # and not here
        images['loose%d' % i] = (loose, loose_truth, 'colour')
        images['tight%d' % i] = (tight, tight_truth, 'fluorescence')
    path = str(tmp_path / 'maps.npz')
    _save_kinds(path, images)
    for jobs in ('1', '2'):  # in this process, and in two others
        dsb_val_analysis.main(['per-kind', path, '--jobs', jobs])
        rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
        assert rows['colour'] == ['2', '0.0000', '1.0000'] and rows['fluorescence'] == ['2', '0.0000', '1.0000']
        assert rows['all'] == ['4', '0.0000', '1.0000'], rows


def test_val_analysis_markers_from_probability_cores_split_what_the_distance_merges(tmp_path, capsys):
    """dsb_val_analysis.py markers: two nuclei side by side make one rectangle, whose
    distance has one ridge, but the probability dips where they touch."""
    import dsb_val_analysis

    truth, prob = np.zeros((40, 40), np.int32), np.zeros((40, 40), np.float32)
    truth[10:20, 5:15], truth[10:20, 15:25] = 1, 2
    prob[10:20, 5:25] = 0.99
    prob[10:20, 14:16] = 0.7
    path = str(tmp_path / 'maps.npz')
    _save_kinds(path, {'a': (prob, truth, 'fluorescence'), 'b': (prob.copy(), truth, 'fluorescence')})
    with pytest.raises(SystemExit, match='--jobs must be >= 1'):
        dsb_val_analysis.main(['markers', path, '--jobs', '0'])
    dsb_val_analysis.main(['markers', path])
    scores = {line[:24].strip(): line[24:].split(' / ') for line in capsys.readouterr().out.splitlines()[1:]}
    assert float(scores['distance (the search)'][1]) == 0.0, scores  # one object for two nuclei
    assert float(scores['probability cores'][1]) > 0.5, scores


def test_val_analysis_oracles_split_the_loss_between_outline_and_separation(tmp_path, capsys):
    """dsb_val_analysis.py oracles: two touching nuclei outlined exactly but merged lose
    only to the separation; a single nucleus outlined with its halo only to the outline."""
    import dsb_val_analysis

    pair, merged = np.zeros((40, 40), np.int32), np.zeros((40, 40), np.float32)
    pair[10:20, 5:15], pair[10:20, 15:25] = 1, 2
    merged[10:20, 5:25] = 0.99  # one rectangle: its distance has one ridge, no second centre
    one, halo = np.zeros((40, 40), np.int32), np.zeros((40, 40), np.float32)
    one[16:22, 16:22] = 1
    halo[10:28, 10:28] = 0.99  # 36 true pixels inside 324: IoU 0.11
    path = str(tmp_path / 'maps.npz')
    _save_kinds(path, {'pair': (merged, pair, 'fluorescence'), 'halo': (halo, one, 'fluorescence')})
    dsb_val_analysis.main(['oracles', path])
    rows = {line[:31].strip(): float(line.split()[-1]) for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows == {'ours': 0.0, 'true foreground, components': 0.5,      # the pair merged, the one right
                    'true foreground, our watershed': 0.5,                # one ridge: merged on the truth too
                    'our foreground, true split': 0.5}, rows              # the pair right, the halo not


def test_val_analysis_centre_markers_split_what_the_distance_merges(tmp_path, capsys):
    """dsb_val_analysis.py centre: two nuclei side by side make one rectangle, whose
    distance has one ridge, but a centre map has a hill in each; one-map maps are refused."""
    import dsb_val_analysis
    from gluon_unet.data.targets import centre_map

    truth, prob = np.zeros((40, 40), np.int32), np.zeros((40, 40), np.float32)
    truth[10:20, 5:15], truth[10:20, 15:25] = 1, 2
    prob[10:20, 5:25] = 0.99
    maps = np.stack([prob, centre_map(truth)])
    path = str(tmp_path / 'maps.npz')
    np.savez(path, setting=np.array(repr({'threshold': 0.5, 'h': 0.5, 'min_size': 0})),
             **{'%s_%s' % (key, name): value for name in 'ab'
                for key, value in (('maps', maps), ('truth', truth), ('group', np.array('fluorescence')))})
    dsb_val_analysis.main(['centre', path])
    scores = {line[:24].strip(): line[24:].split(' / ') for line in capsys.readouterr().out.splitlines()[1:]}
    assert float(scores['distance (the search)'][1].split()[0]) == 0.0, scores  # one object for two nuclei
    assert float(scores['centre h-maxima'][1].split()[0]) == 1.0, scores
    _save_kinds(path, {'a': (prob, truth, 'fluorescence')})
    with pytest.raises(SystemExit, match='not the maps of a two-map'):
        dsb_val_analysis.main(['centre', path])


def test_val_analysis_maps_with_batch_stats_normalize_each_image_by_itself(tiny, tmp_path):
    """dsb_val_analysis.py maps --batch-stats: BatchNorm uses each image's own statistics
    (the maps change), and predict_mode is the real one again afterwards."""
    import mxnet as mx
    import dsb_val_analysis
    from gluon_unet.training.loop import fit

    cfg = tiny(batch_norm=True, epochs=1, val_split=0.25, tune_postprocess=False)
    fit(cfg, verbose=False)
    predict_mode = mx.autograd.predict_mode
    out = {}
    for name, flags in (('running', []), ('own', ['--batch-stats'])):
        out[name] = str(tmp_path / (name + '.npz'))
        dsb_val_analysis.main(['maps', cfg.output, out[name]] + flags)
    assert mx.autograd.predict_mode is predict_mode
    running, own = np.load(out['running']), np.load(out['own'])
    keys = [k for k in running.files if k.startswith('maps_')]
    assert len(keys) == 6 and sorted(keys) == sorted(k for k in own.files if k.startswith('maps_'))
    for k in keys:
        a, b = running[k].astype(np.float32), own[k].astype(np.float32)
        assert a.shape == b.shape and np.isfinite(b).all()
        assert np.abs(a - b).max() > 1e-3, k


def test_bench_norm_times_the_trainers_step_with_the_norm_swapped():
    import bench_norm
    from mxnet.gluon import nn
    from gluon_unet import recipes
    cfg = bench_norm.load_config(recipes.path('dsb2018'), size=32, batch=2)
    assert (cfg.cpus, cfg.batch_size, cfg.crop, cfg.loss) == (1, 2, 32, 'bce_dice')
    with pytest.raises(SystemExit, match=r'--size 48 .*not divisible by 2\*\*depth = 32'):
        bench_norm.load_config(recipes.path('dsb2018'), size=48, batch=2)

    def norms(step):
        found = []
        step.net.apply(lambda b: found.append(type(b)) if isinstance(
            b, (nn.BatchNorm, nn.BatchNormReLU, nn.InstanceNorm, nn.GroupNorm)) else None)
        return set(found)
    # BatchNorm as the trainer runs it on CPU: fused with its ReLU (model.UNet)
    assert norms(bench_norm.training_step(cfg, 'batch')) == {nn.BatchNormReLU}
    assert norms(bench_norm.training_step(cfg, 'group2')) == {nn.GroupNorm}
    rate = bench_norm.images_per_second(cfg, 'instance', warmup=0, repeats=1)
    assert np.isfinite(rate) and rate > 0
    with pytest.raises(SystemExit, match='--kinds'):
        bench_norm.norm_factory('instanse')


def test_bench_norm_measures_each_kind_in_a_child_process_and_pairs_the_ratio(capsys):
    # Nine networks built in turn in one process held 19.6 GB at width 16:
    # each measurement runs in a child, whose rate comes back to the table.
    import bench_norm
    bench_norm.main(['--size', '32', '--batch', '2', '--rounds', '1', '--repeats', '1',
                     '--warmup', '0', '--kinds', 'batch,group2'])
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {'batch', 'group2'}
    assert float(rows['batch'][1]) > 0 and rows['batch'][-1] == '1.00x'
    assert float(rows['group2'][1]) > 0 and rows['group2'][-1].endswith('x')


def test_a_variant_sets_width_precision_and_contexts_and_passes_the_rest_as_environment():
    base = dict(width=8, amp=False, cpus=1, memory='speed', size=256)
    spec, env = bench_train.variant_spec('WIDTH=16,AMP=1,CONTEXTS=2,OMP_NUM_THREADS=1', base, {'A': 'b'})
    assert (spec['width'], spec['amp'], spec['cpus'], spec['size']) == (16, True, 2, 256)
    assert env == {'A': 'b', 'OMP_NUM_THREADS': '1'}
    spec, env = bench_train.variant_spec('MXNET_X=1', dict(base, amp=True), {})
    assert (spec['width'], spec['amp'], spec['cpus']) == (8, True, 1) and env == {'MXNET_X': '1'}


# Each bad value of bench_train's flags: its name and what is wrong, one line, before any measuring.
BENCH_TRAIN_BAD = [
    ('--variant', 'WIDTH=abc'), ('--variant', 'WIDTH=0'), ('--variant', 'AMP=2'), ('--variant', 'CONTEXTS=-1'),
    ('--variant', 'NOEQUALS'), ('--env', 'NOEQUALS'), ('--env', '=1'), ('--cpus', '0'), ('--cpus', '1,x'),
    ('--cpus', ''), ('--configs', '8:256'), ('--configs', '8:0:16'), ('--configs', 'a:b:c'),
    ('--torch-threads', '0'), ('--reps', '0'), ('--warmup', '-1'), ('--min-seconds', 'nan'),
    ('--min-seconds', 'inf'), ('--max-foreign', '-1'), ('--depth', '0'), ('--channels', '0'),
    ('--memory', 'fast'), ('--memory', ','), ('--old', '/nonexistent'),
]


@pytest.mark.parametrize('flag,value', BENCH_TRAIN_BAD)
def test_bench_train_refuses_a_bad_value_in_one_line_naming_the_flag(flag, value, capsys, monkeypatch):
    monkeypatch.setattr(bench_train, 'measure_peak', lambda amp: pytest.fail('measured before checking'))
    with pytest.raises(SystemExit) as e:
        bench_train.main(['--no-torch', '%s=%s' % (flag, value)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and flag in err[-1] and 'Traceback' not in '\n'.join(err)
