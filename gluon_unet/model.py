"""The U-Net (Ronneberger et al. 2015) as a pure Gluon HybridBlock: config in, block out.

The architecture only. Its pieces - the BatchNorm and ReLU after each convolution, the
upsampling, the join of a skip - come from a :class:`Layers` object, the plain Gluon
layers by default (what GPUs and every export use). Training passes the variant the
devices need: SyncBatchNorm, AMP's casts, or on CPUs the oneDNN rewrites of
:mod:`gluon_unet.machine.onednn`, which keep the same function and parameter names so
that checkpoints move between them.
"""
import contextlib

import mxnet as mx
from mxnet.gluon import nn
from mxnet.gluon.contrib.nn import SyncBatchNorm

from .errors import UserError


class Layers:
    """The U-Net's replaceable pieces, as plain Gluon layers.

    Parameters
    ----------
    sync_bn_devices : int
        When > 0, BatchNorm is ``SyncBatchNorm`` synchronized over this many devices.
    amp : bool
        The network trains under AMP (``amp.init`` done): a skip and the upsampled map
        are cast to one dtype before they are joined (MXNet's AMP lists do not make
        Concat cast to the widest type).
    """

    def __init__(self, sync_bn_devices=0, amp=False):
        self.sync_bn_devices, self.amp = sync_bn_devices, amp

    def norm(self):
        """A BatchNorm (synchronized across devices with ``sync_bn_devices``)."""
        return SyncBatchNorm(num_devices=self.sync_bn_devices) if self.sync_bn_devices else nn.BatchNorm()

    def norm_relu(self, channels, in_channels, second, batch_norm):
        """``(norm or None, relu)`` after a :class:`DoubleConv`'s first or ``second`` 3x3
        convolution of ``channels``, the block being fed ``in_channels``."""
        return (self.norm() if batch_norm else None), nn.Activation('relu')

    def upsample(self, channels, mode):
        """The decoder's upsampling to ``channels`` from ``2 * channels``: a 2x2 transposed
        convolution (``'deconv'``), or the 3x3 convolution after a bilinear resize."""
        if mode == 'deconv':
            return nn.Conv2DTranspose(channels, kernel_size=2, strides=2, in_channels=2 * channels)
        # Resize + conv avoids the checkerboard artefacts of transposed convs.
        return nn.Conv2D(channels, 3, padding=1)

    def join(self, channels, mode, batch_norm):
        """The block that concatenates the upsampled map and the skip of ``channels``."""
        return Join(self.amp)


class Join(nn.HybridBlock):
    """``concat(upsampled, skip)`` on the channel axis; under AMP both are cast to one
    dtype first (MXNet keeps Deconvolution in float32 while the skip is in the AMP dtype)."""

    def __init__(self, multicast=False, **kwargs):
        super().__init__(**kwargs)
        self.multicast = multicast

    def hybrid_forward(self, F, x, skip):
        if self.multicast:
            x, skip = F.amp_multicast(x, skip, num_outputs=2)
        return F.concat(x, skip, dim=1)


class DoubleConv(nn.HybridBlock):
    """(3x3 conv -> [BatchNorm] -> ReLU) x 2, 'same' padding so skip shapes match."""

    def __init__(self, channels, in_channels, batch_norm, layers, **kwargs):
        super().__init__(**kwargs)
        self.body = nn.HybridSequential()
        for second in (False, True):
            # A bias in front of BatchNorm is cancelled by its mean subtraction.
            self.body.add(nn.Conv2D(channels, 3, padding=1, use_bias=not batch_norm))
            norm, relu = layers.norm_relu(channels, in_channels, second, batch_norm)
            if norm is not None:
                self.body.add(norm)
            self.body.add(relu)

    # What the symbolic training graph recomputes in backward (see :func:`recompute`);
    # None: nothing. Read only while a symbol is built: CachedOp ignores the attribute.
    recompute = None

    def hybrid_forward(self, F, x):
        if F is not mx.sym or self.recompute is None:
            return self.body(x)
        layers = list(self.body)
        for i, layer in enumerate(layers):
            # 'blocks': everything but the block's output is recomputed from the block's
            # input, so backward keeps one tensor per block instead of ~6 (the skips and
            # the pooled inputs are such outputs). 'activations': only BatchNorm and ReLU
            # (cheap, memory-bound), not the convolutions - MXNet's own
            # MXNET_BACKWARD_DO_MIRROR=1 choice, which Gluon's CachedOp never applies.
            mirror = i < len(layers) - 1 if self.recompute == 'blocks' else not isinstance(layer, nn.Conv2D)
            with mx.AttrScope(force_mirroring=str(mirror)):
                x = layer(x)
        return x


