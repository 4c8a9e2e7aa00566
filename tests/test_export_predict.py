"""Export round trip, bin/export errors, and bin/predict (modes, TTA, outputs, bad input)."""
import json
import os
import re
import subprocess
import sys
import textwrap

import cv2
import mxnet as mx
import numpy as np
import pytest

from conftest import export_names
from gluon_unet.checkpoint import load_checkpoint
from gluon_unet.cli import export_main, predict_main
from gluon_unet.config import ModelConfig, TrainConfig
from gluon_unet.data.synthetic import synthetic_nuclei
from gluon_unet.training.loop import fit
from gluon_unet.errors import UserError
from gluon_unet.inference.batched import load_exported, predict_image
from gluon_unet.model import build_model
from gluon_unet.inference.predict import find_inputs, predict_paths
from gluon_unet.inference.submission import rle_decode
from gluon_unet.inference.tiling import blend_window, choose_mode, tile_starts
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _trained_block(run):
    """The best checkpoint of ``run`` in a freshly built (imperative) UNet."""
    meta = load_checkpoint(os.path.join(run, 'checkpoints', 'best.ckpt'))
    cfg = TrainConfig.from_dict(meta['config'])
    net = build_model(cfg.model)
    net.initialize(ctx=mx.cpu())
    net(mx.nd.zeros((1, cfg.model.in_channels, 32, 32)))
    load_checkpoint(os.path.join(run, 'checkpoints', 'best.ckpt'), net=net)
    return net


def _export_block(net, folder, in_channels, train_size=32, multiple=4, resize_mode='resize', threshold=0.5):
    """Export any block the way export_checkpoint does (graph + params + sidecar)."""
    os.makedirs(folder, exist_ok=True)
    net.hybridize()
    net(mx.nd.zeros((1, in_channels, train_size, train_size)))
    net.export(os.path.join(folder, 'model'), epoch=0)
    with open(os.path.join(folder, 'model.json'), 'w') as f:
        json.dump({'in_channels': in_channels, 'classes': 1, 'multiple': multiple, 'train_size': train_size,
                   'resize_mode': resize_mode, 'threshold': threshold}, f)
    return folder


def _brightness_model(folder, in_channels=1, train_size=32):
    """A 1x1 conv whose probability is > 0.5 where the image is brighter than ~0.5:
    segments the synthetic nuclei (mean 171/255 vs background 35/255) exactly."""
    net = mx.gluon.nn.Conv2D(1, 1, in_channels=in_channels)
    net.initialize(mx.init.Constant(20.0 / in_channels))
    net.bias.set_data(mx.nd.array([-10.0]))
    return _export_block(net, folder, in_channels, train_size=train_size)


def _random_unet(depth=2, width=8, seed=0):
    mx.random.seed(seed)
    net = build_model(ModelConfig(in_channels=1, width=width, depth=depth, batch_norm=False))
    net.initialize(mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2),
                   ctx=[mx.cpu(0), mx.cpu(1)])
    return net


def _nuclei(size, seed=3, channels=1):
    images, _, inst = synthetic_nuclei(1, size=size, channels=channels, seed=seed)
    return images[0], inst[0]


def _exit_code(main, argv):
    try:
        return main(argv)
    except SystemExit as exc:  # argparse usage errors
        return exc.code


# -- export ---------------------------------------------------------------------------------

FRESH_LOADER = textwrap.dedent('''
    import sys, numpy as np, mxnet as mx
    prefix, x_file, y_file = sys.argv[1:4]
    net = mx.gluon.SymbolBlock.imports(prefix + '-symbol.json', ['data'], prefix + '-0000.params')
    y = net(mx.nd.array(np.load(x_file))).asnumpy()
    assert not [m for m in sys.modules if m.startswith('gluon_unet')]
    np.save(y_file, y)
''')


