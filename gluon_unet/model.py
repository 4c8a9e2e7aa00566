"""The U-Net (Ronneberger et al. 2015) as a pure Gluon HybridBlock: config in, block out."""
import contextlib

import mxnet as mx
from mxnet.contrib.amp.amp import bfloat16 as amp_bfloat16
from mxnet.gluon import nn
from mxnet.gluon.contrib.nn import SyncBatchNorm

from .errors import UserError

#: MXNet's bfloat16 dtype for ``amp_cast`` (numpy has none; AMP's own casts use this).
BFLOAT16 = amp_bfloat16


class _Float32ReLU(nn.HybridBlock):
    """ReLU in float32 for a bfloat16 network on AMX: the same function, but its output and
    its gradient leave in the plain NCHW layout.

    Why: MXNet 1.9.1's oneDNN BatchNorm backward falls back to oneDNN's reference kernel
    (about 200x slower: 250 ms for 16x16x128x128 on a 2-core Xeon, half the step) when its
    input and its gradient arrive in two different blocked layouts; it reorders one of them
    only when the other is plain (``src/operator/nn/mkldnn/mkldnn_batch_norm-inl.h``).
    With AMX that happens where channels are not a multiple of 32 (e.g. 16): the AMX
    forward convolution writes ``acdb`` while the backward one, which oneDNN 2.4 has no
    AMX kernel for there, writes ``aBcd16b`` (:func:`amx_float32_relus` says where).
    ``amp_cast`` is a oneDNN reorder to the plain layout (``src/operator/tensor/amp_cast.cc``),
    forward and backward, so the gradient reaching BatchNorm is plain and is reordered:
    the fast kernel runs. The cost, a few reorders of those maps, is small beside it
    (docs/performance.md).
    """

    def hybrid_forward(self, F, x):
        return F.Activation(F.amp_cast(x, dtype='float32'), act_type='relu')


def amx_float32_relus(in_channels, channels):
    """Which of a :class:`_DoubleConv`'s two ReLUs compute in float32 on AMX: ``(first,
    second)``, for a block of ``channels`` fed ``in_channels``.

    Where oneDNN 2.4 (MXNet 1.9.1) runs a layer's forward convolution on AMX and the
    backward one that produces its BatchNorm's gradient without (or the other way round),
    the two blocked layouts differ and :class:`_Float32ReLU` is needed. oneDNN 2.4's AMX
    kernels work on channels in blocks of 32: the first ReLU needs it when the block's channels are not a multiple
    of 32, or its input's are not and exceed 16 (3x3 convolutions from up to 16 channels
    run forward on AMX); the second when its channels are not a multiple of 32 and exceed
    16 (its gradient comes through pooling and the decoder's concatenation). Measured on
    a Xeon with AMX with DNNL_VERBOSE: widths 4-96 and depths 2-4 run no ``bnorm_ref``
    with this rule; with float32 ReLUs only below 32 channels, widths 12, 20, 24, 28, 40
    and 48 did (tests/test_amx.py).
    """
    first = channels % 32 != 0 or (in_channels % 32 != 0 and in_channels > 16)
    return first, channels % 32 != 0 and channels > 16


#: Gluon's BatchNorm class as imported (benchmarks/bench_norm.py patches the name).
_GLUON_BATCHNORM = nn.BatchNorm


class _ReLUInTheNorm(nn.HybridBlock):
    """Where the ReLU was: it is computed by the ``nn.BatchNormReLU`` before it. Holds the
    slot so that the structural parameter names stay those of the unfused network."""

    def hybrid_forward(self, F, x):
        return x


