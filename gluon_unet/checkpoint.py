"""Resumable checkpoints: one file each, written atomically.

A checkpoint is a single ``mx.nd.save`` file holding the parameters (by structural
name, so a SyncBatchNorm model loads into a plain one), the optimizer state (moments as
named arrays; update counts and the LR scheduler's position in JSON - never a pickle, so
loading a checkpoint cannot run code) and a JSON record (config, epoch, step, best
value, history). It is written to a temporary
file in the same folder and ``os.replace``-d into place, so a crash at any moment leaves
either the old checkpoint or the new one - never half of one. A CRC-32 of all its arrays
(``digest``) is checked whenever it is read: a checkpoint damaged on disk since (a bad
copy, storage errors) stops the command in one line instead of training on it.

This is the file format both sides read: training writes and resumes checkpoints, export
rebuilds a model from one (:func:`model_from_checkpoint`). Which checkpoints a run keeps
is training's business (``recorder.CheckpointSaver``).
"""
import glob
import json
import os
import re

import mxnet as mx
import numpy as np

from .config import TrainConfig
from .errors import DamagedFile, UserError, mxnet_message
from .model import build_model
from .utils import DIGEST, atomic_path, crc32_of

# 2: optimizer state as named arrays + JSON (format 1 pickled it; see load_trainer_state).
# 3: that state keyed by the parameter's structural name, not the Trainer's index.
FORMAT = 3
_EPOCH_FILE = re.compile(r'epoch(\d+)(?:-step(\d+))?\.ckpt$')


def save_checkpoint(path, net, trainer, meta, average=None):
    """Write ``net`` parameters, ``trainer`` states and ``meta`` (JSON-able) to ``path``.

    With ``average`` (a :class:`~gluon_unet.training.ema.WeightAverage`) the model the
    checkpoint holds - what export, prediction and fine-tuning load - is the average;
    the training weights are kept beside it (``train:``) for ``--resume``.
    """
    weights = {name: p._reduce() for name, p in net._collect_params_with_prefix().items()}
    if average is None:
        arrays = {'param:' + name: w for name, w in weights.items()}
    else:
        arrays = {'train:' + name: w for name, w in weights.items()}
        # From the CPU: the average lives on the first training device, and mx.nd.load puts
        # an array saved from a GPU back on that GPU id whenever one is visible
        # (NDArray::Load, src/ndarray/ndarray.cc) - in export or predict, a CUDA context on
        # whatever card has that number there.
        arrays.update({'param:' + name: a.as_in_context(mx.cpu()) for name, a in average.arrays.items()})
    meta = dict(meta, format=FORMAT)
    if trainer is not None:
        opt_arrays, meta['optimizer_state'] = trainer_state(trainer, net)
        arrays.update(opt_arrays)
    arrays['meta'] = _bytes_array(json.dumps(meta).encode())
    arrays[DIGEST_KEY] = _bytes_array(json.dumps({DIGEST: '%08x' % arrays_crc32(arrays)}).encode())
    with atomic_path(path) as tmp:
        mx.nd.save(tmp, arrays)


#: The array holding a checkpoint's digest: JSON ``{"crc32": "<8 hex digits>"}`` over every
#: other array, in name order (:func:`arrays_crc32`).
DIGEST_KEY = 'digest'


def arrays_crc32(arrays):
    """CRC-32 over the named NDArrays ``arrays`` (the ``digest`` entry excluded), in
    name order: each name, dtype and shape, then the values' bytes."""
    crc = 0
    for name in sorted(arrays):
        if name == DIGEST_KEY:
            continue
        value = arrays[name]
        try:
            data = value.asnumpy()
        except TypeError:  # a dtype numpy lacks (bfloat16): its float32 values, the same at save and load
            data = value.astype('float32').asnumpy()
        crc = crc32_of([('%s|%s|%s;' % (name, data.dtype.str, data.shape)).encode(), data], crc)
    return crc


# Checkpoints verified in this process, by path -> (inode, size, mtime): resume and export
# read a checkpoint twice (its record, then its arrays); the second read is not checked again.
_VERIFIED = {}


