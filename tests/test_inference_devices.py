"""How inference spreads work over the devices (CPU contexts stand in for GPUs): whole-mode
images round-robin with every device busy, TTA passes grouped by shape (issue 17 item 2)."""
import itertools

import mxnet as mx
import numpy as np

from gluon_unet.config import ModelConfig
from gluon_unet.data.synthetic import synthetic_nuclei
from gluon_unet.inference.batched import image_jobs, predict_image, run_jobs
from gluon_unet.model import build_model
from gluon_unet.inference.tiling import DIHEDRAL, dihedral, undihedral

CPUS = [mx.cpu(0), mx.cpu(1), mx.cpu(2)]
META = {'train_size': 32, 'multiple': 4, 'resize_mode': 'crop'}
#: (H, W) of the images of one run: all different, some non-square.
SHAPES = [(40, 36), (28, 44), (48, 48), (33, 29), (52, 40), (36, 60), (44, 28)]


class CountingNet:
    """Wraps a block; records the context and shape of every forward call."""

    def __init__(self, net):
        self.net, self.calls = net, []

    def __call__(self, x):
        self.calls.append((x.context, tuple(x.shape)))
        return self.net(x)


def _net(depth=2):
    mx.random.seed(0)
    net = build_model(ModelConfig(in_channels=1, width=8, depth=depth, batch_norm=False))
    net.initialize(mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2), ctx=CPUS)
    net.hybridize(static_alloc=True)  # as load_model does
    return net


def _images():
    big = synthetic_nuclei(1, size=64, channels=1, seed=7)[0][0]
    return [np.ascontiguousarray(big[:h, 64 - w:]) for h, w in SHAPES]


def _predict_all(net, ctxs, images, mode='whole', tta=False, batch_size=8):
    out = {}
    jobs = itertools.chain.from_iterable(
        image_jobs(img, META, mode, tta, on_done=lambda prob, used, i=i: out.setdefault(i, prob))
        for i, img in enumerate(images))
    runner = run_jobs(net, ctxs, jobs, batch_size)
    return [out[i] for i in range(len(images))], runner


def test_whole_mode_images_go_round_robin_to_every_device_with_the_same_results():
    net, images = _net(), _images()
    single, _ = _predict_all(net, CPUS[:1], images)
    counting = CountingNet(net)
    spread, runner = _predict_all(counting, CPUS, images)
    # one image per forward (every shape differs), device k gets image k mod 3
    assert [ctx for ctx, _ in counting.calls] == [CPUS[i % 3] for i in range(len(images))]
    assert runner.jobs_per_device == [3, 2, 2] and runner.forwards_per_device == [3, 2, 2]
    for a, b, img in zip(single, spread, images):
        assert a.shape == b.shape == (1,) + img.shape[:2]  # (K, H, W) maps, K = 1 here
        assert np.abs(a - b).max() < 1e-5
    # a batch goes on from the device after the last one used: 2 whole images, then the
    # 8 TTA inputs of a square image in batches of 4, each split 2-1-1 over 3 devices
    counting.calls.clear()
    jobs = itertools.chain(image_jobs(images[0], META, 'whole', on_done=lambda *a: None),
                           image_jobs(images[1], META, 'whole', on_done=lambda *a: None),
                           image_jobs(images[2], META, 'whole', tta=True, on_done=lambda *a: None))
    run_jobs(counting, CPUS, jobs, batch_size=4)
    assert [(ctx.device_id, shape[0]) for ctx, shape in counting.calls] == \
        [(0, 1), (1, 1), (2, 2), (0, 1), (1, 1), (2, 2), (0, 1), (1, 1)]


def test_tta_on_a_non_square_image_makes_two_batches_one_per_shape():
    net = _net()
    image = _images()[5]  # 36 x 60
    ref = np.mean([undihedral(predict_image(net, META, np.ascontiguousarray(dihedral(image[..., 0], k, f)),
                                            CPUS[:1], mode='whole'), k, f) for k, f in DIHEDRAL], axis=0)
    for ctxs, batch_size in ((CPUS[:1], 8), (CPUS[:2], 8), (CPUS, 3)):
        counting = CountingNet(net)
        prob = predict_image(counting, META, image, ctxs, mode='whole', tta=True, batch_size=batch_size)
        shapes = [shape[2:] for _, shape in counting.calls]
        assert set(shapes) == {(36, 60), (60, 36)}
        # grouped: all (H, W) inputs first, then all (W, H); never back and forth
        assert sum(a != b for a, b in zip(shapes, shapes[1:])) == 1, shapes
        assert sum(shape[0] for _, shape in counting.calls) == 8
        assert np.abs(prob - ref).max() < 1e-5


def test_work_stays_in_flight_on_every_device(monkeypatch):
    """Every device's forward is issued before the first result is read back."""
    net, images = _net(), _images()
    events = []
    counting = CountingNet(net)
    real_call = counting.__call__

    def call(x):
        events.append(('forward', x.context.device_id))
        return real_call(x)
    counting.__call__ = call
    real_asnumpy = mx.nd.NDArray.asnumpy

    def asnumpy(self):
        events.append(('read', self.context.device_id))
        return real_asnumpy(self)
    monkeypatch.setattr(mx.nd.NDArray, 'asnumpy', asnumpy)
    _predict_all(lambda x: call(x), CPUS, images[:5])
    assert events[:4] == [('forward', 0), ('forward', 1), ('forward', 2), ('forward', 0)]
    # results are read in the order they were issued
    assert [d for e, d in events if e == 'read'] == [0, 1, 2, 0, 1]


def test_buckets_give_fewer_shapes_and_the_same_masks():
    """Whole mode with buckets: the padding is cropped away exactly; pixels farther than
    the depth-2 net's receptive field (measured: differences end within 24 px) are
    unchanged, the border ones see more reflected context."""
    net = _net()
    big = synthetic_nuclei(1, size=160, channels=1, seed=3)[0][0]
    images = [np.ascontiguousarray(big[:h, :w]) for h, w in ((130, 147), (135, 150), (141, 155), (100, 157))]
    runs = {}
    for buckets in (False, True):
        counting = CountingNet(net)
        out = {}
        jobs = itertools.chain.from_iterable(
            image_jobs(img, META, 'whole', buckets=buckets, on_done=lambda p, u, i=i: out.setdefault(i, p))
            for i, img in enumerate(images))
        run_jobs(counting, CPUS[:2], jobs)
        runs[buckets] = ([out[i] for i in range(len(images))], [s for _, s in counting.calls])
    (plain, plain_calls), (bucketed, bucket_calls) = runs[False], runs[True]
    assert len({s[2:] for s in plain_calls}) == 4 and len(plain_calls) == 4
    # 3 images share the (144, 160) bucket: one batch of 3, split 2 + 1 over the devices
    assert bucket_calls == [(2, 1, 144, 160), (1, 1, 144, 160), (1, 1, 104, 160)]
    for a, b, img in zip(plain, bucketed, images):
        assert a.shape == b.shape == (1,) + img.shape[:2]
        assert np.abs(a - b)[:, 24:-24, 24:-24].max() < 1e-5
        assert ((a > 0.5) != (b > 0.5)).mean() < 0.01
