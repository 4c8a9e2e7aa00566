"""The run's data, ready to train on: datasets built from the config (or given), their
channel count resolved, transforms attached, a fingerprint for ``--resume`` and the
model card, and ``--balance``'s sampling of the appearance groups.

Used by training (:func:`gluon_unet.training.loop.fit`) and by the post-processing search that
``bin/export --tune-postprocess`` reruns on a run's own validation split
(:func:`gluon_unet.inference.postprocess_search.retune`): both rebuild the same data from a config.
"""
import dataclasses
import functools
import hashlib
import os
import warnings

import numpy as np

from . import layouts, readers
from ..errors import UserError
from ..outputs import check_apart as paths_apart
from .known import count_dsb2018
from .sizes import nucleus_sizes
from .augment import StainJitter, make_transform
from .dataset import split_indices
from .synthetic import synthetic_dataset
from .weights import WEIGHTED, unet_weight_map


def build_datasets(cfg):
    """Training and validation datasets for ``cfg`` (generated nuclei when ``data`` is None).

    Returns
    -------
    (train_ds, val_ds) : SegmentationDataset, SegmentationDataset or None
    """
    side = cfg.crop or cfg.size
    if cfg.data is None:
        full = synthetic_dataset(cfg.synthetic_count, side, channels=cfg.model.in_channels or 1,
                                 seed=cfg.seed)
        val = None
    else:
        opts = readers.LoadOptions(layout=cfg.layout, mask_suffix=cfg.mask_suffix, size=cfg.size, crop=cfg.crop,
                                   channels=cfg.model.in_channels, cache_dir=cfg.cache_dir, workers=cfg.workers,
                                   skip_unpaired=cfg.skip_unpaired, progress=cfg.progress, normalize=cfg.normalize,
                                   denoise=cfg.denoise, keep_colour=cfg.stain_jitter > 0, plane=cfg.plane)
        full = readers.load_dataset(cfg.data, masks=cfg.masks, options=opts)
        check_foreground(full, '--data', cfg.data)
        val = readers.load_dataset(cfg.val_data, options=opts, flag='--val-data') if cfg.val_data else None
        if val is not None:
            check_foreground(val, '--val-data', cfg.val_data)
            check_apart(full, val, cfg.val_data)
    if val is None and cfg.val_split > 0:
        train_idx, val_idx = split_indices(len(full), cfg.val_split, cfg.seed)
        train, val = full.subset(train_idx), full.subset(val_idx)
        if cfg.data is not None and len(val) and not any(np.any(val.masks[i]) for i in range(len(val))):
            # Training can go on, but its validation numbers cannot be read.
            warnings.warn('--val-split %g: every mask of the %d validation images is empty, so val_dsb is 1.0 '
                          'for an empty prediction; give --val-data or another --seed' % (cfg.val_split, len(val)))
        return train, val
    return full, val


def check_foreground(ds, flag, path):
    """Refuse a dataset whose every mask is empty: there is nothing to learn, and the
    DSB score of an empty prediction on empty masks is a perfect 1.0."""
    if len(ds) and not any(np.any(ds.masks[i]) for i in range(len(ds))):
        raise UserError('%s %s: every mask of its %d images is empty (no foreground pixel): nothing to learn, and '
                        'validation would score 1.0; check the masks (0 = background, > 0 = nucleus)'
                        % (flag, path, len(ds)))


def check_apart(train_ds, val_ds, val_path):
    """Refuse validation images that are also training images (the same pixels, whatever
    the file names): the best epoch, early stopping and the post-processing search would
    be chosen on images the network learned."""
    def digest(ds, i):
        return hashlib.sha1(np.ascontiguousarray(ds.images[i]).tobytes()).hexdigest()
    seen = {digest(train_ds, i): train_ds.names[i] for i in range(len(train_ds))}
    shared = [(val_ds.names[i], seen[d]) for i in range(len(val_ds)) for d in [digest(val_ds, i)] if d in seen]
    if shared:
        raise UserError('--val-data %s: %d of its %d images are also in --data (%s): validation would choose the '
                        'best epoch and tune the post-processing on training images; keep the two sets apart'
                        % (val_path, len(shared), len(val_ds), ', '.join(
                            v if v == t else '%s = %s' % (v, t) for v, t in shared[:3]) + (', ...' if len(shared) > 3
                                                                                            else '')))