class Up(nn.HybridBlock):
    """Double the resolution and halve the channels, join the skip, then a :class:`DoubleConv`."""

    def __init__(self, channels, mode, batch_norm, layers, **kwargs):
        super().__init__(**kwargs)
        self.mode = mode
        self.up = layers.upsample(channels, mode)
        self.conv = DoubleConv(channels, 2 * channels, batch_norm, layers)
        self.join = layers.join(channels, mode, batch_norm)

    # 'blocks' (see :func:`recompute`): the upsampling and the concatenation are
    # recomputed too, so the concatenated input (2x the block's channels at full
    # resolution) is not kept from forward to backward.
    recompute = None

    def hybrid_forward(self, F, x, skip):
        mirrored = F is mx.sym and self.recompute == 'blocks'
        with mx.AttrScope(force_mirroring='True') if mirrored else contextlib.nullcontext():
            if self.mode == 'bilinear':
                x = F.contrib.BilinearResize2D(x, scale_height=2., scale_width=2.)
            x = self.join(self.up(x), skip)
        return self.conv(x)


class UNet(nn.HybridBlock):
    """U-Net for 2-D segmentation.

    Parameters
    ----------
    in_channels : int
        Channels of the input image.
    classes : int
        Output channels: 1 for a binary mask (logits, sigmoid applied by the loss),
        more for softmax classes.
    width : int
        Filters at the first level; level ``i`` has ``width * 2**i``.
    depth : int
        Number of poolings. Input sides must be divisible by ``2**depth``.
    batch_norm : bool
        BatchNorm after each convolution.
    dropout : float
        Dropout rate at the bottleneck (0 disables it).
    upsample : {'deconv', 'bilinear'}
        Decoder upsampling.
    layers : Layers, optional
        How the pieces are built (default: plain :class:`Layers`). Every variant gives
        the same function with the same parameters.

    Input ``(N, in_channels, H, W)``; output logits ``(N, classes, H, W)``.
    """

    def __init__(self, in_channels=1, classes=1, width=32, depth=4, batch_norm=True,
                 dropout=0.0, upsample='deconv', layers=None, **kwargs):
        super().__init__(**kwargs)
        self.in_channels, self.depth = in_channels, depth
        layers = layers or Layers()
        with self.name_scope():
            self.down = nn.HybridSequential()
            for level in range(depth):
                self.down.add(DoubleConv(width * 2 ** level, width * 2 ** (level - 1) if level else in_channels,
                                         batch_norm, layers))
            self.pool = nn.MaxPool2D(2, 2)
            self.bottom = DoubleConv(width * 2 ** depth, width * 2 ** (depth - 1), batch_norm, layers)
            self.drop = nn.Dropout(dropout) if dropout > 0 else None
            self.up = nn.HybridSequential()
            for level in reversed(range(depth)):
                self.up.add(Up(width * 2 ** level, upsample, batch_norm, layers))
            self.head = nn.Conv2D(classes, 1)

    def forward(self, x, *args):
        # Checked here, not in hybrid_forward, because symbols have no shapes; a wrong
        # size would otherwise fail deep inside Concat with an unreadable message.
        shape = getattr(x, 'shape', None)
        if shape is not None:
            if len(shape) != 4 or shape[1] != self.in_channels:
                raise UserError('UNet expects input (N, %d, H, W), got %s'
                                % (self.in_channels, tuple(shape)))
            m = 2 ** self.depth
            if shape[2] % m or shape[3] % m:
                raise UserError('UNet input %dx%d: height and width must be divisible by '
                                '2**depth = %d (depth %d)' % (shape[2], shape[3], m, self.depth))
        return super().forward(x, *args)

    # 'blocks' (see :func:`recompute`): the pooled block outputs are recomputed from
    # the skips (kept anyway) instead of being kept too.
    recompute = None

    def hybrid_forward(self, F, x):
        skips = []
        mirrored = F is mx.sym and self.recompute == 'blocks'
        for block in self.down:
            x = block(x)
            skips.append(x)
            with mx.AttrScope(force_mirroring='True') if mirrored else contextlib.nullcontext():
                x = self.pool(x)
        x = self.bottom(x)
        if self.drop is not None:
            x = self.drop(x)
        for block, skip in zip(self.up, reversed(skips)):
            x = block(x, skip)
        return self.head(x)


