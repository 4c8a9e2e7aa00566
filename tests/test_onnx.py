"""ONNX export and prediction without MXNet (issue 48).

The export side runs here (mxnet + onnx 1.14). onnxruntime cannot live beside MXNet
(its wheels need numpy >= 1.24), so the runtime side runs in a second environment without
mxnet - ``$GLUON_UNET_ONNX_PYTHON``, a Python with requirements-onnx.txt, which .ci/run
builds - called as a subprocess on the same files: MXNet's outputs are made here, in the
same test. Those tests skip where that environment is absent, and fail instead under CI.
"""
import csv
import json
import os
import shutil
import subprocess
import sys
import textwrap

import cv2
import mxnet as mx
import numpy as np
import pytest

from conftest import tiny_config
from gluon_unet.config import ModelConfig, TrainConfig
from gluon_unet.errors import DamagedFile, UserError
from hang import HANG_SECONDS

onnx = pytest.importorskip('onnx')  # requirements-dev.txt installs it; a bare install may not have it

from gluon_unet.inference.export_onnx import OPSET, TOLERANCE, add_onnx, check_parity, convert  # noqa: E402
from gluon_unet.inference.batched_onnx import ONNX_FILE, onnx_path  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def onnx_python():
    """The ONNX environment's Python, else skip (fail under CI=true, where .ci/run builds it)."""
    python = os.environ.get('GLUON_UNET_ONNX_PYTHON')
    if python and os.access(python, os.X_OK):
        return python
    why = ('no ONNX environment: set GLUON_UNET_ONNX_PYTHON to a Python with requirements-onnx.txt and without '
           'mxnet (.ci/run builds one)')
    if os.environ.get('CI') == 'true':
        pytest.fail(why)
    pytest.skip(why)