def attach_transforms(cfg, train_ds, val_ds):
    """Augmentation (and crops) for training, with the stain jitter of its colour images
    (``--stain-jitter``, :class:`~.augment.StainJitter`); deterministic crops for
    validation."""
    weight_fn = None
    if cfg.loss in WEIGHTED:
        # wbce is the paper's map, class balancing included. wbce_dice keeps only its
        # border term: the Dice term already balances nuclei against background, so the
        # BCE stays calibrated as in bce_dice and the searched threshold means the same.
        weight_fn = functools.partial(unet_weight_map, class_balance=cfg.loss == 'wbce')
    train_tf = val_tf = None
    if cfg.augment or cfg.crop or cfg.elastic:
        train_tf = make_transform(augment=cfg.augment, elastic=cfg.elastic, crop=cfg.crop, scale=cfg.scale_range(),
                                  paste=cfg.paste_rate)
        if cfg.crop:
            # validate() draws per-sample seeds from a fixed sampler seed, so these
            # crops are the same every epoch: comparable numbers across epochs.
            val_tf = make_transform(augment=False, crop=cfg.crop)
    train_ds.transform, train_ds.weight_fn, train_ds.target = train_tf, weight_fn, cfg.model.target
    if cfg.stain_jitter > 0 and getattr(train_ds, 'colour', None) is not None:
        # The jittered colour image goes through what made the cached input: the run's
        # channels, --normalize and (in resize mode) --size.
        to_input = functools.partial(readers.network_input, channels=data_channels(train_ds),
                                     normalize=cfg.normalize, denoise=cfg.denoise, size=0 if cfg.crop else cfg.size)
        train_ds.stain = StainJitter(cfg.stain_jitter, to_input)
    if val_ds is not None:
        val_ds.transform, val_ds.weight_fn, val_ds.target = val_tf, weight_fn, cfg.model.target


def data_channels(ds):
    """Channel count of a dataset's images."""
    channels = getattr(ds, 'channels', None)
    return channels or int(np.asarray(ds.images[0]).shape[-1])


def data_fingerprint(train_ds, val_ds, num_workers=1):
    """What identifies the data a run trains on, for resume to compare and the model card
    to record: sample counts, a digest of the sample names in order (the split and the
    batches follow from them), a digest of the decoded images and masks, and the number
    of workers (with a dist kvstore they set the global batch); and how many of its images
    are the Data Science Bowl 2018's, by their ids (:mod:`.known`), which the model card
    keeps so that a package can cite that data without a word from the user."""
    names, content = hashlib.sha1(), hashlib.sha1()
    for ds in (train_ds, val_ds):
        names.update(('\n'.join(ds.names) if ds is not None else '').encode() + b'\0')
        for i in range(0 if ds is None else len(ds)):
            for arr in (ds.images[i], ds.masks[i]):
                arr = np.ascontiguousarray(arr)
                content.update(str(arr.shape).encode())
                content.update(arr.data)
    return {'train': len(train_ds), 'val': 0 if val_ds is None else len(val_ds),
            'names_sha1': names.hexdigest(), 'content_sha1': content.hexdigest(), 'workers': num_workers,
            'dsb2018_ids': sum(count_dsb2018(ds.names) for ds in (train_ds, val_ds) if ds is not None)}


#: The fingerprint's keys that say which images a run saw (``workers`` is not about the data).
DATA_KEYS = ('train', 'val', 'names_sha1', 'content_sha1')


def data_changed(old, new):
    """Whether the data fingerprint ``new`` (:func:`data_fingerprint`) names other images
    than ``old``, a checkpoint's record (None or missing keys, from older runs: not changed)."""
    return bool(old) and any(k in old and old[k] != new[k] for k in DATA_KEYS)


#: The config fields that are paths a run reads, and their flags.
PATH_FIELDS = (('data', '--data'), ('masks', '--masks'), ('val_data', '--val-data'), ('cache_dir', '--cache-dir'))


def data_inputs(cfg, whose=''):
    """What the data of ``cfg`` reads, as :func:`~gluon_unet.outputs.check_apart` takes it:
    ``--data``, ``--masks``, ``--val-data`` and, for a CSV, each folder its images and masks
    lie in (``whose``: ``"the run's "`` for a run's data read by another command)."""
    found = []
    for name, flag in PATH_FIELDS[:3]:
        path = getattr(cfg, name)
        if path:
            found.append((whose + flag, path))
            if os.path.isfile(path):
                found += [('%s%s (its CSV lists files in)' % (whose, flag), folder)
                          for folder in layouts.csv_folders(path)]
    return found


def check_data_apart(outputs, cfg, cache, command, whose='', also_read=(), own=()):
    """Refuse, in one line, an output that is, or lies inside, what the run's data reads
    (:func:`data_inputs`), the cache of decoded images ``cache`` or ``also_read``; and a
    cache - which decoding the data writes - that is, or lies inside, what it reads.

    ``own``: as :func:`~gluon_unet.outputs.check_apart`'s (the cache is never one of the
    files an output folder's command writes there)."""
    read = data_inputs(cfg, whose) + list(also_read)
    label = whose + '--cache-dir'
    paths_apart(outputs, read + [(label, cache)], command, own)
    paths_apart([(label, cache)], read, command, own)


def run_folder_of(checkpoint):
    """The run folder a checkpoint belongs to (``<run>/checkpoints/x.ckpt``), or None."""
    folder = os.path.dirname(os.path.abspath(checkpoint))
    return os.path.dirname(folder) if os.path.basename(folder) == 'checkpoints' else None


