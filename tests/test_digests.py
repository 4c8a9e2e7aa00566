"""Damage that keeps a file's size is never used silently (issue 45, observation 5):
checkpoints, exports and cache entries carry a CRC-32 of their content, checked on load.
A damaged checkpoint stops --resume, export and prediction in one line naming the file
(and, for --resume, the newest intact checkpoint); a damaged cache entry is rebuilt, not
trained on. Files written before digests still load."""
import json
import os
import shutil

import cv2
import mxnet as mx
import numpy as np
import pytest

import gluon_unet.data.readers as readers
from gluon_unet.checkpoint import list_checkpoints, load_checkpoint
from gluon_unet.cli import export_main, predict_main, train_main
from gluon_unet.data import load_dataset, synthetic_nuclei
from gluon_unet.training.loop import fit
from gluon_unet.errors import DamagedFile
from gluon_unet.inference.batched import load_exported

from conftest import run_cli

TRAIN = ['--width', '4', '--depth', '2', '--size', '32', '--batch-size', '8', '--synthetic-count', '24',
         '--workers', '0', '--no-progress', '--patience', '0', '--optimizer', 'adam', '--keep-last', '3',
         '--lr-schedule', 'constant']


def damage_array(path, key):
    """Change the values of the array ``key`` inside the checkpoint ``path`` in place, the
    file's size and every other byte unchanged (as a bad copy or a bit flip would)."""
    values = mx.nd.load(path)[key].asnumpy()
    raw = open(path, 'rb').read()
    at = raw.find(values.tobytes())
    assert at > 0 and raw.find(values.tobytes(), at + 1) < 0
    changed = (values * 1.5 + 0.25).astype(values.dtype).tobytes()
    with open(path, 'r+b') as f:
        f.seek(at)
        f.write(changed)
    assert len(open(path, 'rb').read()) == len(raw)


@pytest.fixture(scope='module')
def run3(tmp_path_factory):
    """A 3-epoch demo run (Adam), its checkpoints epoch 1-3 kept."""
    out = str(tmp_path_factory.mktemp('digest') / 'run')
    assert run_cli(train_main, TRAIN + ['--epochs', '3', '--output', out]) == 0
    return out


@pytest.fixture
def run(run3, tmp_path):
    copy = str(tmp_path / 'run')
    shutil.copytree(run3, copy)
    return copy


@pytest.mark.parametrize('key', ['param:enc0.0.weight', 'opt:i0.1'], ids=['weights', 'adam-moment'])
def test_a_checkpoint_damaged_in_place_stops_resume_and_export_in_one_line(run, key, capsys):
    ckpts = list_checkpoints(os.path.join(run, 'checkpoints'))
    latest = ckpts[-1]
    key = key if key in mx.nd.load(latest) else sorted(k for k in mx.nd.load(latest) if k.startswith('param:'))[0]
    damage_array(latest, key)
    with pytest.raises(DamagedFile, match='checkpoint %s is damaged' % latest):
        load_checkpoint(latest)
    capsys.readouterr()
    # export: one line naming the file, exit 1, no export written from it
    assert run_cli(export_main, [latest, '--output', os.path.join(run, 'x')]) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and latest in err and 'damaged' in err, err
    assert 'export it with bin/export %s' % ckpts[-2] in err, err
    assert not os.path.exists(os.path.join(run, 'x'))
    # --resume auto: refuses the damaged latest one and names the newest intact one
    assert run_cli(train_main, TRAIN + ['--epochs', '4', '--output', run, '--resume', 'auto']) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and latest in err, err
    assert 'continue from it with --resume %s' % ckpts[-2] in err, err
    assert list_checkpoints(os.path.join(run, 'checkpoints'))[-1] == latest  # nothing trained or written
    # ... and that advice works
    assert run_cli(train_main, TRAIN + ['--epochs', '4', '--output', run, '--resume', ckpts[-2]]) == 0
    assert load_checkpoint(list_checkpoints(os.path.join(run, 'checkpoints'))[-1])['epoch'] == 4


def test_resume_auto_with_no_intact_checkpoint_left_says_so(run, capsys):
    folder = os.path.join(run, 'checkpoints')
    for path in list_checkpoints(folder) + [os.path.join(folder, 'best.ckpt')]:
        if os.path.exists(path):
            damage_array(path, 'meta')
    capsys.readouterr()
    assert run_cli(train_main, TRAIN + ['--epochs', '4', '--output', run, '--resume', 'auto']) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and 'no earlier checkpoint of this run is intact' in err, err