def run_onnx(args):
    """Run ``args`` with the ONNX environment's Python, this checkout first on its path."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS='1')
    return subprocess.run([onnx_python()] + args, capture_output=True, text=True, env=env, timeout=HANG_SECONDS)


# -- every kind of model converts, and matches MXNet ---------------------------------------

KINDS = {
    'default': {},
    'bilinear': {'upsample': 'bilinear'},
    'mask+border': {'target': 'mask+border'},
    'no-batchnorm': {'batch_norm': False},
    'depth3-rgb': {'depth': 3, 'in_channels': 3},
    'depth5': {'depth': 5},
}


def _export_kind(folder, depth=4, in_channels=1, onnx=False, **model):
    """A random width-4 U-Net of one kind, exported as training does (biases and BatchNorm
    statistics made non-trivial, so a wrong bias or BatchNormalization shows); its
    model.onnx only with ``onnx`` (the tests add it with add_onnx)."""
    mx.random.seed(0)
    cfg = TrainConfig(model=ModelConfig(in_channels=in_channels, width=4, depth=depth, **model), size=64)
    from gluon_unet.inference.export import export_block
    from gluon_unet.model import build_model
    net = build_model(cfg.model)
    net.initialize(mx.init.Xavier(magnitude=2))
    net(mx.nd.zeros((1, in_channels, 64, 64)))
    rng = np.random.default_rng(1)
    for name, p in net.collect_params().items():
        if name.endswith(('running_mean', 'beta', 'bias')):
            p.set_data(mx.nd.array(rng.normal(0, 0.2, p.shape)))
        elif name.endswith(('running_var', 'gamma')):
            p.set_data(mx.nd.array(rng.uniform(0.5, 2, p.shape)))
    export_block(net, cfg, folder, onnx=onnx)
    return cfg


@pytest.fixture(scope='module')
def kinds(tmp_path_factory):
    """Each kind exported with its model.onnx, and MXNet's logits on a shape the parity
    check did not use (saved for the ONNX environment)."""
    root = tmp_path_factory.mktemp('kinds')
    made = {}
    for kind, model in KINDS.items():
        folder = str(root / kind)
        cfg = _export_kind(folder, **model)
        path, record, seconds = add_onnx(folder)
        m = 2 ** cfg.model.depth
        x = np.random.default_rng(2).random((3, cfg.model.in_channels, 3 * m, 5 * m), dtype=np.float32)
        net = mx.gluon.SymbolBlock.imports(os.path.join(folder, 'model-symbol.json'), ['data'],
                                           os.path.join(folder, 'model-0000.params'))
        np.save(os.path.join(folder, 'x.npy'), x)
        np.save(os.path.join(folder, 'y.npy'), net(mx.nd.array(x)).asnumpy())
        made[kind] = {'folder': folder, 'record': record, 'cfg': cfg}
    return made


@pytest.mark.parametrize('kind', list(KINDS))
def test_every_kind_converts_with_weights_as_initializers_named_axes_and_parity(kinds, kind):
    made = kinds[kind]
    model = onnx.load(os.path.join(made['folder'], ONNX_FILE))
    assert [i.name for i in model.graph.input] == ['data']  # no weight among the inputs
    assert len(model.graph.initializer) > 10 and [o.name for o in model.graph.output] == ['logits']
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ['batch', made['cfg'].model.in_channels, 'height', 'width']
    out = [d.dim_param or d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert out == ['batch', made['cfg'].model.outputs, 'height', 'width']
    assert [(o.domain, o.version) for o in model.opset_import] == [('', OPSET)]
    meta = json.load(open(os.path.join(made['folder'], 'model.json')))
    assert meta['onnx'] == made['record'] and meta['onnx']['opset'] == OPSET
    assert meta['digest'][ONNX_FILE].startswith('crc32:') and 'model-0000.params' in meta['digest']
    parity = meta['onnx']['parity']
    assert len(parity['shapes']) == 3 and parity['max_abs_diff'] <= TOLERANCE * max(1, parity['scale'])
    assert parity['scale'] > 0.05  # the outputs are not all ~0: the comparison means something


def test_onnxruntime_matches_mxnet_for_every_kind_on_new_shapes(kinds):
    script = textwrap.dedent('''
        import json, sys, numpy as np
        from gluon_unet.inference.batched_onnx import OnnxNetwork
        out = {}
        for kind, folder in json.loads(sys.argv[1]).items():
            net = OnnxNetwork(folder + '/model.onnx', [[('CPUExecutionProvider', {})]], threads=1)
            x, y = np.load(folder + '/x.npy'), np.load(folder + '/y.npy')
            got = net(x)
            out[kind] = [float(np.abs(got - y).max()), float(np.abs(y).max()), list(got.shape), list(y.shape)]
        assert 'mxnet' not in sys.modules
        print(json.dumps(out))
    ''')
    done = run_onnx(['-c', script, json.dumps({k: v['folder'] for k, v in kinds.items()})])
    assert done.returncode == 0, done.stderr
    for kind, (diff, scale, got, expected) in json.loads(done.stdout).items():
        assert got == expected, kind
        assert diff <= TOLERANCE * max(1, scale), (kind, diff, scale)


def test_bf16_trained_weights_export_as_a_float32_graph_that_converts(tmp_path):
    # A network built for bfloat16 AMP computes its 2x2 up-convolutions as a 1x1 conv and a
    # reshape with -4, which MXNet's ONNX converter cannot translate. Its checkpoint holds the
    # same parameters as a float32 U-Net's, and exports are rebuilt in float32 from it.
    from gluon_unet.checkpoint import save_checkpoint
    from gluon_unet.inference.export import export_checkpoint
    from gluon_unet.model import build_model
    from gluon_unet.inference.export_onnx import graph_data
    from gluon_unet.inference.onnx_numpy import run_graph
    mx.random.seed(0)
    cfg = TrainConfig(model=ModelConfig(in_channels=1, width=4, depth=2, batch_norm=False), size=32)
    from gluon_unet.machine.onednn import OneDNNLayers
    from gluon_unet.model import Layers
    # float32 here: only the structure matters
    standin = build_model(cfg.model, OneDNNLayers(Layers(amp=True), bfloat16=True))
    standin.initialize(mx.init.Xavier(magnitude=2))
    x = np.random.default_rng(0).random((1, 1, 32, 48), dtype=np.float32)
    expected = standin(mx.nd.array(x)).asnumpy()
    ckpt = str(tmp_path / 'epoch0001.ckpt')
    save_checkpoint(ckpt, standin, None, {'config': cfg.to_dict(), 'epoch': 1, 'metrics': {}})
    folder = str(tmp_path / 'export')
    export_checkpoint(ckpt, folder)
    assert '"Deconvolution"' in open(os.path.join(folder, 'model-symbol.json')).read()
    add_onnx(folder)
    model = onnx.load(os.path.join(folder, ONNX_FILE))
    got, = run_graph(*graph_data(model), {'data': x}, ['logits'])
    assert np.abs(got - expected).max() <= 1e-5 * max(1, np.abs(expected).max())
    # The stand-in's own graph is what would not convert: one line, no traceback.
    standin.hybridize()
    standin(mx.nd.array(x))
    standin.export(str(tmp_path / 'standin'), epoch=0)
    with pytest.raises(UserError, match='cannot convert to ONNX') as err:
        convert(str(tmp_path / 'standin-symbol.json'), str(tmp_path / 'standin-0000.params'), 1, 4)
    assert '\n' not in str(err.value)


def test_parity_check_refuses_a_graph_that_differs_from_mxnet(kinds):
    folder = kinds['default']['folder']
    model = onnx.load(os.path.join(folder, ONNX_FILE))
    net = mx.gluon.SymbolBlock.imports(os.path.join(folder, 'model-symbol.json'), ['data'],
                                       os.path.join(folder, 'model-0000.params'))
    assert check_parity(model, net, [(1, 1, 32, 32)], 'x')['max_abs_diff'] < 1e-4
    bn = next(n for n in model.graph.node if n.op_type == 'BatchNormalization')
    bn.attribute[0].f = 0.5 if bn.attribute[0].name == 'epsilon' else bn.attribute[0].f
    assert bn.attribute[0].name == 'epsilon'
    with pytest.raises(UserError, match='differs from MXNet by'):
        check_parity(model, net, [(1, 1, 32, 32)], 'x')


def test_numpy_interpreter_names_an_operator_it_does_not_know():
    from gluon_unet.inference.onnx_numpy import UnsupportedGraph, run_graph
    with pytest.raises(UnsupportedGraph, match='Softmax'):
        run_graph([('Softmax', ['x'], ['y'], {})], {}, {'x': np.zeros((1, 2))}, ['y'])


def test_probability_maps_match_mxnet():
    from gluon_unet.model import probability_maps as mx_maps
    from gluon_unet.inference.batched_onnx import probability_maps
    rng = np.random.default_rng(0)
    for channels, second in ((1, None), (2, 'border'), (3, None)):
        logits = rng.normal(0, 30, (2, channels, 8, 8)).astype(np.float32)
        expected = mx_maps(mx.nd.array(logits), second).asnumpy()
        got = probability_maps(logits, second)
        assert got.shape == expected.shape and got.dtype == np.float32
        assert np.abs(got - expected).max() < 1e-6


def test_a_stale_or_damaged_model_onnx_is_refused(kinds, tmp_path):
    folder = str(tmp_path / 'export')
    shutil.copytree(kinds['no-batchnorm']['folder'], folder)
    assert onnx_path(folder)[0] == os.path.join(folder, ONNX_FILE)
    with open(os.path.join(folder, ONNX_FILE), 'r+b') as f:
        f.seek(-5, os.SEEK_END)
        f.write(b'xxxxx')
    with pytest.raises(DamagedFile, match='model.onnx is damaged'):
        onnx_path(folder)
    # A later export of other weights into the folder, without ONNX, takes the old file away...
    _export_kind(folder, batch_norm=False)
    assert not os.path.exists(os.path.join(folder, ONNX_FILE))
    with pytest.raises(UserError, match='the export has no model.onnx'):
        onnx_path(folder)
    # ... and one put back by hand is not listed in its model.json: refused.
    shutil.copy(os.path.join(kinds['no-batchnorm']['folder'], ONNX_FILE), folder)
    with pytest.raises(UserError, match='is not recorded in .*model.json') as err:
        onnx_path(folder)
    assert '\n' not in str(err.value)


def test_predict_imports_no_mxnet_until_it_predicts_with_mxnet():
    code = ('import sys, gluon_unet.cli, gluon_unet.inference.predict, gluon_unet.inference.batched_onnx, gluon_unet.inference.export, '
            'gluon_unet.inference.batched, gluon_unet.data.io; '
            'assert not [m for m in sys.modules if m.split(".")[0] in ("mxnet", "onnx", "onnxruntime")], '
            'sorted(m for m in sys.modules if "mxnet" in m)[:5]')
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=HANG_SECONDS, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_without_onnxruntime_the_onnx_path_is_one_line(kinds):
    from gluon_unet.inference.batched_onnx import load_onnx_model
    try:
        import onnxruntime  # noqa: F401
        pytest.skip('onnxruntime is installed beside mxnet here')
    except ImportError:
        pass
    with pytest.raises(UserError) as err:
        load_onnx_model(kinds['default']['folder'], why='mxnet is not installed')
    text = str(err.value)
    assert text.startswith('mxnet is not installed and onnxruntime is not installed in this Python')
    assert 'pip install -r requirements-onnx.txt' in text and '\n' not in text


# -- bin/predict in the environment without mxnet -----------------------------------------

@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A small mask+border model trained by fit (its export written by the end of training,
    as bin/train does, model.onnx included: the onnx package is installed), and images to
    predict."""
    from gluon_unet.data.synthetic import synthetic_nuclei
    from gluon_unet.training.loop import fit
    root = tmp_path_factory.mktemp('trained')
    cfg = tiny_config(root, epochs=4, width=8, batch_norm=True, target='mask+border', size=64, crop=32)
    fit(cfg, verbose=False)
    images = root / 'images'
    images.mkdir()
    pictures, _, _ = synthetic_nuclei(3, size=88, seed=11)
    for i, picture in enumerate(pictures):
        cv2.imwrite(str(images / ('img%d.png' % i)), picture)
    wide, _, _ = synthetic_nuclei(1, size=72, seed=12)
    cv2.imwrite(str(images / 'wide.png'), np.concatenate([wide[0], wide[0][:, :40]], axis=1))
    return cfg.output, str(images), root


