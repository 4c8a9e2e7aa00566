"""The peers' shared rules (benchmarks/peers/peer_common.py) agree with gluon_unet's, without any
peer installed: the same grey image, the same bright-background inversion as ``--normalize
auto``, DSB masks merged as training reads them, labels that ``bin/evaluate`` reads back; and
both peer scripts answer ``--help`` with the standard library alone (their frameworks are
imported only by the subcommands, in the peers' own venvs); every numeric flag of the peers'
scripts refuses its bad values in one line (the flags and bad values read off the parsers)."""
import os
import subprocess
import sys

import numpy as np
import pytest
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, 'benchmarks', 'peers')
sys.path.insert(0, PEERS)

import peer_common  # noqa: E402
from gluon_unet.data import io  # noqa: E402
from gluon_unet.inference.evaluate import read_labels as evaluate_read_labels  # noqa: E402


def test_the_bright_background_cut_is_gluon_unets():
    assert peer_common.BRIGHT_BACKGROUND == io.BRIGHT_BACKGROUND


@pytest.mark.parametrize('median', [0, 44, 80, 81, 127, 200])
def test_inversion_decides_as_normalize_invert(median):
    rng = np.random.RandomState(median)
    grey = np.full((40, 50), median, np.uint8)
    spots = rng.rand(40, 50) < 0.2  # a minority of nuclei, darker or brighter than the background
    grey[spots] = rng.randint(0, 256, spots.sum())
    ours, inverted = peer_common.invert_if_bright(grey)
    theirs = io.normalize_image(grey[..., None], 'invert')[..., 0]
    np.testing.assert_array_equal(ours, theirs)
    assert inverted == (median > 80)


def test_grey_is_the_grey_of_channels_1(tmp_path):
    rng = np.random.RandomState(0)
    colour = rng.randint(0, 256, (30, 20, 4)).astype(np.uint8)  # RGBA: alpha dropped
    flat = np.repeat(rng.randint(0, 256, (30, 20, 1)).astype(np.uint8), 3, axis=2)  # grey stored as RGB
    for name, arr in (('c.png', colour), ('g.png', flat)):
        path = str(tmp_path / name)
        import cv2
        bgr = arr[..., [2, 1, 0, 3]] if arr.shape[2] == 4 else arr[..., ::-1]
        assert cv2.imwrite(path, np.ascontiguousarray(bgr))
        np.testing.assert_array_equal(peer_common.read_grey(path), io.read_image(path, channels=1)[..., 0])


def test_dsb_folder_read_and_labels_written_as_bin_evaluate_reads_them(tmp_path):
    import cv2
    sample = tmp_path / 'data' / 'abc'
    (sample / 'images').mkdir(parents=True)
    (sample / 'masks').mkdir()
    assert cv2.imwrite(str(sample / 'images' / 'abc.png'), np.zeros((16, 16, 3), np.uint8))
    masks = []
    for k, (r, c) in enumerate([(2, 2), (8, 8), (9, 9)]):  # the last two overlap: later wins
        m = np.zeros((16, 16), np.uint8)
        m[r:r + 4, c:c + 4] = 255
        masks.append(str(sample / 'masks' / ('m%d.png' % k)))
        assert cv2.imwrite(masks[-1], m)
    (listed,) = peer_common.list_dsb(str(tmp_path / 'data'))
    assert listed[0] == 'abc' and listed[2] == masks
    np.testing.assert_array_equal(peer_common.read_labels(listed[2]), io.merge_object_masks(masks))
    assert peer_common.list_inputs(str(tmp_path / 'data')) == [('abc', str(sample / 'images' / 'abc.png'))]

    labels = np.zeros((16, 16), np.int64)
    labels[0:3, 0:3], labels[5:9, 5:9], labels[12:, 12:] = 7, 70000, 300  # ids beyond 16 bits renumbered
    out = str(tmp_path / 'abc_labels.png')
    peer_common.write_labels(out, labels)
    back = evaluate_read_labels(out)
    assert sorted(np.unique(back)) == [0, 1, 2, 3]
    for region in ((slice(0, 3), slice(0, 3)), (slice(5, 9), slice(5, 9)), (slice(12, 16), slice(12, 16))):
        assert len(np.unique(back[region])) == 1 and back[region][0, 0] > 0
    assert (back > 0).sum() == (labels > 0).sum()


def test_validation_split_is_seeded_and_disjoint():
    ids = ['id%02d' % i for i in range(20)]
    trn, val = peer_common.split_ids(ids, 0.15, 42)
    assert len(val) == 3 and sorted(trn + val) == ids
    assert peer_common.split_ids(ids, 0.15, 42) == (trn, val)
    assert peer_common.split_ids(ids, 0.0, 42) == (ids, [])