def verify_checkpoint(path, arrays):
    """Raise :class:`~.errors.DamagedFile` when the arrays read from ``path`` do not match
    the digest stored with them. Checkpoints written before digests (no ``digest``
    entry) are read as they are: there is nothing to check them against."""
    if DIGEST_KEY not in arrays:
        return  # written before gluon_unet stored digests: still loads, unchecked
    try:
        st = os.stat(path)
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        stamp = None
    if stamp is not None and _VERIFIED.get(os.path.abspath(path)) == stamp:
        return
    try:
        stored = json.loads(arrays[DIGEST_KEY].asnumpy().tobytes().decode())[DIGEST]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        stored = None
    if stored != '%08x' % arrays_crc32(arrays):
        raise DamagedFile('checkpoint %s is damaged: its content does not match the digest written with it '
                          '(changed on disk since it was saved)' % path, path)
    if stamp is not None:
        _VERIFIED[os.path.abspath(path)] = stamp


def forget_verified():
    """Forget which checkpoints this process has verified: the next read of each checks
    its digest again (for timing the check)."""
    _VERIFIED.clear()


def checkpoint_is_good(path):
    """Whether ``path`` reads as a checkpoint and matches its digest."""
    try:
        verify_checkpoint(path, mx.nd.load(path))
        return True
    except (mx.MXNetError, UserError, OSError, ValueError):
        return False


def load_checkpoint(path, net=None, trainer=None, ctx=None, average=None):
    """Read a checkpoint; load it into ``net`` / ``trainer`` when given.

    ``net`` receives the checkpoint's model (the averaged weights of an ``--ema`` run);
    to resume such a run, pass its ``average`` too: ``net`` then receives the training
    weights and ``average`` the average.

    Returns
    -------
    meta : dict
        The JSON record (``config``, ``epoch``, ``step``, ...).
    """
    if not os.path.isfile(path):
        raise UserError('checkpoint %s does not exist' % path)
    try:
        arrays = mx.nd.load(path)
    except (mx.MXNetError, KeyError, ValueError) as exc:
        raise UserError('checkpoint %s is not a gluon_unet checkpoint or is damaged (%s)'
                        % (path, mxnet_message(exc, limit=120))) from None
    verify_checkpoint(path, arrays)
    try:
        meta = json.loads(arrays['meta'].asnumpy().tobytes().decode())
    except (mx.MXNetError, KeyError, ValueError) as exc:
        raise UserError('checkpoint %s is not a gluon_unet checkpoint or is damaged (%s)'
                        % (path, mxnet_message(exc, limit=120))) from None
    if average is not None:
        if not any(k.startswith('train:') for k in arrays):
            raise UserError('--resume %s: this checkpoint has no weight average (it was written without --ema)'
                            % path)
        average.load({k[len('param:'):]: v for k, v in arrays.items() if k.startswith('param:')}, path)
    if net is not None:
        params = net._collect_params_with_prefix()
        prefix = 'train:' if average is not None else 'param:'
        saved = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
        missing, extra = set(params) - set(saved), set(saved) - set(params)
        if missing or extra:
            raise UserError('checkpoint %s does not fit this model (missing %s, unexpected %s): was it '
                            'trained with another --width/--depth/--channels?'
                            % (path, sorted(missing)[:3], sorted(extra)[:3]))
        for name, p in params.items():
            if p.shape != saved[name].shape:
                raise UserError('checkpoint %s: parameter %s has shape %s, the model wants %s'
                                % (path, name, saved[name].shape, p.shape))
            if p._data is None:
                p.initialize(ctx=ctx or [mx.cpu()])
            p.set_data(saved[name])
    if trainer is not None:
        if 'trainer_states' in arrays:
            # Written before format 2: MXNet's pickled Updater. Unpickling it could run
            # any code the file's author chose, so it is never read.
            raise UserError('--resume %s: this checkpoint stores its optimizer state as a Python pickle '
                            '(gluon_unet < 0.2), which can run code when loaded; refusing to resume from it '
                            '(bin/export still reads its weights)' % path)
        if 'optimizer_state' in meta:
            load_trainer_state(trainer, arrays, meta['optimizer_state'], path, net=net)
    return meta