def test_training_writes_model_onnx_into_its_export_and_bin_export_follows_the_flags(trained, tmp_path, capsys):
    from gluon_unet.cli import export_main
    from gluon_unet.inference.sidecar import read_sidecar
    run, _, _ = trained
    export = os.path.join(run, 'export')
    meta = read_sidecar(os.path.join(export, 'model.json'))
    assert meta['onnx']['opset'] == OPSET and meta['onnx']['parity']['max_abs_diff'] <= TOLERANCE
    assert onnx_path(run)[0] == os.path.join(export, ONNX_FILE)  # recorded, its digest matches
    # --no-onnx: the new export has none, and the old model.onnx (of other weights, maybe)
    # does not outlive the files it was made from.
    out = str(tmp_path / 'again')
    assert export_main([run, '--output', out]) == 0
    assert sorted(os.listdir(out)) == ['model-0000.params', 'model-symbol.json', 'model.json', 'model.onnx']
    assert capsys.readouterr().out.startswith('exported %s/model-symbol.json, %s/model-0000.params and %s/model.onnx'
                                              % (out, out, out))
    assert export_main([run, '--output', out, '--no-onnx']) == 0
    assert sorted(os.listdir(out)) == ['model-0000.params', 'model-symbol.json', 'model.json']
    assert ONNX_FILE not in read_sidecar(os.path.join(out, 'model.json'))['digest']
    assert export_main([run, '--output', out, '--onnx']) == 0 and os.path.isfile(os.path.join(out, ONNX_FILE))