@pytest.mark.parametrize('script', ['stardist_peer.py', 'cellpose_peer.py'])
def test_peer_scripts_parse_without_their_frameworks(script):
    path = os.path.join(PEERS, script)
    for args in (['--help'], ['train', '--help'], ['predict', '--help']):
        # -S: no site-packages, the standard library alone
        done = subprocess.run([sys.executable, '-S', path] + args, capture_output=True, text=True, timeout=HANG_SECONDS)
        assert done.returncode == 0, done.stderr
        assert 'usage:' in done.stdout
    assert '--init MODEL_DIR' in subprocess.run([sys.executable, '-S', path, 'train', '--help'], capture_output=True,
                                                text=True, timeout=HANG_SECONDS).stdout
    # the module doc says how to install and run it, and how to fine-tune
    with open(path) as f:
        head = f.read(3000)
    assert 'pip install -r benchmarks/peers/requirements-' in head and ' train ' in head and ' predict ' in head
    assert 'train --init' in head


@pytest.mark.parametrize('script,commands', [('fewshot_peers.py', ['run', 'summary']), ('star_ceiling.py', [])])
def test_the_other_peer_tools_parse_without_the_project(script, commands):
    path = os.path.join(PEERS, script)
    for args in [['--help']] + [[c, '--help'] for c in commands]:
        done = subprocess.run([sys.executable, '-S', path] + args, capture_output=True, text=True, timeout=HANG_SECONDS)
        assert done.returncode == 0, done.stderr
        assert 'usage:' in done.stdout


@pytest.mark.parametrize('script', ['stardist_peer.py', 'cellpose_peer.py'])
def test_a_missing_or_foreign_init_is_one_line_and_exit_2(script, tmp_path):
    """Checked before any framework is imported, so the project's venv can run it."""
    path = os.path.join(PEERS, script)
    other = {'stardist_peer.py': 'cellpose', 'cellpose_peer.py': 'stardist'}[script]
    foreign = tmp_path / 'foreign'
    foreign.mkdir()
    (foreign / 'peer.json').write_text('{"peer": "%s", "invert_bright": false}' % other)
    empty = tmp_path / 'empty'
    empty.mkdir()
    damaged = tmp_path / 'damaged'
    damaged.mkdir()
    (damaged / 'peer.json').write_text('{"peer": ')
    unfinished = tmp_path / 'unfinished'  # its own peer's, without the weights
    unfinished.mkdir()
    (unfinished / 'peer.json').write_text('{"peer": "%s", "invert_bright": false}' % script.split('_')[0])
    for init in (tmp_path / 'missing', foreign, empty, damaged, unfinished):
        done = subprocess.run([sys.executable, path, 'train', '--init', str(init), '--data', str(tmp_path),
                               '--out', str(tmp_path / 'out')], capture_output=True, text=True, timeout=HANG_SECONDS)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count('\n') == 1 and done.stderr.startswith('error: --init '), done.stderr
    assert not (tmp_path / 'out').exists()


def test_a_failed_step_of_the_fewshot_runs_shows_its_log_tail_and_one_error_line(tmp_path, capsys):
    """fewshot.py's run (which fewshot_peers.py's steps use too): the command is logged quoted,
    a failure ends in its log's last lines on stderr and one error line naming the log."""
    sys.path.insert(0, os.path.join(ROOT, 'experiments', 'dsb2018'))
    import fewshot
    log = str(tmp_path / 'step.log')
    assert fewshot.run([sys.executable, '-c', 'print("fine")'], log) >= 0
    with pytest.raises(SystemExit) as stop:
        fewshot.run([sys.executable, '-c', 'import sys; print("the cause"); sys.exit(3)', 'a b'], log)
    message = str(stop.value.code)
    assert message.startswith('error: ') and 'exit 3' in message and log in message and '\n' not in message
    assert 'the cause' in capsys.readouterr().err
    with open(log) as f:
        text = f.read()
    assert 'fine\n' in text and "'a b'" in text  # both steps appended, the argument quoted


def _peer_parsers():
    """Every parser of the peers' scripts (each subcommand's), built without their frameworks."""
    import importlib.util
    import argparse
    for script in ('stardist_peer.py', 'cellpose_peer.py', 'fewshot_peers.py', 'star_ceiling.py'):
        spec = importlib.util.spec_from_file_location(script[:-3] + '_under_test', os.path.join(PEERS, script))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        parser = module.build_parser()
        sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not sub:
            yield script, '', parser
        for command, p in (sub[0].choices.items() if sub else ()):
            yield script, command, p


