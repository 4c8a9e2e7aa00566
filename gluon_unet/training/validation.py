"""Validation after each epoch: the loss, pixel IoU and Dice over the whole validation
set, and the DSB score of the instances grown from the network's maps - the numbers
that pick the best checkpoint and drive early stopping.
"""
import time

import mxnet as mx
import numpy as np

from .. import metrics as M
from ..data.loader import make_loader
from ..data.targets import OUTPUTS, second_map_of
from ..inference import postprocess
from ..model import probability_maps
from .parallel import split_batch


def _forward_eval(net, ctxs, arrays, loss_fn, second=None):
    """Inference-mode forward of ``arrays[0]`` split over ``ctxs``: probability maps
    ``(N, K, H, W)`` (foreground, then the ``second`` map of a two-map model: 'border',
    'centre' or 'contact') and the summed loss against ``arrays[1:]`` (target, weight), computed on
    the devices; also whether the model is binary (a foreground, alone or with a second map)."""
    probs, losses = [], []
    with mx.autograd.predict_mode():
        for part in split_batch(arrays, ctxs):
            logits = net(part[0])
            losses.append(loss_fn(logits, *part[1:]).sum())
            probs.append(probability_maps(logits, second))
    maps = np.concatenate([p.asnumpy() for p in probs], axis=0)
    return maps, sum(float(l.asscalar()) for l in losses), bool(second) or logits.shape[1] == 1


def validate(net, ctxs, dataset, batch_size, loss_fn, threshold=0.5, instance_metric=True, keep=None):
    """Validation loss, pixel IoU (averaged over thresholds 0.50:0.95), Dice and DSB score.

    Pixel metrics are summed over the whole set (not averaged per batch), so the
    numbers do not depend on the batch size or on how batches fall on devices; they
    score the foreground against the true nuclei (a ``mask-gap`` model's target gaps
    count as foreground; a two-map model's second channel enters the loss and, through
    the instances, the DSB score). A two-map model's ``val_dsb`` is the better of two
    scores, both also returned: its instances grown from its second map's markers
    (``val_dsb_border``, ``val_dsb_centre`` or ``val_dsb_contact``) and from the distance
    watershed on its foreground (``val_dsb_distance``). With a list ``keep``, the first few
    ``(image, truth, probability)`` are appended to it (for TensorBoard's overlays).
    """
    pixel = M.PixelMetrics()
    loss_total, offset = 0.0, 0
    t0 = time.time()
    binary = True
    gap_target = getattr(dataset, 'target', 'mask') == 'mask-gap'
    second = second_output(getattr(dataset, 'target', 'mask'))
    # The search after training chooses a two-map model's markers between its second map
    # and the distance watershed (postprocess_search.tune_on_maps), so the epoch it is given
    # is picked by the better of the two: scored by the second map's markers alone, a
    # centre model's val_dsb peaked early while the distance watershed, which the search
    # then chose, kept improving (experiments/dsb2018/log.md, the centre map at depth 5).
    dsbs = {markers: M.DSBMetric() for markers in ((second, 'distance') if second else (None,))}
    for batch, maps, loss_sum, binary, true_labels in _val_batches(net, ctxs, dataset, batch_size, loss_fn):
        loss_total += loss_sum
        truth = batch[1].asnumpy()[:, 0]
        prob = maps[:, 0]
        labels = [true_labels(k) for k in range(len(prob))] if binary and (
            instance_metric or gap_target) else None
        if gap_target:  # its gaps are foreground in the truth: score against the true nuclei
            truth = np.stack(labels) > 0
        pixel.update(prob, truth > 0)  # foreground = any non-background class
        if keep is not None and len(keep) < KEEP_VAL_SAMPLES:
            keep.extend(zip(batch[0].asnumpy(), truth, prob))
            del keep[KEEP_VAL_SAMPLES:]
        if binary and instance_metric:
            for k in range(len(prob)):
                for markers, dsb in dsbs.items():
                    dsb.update(postprocess.instances_from_maps(maps[k], threshold, markers=markers), labels[k])
        offset += len(prob)
    px = pixel.result()
    result = {'val_loss': loss_total / max(1, offset), 'val_iou': px['iou'], 'val_iou50': px['iou50'],
              'val_dice': px['dice']}
    if instance_metric and binary:
        scores = {markers: dsb.result() for markers, dsb in dsbs.items()}
        result['val_dsb'] = max(scores.values())
        if second:
            result.update(('val_dsb_%s' % markers, score) for markers, score in scores.items())
    result['val_seconds'] = time.time() - t0
    return result


KEEP_VAL_SAMPLES = 4  # validation overlays per epoch in TensorBoard


def _val_batches(net, ctxs, dataset, batch_size, loss_fn):
    """The validation set in inference mode, batch by batch, in order, with the loader's
    deterministic crops: yields ``(batch, maps, loss_sum, binary, true_labels)`` (maps as
    :func:`_forward_eval` gives them), where
    ``true_labels(k)`` are the true instance labels of the batch's sample ``k``, cropped
    like its image (see :func:`val_instances`)."""
    loader = make_loader(dataset, batch_size, shuffle=False, seed=0, workers=0)
    seeds = loader.epoch_sampler.seeds()
    second = second_output(getattr(dataset, 'target', 'mask'))
    offset = 0
    for batch in loader:
        prob, loss_sum, binary = _forward_eval(net, ctxs, list(batch), loss_fn, second)
        yield batch, prob, loss_sum, binary, \
            (lambda k, first=offset: val_instances(dataset, first + k, seeds[first + k]))
        offset += len(prob)


def second_output(target):
    """The maps a ``--target`` adds ('border', 'centre', 'contact', 'flow'), or None."""
    return second_map_of(OUTPUTS[target])


def val_instances(dataset, i, seed):
    """The true instance labels of validation sample ``i`` as the network saw it (cropped
    like the image with the loader's ``seed``): touching nuclei count as separate
    objects, as in the DSB metric itself - not as connected components of the mask."""
    if dataset.transform is None:
        return dataset.instances(i)
    return dataset.sample(i, seed)[2]