def test_without_the_onnx_package_an_export_says_so_in_one_line(trained, tmp_path):
    # Asked for (--onnx): an error naming the requirements file, before anything is written.
    # By default: the export without model.onnx, and one note line.
    run, _, _ = trained
    script = textwrap.dedent('''
        import sys
        sys.modules['onnx'] = None  # as if it were not installed
        from gluon_unet.cli import export_main
        sys.exit(export_main(sys.argv[1:]))
    ''')
    env = dict(os.environ, PYTHONPATH=ROOT)
    asked = subprocess.run([sys.executable, '-c', script, run, '--output', str(tmp_path / 'a'), '--onnx'],
                           capture_output=True, text=True, env=env, timeout=HANG_SECONDS)
    assert asked.returncode == 2 and asked.stderr.count('\n') == 1, asked.stderr
    assert asked.stderr.startswith('error: --onnx: ONNX export needs the onnx package')
    assert 'pip install -r requirements-onnx-export.txt' in asked.stderr and not (tmp_path / 'a').exists()
    default = subprocess.run([sys.executable, '-c', script, run, '--output', str(tmp_path / 'b')],
                             capture_output=True, text=True, env=env, timeout=HANG_SECONDS)
    assert default.returncode == 0, default.stderr
    notes = [line for line in default.stdout.splitlines() if line.startswith('note:')]
    assert len(notes) == 1 and notes[0].startswith('note: no model.onnx (it predicts without MXNet): ONNX export '
                                                   'needs the onnx package'), default.stdout
    assert sorted(os.listdir(tmp_path / 'b')) == ['model-0000.params', 'model-symbol.json', 'model.json']