def model_from_checkpoint(checkpoint, ctxs=None):
    """The U-Net of ``checkpoint``'s config with its weights, on ``ctxs`` (default the
    CPU), not hybridized.

    Returns
    -------
    (net, cfg, meta)
        The block, its :class:`TrainConfig` and the checkpoint's record.
    """
    ctxs = ctxs or [mx.cpu()]
    meta = load_checkpoint(checkpoint)
    cfg = TrainConfig.from_dict(meta['config'])
    net = build_model(cfg.model)
    net.initialize(ctx=ctxs)
    net(dummy_input(cfg, ctxs[0]))  # resolves the deferred parameter shapes before loading
    load_checkpoint(checkpoint, net=net)
    return net, cfg, meta


def dummy_input(cfg, ctx):
    """A zero batch of one image of ``cfg``'s training shape, on ``ctx``: one forward of it
    resolves a network's deferred parameter shapes (and builds a hybridized graph)."""
    side = cfg.crop or cfg.size
    return mx.nd.zeros((1, cfg.model.in_channels, side, side), ctx=ctx)


def list_checkpoints(folder):
    """Epoch checkpoints in ``folder``, oldest first (``best.ckpt`` excluded)."""
    found = []
    for path in glob.glob(os.path.join(folder, 'epoch*.ckpt')):
        m = _EPOCH_FILE.search(os.path.basename(path))
        if m:
            found.append(((int(m.group(1)), int(m.group(2) or 0)), path))
    return [p for _, p in sorted(found)]


def resolve_resume(resume, output):
    """``--resume auto`` -> latest checkpoint of the run (or None); a path is checked."""
    if resume is None:
        return None
    if resume == 'auto':
        found = list_checkpoints(os.path.join(output, 'checkpoints'))
        return found[-1] if found else None
    if os.path.isdir(resume):
        found = list_checkpoints(os.path.join(resume, 'checkpoints')) or list_checkpoints(resume)
        if not found:
            raise UserError('--resume %s: no checkpoint in that folder' % resume)
        return found[-1]
    if not os.path.isfile(resume):
        raise UserError('--resume %s: no such checkpoint file' % resume)
    return resume


def earlier_good_checkpoint(path):
    """The newest checkpoint of ``path``'s folder older than ``path`` that reads and
    matches its digest (``best.ckpt`` last, and only when it is another file), or None."""
    folder = os.path.dirname(os.path.abspath(path))
    found = list_checkpoints(folder)
    real = [os.path.realpath(p) for p in found]
    older = found[:real.index(os.path.realpath(path))] if os.path.realpath(path) in real else found
    for candidate in older[::-1] + [os.path.join(folder, 'best.ckpt')]:
        if (os.path.isfile(candidate) and not os.path.samefile(candidate, path)
                and checkpoint_is_good(candidate)):
            return candidate
    return None


def damaged_resume(exc, resume):
    """The one-line error for ``--resume`` landing on the damaged checkpoint of ``exc``
    (a :class:`~.errors.DamagedFile`): it names the earlier good checkpoint to resume from."""
    earlier = earlier_good_checkpoint(exc.path)
    if earlier is None:
        note = 'no earlier checkpoint of this run is intact: start it over (--overwrite) or restore the file'
    else:
        note = 'the newest intact one is %s: continue from it with --resume %s' % (earlier, earlier)
    return DamagedFile('--resume %s: %s; %s' % (resume, exc, note), exc.path)


def _bytes_array(b):
    return mx.nd.array(np.frombuffer(b, dtype=np.uint8), ctx=mx.cpu(), dtype=np.uint8)


# -- optimizer state without pickle ---------------------------------------------------------
#
# MXNet's Trainer.save_states pickles its Updater (states and optimizer object), and
# load_states unpickles whatever it is given: a crafted checkpoint would run code on
# --resume. We store the same information as data instead: every state tensor as a named
# NDArray in the checkpoint (``opt:<index>:<path>``) and, as JSON, the nesting of each
# state (None, one array, or tuples of them: Adam's (mean, var)), the optimizer's class and
# its progress counters, and the LR scheduler's mutable position. The optimizer and
# scheduler objects themselves are rebuilt from the config, which resume checks is the same.