class _DoubleConv(nn.HybridBlock):
    """(3x3 conv -> [BatchNorm] -> ReLU) x 2, 'same' padding so skip shapes match.

    ``amx``: a bfloat16 network on AMX, where :func:`amx_float32_relus` chooses ReLUs in
    float32 (``in_channels`` is only read for that). ``fuse``: BatchNorm and ReLU as one
    oneDNN operator (see :class:`UNet`).
    """

    def __init__(self, channels, batch_norm, norm_layer, norm_kwargs, amx=False, in_channels=0, fuse=False,
                 **kwargs):
        super().__init__(**kwargs)
        self.body = nn.HybridSequential()
        plain = amx_float32_relus(in_channels, channels) if amx and batch_norm else (False, False)
        for i in range(2):
            # A bias in front of BatchNorm is cancelled by its mean subtraction.
            self.body.add(nn.Conv2D(channels, 3, padding=1, use_bias=not batch_norm))
            norm = norm_layer(**norm_kwargs) if batch_norm else None
            # Only Gluon's own BatchNorm (not SyncBatchNorm, nor a norm a benchmark swapped in).
            fused = fuse and type(norm) is _GLUON_BATCHNORM and not plain[i]
            if batch_norm:
                self.body.add(nn.BatchNormReLU(**norm_kwargs) if fused else norm)
            self.body.add(_Float32ReLU() if plain[i] else _ReLUInTheNorm() if fused else nn.Activation('relu'))

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


class _TransposedConv2x2(nn.HybridBlock):
    """``Conv2DTranspose(channels, kernel_size=2, strides=2)`` computed as a 1x1
    convolution to ``4 * channels`` whose channels are then moved into 2x2 pixel
    blocks (``depth_to_space``).

    With stride equal to kernel size every input pixel writes its own 2x2 output block,
    so the two are the same function with the same parameters (names, shapes and
    initialisation match ``Conv2DTranspose``, so checkpoints are interchangeable). Why:
    under bfloat16 AMP, the backward pass of a hybridized graph with Deconvolution
    crashes MXNet 1.9 (segfault, or "could not execute a primitive"), while a 1x1
    Convolution trains in bfloat16. Used only under bfloat16 AMP: in float32,
    Deconvolution is the faster kernel, and cuDNN's works under float16 AMP.
    """

    def __init__(self, channels, kernel_size=2, strides=2, in_channels=0, **kwargs):
        super().__init__(**kwargs)
        assert kernel_size == strides == 2 and in_channels > 0
        self.channels, self.in_channels = channels, in_channels
        self.weight = self.params.get('weight', shape=(in_channels, channels, 2, 2))
        self.bias = self.params.get('bias', shape=(channels,), init='zeros')

    def hybrid_forward(self, F, x, weight, bias):
        # (in, out, kh, kw) -> (kh, kw, out, in): output pixel (2i + kh, 2j + kw) of
        # channel o comes from channel (kh * 2 + kw) * out + o of the 1x1 convolution.
        w = F.reshape(F.transpose(weight, axes=(2, 3, 1, 0)),
                      shape=(4 * self.channels, self.in_channels, 1, 1))
        y = F.Convolution(x, w, F.tile(bias, reps=(4,)), kernel=(1, 1),
                          num_filter=4 * self.channels)
        # depth_to_space as reshapes and two 4-D transposes: MXNet runs a transpose of at
        # most 4 dimensions as a oneDNN reorder (float32 and bfloat16), anything larger
        # (one 6-D transpose did this before) with its plain C++ kernel: 34 ms against
        # 10 ms of a ~300 ms bfloat16 step at width 16 on an AMX Xeon.
        # y: (N, kh*kw*C, H, W) -> per (n, kh): (kw, C*H, W) -> (C*H, W, kw) = (C*H, 2W)
        y = F.reshape(y, shape=(0, -4, 2, -1, -2))           # (N, kh, kw*C, H, W)
        y = F.reshape(y, shape=(-3, -4, 2, -1, -2))          # (N*kh, kw, C, H, W)
        y = F.reshape(y, shape=(0, 0, -3, 0))                # (N*kh, kw, C*H, W)
        y = F.reshape(F.transpose(y, axes=(0, 2, 3, 1)), shape=(0, 0, -3))  # (N*kh, C*H, 2W)
        # -> (N, C*H, kh, 2W), i.e. (N, C, H, kh, 2W): row 2i + kh, column 2j + kw
        y = F.transpose(F.reshape(y, shape=(-4, -1, 2, -2)), axes=(0, 2, 1, 3))
        return F.reshape(F.reshape(y, shape=(0, -4, self.channels, -1, -2)), shape=(0, 0, -3, 0))