def test_providers_choose_onnxruntime_even_where_mxnet_is_installed(trained, tmp_path, capsys):
    # Here (mxnet, no onnxruntime) --providers routes bin/predict to the export's model.onnx
    # on onnxruntime: the one line says what to install for it.
    from gluon_unet.cli import predict_main
    if subprocess.run([sys.executable, '-c', 'import onnxruntime'], capture_output=True,
                      timeout=HANG_SECONDS).returncode == 0:
        pytest.skip('onnxruntime is installed beside mxnet here')
    run, images, _ = trained
    assert predict_main(['--model', run, '--input', images, '--output', str(tmp_path / 'out'),
                         '--providers', 'cpu']) == 2
    err = capsys.readouterr().err
    assert err.startswith('error: onnxruntime is not installed in this Python') and err.count('\n') == 1, err
    assert 'pip install -r requirements-onnx.txt' in err and not (tmp_path / 'out').exists()


def _outputs(folder):
    names = sorted(n for n in os.listdir(folder) if n.endswith('.png'))
    return {n: cv2.imread(os.path.join(folder, n), cv2.IMREAD_UNCHANGED) for n in names}


@pytest.mark.parametrize('flags', [['--mode', 'tile', '--overlay'], ['--mode', 'whole', '--tta', '--cpus', '2'],
                                   ['--mode', 'tile', '--diameter', 'auto']])
