"""The U-Net block: shapes, hybridized == imperative, clear input errors, no NaNs."""
import mxnet as mx
import numpy as np
import pytest

from gluon_unet.config import ModelConfig
from gluon_unet.errors import UserError
from gluon_unet.model import build_model, flops_per_image


@pytest.mark.parametrize('upsample, batch_norm, classes', [
    ('deconv', True, 1), ('bilinear', False, 1), ('deconv', True, 3)])
def test_shapes_and_hybridized_equals_imperative(upsample, batch_norm, classes):
    cfg = ModelConfig(in_channels=3, classes=classes, width=4, depth=3, batch_norm=batch_norm,
                      upsample=upsample, dropout=0.2)
    net = build_model(cfg)
    net.initialize(mx.init.Xavier())
    x = mx.nd.random.uniform(shape=(2, 3, 32, 48))
    with mx.autograd.predict_mode():
        imperative = net(x).asnumpy()
        net.hybridize(static_alloc=True, static_shape=True)
        hybrid = net(x).asnumpy()
    assert imperative.shape == (2, classes, 32, 48)
    assert np.isfinite(imperative).all()
    np.testing.assert_allclose(hybrid, imperative, atol=1e-5)


def test_training_mode_gradients_are_finite():
    net = build_model(ModelConfig(in_channels=1, width=4, depth=2))
    net.initialize(mx.init.Xavier())
    x = mx.nd.random.uniform(shape=(2, 1, 16, 16))
    with mx.autograd.record():
        loss = net(x).mean()
    loss.backward()
    grads = [p.grad().asnumpy() for p in net.collect_params().values() if p.grad_req != 'null']
    assert all(np.isfinite(g).all() for g in grads)
    assert any(np.abs(g).sum() > 0 for g in grads)


@pytest.mark.parametrize('shape, words', [((1, 1, 30, 32), 'divisible by 2**depth = 4'),
                                          ((1, 3, 32, 32), 'expects input (N, 1, H, W)')])
def test_bad_input_shapes_are_one_line_errors(shape, words):
    net = build_model(ModelConfig(in_channels=1, width=4, depth=2))
    net.initialize()
    with pytest.raises(UserError, match=r'.*' + words.replace('(', r'\(').replace(')', r'\)').replace('*', r'\*')):
        net(mx.nd.zeros(shape))


def test_flops_count_matches_a_hand_count():
    # depth 1, width 2, 1 input channel, 4x4, deconv: encoder 16*9*(1*2+2*2), bottom 4*9*(2*4+4*4),
    # up-conv 16*4*(2*2*2), decoder 16*9*(2*2*2+2*2), head 16*2*1 -> x2 for multiply-add.
    cfg = ModelConfig(in_channels=1, width=2, depth=1)
    hand = 16 * 9 * 6 + 4 * 9 * 24 + 16 * 4 * 8 + 16 * 9 * 12 + 32
    assert flops_per_image(cfg, 4) == 2 * hand


@pytest.mark.parametrize('hybridize', [False, True])
def test_transposed_conv_as_1x1_conv_equals_conv2d_transpose(hybridize):
    # The bfloat16 stand-in for Conv2DTranspose(k=2, s=2): same function, same gradients,
    # and the same parameters, so a checkpoint loads into either.
    from gluon_unet.machine.onednn import TransposedConv2x2
    x = mx.nd.random.uniform(shape=(2, 6, 5, 7))
    ref = mx.gluon.nn.Conv2DTranspose(3, 2, strides=2, in_channels=6)
    ours = TransposedConv2x2(3, in_channels=6)
    ref.initialize(mx.init.Xavier())
    ours.initialize()
    ref.bias.set_data(mx.nd.random.uniform(shape=(3,)))
    for name in ('weight', 'bias'):
        assert getattr(ours, name).shape == getattr(ref, name).shape
        getattr(ours, name).set_data(getattr(ref, name).data())
    if hybridize:
        ours.hybridize(static_alloc=True)
    results = []
    for block in (ref, ours):
        xg = x.copy()
        xg.attach_grad()
        with mx.autograd.record():
            y = block(xg)
            loss = (y * mx.nd.arange(y.size).reshape(y.shape)).sum()  # position-dependent
        loss.backward()
        results.append((y.asnumpy(), xg.grad.asnumpy(), block.weight.grad().asnumpy(),
                        block.bias.grad().asnumpy()))
    assert results[0][0].shape == (2, 3, 10, 14)
    for a, b in zip(*results):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize('amp_dtype, stand_in', [(None, False), ('float16', False), ('bfloat16', True)])