class _Up(nn.HybridBlock):
    """Double the resolution and halve the channels, then concatenate the skip."""

    def __init__(self, channels, mode, batch_norm, norm_layer, norm_kwargs, amp_dtype=None, amx=False,
                 onednn_training=False, **kwargs):
        super().__init__(**kwargs)
        self.mode = mode
        if mode == 'deconv':
            # oneDNN's Deconvolution is the faster float32 kernel (width 16 at 128 px:
            # 8 % faster steps), but cannot train hybridized in bfloat16. cuDNN's trains
            # under float16 AMP.
            up = _TransposedConv2x2 if amp_dtype == 'bfloat16' else nn.Conv2DTranspose
            self.up = up(channels, kernel_size=2, strides=2, in_channels=2 * channels)
        else:
            # Resize + conv avoids the checkerboard artefacts of transposed convs.
            self.up = nn.Conv2D(channels, 3, padding=1)
        self.conv = _DoubleConv(channels, batch_norm, norm_layer, norm_kwargs, amx, in_channels=2 * channels,
                                fuse=onednn_training)
        # Under bfloat16 AMP, MXNet keeps Deconvolution in float32 while the skip path
        # is bfloat16, and its bf16 lists do not make Concat cast to the widest type;
        # an explicit multicast does (only under AMP, so float32 graphs stay unchanged).
        self.multicast = amp_dtype is not None
        # MXNet's bfloat16 lists run reshape and transpose in float32, so the output of
        # _TransposedConv2x2's depth_to_space is float32, and the multicast then cast the
        # skip up too: the concatenation (twice the channels, full resolution) was float32
        # and cast back for the next convolution, at each level. Cast the upsampled map
        # back instead, where the skip is bfloat16 (not a _Float32ReLU's). Exact: the
        # values are the convolution's bfloat16 output, only moved. 11 % less memory at
        # width 64 on AMX, 16-19 % without (docs/performance.md). Keeping the transposes in
        # bfloat16 is no option: MXNet 1.9.1's oneDNN bfloat16 transpose crashes ("double
        # free or corruption").
        skip_float32 = amx and batch_norm and amx_float32_relus(0, channels)[1]  # the encoder's block
        self.to_bfloat16 = amp_dtype == 'bfloat16' and mode == 'deconv' and not skip_float32
        # The skip feeds both the encoder's pooling and this concatenation, so backward sums
        # its two gradients (add_n). Concat's backward writes the plain layout and pooling's
        # a oneDNN blocked one, and MXNet 1.9.1 runs add_n on oneDNN only when all its
        # inputs are blocked: otherwise it reorders them to plain and adds element by element
        # in bfloat16 (13x slower than oneDNN's sum for 16x16x128x128 on a 2-core Xeon; 22 ms
        # of a 222 ms step at width 16). A 1x1 average pooling here is an exact identity
        # whose gradient leaves in the blocked layout, so add_n runs on oneDNN: +5-9 % per
        # step, and less memory (docs/performance.md). Training only: nothing to sum in an
        # export; bfloat16 only: in float32 it was within the noise.
        self.skip_blocked = onednn_training and amp_dtype == 'bfloat16' and not skip_float32

    # 'blocks' (see :func:`recompute`): the upsampling and the concatenation are
    # recomputed too, so the concatenated input (2x the block's channels at full
    # resolution) is not kept from forward to backward.
    recompute = None

    def hybrid_forward(self, F, x, skip):
        if self.skip_blocked:
            skip = F.Pooling(skip, kernel=(1, 1), stride=(1, 1), pool_type='avg')
        mirrored = F is mx.sym and self.recompute == 'blocks'
        with mx.AttrScope(force_mirroring='True') if mirrored else contextlib.nullcontext():
            if self.mode == 'bilinear':
                x = F.contrib.BilinearResize2D(x, scale_height=2., scale_width=2.)
            x = self.up(x)
            if self.to_bfloat16:
                x = F.amp_cast(x, dtype=BFLOAT16)
            if self.multicast:
                x, skip = F.amp_multicast(x, skip, num_outputs=2)
            x = F.concat(x, skip, dim=1)
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
    sync_bn_devices : int
        When > 0, BatchNorm is ``SyncBatchNorm`` synchronized over this many devices.
    amp_dtype : {None, 'float16', 'bfloat16'}
        The AMP dtype the network will train in (``amp.init(target_dtype=...)``, which
        must come first), None for float32. Under 'bfloat16' the 2x2 transposed
        convolutions are computed as 1x1 convolutions (:class:`_TransposedConv2x2`, the
        same parameters): MXNet 1.9 cannot train a hybridized bfloat16 Deconvolution.
    amx : bool
        The bfloat16 network will run on AMX (``runtime.amx_state()``): the layers
        :func:`amx_float32_relus` names compute their ReLU in float32 (:class:`_Float32ReLU`),
        which keeps oneDNN 2.4's BatchNorm backward on its fast kernel. The same
        function and parameters, so checkpoints are interchangeable.
    onednn_training : bool
        The network trains on CPU contexts (oneDNN). BatchNorm and the ReLU after it
        become one operator (``nn.BatchNormReLU``, oneDNN's fused kernel; not with
        SyncBatchNorm): 5-14 % faster training steps. Under bfloat16, each skip reaches
        its concatenation through an identity that keeps its gradient in oneDNN's layout
        (see :class:`_Up`): 5-9 % more. CPU training only: MXNet 1.9 has no GPU kernel for
        the fused operator, ONNX no such operator, and inference sums no gradients, so
        exports are built without both. The same function and parameter names.

    Input ``(N, in_channels, H, W)``; output logits ``(N, classes, H, W)``.
    """

    def __init__(self, in_channels=1, classes=1, width=32, depth=4, batch_norm=True,
                 dropout=0.0, upsample='deconv', sync_bn_devices=0, amp_dtype=None, amx=False,
                 onednn_training=False, **kwargs):
        super().__init__(**kwargs)
        self.in_channels, self.depth = in_channels, depth
        if sync_bn_devices:
            norm_layer, norm_kwargs = SyncBatchNorm, {'num_devices': sync_bn_devices}
        else:
            norm_layer, norm_kwargs = nn.BatchNorm, {}
        with self.name_scope():
            self.down = nn.HybridSequential()
            for level in range(depth):
                self.down.add(_DoubleConv(width * 2 ** level, batch_norm, norm_layer, norm_kwargs, amx,
                                          in_channels=width * 2 ** (level - 1) if level else in_channels,
                                          fuse=onednn_training))
            self.pool = nn.MaxPool2D(2, 2)
            self.bottom = _DoubleConv(width * 2 ** depth, batch_norm, norm_layer, norm_kwargs, amx,
                                      in_channels=width * 2 ** (depth - 1), fuse=onednn_training)
            self.drop = nn.Dropout(dropout) if dropout > 0 else None
            self.up = nn.HybridSequential()
            for level in reversed(range(depth)):
                self.up.add(_Up(width * 2 ** level, upsample, batch_norm, norm_layer, norm_kwargs, amp_dtype, amx,
                                onednn_training=onednn_training))
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


def build_model(model_cfg, sync_bn_devices=0, amp_dtype=None, amx=False, onednn_training=False):
    """Build a :class:`UNet` from a :class:`~gluon_unet.config.ModelConfig`.

    ``amp_dtype`` is the dtype of the AMP already initialized (``step.init_amp``'s
    result), None for float32; ``amx``: it will run on AMX; ``onednn_training``: it will
    train on CPU contexts (both: see :class:`UNet`).
    """
    return UNet(in_channels=model_cfg.in_channels, classes=model_cfg.outputs,
                width=model_cfg.width, depth=model_cfg.depth,
                batch_norm=model_cfg.batch_norm, dropout=model_cfg.dropout,
                upsample=model_cfg.upsample, sync_bn_devices=sync_bn_devices, amp_dtype=amp_dtype,
                amx=amx and amp_dtype == 'bfloat16', onednn_training=onednn_training)


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
    :class:`gluon_unet.parallel.MirroredStep` trains through a bound symbol.

    A recomputed BatchNorm updates its running statistics once per step, as without
    recomputing (checked by ``tests/test_memory.py``).
    """
    if what not in RECOMPUTE:
        raise ValueError('recompute: %r is not one of %s' % (what, ', '.join(RECOMPUTE)))
    blocks = []

    def visit(block):
        if isinstance(block, (_DoubleConv, _Up, UNet)):
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