def test_predict_without_mxnet_writes_the_same_labels_as_mxnet(trained, flags):
    from gluon_unet.cli import predict_main
    run, images, root = trained
    tag = '-'.join(f.strip('-') for f in flags)
    mx_out, ort_out = str(root / ('mx-' + tag)), str(root / ('ort-' + tag))
    common = ['--model', run, '--input', images, '--no-progress'] + flags
    assert predict_main(common + ['--output', mx_out, '--rle', mx_out + '.csv']) == 0
    done = run_onnx([os.path.join(ROOT, 'bin', 'predict')] + common + ['--output', ort_out, '--rle', ort_out + '.csv'])
    assert done.returncode == 0, done.stderr
    line, = done.stderr.splitlines()  # the one line that says what runs the model
    assert line.startswith('mxnet is not installed: predicting with %s' % os.path.join(run, 'export', ONNX_FILE))
    assert 'on onnxruntime' in line
    expected, got = _outputs(mx_out), _outputs(ort_out)
    assert sorted(got) == sorted(expected) and len(expected) >= 8
    objects = 0
    for name, array in expected.items():
        assert np.array_equal(got[name], array), name
        objects += int(array.max()) if name.endswith('_labels.png') else 0
    assert objects >= 4  # at least one nucleus an image: the comparison is not of empty images
    rows = lambda path: list(csv.reader(open(path)))  # noqa: E731
    assert rows(ort_out + '.csv') == rows(mx_out + '.csv')
    manifest = json.load(open(os.path.join(ort_out, 'gluon_unet-predictions.json')))
    assert manifest['complete'] and manifest['model']['weights_sha256'] == json.load(
        open(os.path.join(mx_out, 'gluon_unet-predictions.json')))['model']['weights_sha256']
    # what ran the network, in the manifest and the summary line (bin/predict prints it on stdout)
    backend = manifest['model']['backend']
    assert backend['name'] == 'onnxruntime' and backend['providers'] == ['CPUExecutionProvider'], backend
    assert ' with onnxruntime %s (CPUExecutionProvider);' % backend['version'] in done.stdout, done.stdout


def test_onnx_environment_errors_are_one_line(trained, tmp_path):
    run, images, _ = trained
    script = textwrap.dedent('''
        import sys
        from gluon_unet.errors import UserError
        from gluon_unet.inference.batched_onnx import parse_providers
        for text, gpus in (('nope', ''), ('cuda', ''), ('', '0')):
            try:
                parse_providers(text, gpus)
                print('accepted', text, gpus)
            except UserError as exc:
                print(exc)
        print(parse_providers('CPU'))
        sys.modules['onnxruntime'] = None  # as if it were not installed
        from gluon_unet.cli import predict_main
        sys.exit(predict_main(sys.argv[1:]))
    ''')
    done = run_onnx(['-c', script, '--model', run, '--input', images, '--output', str(tmp_path / 'out')])
    lines = done.stdout.splitlines()
    assert lines[0].startswith("--providers nope: unknown provider 'nope'; use cpu, cuda, tensorrt")
    assert lines[1].startswith('--providers cuda: this onnxruntime') and 'has no CUDAExecutionProvider' in lines[1]
    assert 'onnxruntime-gpu' in lines[1]
    assert lines[2].startswith('--gpus 0: this onnxruntime') and 'CUDAExecutionProvider' in lines[2]
    assert lines[3] == "[[('CPUExecutionProvider', {})]]"
    assert done.returncode == 2 and done.stderr.count('\n') == 1, done.stderr
    assert done.stderr.startswith('error: mxnet is not installed and onnxruntime is not installed in this Python')
    assert 'pip install -r requirements-onnx.txt' in done.stderr and not os.path.exists(tmp_path / 'out')


# -- an export copied for a machine without MXNet (issue 60, observation 6) ---------------

def _onnx_only_copy(run, folder):
    """What a user copies to a machine without MXNet: the export's model.json + model.onnx."""
    os.makedirs(folder)
    for name in ('model.json', ONNX_FILE):
        shutil.copy2(os.path.join(run, 'export', name), folder)
    return folder