def foreground_probability(logits):
    """Foreground probability ``(N, H, W)`` from U-Net logits ``(N, C, H, W)``: the
    sigmoid of a single class, else 1 - P(background) under a softmax."""
    if logits.shape[1] == 1:
        return mx.nd.sigmoid(logits)[:, 0]
    return 1 - mx.nd.softmax(logits, axis=1)[:, 0]


def probability_maps(logits, second=None):
    """Probability maps ``(N, K, H, W)`` from U-Net logits ``(N, C, H, W)``: channel 0 is
    the foreground (:func:`foreground_probability`); a two-map model (``second``:
    'border', 'centre' or 'contact', after its ``--target``) adds its second map as
    channel 1 (both outputs are independent sigmoids)."""
    if second:
        return mx.nd.sigmoid(logits)
    return foreground_probability(logits).expand_dims(axis=1)


def build_model(model_cfg, layers=None):
    """Build a :class:`UNet` from a :class:`~gluon_unet.config.ModelConfig`.

    ``layers``: how its pieces are built (:class:`Layers`, the default; training passes
    SyncBatchNorm, AMP and the CPU backend's variant through it).
    """
    return UNet(in_channels=model_cfg.in_channels, classes=model_cfg.outputs,
                width=model_cfg.width, depth=model_cfg.depth,
                batch_norm=model_cfg.batch_norm, dropout=model_cfg.dropout,
                upsample=model_cfg.upsample, layers=layers)


RECOMPUTE = ('activations', 'blocks')


@contextlib.contextmanager
def recompute(net, what):
    """While building a symbol of ``net``, mark what backward recomputes instead of
    keeping from the forward pass (``what``: one of :data:`RECOMPUTE`).

    MXNet 1.9's symbolic executor honours the ``__force_mirroring__`` node attribute
    (``src/executor/graph_executor.cc``, ``need_mirror``): a marked node is run again
    during backward, so its output need not live from forward to backward. Gluon's
    CachedOp builds its gradient graph without any mirror function
    (``src/imperative/cached_op.h``, ``MXGradient(..., nullptr, ...)``), which is why
    :class:`gluon_unet.training.parallel.MirroredStep` trains through a bound symbol.

    A recomputed BatchNorm updates its running statistics once per step, as without
    recomputing (checked by ``tests/test_memory.py``).
    """
    if what not in RECOMPUTE:
        raise ValueError('recompute: %r is not one of %s' % (what, ', '.join(RECOMPUTE)))
    blocks = []

    def visit(block):
        if isinstance(block, (DoubleConv, Up, UNet)):
            blocks.append(block)
        for child in block._children.values():
            visit(child)
    visit(net)
    for b in blocks:
        b.recompute = what
    try:
        yield net
    finally:
        for b in blocks:
            b.recompute = None


def flops_per_image(model_cfg, size):
    """Multiply-adds x 2 of one forward pass at ``size`` x ``size`` (convs only).

    Used by the benchmarks to report achieved GFLOP/s; a training step costs about
    three forward passes (forward, input-gradient and weight-gradient).
    """
    w, c_in, total = model_cfg.width, model_cfg.in_channels, 0.0
    side = size
    for level in range(model_cfg.depth + 1):
        c = w * 2 ** level
        total += side * side * 9 * (c_in * c + c * c)
        c_in = c
        side //= 2
    side = size // 2 ** model_cfg.depth
    for level in reversed(range(model_cfg.depth)):
        side *= 2
        c = w * 2 ** level
        k = 4 if model_cfg.upsample == 'deconv' else 9
        total += side * side * k * (2 * c * c)          # upsampling conv: 2c -> c
        total += side * side * 9 * (2 * c * c + c * c)  # double conv on the concat
    total += size * size * w * model_cfg.outputs
    return 2.0 * total