# Scheduler attributes that change while training (mx.lr_scheduler: FactorScheduler and
# MultiFactorScheduler decay base_lr in place and count steps; the others are stateless).
_SCHEDULER_PROGRESS = ('base_lr', 'count', 'cur_step_ind')


def _updaters(trainer):
    """The Updaters holding ``trainer``'s optimizer states (one per device, or the kvstore's)."""
    if not trainer._kv_initialized:
        trainer._init_kvstore()
    if trainer._params_to_init:
        trainer._init_params()
    if trainer._update_on_kvstore:
        return [trainer._kvstore._updater]
    return trainer._updaters


# Why states are keyed by the parameter's structural name ('n' + '0.weight'), not the
# Trainer's index: gluon.Trainer numbers a ParameterDict's parameters in the order of their
# *sorted global names* (trainer.py: ``for key in sorted(params.keys())``), and those names
# carry process-wide counters ('hybridsequential9_conv0_weight'). A run resumed in a
# process that built another number of blocks first (a notebook, a test session, a
# search) numbers them differently once a counter crosses a power of ten ('conv10' sorts
# before 'conv9'), and index-keyed moments would land on the wrong weights - silently
# where two shapes agree. Format-2 checkpoints ('i' keys) still load, shape-checked.

def _state_names(trainer, net):
    """{Trainer index: structural name} for ``trainer``'s parameters found in ``net``."""
    if net is None:
        return {}
    structural = {p.name: name for name, p in net._collect_params_with_prefix().items()}
    return {i: structural[p.name] for i, p in enumerate(trainer._params) if p.name in structural}


def _index_key(index, names):
    if isinstance(index, int):
        return ('n' + names[index]) if index in names else ('i%d' % index)
    return 's' + str(index)  # a kvstore's own string key: kept as it is


def _index_from_key(key, indices, path):
    """The Trainer index a saved state key belongs to (``indices``: structural name -> index)."""
    if key[0] == 'n':
        if key[1:] not in indices:
            raise UserError('--resume %s: the checkpoint holds optimizer state for parameter %s, which this '
                            'model lacks' % (path, key[1:]))
        return indices[key[1:]]
    if key[0] == 'i':
        return int(key[1:])
    return key[1:]


def _check_state_shapes(trainer, states, path):
    """Refuse states whose arrays do not match their parameter's shape (format-2 index
    keys from a process that numbered the parameters another way)."""
    for index, state in states.items():
        if not isinstance(index, int) or index >= len(trainer._params):
            continue
        want = trainer._params[index].shape
        for arr in _state_arrays(state):
            if arr.shape != want:
                raise UserError('--resume %s: optimizer state %s has shape %s, its parameter %s has %s (a format-2 '
                                'checkpoint, keyed by position, resumed in a Python session that numbered the '
                                'parameters otherwise); resume it with bin/train'
                                % (path, index, arr.shape, trainer._params[index].name, want))


def _state_arrays(state):
    if isinstance(state, mx.nd.NDArray):
        return [state]
    if isinstance(state, (tuple, list)):
        return [a for s in state for a in _state_arrays(s)]
    return []


def _flatten_state(state, name, arrays):
    """Put the NDArrays of ``state`` into ``arrays``; return its JSON-able nesting."""
    if state is None:
        return None
    if isinstance(state, mx.nd.NDArray):
        arrays[name] = state.copyto(mx.cpu())
        return 'nd'
    if isinstance(state, (tuple, list)):
        return [_flatten_state(s, '%s.%d' % (name, k), arrays) for k, s in enumerate(state)]
    raise TypeError('cannot store optimizer state of type %s' % type(state).__name__)


def _unflatten_state(layout, name, arrays):
    if layout is None:
        return None
    if layout == 'nd':
        return arrays[name].copy()  # each device's updater gets its own array
    return tuple(_unflatten_state(s, '%s.%d' % (name, k), arrays) for k, s in enumerate(layout))