@pytest.mark.parametrize('name', ['model-0000.params', 'model-symbol.json'])
def test_a_damaged_export_stops_prediction_in_one_line_naming_the_file(run, name, capsys):
    path = os.path.join(run, 'export', name)
    if name.endswith('.params'):
        values = mx.nd.load(path)
        key = sorted(values)[0]
        raw = open(path, 'rb').read()
        at = raw.find(values[key].asnumpy().tobytes())
        data = bytearray(raw)
        data[at:at + 4] = np.float32([1234.5]).tobytes()
    else:  # a digit of the symbol's JSON: still valid JSON, another network
        data = bytearray(open(path, 'rb').read())
        at = data.find(b'"num_filter": "4"')
        assert at > 0
        data[at + len('"num_filter": "')] = ord('5')
    with open(path, 'r+b') as f:
        f.write(bytes(data))
    capsys.readouterr()
    code = run_cli(predict_main, ['--model', run, '--input', os.path.join(run, 'demo_inputs'), '--output',
                                  os.path.join(run, 'again'), '--no-progress'])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.splitlines() == [err] and path in err and 'damaged' in err, err
    assert not os.path.exists(os.path.join(run, 'again'))


def test_checkpoints_and_exports_written_before_digests_still_load(run):
    ckpt = list_checkpoints(os.path.join(run, 'checkpoints'))[-1]
    arrays = mx.nd.load(ckpt)
    del arrays['digest']
    mx.nd.save(ckpt, arrays)
    assert load_checkpoint(ckpt)['epoch'] == 3
    sidecar = os.path.join(run, 'export', 'model.json')
    meta = json.load(open(sidecar))
    del meta['digest']
    json.dump(meta, open(sidecar, 'w'))
    load_exported(run)


def _paired_folders(root, n, size, seed):
    """``root/im/a<i>.png`` and ``root/mk/a<i>_mask.png``: ``n`` synthetic nuclei images."""
    images, masks, _ = synthetic_nuclei(n, size=size, channels=1, seed=seed)
    for folder in ('im', 'mk'):
        (root / folder).mkdir()
    for i in range(n):
        cv2.imwrite(str(root / 'im' / ('a%d.png' % i)), images[i])
        cv2.imwrite(str(root / 'mk' / ('a%d_mask.png' % i)), masks[i] * 255)


def test_a_cache_entry_damaged_in_place_is_rebuilt_not_trained_on(tmp_path, monkeypatch, caplog):
    _paired_folders(tmp_path, 4, size=40, seed=5)
    decoded = []
    real = readers.decode_sample
    monkeypatch.setattr(readers, 'decode_sample', lambda *a, **k: decoded.append(1) or real(*a, **k))

    def load():
        return load_dataset(str(tmp_path / 'im'), str(tmp_path / 'mk'), size=32, workers=0, progress=False,
                            cache_dir=str(tmp_path / 'cache'))
    good = np.array(load().images)
    entry = next(p for p in (tmp_path / 'cache').iterdir() if not p.name.startswith('.'))
    blob = entry / 'images.bin'
    size = blob.stat().st_size
    with open(blob, 'r+b') as f:  # its first half zeroed, the size unchanged
        f.write(b'\0' * (size // 2))
    decoded.clear()
    caplog.clear()
    again = load()
    warned = [r.getMessage() for r in caplog.records if r.levelname == 'WARNING']
    assert len(warned) == 1 and str(blob) in warned[0] and 'damaged' in warned[0] and 'rebuilding' in warned[0]
    assert len(decoded) == 4  # rebuilt from the images ...
    np.testing.assert_array_equal(np.array(again.images), good)  # ... never the zeros
    # the rebuilt entry replaced the damaged one: the next load hits it, silently
    decoded.clear()
    caplog.clear()
    np.testing.assert_array_equal(np.array(load().images), good)
    assert not decoded and not [r for r in caplog.records if r.levelname == 'WARNING']
    assert [p.name for p in (tmp_path / 'cache').iterdir()] == [entry.name]


def test_a_run_trains_on_the_rebuilt_cache_not_the_damaged_one(tiny, tmp_path, caplog):
    # The same through fit(): the first half of the masks zeroed would teach "no nuclei".
    _paired_folders(tmp_path, 8, size=32, seed=2)
    cfg = dict(data=str(tmp_path / 'im'), masks=str(tmp_path / 'mk'), cache_dir=str(tmp_path / 'cache'),
               epochs=1, val_split=0.25)
    first = fit(tiny(output=str(tmp_path / 'a'), **cfg), verbose=False)
    entry = next(p for p in (tmp_path / 'cache').iterdir() if not p.name.startswith('.'))
    with open(entry / 'masks.bin', 'r+b') as f:
        f.write(b'\0' * ((entry / 'masks.bin').stat().st_size // 2))
    caplog.clear()
    second = fit(tiny(output=str(tmp_path / 'b'), **cfg), verbose=False)
    assert any('damaged' in r.getMessage() and 'masks.bin' in r.getMessage() for r in caplog.records)
    assert second[0]['train_loss'] == pytest.approx(first[0]['train_loss'], rel=1e-5)
