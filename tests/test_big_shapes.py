"""Shapes MXNet 1.9.1's CPU build dies on (issue 45 item 7): a 1x1 convolution in inference
mode over H x W with H*H*W a multiple of 2**32 is a SIGFPE inside libmxnet.so (oneDNN
2.4.4's brgemm 1x1 blocking divides by a product that wraps to 0; gluon_unet/machine/limits.py).
bin/predict pads such windows a little further and bin/train refuses such sides on CPU.
No 2048 px network runs in this process: the planning is checked, and the two
subprocesses below run one 1x1 convolution or a 1x1-convolution model."""
import os
import subprocess
import sys

import cv2
import numpy as np
import pytest

from conftest import export_brightness_model, run_in_own_group
from gluon_unet.config import ModelConfig, TrainConfig
from gluon_unet.errors import UserError
from gluon_unet.machine.limits import conv1x1_crashes, safe_window, unet_crash
from gluon_unet.inference.tiling import plan_image
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (height, width, outputs): measured on an AMD EPYC Zen 4 (AVX-512), one 1x1 convolution of
# 1-16 channels in inference mode, each in its own process (benchmarks/conv1x1_crash.py).
CRASHED = [(2048, 2048, 1), (2048, 2048, 16), (2048, 1024, 1), (4096, 1024, 1), (1024, 4096, 1), (4096, 2048, 1),
           (8192, 512, 1), (4096, 256, 1), (8192, 64, 1), (6144, 2048, 1), (65536, 1, 1), (4194304, 1, 1),
           (5242880, 1, 1), (6291456, 1, 1), (12582912, 1, 1), (8388608, 1, 1), (16777216, 1, 1),
           (512, 512, 512), (512, 1024, 512)]
RAN = [(2040, 2040, 1), (2048, 2047, 1), (1024, 2048, 1), (256, 4096, 1), (2048, 512, 1), (2049, 2048, 1),
       (2049, 2049, 1), (3000, 3000, 1), (2047, 4096, 1), (4096, 2047, 1), (2064, 2048, 1), (16, 65536, 1),
       (1448, 1449, 1), (4194303, 1, 1), (4194288, 1, 1), (4194320, 1, 1), (4210688, 1, 1), (4198400, 1, 1),
       (4196352, 1, 1), (512, 512, 256), (1024, 1024, 16)]


def test_the_rule_marks_exactly_the_shapes_that_crashed():
    assert [s for s in CRASHED if not conv1x1_crashes(*s)] == []
    assert [s for s in RAN if conv1x1_crashes(*s)] == []


def _image(h, w):
    return np.zeros((h, w), np.uint8)


@pytest.mark.parametrize('h, w, multiple', [(2048, 2048, 16), (2048, 1024, 4), (1024, 2048, 4), (2040, 2040, 16),
                                            (4096, 256, 8), (2047, 100, 8)])
def test_whole_images_reach_the_network_in_a_shape_it_runs_both_ways(h, w, multiple):
    meta = {'multiple': multiple, 'train_size': 256, 'resize_mode': 'crop', 'classes': 1}
    plan = plan_image(_image(h, w), meta, mode='whole')
    th, tw = plan.tile
    assert th % multiple == 0 and tw % multiple == 0 and th >= h and tw >= w
    assert not conv1x1_crashes(th, tw) and not conv1x1_crashes(tw, th)  # TTA turns the window
    assert th * tw <= (h + multiple) * (w + 2 * multiple)  # a little more border, no more
    assert plan.to_image(np.zeros((1, th, tw), np.float32)).shape == (1, h, w)


def test_bucketed_whole_images_too():
    # 2040 px is bucketed up to 2048 (bin/predict --buckets), which the network dies on.
    meta = {'multiple': 8, 'train_size': 256, 'resize_mode': 'crop', 'classes': 1}
    th, tw = plan_image(_image(2040, 2040), meta, mode='whole', buckets=True).tile
    assert (th, tw) in ((2048, 2056), (2056, 2048))


def test_windows_the_network_runs_are_left_as_they_are():
    assert safe_window(2040, 2040, 8) == (2040, 2040)
    assert safe_window(2064, 2048, 16) == (2064, 2048)
    assert safe_window(2048, 2048, 16) in ((2048, 2064), (2064, 2048))


