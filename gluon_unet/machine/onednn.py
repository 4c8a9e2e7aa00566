"""What the U-Net becomes on oneDNN, MXNet 1.9.1's CPU backend: the same function with
the same parameters, built from the kernels that run fast (or at all) there.

:class:`OneDNNLayers` wraps the plain layers of :class:`gluon_unet.model.Layers` and
changes four pieces, each only where it pays:

* **fused BatchNorm + ReLU** (``nn.BatchNormReLU``, one oneDNN kernel) for CPU training;
* **float32 ReLUs** (:class:`Float32ReLU`) where a bfloat16 network on AMX would
  otherwise send BatchNorm's backward to oneDNN's reference kernel
  (:func:`amx_float32_relus` says where);
* **the bfloat16 up-convolution** as a 1x1 convolution and a depth-to-space
  (:class:`TransposedConv2x2`): MXNet 1.9 cannot train a hybridized bfloat16
  Deconvolution, and its upsampled map is cast back to bfloat16 before the join;
* **the skip's identity** for bfloat16 training: an exact 1x1 average pooling whose
  gradient stays in oneDNN's blocked layout, so backward's gradient sum runs on oneDNN.

Exports and GPUs use the plain layers: MXNet has no GPU kernel for the fused operator,
ONNX no such operator, and inference sums no gradients. Why each rewrite exists and what
it gained, measured: docs/explanation/onednn.md.
"""
from mxnet.contrib.amp.amp import bfloat16 as amp_bfloat16
from mxnet.gluon import nn

#: MXNet's bfloat16 dtype for ``amp_cast`` (numpy has none; AMP's own casts use this).
BFLOAT16 = amp_bfloat16
#: Gluon's BatchNorm class as imported: only it is fused (not SyncBatchNorm, nor a norm
#: benchmarks/bench_norm.py swaps in).
_GLUON_BATCHNORM = nn.BatchNorm


def amx_float32_relus(in_channels, channels):
    """Which of a :class:`~gluon_unet.model.DoubleConv`'s two ReLUs compute in float32 on
    AMX: ``(first, second)``, for a block of ``channels`` fed ``in_channels``.

    Where oneDNN 2.4 runs a layer's forward convolution on AMX and the backward one that
    produces its BatchNorm's gradient without (or the other way round), the two blocked
    layouts differ and MXNet's BatchNorm backward falls back to oneDNN's reference kernel.
    oneDNN 2.4's AMX kernels work on channels in blocks of 32: the first ReLU needs float32
    when the block's channels are not a multiple of 32, or its input's are not and exceed
    16 (3x3 convolutions from up to 16 channels run forward on AMX); the second when its
    channels are not a multiple of 32 and exceed 16. Checked for widths 4-96 and depths 2-4
    under ``DNNL_VERBOSE`` (tests/test_amx.py).
    """
    first = channels % 32 != 0 or (in_channels % 32 != 0 and in_channels > 16)
    return first, channels % 32 != 0 and channels > 16


class Float32ReLU(nn.HybridBlock):
    """ReLU in float32 for a bfloat16 network on AMX: the same function, but its output
    and its gradient leave in the plain NCHW layout.

    ``amp_cast`` is a oneDNN reorder to the plain layout, forward and backward, so the
    gradient reaching BatchNorm is plain and gets reordered: MXNet's BatchNorm backward
    reorders one of its two inputs only when the other is plain
    (``src/operator/nn/mkldnn/mkldnn_batch_norm-inl.h``), else runs the reference kernel.
    """

    def hybrid_forward(self, F, x):
        return F.Activation(F.amp_cast(x, dtype='float32'), act_type='relu')


class ReLUInTheNorm(nn.HybridBlock):
    """Where the ReLU was: it is computed by the ``nn.BatchNormReLU`` before it. Holds the
    slot so that the structural parameter names stay those of the unfused network."""

    def hybrid_forward(self, F, x):
        return x