def test_export_loads_in_a_fresh_process_and_matches_the_trained_block(tiny, tmp_path):
    cfg = tiny(epochs=1)
    fit(cfg, verbose=False)
    x = np.random.default_rng(0).random((2, 1, 32, 48)).astype(np.float32)
    np.save(tmp_path / 'x.npy', x)
    done = subprocess.run([sys.executable, '-c', FRESH_LOADER, os.path.join(cfg.output, 'export', 'model'),
                           str(tmp_path / 'x.npy'), str(tmp_path / 'y.npy')], capture_output=True, text=True,
                               timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    expected = _trained_block(cfg.output)(mx.nd.array(x)).asnumpy()
    got = np.load(tmp_path / 'y.npy')
    assert got.shape == (2, 1, 32, 48)
    assert np.abs(got - expected).max() <= 1e-5
    meta = json.load(open(os.path.join(cfg.output, 'export', 'model.json')))
    assert (meta['in_channels'], meta['train_size'], meta['multiple'], meta['threshold']) == (1, 32, 4, 0.5)


def test_export_of_two_device_syncbn_training_is_a_plain_float32_model(tiny):
    cfg = tiny(epochs=1, cpus=2, batch_norm=True, sync_bn=True)
    fit(cfg, verbose=False)
    prefix = os.path.join(cfg.output, 'export', 'model')
    symbol = open(prefix + '-symbol.json').read()
    assert 'SyncBatchNorm' not in symbol and '"BatchNorm"' in symbol
    params = mx.nd.load(prefix + '-0000.params')
    assert params and {v.dtype for v in params.values()} == {np.float32}
    assert {v.context for v in params.values()} == {mx.cpu(0)}
    net, _ = load_exported(cfg.output)  # the run folder resolves to its export
    x = mx.nd.array(np.random.default_rng(1).random((3, 1, 32, 32)))
    with mx.autograd.predict_mode():
        expected = _trained_block(cfg.output)(x).asnumpy()
    assert np.abs(net(x).asnumpy() - expected).max() <= 1e-5


def test_export_errors_are_one_line(tiny, tmp_path, capsys):
    cfg = tiny(epochs=1)
    fit(cfg, verbose=False)
    (tmp_path / 'empty').mkdir()
    (tmp_path / 'junk.ckpt').write_bytes(b'not a checkpoint')
    cases = [(str(tmp_path / 'nope'), 'no such run folder or checkpoint'),
             (str(tmp_path / 'empty'), 'no checkpoint there'),
             (str(tmp_path / 'junk.ckpt'), 'not a gluon_unet checkpoint')]
    for arg, words in cases:
        assert export_main([arg]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count('\n') == 1 and 'Traceback' not in err
    assert not (tmp_path / 'export').exists()
    # bin/export re-exports a run, through the shim
    out = tmp_path / 'again'
    done = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'export'), cfg.output, '--output', str(out)],
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(out)) == export_names()

    export = os.path.join(cfg.output, 'export')
    only_symbol = tmp_path / 'only_symbol'
    only_symbol.mkdir()
    (only_symbol / 'model-symbol.json').write_text(open(os.path.join(export, 'model-symbol.json')).read())
    with pytest.raises(UserError, match='model-0000.params is missing'):
        load_exported(str(only_symbol))
    # params of a wider network under this symbol: caught at load, not at the first forward
    wide = tiny(epochs=1, width=8, output=str(tmp_path / 'wide'))
    fit(wide, verbose=False)
    mixed = tmp_path / 'mixed'
    mixed.mkdir()
    (mixed / 'model-symbol.json').write_text(open(os.path.join(export, 'model-symbol.json')).read())
    # same parameter names as the symbol (block name counters differ within one process)
    own = next(iter(mx.nd.load(os.path.join(export, 'model-0000.params')))).split('_')[0].split(':')[1]
    wide_params = mx.nd.load(os.path.join(wide.output, 'export', 'model-0000.params'))
    mx.nd.save(str(mixed / 'model-0000.params'),
               {re.sub(r'unet\d+_', own + '_', k): v for k, v in wide_params.items()})
    with pytest.raises(UserError, match='model-0000.params does not fit model-symbol.json.*Shape inconsistent') as info:
        load_exported(str(mixed))
    assert '\n' not in str(info.value)


