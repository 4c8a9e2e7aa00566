"""Network input shapes that MXNet 1.9.1's CPU build cannot run, and the nearest that it can.

A 1x1 convolution in inference mode kills the process with SIGFPE ("Floating point
exception", exit code 136) on CPUs with AVX-512 when its input's height H and width W
make ``H * H * W`` a multiple of 2**32 (2048x2048, 2048x1024, 4096x256, ...; with more
than 16 outputs sooner: 512x512 to 512 outputs). It is an integer division by zero inside
libmxnet.so while oneDNN 2.4.4 (which MXNet 1.9.1 links) creates the convolution: its
brgemm 1x1 kernel estimates every spatial block size ``spb`` it may use
(``brg_blocking_t::calc_blocks_1x1`` and ``est_eff_1x1`` in
src/cpu/x64/jit_brgemm_conv_utils.cpp) and computes ``div_up(job, dim_od)`` with
``dim_od = nb_oh * nb_os * (1 or nb_oc)`` in 32-bit ``int``, which is ``H * ceil(H*W /
spb) * m`` and wraps to exactly 0 (spb = 1: H*H*W*m a multiple of 2**32). Found with gdb
(``idiv`` by a zero register four frames under ``dnnl::primitive_desc``, called from
``mxnet::op::GetConvFwdImpl``); ``benchmarks/conv1x1_crash.py`` runs 28 shapes around the
boundary in their own processes and the rule below agrees on all 28 (2040x2040,
2048x2047, 1024x2048, 2064x2048, 3000x3000, 512x512 to 256 outputs run). Not with
``MXNET_MKLDNN_ENABLED=0``, nor in training mode (the same convolution's forward for
training and its backward take other kernels: they ran at 2048x2048, 2048x1024 and
65536x1, float32 and bfloat16), nor on CPUs without AVX-512 (with ``DNNL_MAX_CPU_ISA=AVX2``
2048x2048 ran), nor on GPUs. The 3x3 convolutions, pooling, BatchNorm and Deconvolution
of a U-Net ran at these sizes (its forward at 2064x2048, 1024x2048 and 3072x3072).

A U-Net meets it at its last layer, a 1x1 convolution at full resolution, and under
bfloat16 AMP at the 1x1 convolutions its upsampling is computed with
(``onednn.TransposedConv2x2``). So bin/predict pads such a window a little further
(:func:`safe_window`, :func:`safe_square`) and bin/train refuses on CPU a ``--crop`` or
``--size`` its validation would meet (:func:`unet_crash`). Stdlib only: config.py imports
it before mxnet loads.
"""

#: Spatial block sizes oneDNN 2.4.4's brgemm 1x1 blocking may estimate: at most
#: ``div_up(1001, destination bytes)``, 1001 for int8 (251 for float32).
_SPATIAL_BLOCKS = range(1, 1002)
#: Its output-channel blocks.
_OC_BLOCKS = (16, 32, 48, 64)


def conv1x1_crashes(height, width, channels_out=1):
    """Whether an inference-mode 1x1 convolution over (height, width) with
    ``channels_out`` outputs dies with SIGFPE in MXNet 1.9.1 on an AVX-512 CPU (see the
    module doc): some block size ``spb`` makes ``height * ceil(height * width / spb) *
    m`` a multiple of 2**32, with ``m`` 1 or the number of output-channel blocks."""
    pixels = height * width
    factors = {1} | {-(-channels_out // b) for b in _OC_BLOCKS}
    if height * pixels * max(factors) < 2 ** 32:  # no product can reach 2**32: none wraps
        return False
    for spb in _SPATIAL_BLOCKS:
        blocks = -(-pixels // spb)
        if any(height * blocks * m % 2 ** 32 == 0 for m in factors):
            return True
    return False


def unet_crash(height, width, width_=32, depth=4, outputs=1, bf16=False):
    """The first 1x1 convolution of a U-Net (first level ``width_`` filters, ``depth``
    poolings, ``outputs`` output maps) that would crash on an (height, width) input in
    inference mode, as ``'the output layer at HxW'``; None when none would. Under
    ``bf16`` AMP every upsampling is a 1x1 convolution too (``onednn.TransposedConv2x2``)."""
    if conv1x1_crashes(height, width, outputs):
        return 'the output layer at %dx%d' % (height, width)
    if bf16:
        for level in range(depth):
            h, w = height >> (level + 1), width >> (level + 1)
            if conv1x1_crashes(h, w, 4 * width_ * 2 ** level):
                return 'the upsampling to level %d at %dx%d' % (level, h, w)
    return None


def safe_window(height, width, multiple, outputs=1):
    """The smallest (height', width') at least (height, width), grown by multiples of
    ``multiple``, whose 1x1 output convolution runs in both orientations (test-time
    augmentation turns windows by a quarter): (height, width) itself almost always."""
    def runs(h, w):
        return not (conv1x1_crashes(h, w, outputs) or conv1x1_crashes(w, h, outputs))
    if runs(height, width):
        return height, width
    grown = sorted(((height + i * multiple) * (width + j * multiple), i + j, i, j)
                   for i in range(8) for j in range(8))
    for _, _, i, j in grown:
        if runs(height + i * multiple, width + j * multiple):
            return height + i * multiple, width + j * multiple
    # Not reached: one of them is an odd multiple of ``multiple`` (at most 2**7) on both
    # sides, so H*H*W has at most 21 factors 2.
    raise AssertionError('no window near %dx%d runs' % (height, width))


def safe_square(side, multiple, outputs=1):
    """The smallest square side at least ``side`` (grown by multiples of ``multiple``)
    whose 1x1 output convolution runs: ``side`` itself unless it is a multiple of 2048."""
    while conv1x1_crashes(side, side, outputs):
        side += multiple
    return side


def safe_sides(side, multiple, outputs=1, **unet):
    """The nearest square sides below and above ``side`` (multiples of ``multiple``) on
    which :func:`unet_crash` finds nothing, for the message that refuses ``side``."""
    below = next((s for s in range(side - multiple, 0, -multiple)
                  if not unet_crash(s, s, outputs=outputs, **unet)), None)
    above = next(s for s in range(side + multiple, 8 * side + multiple, multiple)
                 if not unet_crash(s, s, outputs=outputs, **unet))
    return below, above
