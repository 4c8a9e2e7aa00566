"""bin/predict when some inputs fail: the good images are still written, one summary
line names the failures, and the exit code says so (issue 12). Also broken model.json
sidecars: one line naming the file, exit 2."""
import os
import subprocess
import sys

import pytest

from gluon_unet.cli import predict_main
from gluon_unet.errors import UserError
from gluon_unet.inference.predict import predict_paths

from conftest import export_brightness_model, nuclei_png, run_cli
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = ('a', 'b', 'd', 'e', 'f')


def _folder(path, good=GOOD, bad=('c_bad',)):
    """Good synthetic PNGs and truncated ones (sorted among the good, inside one batch)."""
    path.mkdir()
    for i, name in enumerate(good):
        (path / (name + '.png')).write_bytes(nuclei_png(i))
    for name in bad:
        data = nuclei_png(99)
        (path / (name + '.png')).write_bytes(data[:len(data) // 2])
    return path


def _masks(out):
    return sorted(n[:-len('_mask.png')] for n in os.listdir(out) if n.endswith('_mask.png')) \
        if os.path.isdir(out) else []


def test_one_truncated_png_costs_only_itself(tmp_path):
    model = export_brightness_model(str(tmp_path / 'model'))
    inputs = _folder(tmp_path / 'in')
    out, rle = tmp_path / 'out', tmp_path / 'sub.csv'
    done = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'predict'), '--model', model,
                           '--input', str(inputs), '--output', str(out), '--rle', str(rle), '--no-progress'],
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 1, done.stderr
    assert _masks(out) == list(GOOD)
    assert 'Traceback' not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith('error: 1 of 6 images failed: c_bad.png (') and 'truncated PNG' in lines[0]
    assert str(inputs) not in lines[0]  # the name, not the full path, in the list
    # the submission has every good image (the brightness model finds nuclei in all)
    ids = {line.split(',')[0] for line in rle.read_text().splitlines()[1:]}
    assert ids == set(GOOD)


def test_allow_failures_exits_0_and_all_failed_exits_2(tmp_path, capsys):
    model = export_brightness_model(str(tmp_path / 'model'))
    inputs = _folder(tmp_path / 'in')
    out = tmp_path / 'out'
    args = ['--model', model, '--input', str(inputs), '--output', str(out), '--no-progress']
    assert run_cli(predict_main, args + ['--allow-failures']) == 0
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and '1 of 6 images failed: c_bad.png' in err and 'Traceback' not in err
    assert _masks(out) == list(GOOD)
    # every image failing is an error even with --allow-failures; nothing is written
    bad_only = _folder(tmp_path / 'bad_only', good=(), bad=('x', 'y'))
    for extra in ([], ['--allow-failures']):
        code = run_cli(predict_main, ['--model', model, '--input', str(bad_only), '--output',
                                   str(tmp_path / 'none'), '--rle', str(tmp_path / 'none.csv'),
                                   '--no-progress'] + extra)
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.startswith('error: all 2 images failed: x.png (') and err.count('\n') == 1
        assert 'y.png (' in err and 'Traceback' not in err
        assert not (tmp_path / 'none').exists() and not (tmp_path / 'none.csv').exists()
    # the flag is in the help
    assert run_cli(predict_main, ['--help']) == 0
    assert '--allow-failures' in capsys.readouterr().out


def test_many_failures_are_counted_and_write_errors_are_per_image(tmp_path, capsys):
    model = export_brightness_model(str(tmp_path / 'model'))
    bad = tuple('bad%d' % i for i in range(6))
    # b's name fits a file name, b_mask.png's does not (255 bytes): a per-image write error
    b = 'b' + 'a' * 247  # sorts before bad0, so the summary names it
    inputs = _folder(tmp_path / 'in', good=('a', b, 'c'), bad=bad)
    out = tmp_path / 'out'
    code = run_cli(predict_main, ['--model', model, '--input', str(inputs), '--output', str(out),
                               '--no-progress'])
    err = capsys.readouterr().err
    assert code == 1 and err.count('\n') == 1 and 'Traceback' not in err, err
    assert err.startswith('error: 7 of 9 images failed: ')
    assert b + '.png (' in err and 'and 4 more' in err
    assert sorted(n for n in os.listdir(out) if n.startswith(('a_', 'c_'))) == [
        'a_labels.png', 'a_mask.png', 'c_labels.png', 'c_mask.png']


def test_predict_paths_returns_the_good_records_and_the_failures(tmp_path):
    model = export_brightness_model(str(tmp_path / 'model'))
    inputs = _folder(tmp_path / 'in')
    records = predict_paths(model, str(inputs), str(tmp_path / 'out'), progress=False)
    assert [r['id'] for r in records] == list(GOOD) and len(records) == 5
    assert all(r['objects'] >= 1 for r in records)
    assert [(f['id'], os.path.basename(f['image'])) for f in records.failures] == [('c_bad', 'c_bad.png')]
    assert 'truncated PNG' in records.failures[0]['error']
    # no failures: an empty list
    assert predict_paths(model, str(inputs / 'a.png'), str(tmp_path / 'one'), progress=False).failures == []
    # a single input that fails keeps its own one-line error
    with pytest.raises(UserError, match='c_bad.png: truncated PNG'):
        predict_paths(model, str(inputs / 'c_bad.png'), str(tmp_path / 'x'), progress=False)