class TransposedConv2x2(nn.HybridBlock):
    """``Conv2DTranspose(channels, kernel_size=2, strides=2)`` computed as a 1x1
    convolution to ``4 * channels`` whose channels are then moved into 2x2 pixel
    blocks (``depth_to_space``).

    With stride equal to kernel size every input pixel writes its own 2x2 output block,
    so the two are the same function with the same parameters (names, shapes and
    initialisation match ``Conv2DTranspose``, so checkpoints are interchangeable). Under
    bfloat16 AMP the backward pass of a hybridized graph with Deconvolution crashes
    MXNet 1.9 (segfault, or "could not execute a primitive"), while a 1x1 Convolution
    trains. In float32 Deconvolution is the faster kernel, so it is used only there.
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
        # most 4 dimensions as a oneDNN reorder, a larger one with its plain C++ kernel.
        # y: (N, kh*kw*C, H, W) -> per (n, kh): (kw, C*H, W) -> (C*H, W, kw) = (C*H, 2W)
        y = F.reshape(y, shape=(0, -4, 2, -1, -2))           # (N, kh, kw*C, H, W)
        y = F.reshape(y, shape=(-3, -4, 2, -1, -2))          # (N*kh, kw, C, H, W)
        y = F.reshape(y, shape=(0, 0, -3, 0))                # (N*kh, kw, C*H, W)
        y = F.reshape(F.transpose(y, axes=(0, 2, 3, 1)), shape=(0, 0, -3))  # (N*kh, C*H, 2W)
        # -> (N, C*H, kh, 2W), i.e. (N, C, H, kh, 2W): row 2i + kh, column 2j + kw
        y = F.transpose(F.reshape(y, shape=(-4, -1, 2, -2)), axes=(0, 2, 1, 3))
        return F.reshape(F.reshape(y, shape=(0, -4, self.channels, -1, -2)), shape=(0, 0, -3, 0))


class OneDNNJoin(nn.HybridBlock):
    """:class:`gluon_unet.model.Join` for bfloat16 on oneDNN.

    ``to_bfloat16``: the upsampled map is cast back to bfloat16 (exact: MXNet's bfloat16
    lists run :class:`TransposedConv2x2`'s reshapes in float32, which would otherwise make
    the whole concatenation float32). ``skip_blocked``: the skip passes a 1x1 average
    pooling, an exact identity whose gradient leaves in oneDNN's blocked layout; the skip
    also feeds the encoder's pooling, and MXNet runs the sum of the two gradients on oneDNN
    only when both are blocked.
    """

    def __init__(self, to_bfloat16, skip_blocked, multicast, **kwargs):
        super().__init__(**kwargs)
        self.to_bfloat16, self.skip_blocked, self.multicast = to_bfloat16, skip_blocked, multicast

    def hybrid_forward(self, F, x, skip):
        if self.skip_blocked:
            skip = F.Pooling(skip, kernel=(1, 1), stride=(1, 1), pool_type='avg')
        if self.to_bfloat16:
            x = F.amp_cast(x, dtype=BFLOAT16)
        if self.multicast:
            x, skip = F.amp_multicast(x, skip, num_outputs=2)
        return F.concat(x, skip, dim=1)


class OneDNNLayers:
    """The U-Net's pieces for MXNet's CPU backend, around the ``plain`` ones.

    Parameters
    ----------
    plain : gluon_unet.model.Layers
        The layers to change (SyncBatchNorm, AMP's casts): what is not rewritten is theirs.
    bfloat16 : bool
        The network trains under bfloat16 AMP (``amp.init`` done).
    amx : bool
        It runs on AMX: the ReLUs :func:`amx_float32_relus` names compute in float32.
    training : bool
        It trains (not an export): fused BatchNorm + ReLU, and under bfloat16 the skips'
        identity. Not with ``--memory balanced/low``, whose recomputation marks assume
        separate layers.
    """

    def __init__(self, plain, bfloat16=False, amx=False, training=False):
        self.plain, self.bfloat16, self.amx, self.training = plain, bfloat16, amx, training

    def norm_relu(self, channels, in_channels, second, batch_norm):
        norm, relu = self.plain.norm_relu(channels, in_channels, second, batch_norm)
        if norm is None:
            return norm, relu
        if self.amx and amx_float32_relus(in_channels, channels)[second]:
            return norm, Float32ReLU()
        if self.training and type(norm) is _GLUON_BATCHNORM:
            return nn.BatchNormReLU(), ReLUInTheNorm()
        return norm, relu

    def upsample(self, channels, mode):
        if self.bfloat16 and mode == 'deconv':
            return TransposedConv2x2(channels, kernel_size=2, strides=2, in_channels=2 * channels)
        return self.plain.upsample(channels, mode)

    def join(self, channels, mode, batch_norm):
        # A skip whose encoder block ends in a float32 ReLU is float32: it stays so.
        skip_float32 = self.amx and batch_norm and amx_float32_relus(0, channels)[1]
        bfloat16 = self.bfloat16 and not skip_float32
        to_bfloat16, skip_blocked = bfloat16 and mode == 'deconv', bfloat16 and self.training
        if not (to_bfloat16 or skip_blocked):
            return self.plain.join(channels, mode, batch_norm)
        return OneDNNJoin(to_bfloat16, skip_blocked, self.plain.amp)