def test_a_model_trained_on_2048_px_tiles_predicts_on_tiles_and_resized_windows_it_runs():
    meta = {'multiple': 16, 'train_size': 2048, 'resize_mode': 'crop', 'classes': 1}
    tiled = plan_image(_image(3000, 2100), meta, mode='tile')
    assert tiled.tile == (2064, 2064)
    resized = plan_image(_image(100, 60), dict(meta, resize_mode='resize'), mode='resize')
    assert resized.tile == (2064, 2064) and resized.source.shape == (1, 2064, 2064)
    maps = np.zeros((1, 2064, 2064), np.float32)
    maps[:, :2048, :2048] = 1.0  # the reflected border is cut away before resizing back
    assert resized.to_image(maps).shape == (1, 100, 60) and resized.to_image(maps).min() == 1.0


def test_bin_predict_whole_on_a_2048_by_1024_image_runs(tmp_path):
    # It died with "Floating point exception" (exit code 136) on AVX-512 CPUs.
    model = export_brightness_model(str(tmp_path / 'model'))
    image = np.zeros((2048, 1024), np.uint8)
    cv2.circle(image, (500, 900), 30, 255, -1)
    cv2.imwrite(str(tmp_path / 'tall.png'), image)
    code, out = run_in_own_group([sys.executable, os.path.join(ROOT, 'bin', 'predict'), '--model', model, '--input',
                                  str(tmp_path / 'tall.png'), '--output', str(tmp_path / 'out'), '--mode', 'whole',
                                  '--tta'])
    assert code == 0, out[-2000:]
    mask = cv2.imread(str(tmp_path / 'out' / 'tall_mask.png'), cv2.IMREAD_UNCHANGED)
    assert mask.shape == (2048, 1024) and mask[900, 500] > 0 and mask[100, 100] == 0


@pytest.mark.parametrize('flag', ['--crop', '--size'])
def test_bin_train_refuses_a_side_the_cpu_build_dies_on_in_one_line(tmp_path, flag):
    out = tmp_path / 'run'
    done = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'train'), flag, '2048', '--depth', '4',
                           '--output', str(out), '--no-progress'], capture_output=True, text=True, timeout=HANG_SECONDS)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert '%s 2048' % flag in lines[0] and '%s 2032 or %s 2064' % (flag, flag) in lines[0]
    assert not out.exists()


def test_the_side_limit_is_for_cpu_training_only():
    with pytest.raises(UserError, match='--crop 4096'):
        TrainConfig(crop=4096).validate()
    TrainConfig(crop=2048, gpus='0').validate()  # cuDNN's convolutions: no such limit
    TrainConfig(crop=3072).validate()  # 3 * 10 factors 2: it runs (measured: a U-Net's forward at 3072x3072)


def test_under_bfloat16_the_upsampling_convolutions_count_too():
    # Under bf16 AMP a transposed 2x2 convolution is a 1x1 convolution to 4x its channels
    # (onednn.TransposedConv2x2): at width 128 the one to level 0 of a 1024 px input sees
    # 512x512 with 512 outputs (measured: it crashes; with 256 outputs it runs).
    assert unet_crash(1024, 1024, width_=128, depth=4) is None
    assert unet_crash(1024, 1024, width_=128, depth=4, bf16=True) == 'the upsampling to level 0 at 512x512'
    with pytest.raises(UserError, match=r'--crop 1024: .* the upsampling to level 0 at 512x512; use --crop 1008 or'):
        TrainConfig(crop=1024, amp=True, model=ModelConfig(width=128)).validate()


def _avx512():
    with open('/proc/cpuinfo') as f:
        return 'avx512f' in f.read()


@pytest.mark.skipif(not os.path.exists('/proc/cpuinfo'), reason='needs /proc/cpuinfo')
def test_the_boundary_is_where_onednn_divides_by_zero_on_this_cpu():
    """Run in child processes: 2048x1024 (the rule says it crashes) and 1024x2048 (it
    does not). Without AVX-512 oneDNN takes other kernels and neither crashes."""
    script = ('import sys, mxnet as mx; h, w = int(sys.argv[1]), int(sys.argv[2]); '
              'mx.nd.Convolution(mx.nd.ones((1, 4, h, w)), mx.nd.ones((1, 4, 1, 1)), mx.nd.zeros(1), kernel=(1, 1), '
              'num_filter=1).wait_to_read()')
    codes = {}
    for h, w in ((2048, 1024), (1024, 2048)):
        codes[h, w] = subprocess.run([sys.executable, '-c', script, str(h), str(w)], capture_output=True,
                                     timeout=HANG_SECONDS).returncode
    assert codes[1024, 2048] == 0
    assert codes[2048, 1024] == (-8 if _avx512() else 0)  # SIGFPE