def _numeric_flags():
    out = []
    for script, command, parser in _peer_parsers():
        for action in parser._actions:
            if action.type is not None and action.option_strings:
                out.append((script, command, action.option_strings[-1], action.type))
    return out


NUMERIC_FLAGS = _numeric_flags()


def test_every_number_a_peer_flag_takes_is_checked_where_it_is_parsed():
    """No flag of the peers' scripts takes a bare int or float: each uses one of peer_flags'
    checked types, which refuse their bad values in one line (the next test)."""
    import peer_flags
    assert len(NUMERIC_FLAGS) >= 20
    unchecked = [(s, c, f) for s, c, f, t in NUMERIC_FLAGS if t not in peer_flags.CHECKED]
    assert not unchecked, unchecked


@pytest.mark.parametrize('script,command,flag,kind', NUMERIC_FLAGS, ids=['%s-%s-%s' % f[:3] for f in NUMERIC_FLAGS])
def test_a_bad_number_is_one_line_naming_the_flag_and_exit_2(script, command, flag, kind, capsys):
    parser = next(p for s, c, p in _peer_parsers() if (s, c) == (script, command))
    for bad in kind.bad:
        with pytest.raises(SystemExit) as stop:
            parser.parse_args([flag, bad])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.count('\n') == 1 and 'error: argument %s' % flag in err and bad in err, err


@pytest.mark.parametrize('script', ['stardist_peer.py', 'cellpose_peer.py'])
def test_a_bad_match_record_is_one_line_and_exit_2(script, tmp_path):
    """--match BUDGET_JSON is read before any framework is imported: a missing, damaged or
    foreign record, one without the figures it repeats, or --match on a fine-tune."""
    path = os.path.join(PEERS, script)
    peer, other = ('stardist', 'cellpose') if script.startswith('stardist') else ('cellpose', 'stardist')
    records = {'damaged': '{"peer": ', 'foreign': '{"peer": "%s", "steps": 5, "batches": 5}' % other,
               'fine-tune': '{"peer": "%s", "init": {}, "steps": 5}' % peer,
               'incomplete': '{"peer": "%s", "steps": 0, "batches": 0}' % peer}
    bad = [str(tmp_path / 'missing.json')]
    for name, text in records.items():
        (tmp_path / (name + '.json')).write_text(text)
        bad.append(str(tmp_path / (name + '.json')))
    for record in bad:
        done = subprocess.run([sys.executable, path, 'train', '--data', str(tmp_path), '--out', str(tmp_path / 'out'),
                               '--minutes', '5', '--match', record], capture_output=True, text=True,
                              timeout=HANG_SECONDS)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count('\n') == 1 and done.stderr.startswith('error: --match %s' % record), done.stderr
    (tmp_path / 'init').mkdir()
    done = subprocess.run([sys.executable, path, 'train', '--init', str(tmp_path / 'init'), '--data', str(tmp_path),
                           '--out', str(tmp_path / 'out'), '--match', bad[1]], capture_output=True, text=True,
                          timeout=HANG_SECONDS)
    assert done.returncode == 2 and done.stderr.startswith('error: --match only when training from scratch'), \
        done.stderr
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('script', ['stardist_peer.py', 'cellpose_peer.py'])
def test_match_needs_as_many_images_as_the_recorded_run(script, tmp_path):
    """The same steps on other images is not the same work: refused before any framework
    is imported, and before anything is written."""
    import cv2
    sample = tmp_path / 'data' / 'a'
    (sample / 'images').mkdir(parents=True)
    (sample / 'masks').mkdir()
    cv2.imwrite(str(sample / 'images' / 'a.png'), np.zeros((16, 16), np.uint8))
    cv2.imwrite(str(sample / 'masks' / 'm.png'), np.full((16, 16), 255, np.uint8))
    peer = script.split('_')[0]
    record = tmp_path / 'budget.json'
    record.write_text('{"peer": "%s", "steps": 5, "threshold_images": 2, "batches": 5, "planned_epochs": 5, '
                      '"nimg_per_epoch": 8, "size_model_epochs": 1, "size_model_images": 8, "train_images": 3, '
                      '"val_images": 1}' % peer)
    done = subprocess.run([sys.executable, os.path.join(PEERS, script), 'train', '--data', str(tmp_path / 'data'),
                           '--out', str(tmp_path / 'out'), '--minutes', '5', '--match', str(record)],
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 2, done.stderr
    assert done.stderr == 'error: --match %s: recorded on 4 images, --data %s has 1\n' % (record, tmp_path / 'data')
    assert not (tmp_path / 'out').exists()