def trainer_state(trainer, net=None):
    """``trainer``'s optimizer state as ``(arrays, record)``: NDArrays and a JSON-able dict.

    Devices share one optimizer and apply the same summed gradient, so their states are
    equal; like ``Trainer.save_states``, the first device's are stored. With ``net`` (the
    block ``trainer`` trains), states are keyed by structural parameter name.
    """
    updater = _updaters(trainer)[0]
    opt = updater.optimizer
    names = _state_names(trainer, net)
    arrays, layout = {}, {}
    for index, state in updater.states.items():
        key = _index_key(index, names)
        layout[key] = _flatten_state(state, 'opt:' + key, arrays)
    sched = opt.lr_scheduler
    record = {
        'optimizer': type(opt).__name__.lower(),
        'layout': layout,
        'num_update': int(opt.num_update),
        'begin_num_update': int(opt.begin_num_update),
        # Per-device update counts (Adam's bias correction reads them), by device id as
        # MXNet keeps them; load_trainer_state gives every device of the resumed run its
        # parameter's count, whichever ids these are.
        'index_update_counts': {str(dev): {_index_key(i, names): int(n) for i, n in counts.items()}
                                for dev, counts in opt._all_index_update_counts.items()},
        'lr_scheduler': None if sched is None else {
            'class': type(sched).__name__,
            **{k: getattr(sched, k) for k in _SCHEDULER_PROGRESS if hasattr(sched, k)}},
    }
    return arrays, record


def load_trainer_state(trainer, arrays, record, path='checkpoint', net=None):
    """Restore what :func:`trainer_state` saved into ``trainer`` (built from the same
    config); ``net`` is the block it trains (needed for state keyed by structural name)."""
    updaters = _updaters(trainer)
    indices = {name: i for i, name in _state_names(trainer, net).items()}
    opt = updaters[0].optimizer
    if record.get('optimizer') != type(opt).__name__.lower():
        raise UserError('--resume %s: the checkpoint holds %s optimizer state, this run uses %s; '
                        'use the same --optimizer' % (path, record.get('optimizer'), type(opt).__name__.lower()))
    sched = opt.lr_scheduler
    saved_sched = record.get('lr_scheduler')
    if (saved_sched or {}).get('class') != (type(sched).__name__ if sched is not None else None):
        raise UserError('--resume %s: the checkpoint was trained with another learning-rate schedule; '
                        'use the same --lr-schedule and --warmup-epochs' % path)
    try:
        for updater in updaters:
            updater.states = {_index_from_key(k, indices, path): _unflatten_state(v, 'opt:' + k, arrays)
                              for k, v in record['layout'].items()}
            _check_state_shapes(trainer, updater.states, path)
            # Moved to each weight's device at its first update (Updater.sync_state_context).
            updater.states_synced = dict.fromkeys(updater.states, False)
    except KeyError as exc:
        raise UserError('checkpoint %s is damaged: optimizer state %s is missing' % (path, exc)) from None
    opt.num_update = record['num_update']
    opt.begin_num_update = record['begin_num_update']
    # MXNet counts each parameter's updates per device id (Updater.__call__ ->
    # Optimizer._set_current_context(weight.context.device_id)), and Adam's bias
    # correction reads that count: a device id the checkpoint lacks would restart at t=1
    # and its weight copy drift from the others. Which ids count depends on the device
    # count - one per device without update_on_kvstore; with it, the merge buffer's GPU
    # of each key (CommDevice::InitMergeBuffer spreads keys over the GPUs) or
    # cpu_pinned(0) on CPU - so the saved ids need not be this run's. Every device
    # updates every parameter at every step, so a parameter has one true count (the
    # largest saved, also in checkpoints a resume onto more devices wrote before this
    # fix): every device id this trainer can update on gets it.
    counts = {}
    for per_device in record['index_update_counts'].values():
        for k, n in per_device.items():
            index = _index_from_key(k, indices, path)
            counts[index] = max(int(n), counts.get(index, 0))
    device_ids = {0} | {ctx.device_id for ctx in trainer._contexts}
    opt._all_index_update_counts = {dev: dict(counts) for dev in sorted(device_ids)}
    opt._index_update_count = opt._all_index_update_counts[0]
    if sched is not None:
        for k in _SCHEDULER_PROGRESS:
            if k in saved_sched:
                setattr(sched, k, saved_sched[k])