# -- prediction geometry --------------------------------------------------------------------

def test_tiles_cover_the_image_on_the_pooling_grid():
    assert tile_starts(32, 32, 24) == [0]
    assert tile_starts(136, 32, 24) == [0, 24, 48, 72, 96, 104]
    w = blend_window(32, 8)
    assert w[16, 16] == 1 and w[0, 16] < 0.1 and w.min() > 0
    assert np.allclose(w[:, 16][4] + w[:, 16][28], 1.0)  # cross-fade: 4.5/8 + 3.5/8
    meta = {'train_size': 32, 'multiple': 4, 'resize_mode': 'resize'}
    assert choose_mode('auto', 64, 20, meta) == 'tile'
    assert choose_mode('auto', 32, 20, meta) == 'resize'
    assert choose_mode('auto', 32, 20, dict(meta, resize_mode='crop')) == 'whole'


def test_tile_prediction_agrees_with_whole_image_away_from_borders():
    """A random depth-2 U-Net (receptive field ~ +-22 px, larger than half a 32-px tile,
    so no tile pixel sees its full context): tiles cannot match a whole-image pass
    exactly, only where blending gives the tile centres the say. Bound: the interior mean
    difference stays under a quarter of the probabilities' own spread there, and well
    under hard-seamed tiling (measured: 0.021 vs spread 0.095 and 0.041 without overlap).
    Tiles off the 2**depth pooling grid measured 0.090 - this test would catch them."""
    net = _random_unet(depth=2, width=8)
    image = _nuclei(128)[0]
    meta = {'train_size': 32, 'multiple': 4, 'resize_mode': 'resize'}
    whole = predict_image(net, meta, image, [mx.cpu()], mode='whole')
    tiled = predict_image(net, meta, image, [mx.cpu(0), mx.cpu(1)], mode='tile', overlap=0.25, batch_size=5)
    seamed = predict_image(net, meta, image, [mx.cpu()], mode='tile', overlap=0.0)
    assert whole.shape == tiled.shape == (128, 128) and tiled.dtype == np.float32
    inner = (slice(16, -16),) * 2
    diff = np.abs(tiled - whole)[inner].mean()
    assert diff < 0.25 * whole[inner].std()
    assert diff < 0.7 * np.abs(seamed - whole)[inner].mean()
    # a depth-1 net's context (~ +-9 px) fits in a tile; with half overlap the interior
    # differs by 0.0046 for a spread of 0.026
    net1 = _random_unet(depth=1, width=8)
    meta1 = dict(meta, multiple=2)
    whole1 = predict_image(net1, meta1, image, [mx.cpu()], mode='whole')
    tiled1 = predict_image(net1, meta1, image, [mx.cpu()], mode='tile', overlap=0.5)
    assert np.abs(tiled1 - whole1)[inner].mean() < 0.25 * whole1[inner].std()


def test_resize_mode_returns_the_original_size():
    net = _random_unet()
    image = _nuclei(64)[0][:50, :37]
    prob = predict_image(net, {'train_size': 32, 'multiple': 4}, image, [mx.cpu()], mode='resize')
    assert prob.shape == (50, 37) and 0 <= prob.min() and prob.max() <= 1