def test_model_json_and_model_onnx_alone_predict_without_mxnet_by_folder_or_file(trained, tmp_path):
    from gluon_unet.cli import predict_main
    run, images, _ = trained
    copy = _onnx_only_copy(run, str(tmp_path / 'copy'))
    common = ['--input', images, '--no-progress', '--mode', 'tile']
    assert predict_main(['--model', run, '--output', str(tmp_path / 'mx')] + common) == 0
    expected, models, onnx_file = _outputs(str(tmp_path / 'mx')), [], os.path.join(copy, ONNX_FILE)
    for given, out in ((copy, str(tmp_path / 'folder')), (onnx_file, str(tmp_path / 'file'))):
        done = run_onnx([os.path.join(ROOT, 'bin', 'predict'), '--model', given, '--output', out] + common)
        assert done.returncode == 0 and done.stderr.count('\n') == 1, done.stderr  # the one line on the runtime
        assert done.stderr.startswith('mxnet is not installed: predicting with %s on onnxruntime' % onnx_file)
        got = _outputs(out)
        assert sorted(got) == sorted(expected) and all(np.array_equal(got[n], expected[n]) for n in expected)
        manifest = json.load(open(os.path.join(out, 'gluon_unet-predictions.json')))
        models.append((manifest['complete'], manifest['model']['export'], manifest['model']['weights_sha256']))
    # Without the params the model is known by its model.onnx: one identity for both ways in.
    assert models[0] == models[1] and models[0][:2] == (True, copy) and models[0][2].startswith('onnx:')
    assert sorted(os.listdir(copy)) == ['model.json', ONNX_FILE]  # nothing added to the user's copy


def test_on_mxnet_model_onnx_names_its_export_and_alone_says_both_ways_on(trained, tmp_path, capsys):
    # A file names the export in its folder; the runtime chooses the files: MXNet's here.
    from gluon_unet.cli import predict_main
    from gluon_unet.inference.batched_onnx import predict_runtime
    from gluon_unet.inference.sidecar import find_export
    run, images, _ = trained
    export, image = os.path.join(run, 'export'), os.path.join(images, 'img0.png')
    for name in (ONNX_FILE, 'model.json', 'model-0000.params', 'model-symbol.json'):
        assert find_export(os.path.join(export, name)) == os.path.join(export, 'model')
    assert predict_main(['--model', os.path.join(export, ONNX_FILE), '--input', image, '--output',
                         str(tmp_path / 'out'), '--no-progress']) == 0
    record = json.load(open(str(tmp_path / 'out' / 'gluon_unet-predictions.json')))['model']
    assert record['export'] == export and not record['weights_sha256'].startswith('onnx:')  # MXNet's weights
    capsys.readouterr()
    # Another .onnx, a missing model.onnx, model.onnx without MXNet's files: one line each.
    ort_here = subprocess.run([sys.executable, '-c', 'import onnxruntime'], capture_output=True,
                              timeout=HANG_SECONDS).returncode == 0
    (tmp_path / 'other.onnx').write_bytes(open(os.path.join(export, ONNX_FILE), 'rb').read())
    copy = _onnx_only_copy(run, str(tmp_path / 'copy'))
    for given, words in ((str(tmp_path / 'other.onnx'), ["an export's model.onnx is read beside its model.json"]),
                         (str(tmp_path / 'gone' / ONNX_FILE), ['no such file']),
                         (copy, [] if ort_here else [copy, 'copy those beside it', 'requirements-onnx.txt'])):
        assert predict_main(['--model', given, '--input', image, '--output', str(tmp_path / 'no')]) == 2
        err = capsys.readouterr().err
        assert err.count('\n') == 1 and 'Traceback' not in err and all(w in err for w in words), err
    assert not (tmp_path / 'no').exists() and sorted(os.listdir(copy)) == ['model.json', ONNX_FILE]
    # Told the model, the runtime choice is onnxruntime, saying why (and how to run MXNet instead).
    runtime, why = predict_runtime(None, copy)
    assert runtime == 'onnx' and why.startswith('the export %s has model.onnx but not MXNet' % copy), why
    assert predict_runtime(None, run) == ('mxnet', '')


def _edit_sidecar(folder, **keys):
    """Replace keys of ``folder``'s model.json (None: remove), as a user edits it."""
    meta = json.load(open(os.path.join(folder, 'model.json')))
    meta.update(keys)
    json.dump({k: v for k, v in meta.items() if v is not None}, open(os.path.join(folder, 'model.json'), 'w'))