def test_amp_dtype_is_explicit_and_chooses_the_upsampling_block(amp_dtype, stand_in):
    # The network is told the AMP dtype through its layers (no peeking at MXNet's private
    # AMP state): only bfloat16 (on CPUs) needs the 1x1 stand-in for Deconvolution;
    # float16 (cuDNN, on GPUs) and float32 use Deconvolution.
    from gluon_unet.config import TrainConfig
    from gluon_unet.machine.onednn import TransposedConv2x2
    from gluon_unet.training.step import network_layers
    cfg = TrainConfig(model=ModelConfig(in_channels=1, width=4, depth=2))
    ctxs = [mx.gpu(0)] if amp_dtype == 'float16' else [mx.cpu(0)]  # only the device type is read
    net = build_model(cfg.model, network_layers(cfg, ctxs, amp_dtype))
    ups = [block.up for block in net.up]
    assert all(isinstance(u, TransposedConv2x2) == stand_in for u in ups)
    assert all(isinstance(u, mx.gluon.nn.Conv2DTranspose) != stand_in for u in ups)
    assert all(block.join.multicast == (amp_dtype is not None) for block in net.up)
    # The same structural parameter names (what checkpoints store) either way.
    plain = build_model(ModelConfig(in_channels=1, width=4, depth=2))
    assert sorted(net._collect_params_with_prefix()) == sorted(plain._collect_params_with_prefix())


@pytest.mark.parametrize('hybridize', [True, False])
def test_fused_batchnorm_relu_is_the_same_function_with_the_same_parameter_names(hybridize):
    # Training on CPU builds the network with nn.BatchNormReLU (one oneDNN kernel); exports
    # and GPUs build it without: outputs, gradients, running statistics and the structural
    # names that checkpoints store must agree.
    from mxnet.gluon import nn
    from conftest import unet_twin
    from gluon_unet.machine.onednn import OneDNNLayers
    from gluon_unet.model import Layers
    x = mx.nd.array(np.random.RandomState(0).randn(2, 1, 16, 16))
    results, names = [], []
    for fuse in (False, True):
        net, structural, y, dx = unet_twin(0, x, hybridize, in_channels=1, width=4, depth=2,
                                           layers=OneDNNLayers(Layers(), training=fuse))
        params = net._collect_params_with_prefix()
        names.append(structural)
        results.append([y, dx, net(x).asnumpy()]  # the last: inference mode
                       + [params[k].data().asnumpy() for k in sorted(params) if 'running' in k]
                       + [params[k].grad().asnumpy() for k in sorted(params) if params[k].grad_req != 'null'])
        fused = sum(isinstance(b, nn.BatchNormReLU) for b in net.down[0].body)
        assert fused == (2 if fuse else 0)
    assert names[0] == names[1]
    for a, b in zip(*results):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_the_training_network_fuses_batchnorm_relu_on_cpu_and_an_export_does_not():
    from mxnet.gluon import nn
    from gluon_unet.config import TrainConfig
    from gluon_unet.training.step import build_network
    cfg = TrainConfig(model=ModelConfig(in_channels=1, width=4, depth=2), size=16, batch_size=2, progress=False)
    net = build_network(cfg, [mx.cpu(0), mx.cpu(1)])
    assert isinstance(net.down[0].body[1], nn.BatchNormReLU)
    # checkpoint.py and the export build the network as build_model(cfg.model) does
    assert not any(isinstance(b, nn.BatchNormReLU) for b in build_model(cfg.model).down[0].body)
    # The skips' identity for oneDNN's gradient sums: bfloat16 training on CPU only
    # (tests/test_amx.py checks what it does)
    from gluon_unet.machine.onednn import OneDNNLayers
    from gluon_unet.model import Layers

    def skips_blocked(layers):
        return [getattr(up.join, 'skip_blocked', False) for up in build_model(cfg.model, layers).up]
    assert not any(getattr(up.join, 'skip_blocked', False) for up in net.up)  # float32
    assert all(skips_blocked(OneDNNLayers(Layers(amp=True), bfloat16=True, training=True)))
    assert not any(skips_blocked(OneDNNLayers(Layers(amp=True), bfloat16=True)))
    # SyncBatchNorm is not fused
    synced = build_network(TrainConfig(model=ModelConfig(in_channels=1, width=4, depth=2), sync_bn=True),
                           [mx.cpu(0), mx.cpu(1)])
    assert not any(isinstance(b, nn.BatchNormReLU) for b in synced.down[0].body)


def test_build_network_initializes_what_a_forward_pass_would_without_running_the_network():
    # build_network infers the deferred shapes symbolically (a forward pass left oneDNN
    # kernels for a batch of one cached, with their scratch memory); a seed must still
    # give the weights Gluon's own deferred initialization by a forward pass gives.
    from gluon_unet.config import TrainConfig
    from gluon_unet.training.step import build_network
    cfg = TrainConfig(model=ModelConfig(in_channels=3, width=4, depth=3), size=32, progress=False)
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net = build_network(cfg, ctxs)
    assert net._cached_op is None  # hybridized, never run
    mx.random.seed(cfg.seed)
    ref = build_model(cfg.model)
    ref.initialize(mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2), ctx=ctxs)
    ref.hybridize(static_alloc=True, static_shape=True)
    with mx.autograd.predict_mode():
        ref(mx.nd.zeros((1, 3, 32, 32), ctx=ctxs[0])).wait_to_read()
    got, want = net._collect_params_with_prefix(), ref._collect_params_with_prefix()
    assert sorted(got) == sorted(want)
    for name, p in want.items():
        for ctx in ctxs:
            np.testing.assert_array_equal(got[name].data(ctx).asnumpy(), p.data(ctx).asnumpy(), err_msg=name)
