"""Training from files on disk, through the same CLI a user runs."""
import os
import subprocess
import sys

import cv2

from gluon_unet.data import synthetic_nuclei
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_paired(root, count=12, size=48):
    images, masks, _ = synthetic_nuclei(count, size=size, channels=3, seed=7)
    (root / 'im').mkdir()
    (root / 'mask').mkdir()
    for i in range(count):
        cv2.imwrite(str(root / 'im' / ('x%02d.png' % i)), images[i])
        cv2.imwrite(str(root / 'mask' / ('x%02d_mask.png' % i)), masks[i] * 255)


def _write_dsb(root, count=10, size=40):
    images, _, instances = synthetic_nuclei(count, size=size, seed=8)
    for i in range(count):
        sid = 'id%03d' % i
        (root / sid / 'images').mkdir(parents=True)
        (root / sid / 'masks').mkdir()
        cv2.imwrite(str(root / sid / 'images' / (sid + '.png')), images[i])
        for k in range(1, instances[i].max() + 1):
            cv2.imwrite(str(root / sid / 'masks' / ('m%d.png' % k)), (instances[i] == k).astype('uint8') * 255)


def _train(*args):
    cmd = [sys.executable, os.path.join(ROOT, 'bin', 'train'), '--width', '4', '--depth', '2', '--epochs', '1',
           '--batch-size', '4', '--workers', '0', '--no-progress'] + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_SECONDS)


def test_paired_folders_train_with_rgb_and_crops(tmp_path):
    _write_paired(tmp_path)
    out = tmp_path / 'run'
    done = _train('--data', str(tmp_path / 'im'), '--masks', str(tmp_path / 'mask'), '--crop', '32',
                  '--output', str(out), '--cache-dir', str(tmp_path / 'cache'), '--cpus', '2')
    assert done.returncode == 0, done.stderr
    assert '11 train / 1 val images' in done.stderr  # round(12 x 0.1) held out
    assert '"in_channels": 3' in (out / 'export' / 'model.json').read_text()  # channels came from the data


def test_dsb_layout_trains_and_reports_the_instance_metric(tmp_path):
    _write_dsb(tmp_path / 'dsb')
    out = tmp_path / 'run'
    done = _train('--data', str(tmp_path / 'dsb'), '--size', '32', '--output', str(out),
                  '--cache-dir', str(tmp_path / 'cache'), '--loss', 'wbce', '--monitor', 'val_dsb')
    assert done.returncode == 0, done.stderr
    assert 'val_dsb' in (out / 'metrics.csv').read_text().splitlines()[0]


def test_unpaired_images_fail_in_one_line_and_write_nothing(tmp_path):
    _write_paired(tmp_path)
    os.remove(str(tmp_path / 'mask' / 'x03_mask.png'))
    out = tmp_path / 'run'
    done = _train('--data', str(tmp_path / 'im'), '--masks', str(tmp_path / 'mask'), '--output', str(out),
                  '--cache-dir', str(tmp_path / 'cache'), '--size', '32')
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and 'x03' in lines[0], done.stderr
    assert not out.exists()
    done = _train('--data', str(tmp_path / 'im'), '--masks', str(tmp_path / 'mask'), '--output', str(out),
                  '--cache-dir', str(tmp_path / 'cache'), '--size', '32', '--skip-unpaired')
    assert done.returncode == 0, done.stderr