def test_tta_is_flip_invariant_and_in_range():
    net = _random_unet()
    image = _nuclei(64)[0][..., 0]
    sym = ((image.astype(np.uint16) + image[:, ::-1]) // 2).astype(np.uint8)  # left-right symmetric
    meta = {'train_size': 64, 'multiple': 4}
    plain = predict_image(net, meta, sym, [mx.cpu()], mode='whole')
    tta = predict_image(net, meta, sym, [mx.cpu(0), mx.cpu(1)], mode='whole', tta=True, batch_size=3)
    assert tta.shape == (64, 64) and tta.dtype == np.float32
    assert 0 <= tta.min() and tta.max() <= 1
    assert np.abs(plain - plain[:, ::-1]).max() > 1e-3  # the network alone is not symmetric
    assert np.abs(tta - tta[:, ::-1]).max() < 1e-5      # the 8-fold average is
    # and equivariant under a quarter turn, in tile mode too
    image = _nuclei(96)[0][..., 0]
    meta = {'train_size': 32, 'multiple': 4}
    a = predict_image(net, meta, image, [mx.cpu()], mode='tile', tta=True)
    b = predict_image(net, meta, np.rot90(image).copy(), [mx.cpu()], mode='tile', tta=True)
    assert np.abs(np.rot90(a) - b).max() < 1e-4


# -- predict_paths / bin/predict ------------------------------------------------------------

def test_predict_paths_writes_masks_labels_overlays_and_rle(tmp_path):
    _brightness_model(str(tmp_path / 'model'))
    inputs = tmp_path / 'in'
    inputs.mkdir()
    grey, truth = _nuclei(64, seed=5)
    cv2.imwrite(str(inputs / 'a.png'), grey[:48, :40])
    colour = _nuclei(64, seed=6, channels=3)[0]
    cv2.imwrite(str(inputs / 'b.png'), colour[..., ::-1])  # RGB image, 1-channel model: luma
    cv2.imwrite(str(inputs / 'a_mask.png'), np.zeros((48, 40), np.uint8))  # a mask, not an input
    out, rle = tmp_path / 'out', tmp_path / 'sub' / 'submission.csv'
    records = predict_paths(str(tmp_path / 'model'), str(inputs), str(out), cpus=2, overlay=True, rle=str(rle),
                            tta=True, progress=False)
    assert [r['id'] for r in records] == ['a', 'b'] and [r['mode'] for r in records] == ['tile', 'tile']
    assert sorted(os.listdir(out)) == ['a_labels.png', 'a_mask.png', 'a_overlay.png',
                                       'b_labels.png', 'b_mask.png', 'b_overlay.png', 'gluon_unet-predictions.json']
    labels = cv2.imread(str(out / 'a_labels.png'), cv2.IMREAD_UNCHANGED)
    mask = cv2.imread(str(out / 'a_mask.png'), cv2.IMREAD_UNCHANGED)
    over = cv2.imread(str(out / 'a_overlay.png'), cv2.IMREAD_UNCHANGED)
    assert labels.dtype == np.uint16 and labels.shape == mask.shape == (48, 40) and over.shape == (48, 40, 3)
    assert set(np.unique(mask)) <= {0, 255} and np.array_equal(mask > 0, labels > 0)
    # the brightness model finds the true nuclei pixels (up to their faint edges)
    fg = truth[:48, :40] > 0
    assert (fg == (labels > 0)).mean() > 0.97 and labels.max() == records[0]['objects'] >= 3
    rows = [line.split(',') for line in rle.read_text().splitlines()]
    assert rows[0] == ['ImageId', 'EncodedPixels']
    rebuilt = np.zeros_like(labels, np.int64)
    a_rows = [r[1] for r in rows[1:] if r[0] == 'a']
    assert len(a_rows) == labels.max()
    for k, code in enumerate(a_rows, start=1):
        obj = rle_decode(code, labels.shape).astype(bool)
        assert not (rebuilt[obj] > 0).any()  # no overlaps
        rebuilt[obj] = k
    assert np.array_equal(rebuilt, labels)
    assert sum(r[0] == 'b' for r in rows[1:]) == records[1]['objects']


@pytest.mark.parametrize('progress', [True, False])
def test_bin_predict_names_the_backend_in_its_summary_and_manifest(tmp_path, capsys, progress):
    """The one-line summary says what ran the network (also under --no-progress: the bar goes,
    the record stays), and the manifest keeps it beside the model."""
    _brightness_model(str(tmp_path / 'model'))
    cv2.imwrite(str(tmp_path / 'a.png'), _nuclei(48, seed=5)[0])
    out = tmp_path / 'out'
    argv = ['--model', str(tmp_path / 'model'), '--input', str(tmp_path / 'a.png'), '--output', str(out), '--cpus', '2']
    assert _exit_code(predict_main, argv + ([] if progress else ['--no-progress'])) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith('predicted ')]
    assert len(lines) == 1 and ' on 2 devices [cpu(0)' in lines[0] and ' with MXNet %s;' % mx.__version__ in lines[0]
    backend = json.load(open(out / 'gluon_unet-predictions.json'))['model']['backend']
    assert backend == {'name': 'mxnet', 'version': mx.__version__, 'devices': ['cpu(0)', 'cpu(1)']}


