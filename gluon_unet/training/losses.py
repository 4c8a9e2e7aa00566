"""Segmentation losses. Each returns one loss per sample, shape ``(N,)``.

Per-sample (not per-batch) losses are what make multi-device training exact: every
device returns the *sum* of its samples' gradients, the kvstore adds them up, and
``trainer.step(n)`` divides by the number of samples in the whole step.
"""
from mxnet import gluon

from ..data.weights import WEIGHTED


class SegmentationLoss(gluon.HybridBlock):
    """Loss on logits ``(N, C, H, W)`` against ``target (N, 1, H, W)`` and, for ``wbce``
    and ``wbce_dice`` (optional for ``ce``), a pixel ``weight (N, 1, H, W)``.

    The sigmoid losses also take several independent outputs (``--target mask+border``
    and ``mask+centre``: logits and target ``(N, 2, H, W)``): BCE is averaged over all of
    them, Dice is computed per channel and averaged, so the thin border channel counts as
    much as the foreground in the Dice term; the weight map applies to every channel's BCE.
    A channel whose target is a level rather than a class (``--target mask+centre``: the
    distance to the edge, 0..1) takes the BCE only, which with a soft target is least
    where the probability equals it; Dice would push it to 0 or 1 (``dice_channels``).

    Parameters
    ----------
    kind : {'bce', 'dice', 'bce_dice', 'lovasz', 'bce_lovasz', 'wbce', 'wbce_dice', 'ce'}
        ``bce``: sigmoid binary cross-entropy from logits (log-sum-exp form, stable);
        ``dice``: soft Dice; ``bce_dice``: their sum (Dice scaled by ``dice_weight``);
        ``lovasz``: the Lovasz hinge (:func:`lovasz_hinge_loss`), in place of Dice;
        ``bce_lovasz``: BCE plus it (scaled by ``dice_weight``, as Dice in ``bce_dice``);
        ``wbce``: BCE weighted per pixel by ``weight`` (the U-Net paper's boundary map);
        ``wbce_dice``: that weighted BCE plus the (unweighted) soft Dice, as ``bce_dice``
        (training gives it the map without the class balancing: Dice does that);
        ``ce``: softmax cross-entropy for ``classes > 1`` (target holds class ids).
    dice_weight : float
        Weight of the Dice term in ``bce_dice`` and ``wbce_dice``, of the Lovasz term in
        ``bce_lovasz``.
    dice_channels : int, optional
        The Dice (or Lovasz) term covers the first this many channels (None = all).
    weight_second_only : bool
        Two outputs: the pixel weight applies to the second only, the first (the
        foreground) takes the plain BCE (``--weight-on second``).
    """

    def __init__(self, kind='bce', dice_weight=1.0, dice_channels=None, weight_second_only=False, **kwargs):
        super().__init__(**kwargs)
        self.kind, self.dice_weight, self.dice_channels = kind, dice_weight, dice_channels
        self.weight_second_only = weight_second_only
        self._bce = gluon.loss.SigmoidBinaryCrossEntropyLoss(from_sigmoid=False)
        self._ce = gluon.loss.SoftmaxCrossEntropyLoss(axis=1, sparse_label=True)

    def hybrid_forward(self, F, logits, target, weight=None):
        # Losses are computed in float32 even under AMP: sums over 65k pixels in
        # half precision lose the small gradients that matter at the end of training.
        logits = F.cast(logits, 'float32')
        if self.kind == 'ce':
            return self._ce(logits, F.squeeze(target, axis=1),
                            None if weight is None else F.squeeze(weight, axis=1))
        if self.kind in WEIGHTED and weight is None:
            # Gluon's BCE takes a missing weight as all ones: the loss would quietly
            # become bce / bce_dice.
            raise ValueError('--loss %s needs the per-pixel weight map as a third input' % self.kind)
        if weight is not None and self.weight_second_only:
            # (N, 1, H, W) -> (N, 2, H, W): ones on the foreground, the map on the second output
            weight = F.concat(F.ones_like(weight), weight, dim=1)
        if self.kind == 'wbce':
            return self._bce(logits, target, weight)
        if self.kind == 'bce':
            return self._bce(logits, target)
        # The overlap term (Dice or the Lovasz hinge) covers the first dice_channels outputs.
        head, head_target = logits, target
        if self.dice_channels is not None:
            head = F.slice_axis(logits, axis=1, begin=0, end=self.dice_channels)
            head_target = F.slice_axis(target, axis=1, begin=0, end=self.dice_channels)
        if self.kind in ('lovasz', 'bce_lovasz'):
            overlap = lovasz_hinge_loss(F, head, head_target)
        else:
            overlap = soft_dice_loss(F, F.sigmoid(head), head_target)
        if self.kind in ('dice', 'lovasz'):
            return overlap
        bce = self._bce(logits, target, weight) if self.kind == 'wbce_dice' else self._bce(logits, target)
        return bce + self.dice_weight * overlap


def soft_dice_loss(F, prob, target, smooth=1.0):
    """``1 - (2 |P.T| + s) / (|P| + |T| + s)`` per sample and channel, averaged over the
    channels; ``smooth`` keeps empty masks finite."""
    inter = F.sum(prob * target, axis=(2, 3))
    total = F.sum(prob, axis=(2, 3)) + F.sum(target, axis=(2, 3))
    return F.mean(1.0 - (2.0 * inter + smooth) / (total + smooth), axis=1)


def lovasz_hinge_loss(F, logits, target):
    """The Lovasz hinge (Berman et al., CVPR 2018) per sample and channel, averaged over
    the channels: a convex surrogate of ``1 - IoU`` of the thresholded logits.

    Soft Dice rewards overlap in proportion to the probability; the Lovasz hinge is the
    tight convex extension of the IoU loss itself, so its gradient goes to the pixels
    whose sign decides the IoU: the ones wrongly on the edge of an outline. The hinge
    errors ``1 - logit * sign`` are sorted, largest first, and each is weighted by how much
    the IoU loss grows when its pixel joins the ones before it; the weights depend only on
    the order (no gradient through the sort or the cumulative sums). An empty target
    gives all the weight to the largest error (the IoU loss is 1 from the first false
    pixel on).
    """
    logits = F.reshape(logits, (0, 0, -1))                 # (N, C, P)
    target = F.reshape(target, (0, 0, -1))
    errors = 1.0 - logits * (2.0 * target - 1.0)
    order = F.argsort(F.BlockGrad(errors), axis=2, is_ascend=False)
    rows = F.broadcast_like(F.reshape(F.contrib.arange_like(errors, axis=0), (-1, 1, 1)), errors)
    chans = F.broadcast_like(F.reshape(F.contrib.arange_like(errors, axis=1), (1, -1, 1)), errors)
    index = F.stack(rows, chans, order)
    sorted_target = F.gather_nd(target, index)
    positives = F.sum(sorted_target, axis=2, keepdims=True)
    inter = F.broadcast_sub(positives, F.cumsum(sorted_target, axis=2))
    union = F.broadcast_add(positives, F.cumsum(1.0 - sorted_target, axis=2))
    jaccard = 1.0 - inter / union                           # the IoU loss of the first k pixels, k = 1..P
    previous = F.concat(F.zeros_like(F.slice_axis(jaccard, axis=2, begin=0, end=1)),
                        F.slice_axis(jaccard, axis=2, begin=0, end=-1), dim=2)
    # gather_nd carries the gradient back to each pixel's error (a scatter-add)
    hinge = F.relu(F.gather_nd(errors, index))
    return F.mean(F.sum(hinge * F.BlockGrad(jaccard - previous), axis=2), axis=1)
