"""The Python API for experiments: callbacks see the network and the run state."""
import numpy as np

from gluon_unet.training.loop import EpochContext, fit
from hang import HANG_SECONDS


class Recorder:
    """A callback object: keeps a weight norm per epoch and stops after epoch 2."""

    def __init__(self):
        self.seen = []

    def on_epoch_end(self, record, context):
        assert isinstance(context, EpochContext)
        w = context.net.collect_params()
        first = next(iter(w.values())).data(context.ctxs[0]).asnumpy()
        self.seen.append((record['epoch'], context.state.epoch, context.state.step,
                          float(np.abs(first).sum()), context.trainer.learning_rate, context.output))
        return record['epoch'] == 2


def test_callback_objects_get_the_network_and_the_run_state(tiny):
    rec, plain = Recorder(), []
    history = fit(tiny(epochs=4, synthetic_count=16, batch_size=4, val_split=0.25), verbose=False,
                  callbacks=[rec, plain.append])
    assert [r['epoch'] for r in history] == [1, 2]  # the object asked to stop after epoch 2
    assert [e for e, *_ in rec.seen] == [1, 2] and [s for _, s, *_ in rec.seen] == [1, 2]
    assert [st for _, _, st, *_ in rec.seen] == [3, 6]  # optimizer steps so far: 12 images, batch 4
    assert rec.seen[0][3] != rec.seen[1][3]  # the weights it read are the live, training ones
    assert rec.seen[0][5] == history.output
    assert [r['epoch'] for r in plain] == [1, 2]  # plain functions still get the record


class TinyNet(__import__('mxnet').gluon.HybridBlock):
    """Not a U-Net: two convolutions, same H and W in and out."""

    def __init__(self, **kw):
        super().__init__(**kw)
        from mxnet.gluon import nn
        with self.name_scope():
            self.body = nn.HybridSequential()
            self.body.add(nn.Conv2D(6, 3, padding=1, activation='relu'), nn.Conv2D(1, 3, padding=1))

    def hybrid_forward(self, F, x):
        return self.body(x)


def test_fit_trains_checkpoints_and_exports_your_own_hybridblock(tiny, tmp_path):
    import subprocess
    import sys
    import mxnet as mx
    from gluon_unet.errors import UserError
    import pytest
    net = TinyNet()
    cfg = tiny(epochs=3, cpus=2, synthetic_count=16, batch_size=4, val_split=0.25, lr=1e-2)
    history = fit(cfg, verbose=False, net=net)
    assert len(history) == 3 and history[-1]['train_loss'] < history[0]['train_loss']
    best = max(history, key=lambda r: r['val_iou'])
    # The export is the user's network with the best epoch's weights, loadable alone.
    prefix = history.output + '/export/model'
    code = ('import mxnet as mx, numpy as np, sys; net = mx.gluon.SymbolBlock.imports(sys.argv[1] + "-symbol.json", '
            '["data"], sys.argv[1] + "-0000.params"); x = mx.nd.array(np.load(sys.argv[2])); '
            'np.save(sys.argv[3], net(x).asnumpy())')
    x = np.random.RandomState(0).rand(2, 1, 32, 32).astype(np.float32)
    np.save(str(tmp_path / 'x.npy'), x)
    done = subprocess.run([sys.executable, '-c', code, prefix, str(tmp_path / 'x.npy'), str(tmp_path / 'y.npy')],
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stderr
    rebuilt = TinyNet()
    rebuilt.initialize()
    rebuilt(mx.nd.array(x))
    from gluon_unet.checkpoint import load_checkpoint
    meta = load_checkpoint(history.output + '/checkpoints/best.ckpt', net=rebuilt)
    assert meta['epoch'] == best['epoch']
    np.testing.assert_allclose(np.load(str(tmp_path / 'y.npy')), rebuilt(mx.nd.array(x)).asnumpy(), atol=1e-5)
    with pytest.raises(UserError, match='own network'):
        fit(tiny(epochs=1, amp=True, output=str(tmp_path / 'amp')), verbose=False, net=TinyNet())


def test_the_export_carries_a_model_card_and_predict_prints_it(tiny, tmp_path):
    import json
    import os
    import platform
    import mxnet as mx
    import gluon_unet
    from gluon_unet.inference.predict import predict_paths
    from gluon_unet.inference.postprocess import settings_text
    from gluon_unet.data.synthetic import synthetic_nuclei
    import cv2
    history = fit(tiny(epochs=2, val_split=0.25), verbose=False)
    meta = json.load(open(os.path.join(history.output, 'export', 'model.json')))
    card = meta['card']
    assert (card['gluon_unet'], card['mxnet'], card['python']) == (gluon_unet.__version__, mx.__version__,
                                                                   platform.python_version())
    assert card['data']['train_images'] == 18 and card['data']['val_images'] == 6
    assert len(card['data']['content_sha1']) == 40 and card['data']['path'].startswith('generated demo nuclei')
    best = max(history, key=lambda r: r['val_iou'])
    assert card['best_epoch'] == best['epoch'] and card['best_metrics']['val_iou'] == best['val_iou']
    assert card['created'].endswith('Z')
    # The search ran after training (val_split): the card tells its winners, which
    # bin/predict uses, not the config's threshold it replaced.
    tuned = meta['postprocess']
    assert card['postprocess']['threshold'] == tuned['threshold']
    assert card['postprocess']['instances'] == 'marker watershed on the distance transform'
    assert card['postprocess']['chosen'] == 'searched on 6 validation images: %s' % settings_text(tuned)
    images, _, _ = synthetic_nuclei(2, size=32, channels=1, seed=9)
    os.makedirs(str(tmp_path / 'in'))
    for i, im in enumerate(images):
        cv2.imwrite(str(tmp_path / 'in' / ('a%d.png' % i)), im)
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        predict_paths(history.output, str(tmp_path / 'in'), str(tmp_path / 'out'), progress=True)
    first = out.getvalue().splitlines()[0]
    assert first.startswith('model: gluon_unet %s, trained ' % gluon_unet.__version__)
    assert 'generated demo nuclei' in first and 'best epoch %d' % best['epoch'] in first