def test_image_without_objects_still_gets_a_submission_row(tmp_path):
    _brightness_model(str(tmp_path / 'model'))
    cv2.imwrite(str(tmp_path / 'dark.png'), np.zeros((20, 24), np.uint8))
    recs = predict_paths(str(tmp_path / 'model'), str(tmp_path / 'dark.png'), str(tmp_path / 'out'),
                         rle=str(tmp_path / 's.csv'), progress=False)
    assert recs[0]['objects'] == 0 and recs[0]['mode'] == 'resize'
    assert (tmp_path / 's.csv').read_text() == 'ImageId,EncodedPixels\ndark,\n'


def test_find_inputs_reads_the_dsb_layout(tmp_path):
    for sid in ('x1', 'x2'):
        (tmp_path / sid / 'images').mkdir(parents=True)
        (tmp_path / sid / 'masks').mkdir()
        cv2.imwrite(str(tmp_path / sid / 'images' / (sid + '.png')), np.zeros((8, 8), np.uint8))
        cv2.imwrite(str(tmp_path / sid / 'masks' / 'm.png'), np.zeros((8, 8), np.uint8))
    assert [i for i, _ in find_inputs(str(tmp_path))] == ['x1', 'x2']


def test_bad_inputs_fail_in_one_line_and_leave_no_files(tmp_path, capsys):
    model = _brightness_model(str(tmp_path / 'model'))
    two_channel = _brightness_model(str(tmp_path / 'model2'), in_channels=2)
    (tmp_path / 'empty').mkdir()
    bad = tmp_path / 'bad'
    bad.mkdir()
    png = cv2.imencode('.png', _nuclei(32)[0])[1].tobytes()
    (bad / 'cut.png').write_bytes(png[:len(png) // 2])
    good = tmp_path / 'good.png'
    good.write_bytes(png)
    out = tmp_path / 'out'
    cases = [(['--model', model, '--input', str(tmp_path / 'empty')], 'no images'),
             (['--model', model, '--input', str(bad)], 'truncated PNG'),
             (['--model', two_channel, '--input', str(good)], 'has 1 channel but the model takes 2'),
             (['--model', str(tmp_path / 'empty'), '--input', str(good)], 'no exported model'),
             (['--model', model, '--input', str(good), '--mode', 'zoom'], "invalid choice: 'zoom'"),
             (['--model', model, '--input', str(good), '--batch-size', '0'], '--batch-size must be an integer between 1 and 65536')]
    for args, words in cases:
        assert _exit_code(predict_main, args + ['--output', str(out), '--rle', str(tmp_path / 's.csv')]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count('\n') == 1 and 'Traceback' not in err, err
        assert not out.exists() and not (tmp_path / 's.csv').exists()
    # the shim: exit code and a single line, nothing written
    done = subprocess.run([sys.executable, os.path.join(ROOT, 'bin', 'predict'), '--model', model,
                           '--input', str(bad), '--output', str(out)], capture_output=True, text=True,
                               timeout=HANG_SECONDS)
    assert done.returncode == 2 and done.stderr.strip().count('\n') == 0 and 'cut.png' in done.stderr
    assert not out.exists()