def test_damaged_model_onnx_advice_works_on_the_onnx_path(trained, tmp_path):
    # Follow the line bin/predict prints for an altered model.onnx, on the machine without MXNet.
    from onnx import numpy_helper
    run, images, _ = trained
    predict = [os.path.join(ROOT, 'bin', 'predict'), '--input', os.path.join(images, 'img0.png'), '--no-progress']
    # 1. A weight changed on purpose, in a whole export: ways on that work here; the last one followed.
    changed = str(tmp_path / 'changed')
    shutil.copytree(os.path.join(run, 'export'), changed)
    model = onnx.load(os.path.join(changed, ONNX_FILE))
    weight = model.graph.initializer[0]
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * np.float32(1.01), weight.name))
    onnx.save(model, os.path.join(changed, ONNX_FILE))
    done = run_onnx(predict + ['--model', changed, '--output', str(tmp_path / 'a')])
    assert done.returncode == 1 and done.stderr.startswith('error: %s is damaged' % os.path.join(changed, ONNX_FILE))
    assert 'copy it again from the export it came from' in done.stderr and 'export it again' not in done.stderr
    assert 'remove "digest" from model.json if you changed it on purpose' in done.stderr, done.stderr
    assert done.stderr.count('\n') == 1, done.stderr
    _edit_sidecar(changed, digest=None)
    done = run_onnx(predict + ['--model', changed, '--output', str(tmp_path / 'a')])
    assert done.returncode == 0 and os.path.isfile(str(tmp_path / 'a' / 'img0_labels.png')), done.stderr
    # 2. model.onnx cut short by a bad copy: without the digest, onnxruntime's refusal says what is left.
    cut = _onnx_only_copy(run, str(tmp_path / 'cut'))
    path = os.path.join(cut, ONNX_FILE)
    os.truncate(path, os.path.getsize(path) // 2)
    done = run_onnx(predict + ['--model', cut, '--output', str(tmp_path / 'b')])
    assert done.returncode == 1 and 'is damaged' in done.stderr and 'copy it again' in done.stderr, done.stderr
    _edit_sidecar(cut, digest=None)
    done = run_onnx(predict + ['--model', cut, '--output', str(tmp_path / 'b')])
    assert done.returncode == 2 and done.stderr.count('\n') == 1 and not (tmp_path / 'b').exists(), done.stderr
    assert done.stderr.startswith('error: %s: onnxruntime cannot load it' % path)
    assert done.stderr.rstrip().endswith('copy it again from the export it came from, or write it again where '
                                         'mxnet is installed (bin/export RUN --onnx)')
    _edit_sidecar(changed, digest={'model-0000.params': 'crc32:0'})  # model.onnx's entry removed: the same
    assert onnx_path(changed)[0] == os.path.join(changed, ONNX_FILE)


@pytest.mark.parametrize('name', __import__('gluon_unet.models', fromlist=['names']).names())
def test_each_shipped_model_gives_the_same_labels_on_mxnet_and_onnxruntime(name, tmp_path):
    # The shipped models are what a new user runs first, in either environment.
    from gluon_unet.cli import predict_main
    from gluon_unet.data.synthetic import synthetic_nuclei
    images = tmp_path / 'images'
    images.mkdir()
    pictures, _, _ = synthetic_nuclei(3, size=160, seed=7, max_nuclei=15)
    for i, picture in enumerate(pictures):
        cv2.imwrite(str(images / ('n%d.png' % i)), picture)
    mx_out, ort_out = str(tmp_path / 'mx'), str(tmp_path / 'ort')
    common = ['--model', name, '--input', str(images), '--no-progress']
    assert predict_main(common + ['--output', mx_out]) == 0
    done = run_onnx([os.path.join(ROOT, 'bin', 'predict')] + common + ['--output', ort_out])
    assert done.returncode == 0, done.stderr
    assert 'on onnxruntime' in done.stderr
    expected, got = _outputs(mx_out), _outputs(ort_out)
    assert sorted(got) == sorted(expected) and len(expected) == 6
    for key, array in expected.items():
        assert np.array_equal(got[key], array), key
    assert all(int(a.max()) >= 3 for k, a in expected.items() if k.endswith('_labels.png'))  # nuclei found