def training_cwd(meta, checkpoint):
    """The folder a run's relative paths were given in: the ``cwd`` its checkpoint
    records, else (runs from before it did) the folder its relative ``--output`` was
    given in, found from where the checkpoint lies; None when neither tells."""
    if isinstance(meta.get('cwd'), str) and os.path.isabs(meta['cwd']):
        return meta['cwd']
    output, run = (meta.get('config') or {}).get('output'), run_folder_of(checkpoint)
    if not isinstance(output, str) or not output or os.path.isabs(output) or run is None:
        return None
    parts = [p for p in os.path.normpath(output).split(os.sep) if p not in ('', '.')]
    if '..' in parts or not parts:
        return None
    base = run
    for part in reversed(parts):
        if os.path.basename(base) != part:
            return None  # the run folder was moved or renamed: its --output says nothing
        base = os.path.dirname(base)
    return base


def run_data_config(cfg, meta, checkpoint):
    """``cfg`` (a run's config, from ``checkpoint`` and its record ``meta``) with its
    relative ``--data``, ``--masks``, ``--val-data`` and ``--cache-dir`` resolved where
    the run was made (:func:`training_cwd`), not in the current folder; a path not found
    there but found here (an old run, or data moved with it) is taken from here."""
    cwd = training_cwd(meta, checkpoint)
    changes = {}
    for name, _ in PATH_FIELDS:
        path = getattr(cfg, name)
        if not path or os.path.isabs(path) or cwd is None:
            continue
        there = os.path.normpath(os.path.join(cwd, path))
        changes[name] = there if os.path.exists(there) or not os.path.exists(path) else os.path.abspath(path)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def check_run_data(cfg, meta, what):
    """Refuse, in one line naming ``what`` (``'export --tune-postprocess'``), to use a
    run's data when it is missing or no longer the images it trained on (its fingerprint,
    as ``--resume`` compares it): a search or a calibration on other images would be
    stored in the export as the run's own.

    Returns
    -------
    (train_ds, val_ds)
        The run's datasets, rebuilt from ``cfg`` (:func:`run_data_config`'s).
    """
    for name, flag in PATH_FIELDS[:3]:
        path = getattr(cfg, name)
        if path and not os.path.exists(path):
            raise UserError("%s: the run's %s %s is gone (the run trained on it); put the data back there"
                            % (what, flag, path))
    train_ds, val_ds = build_datasets(dataclasses.replace(cfg, progress=False))
    old, new = meta.get('data'), data_fingerprint(train_ds, val_ds)
    if data_changed(old, new):
        raise UserError("%s: the run's data changed since it trained (it trained on %d images and validated on %d, "
                        "now %d and %d, or other files or pixels in %s); put back the data it trained on"
                        % (what, old.get('train', 0), old.get('val', 0), new['train'], new['val'],
                           cfg.data or 'the generated nuclei'))
    return train_ds, val_ds


def prepare_data(cfg, train_ds, val_ds, num_workers=1):
    """The datasets (built from ``cfg`` when not given), ``cfg.model.in_channels``
    resolved from them, transforms attached, and their fingerprint."""
    if train_ds is None:
        train_ds, val_ds = build_datasets(cfg)
    channels = data_channels(train_ds)
    if cfg.model.in_channels == 0:
        cfg.model.in_channels = channels
    elif cfg.model.in_channels != channels:
        raise UserError('--channels %d but the data has %d channels' % (cfg.model.in_channels, channels))
    attach_transforms(cfg, train_ds, val_ds)
    data_id = data_fingerprint(train_ds, val_ds, num_workers)
    # The nuclei's sizes as the network saw them, for bin/predict --diameter: their median,
    # and their range per kind of image (--diameter range).
    data_id['diameter'], data_id['diameter_ranges'] = nucleus_sizes(
        (train_ds.instances(i) for i in range(len(train_ds))), getattr(train_ds, 'kinds', None))
    return train_ds, val_ds, data_id


#: ``--balance``: each group's share of an epoch grows as its size to this power.
BALANCE_POWER = {'groups': 0.0, 'sqrt': 0.5, 'oversample': 0.0}


def balanced_epoch_length(groups, balance):
    """Draws per epoch for ``--balance``: ``oversample`` draws every group as often as
    the largest one (groups x largest); the others keep the dataset's size (None)."""
    if balance != 'oversample' or groups is None:
        return None
    counts = np.unique(np.asarray(groups), return_counts=True)[1]
    return int(len(counts) * counts.max())


def log_groups(log, groups, balance):
    """Log the training images' appearance groups and what ``--balance`` does with them."""
    if groups is None:
        return
    names, counts = np.unique(np.asarray(groups), return_counts=True)
    sizes = ', '.join('%s %d' % (n, c) for n, c in zip(names, counts))
    if balance in BALANCE_POWER:
        weights = counts.astype(float) ** BALANCE_POWER[balance]
        draws_per_epoch = balanced_epoch_length(groups, balance) or len(groups)
        draws = ', '.join('%s ~%d' % (n, draws_per_epoch * w / weights.sum()) for n, w in zip(names, weights))
        log.info('appearance groups of the training images: %s; --balance %s draws per epoch: %s',
                 sizes, balance, draws)
    else:
        log.info('appearance groups of the training images: %s (--balance groups would draw them equally often)',
                 sizes)
