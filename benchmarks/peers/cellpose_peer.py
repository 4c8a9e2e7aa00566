"""Cellpose 3 as a peer of gluon_unet (issue 71): trained from scratch on a DSB-layout folder
for a wall-time budget, with its size model, then predicting a folder into
``<id>_labels.png`` (16-bit instance labels) that ``bin/evaluate`` scores like
``bin/predict``'s.

Install (its own venv, never the project's ``.venv``; Python 3.11, for which the CPU build of
torch 2.13.0 lies on this machine's disk: install it first, so that cellpose's ``torch>=1.6``
takes it and pip never pulls a CUDA build of several GB)::

    /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/venv-cellpose
    /tmp/venv-cellpose/bin/pip install torch==2.13.0
    /tmp/venv-cellpose/bin/pip install -r benchmarks/peers/requirements-cellpose.txt

Run (from the repository root)::

    /tmp/venv-cellpose/bin/python benchmarks/peers/cellpose_peer.py train \\
        --data /tmp/dsb/train --out /tmp/peers/cellpose --minutes 58
    /tmp/venv-cellpose/bin/python benchmarks/peers/cellpose_peer.py predict \\
        --model /tmp/peers/cellpose --input /tmp/dsb/holdout --output /tmp/peers/pred-cellpose
    .venv/bin/python bin/evaluate --pred /tmp/peers/pred-cellpose --truth /tmp/dsb/holdout --csv cp.csv
    # fine-tune that model on a few images (gluon_unet's few-shot protocol), then predict as above
    /tmp/venv-cellpose/bin/python benchmarks/peers/cellpose_peer.py train --init /tmp/peers/cellpose \\
        --data /tmp/fewshot/brightfield/k3/train --out /tmp/peers/cellpose-ft

What it does, and why:

* Cellpose 3.1 (the last U-Net Cellpose, ``CPnet`` 32-64-128-256; Cellpose 4's ``cpsam`` is a
  ViT-L that cannot be trained on these CPUs) from random weights (``pretrained_model=False``,
  what its CLI's ``--pretrained_model None`` means): nothing can be downloaded here, and the
  comparison is of methods trained on the same images.
* Nuclei setup: grey input, ``channels=[0, 0]`` (grey + an empty second channel, ``nchan=2``)
  and ``diam_mean=17``, the size the built-in ``nuclei`` model rescales nuclei to. Training
  takes the CLI's defaults for training (``python -m cellpose --train``): SGD, learning rate
  0.2, momentum 0.9, weight decay 1e-5, batch 8, 224 px crops, each image rescaled by its
  own mean nucleus diameter to ``diam_mean`` (+- scale augmentation), images with fewer
  than 5 nuclei left out (``min_train_masks``), its percentile normalization (1-99).
  Images are made grey as gluon_unet's ``--channels 1`` makes them (colour -> luma);
  ``--invert-bright`` inverts bright-background images as gluon_unet's ``--normalize
  auto`` does (off by default: Cellpose is run as it is).
* The budget: the CLI's 500 epochs are sized by ``nimg_per_epoch`` so that they fill the
  time (an epoch = that many images drawn at random), keeping Cellpose's learning-rate
  schedule (10 warm-up epochs, then halvings over the last 100) whole; the time per batch
  is measured first on a few batches at learning rate 0. If the machine slows down, a
  guard stops training at the deadline anyway (``stopped_by_guard`` in the record).
  ``--minutes`` is the wall time of the whole command, imports, flows and the size model
  included. ``--match BUDGET_JSON`` repeats a recorded run's work instead (its planned
  epochs, its batches, its size model's epochs and images), on a CPU slower or busier than
  the one that recorded it; ``--minutes`` is then only the guard.
* Diameter: Cellpose 3 trains its size model from scratch too (``train.train_size``: a
  linear regression from the network's style vector to the log nucleus diameter), in the
  last ``--size-minutes`` of the budget; ``predict`` estimates each image's diameter with
  it and segments at that diameter, as ``models.Cellpose.eval`` does with a built-in model.
  ``--diameter N`` (predict) overrides it with a fixed value, 0 = the training mean.
* ``train --init MODEL_DIR`` fine-tunes a model this script trained (``pretrained_model=``
  its weights; its ``diam_mean``, saved in them, and its inversion setting kept) with
  Cellpose's own fine-tuning settings, those of its GUI's human-in-the-loop training (SGD at
  0.1, half the CLI's rate; weight decay 1e-4; ``min_train_masks=0``; no test images), for
  gluon_unet's 2,560 crops: 80 epochs of 32 (train_seg's 10 warm-up epochs, then flat, as
  the GUI's 100). The source's size model is copied unless ``--retrain-size`` (the GUI
  itself segments at the training images' mean diameter after training: ``predict
  --diameter 0``). ``--minutes`` is then an optional cap. ``budget.json`` and ``peer.json``
  record the source folder, its weights file and its SHA-256.
* ``MODEL_DIR/budget.json`` records wall and CPU seconds, epochs, batches, images seen, the
  machine's load beside the run; ``predict`` records seconds, CPU seconds and peak resident
  memory (``VmHWM``, reset before each image) per image in ``OUTPUT/prediction_times.csv``
  and ``OUTPUT/prediction.json``.

Threads: ``torch.set_num_threads`` from ``OMP_NUM_THREADS`` (else every allowed core). This
script never imports gluon_unet (its venv has no MXNet); what it shares with
``stardist_peer.py`` is in ``peer_common.py`` and ``peer_flags.py`` beside it.
"""
import argparse
import os
import sys
import time

_T0 = time.time()  # the budget counts from here: imports and data loading are part of it

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: Cellpose's nuclei setup and its CLI's training defaults (cellpose 3.1 ``cli.py``).
DIAM_MEAN = 17.0
CHANNELS = [0, 0]
TRAIN = dict(learning_rate=0.2, weight_decay=1e-5, momentum=0.9, SGD=True, batch_size=8, min_train_masks=5)
TARGET_EPOCHS = 500
#: A fine-tune's settings (``train --init``): those of Cellpose's own fine-tuning, its GUI's
#: human-in-the-loop training (cellpose 3.1 ``gui/gui.py``: ``training_params`` and
#: ``train_model``): SGD at learning rate 0.1 (half the CLI's 0.2), weight decay 1e-4,
#: every annotated image trains (``min_train_masks=0``); its 100 epochs of max(8, n)
#: images become gluon_unet's 2,560 crops (20 x 128) as 80 epochs of 32 (4 batches of 8),
#: which keeps the same schedule shape (``train_seg``: 10 warm-up epochs from rate 0, then
#: flat; it decays only beyond 100 epochs).
FINE_TUNE = dict(learning_rate=0.1, weight_decay=1e-4, momentum=0.9, SGD=True, batch_size=8, min_train_masks=0)
FT_SAMPLES = 2560
FT_EPOCHS = 80
#: Batches timed at learning rate 0 before the plan: the time between the first two loss
#: calls is one whole batch (backward, the next batch's crops, forward), without the first
#: call's warm-up.
CALIBRATION_BATCHES = 2


def build_parser():
    from peer_flags import AT_LEAST_1, NON_NEGATIVE, POSITIVE, SEED, OneLineParser, add_predict_flags, \
        add_train_flags
    p = OneLineParser(prog='cellpose_peer.py', description=__doc__.split('\n\n')[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='command', required=True)
    t = sub.add_parser('train', help='train from scratch (and its size model), or fine-tune (--init), on a '
                                     'DSB-layout folder')
    add_train_flags(t, 'model folder to create (weights, size model, budget.json)')
    t.add_argument('--size-minutes', type=NON_NEGATIVE, default=None,
                   help='of the budget, kept for the size model (default: 8%% of --minutes, at least 0.3)')
    t.add_argument('--epochs', type=AT_LEAST_1, default=None,
                   help='epochs the budget is divided into (default %d, the CLI\'s); with --init the epochs '
                        'the --samples are divided into (default %d)' % (TARGET_EPOCHS, FT_EPOCHS))
    t.add_argument('--seed', type=SEED, default=0)
    f = t.add_argument_group('fine-tuning (--init)')
    f.add_argument('--init', metavar='MODEL_DIR', default=None,
                   help='start from a model folder made by this script\'s train: its weights (pretrained_model=), '
                        'its diam_mean, its inversion setting and its size model')
    f.add_argument('--samples', type=AT_LEAST_1, default=None,
                   help='training crops in all (default %d, gluon_unet\'s 20 x 128), in whole batches of 8'
                        % FT_SAMPLES)
    f.add_argument('--learning-rate', type=POSITIVE, default=None,
                   help='SGD rate (default %g, the GUI\'s fine-tuning rate)' % FINE_TUNE['learning_rate'])
    f.add_argument('--retrain-size', action='store_true',
                   help='retrain the size model on the fine-tune\'s images (default: keep the source\'s)')
    q = sub.add_parser('predict', help='predict a folder into <id>_labels.png')
    add_predict_flags(q, 'a folder made by train')
    q.add_argument('--diameter', type=NON_NEGATIVE, default=None,
                   help='a fixed nucleus diameter in pixels instead of the size model (0 = the training mean)')
    return p


def _threads():
    from peer_common import thread_count
    import torch
    n = thread_count()
    torch.set_num_threads(n)
    return dict(torch_threads=n)


def _versions():
    import cellpose
    import numpy
    import torch
    from cellpose import version
    return dict(cellpose=version, torch=torch.__version__, numpy=numpy.__version__,
                python=sys.version.split()[0], cellpose_file=os.path.dirname(cellpose.__file__))


class _OutOfTime(Exception):
    pass


class _BatchClock:
    """Wraps ``cellpose.train._loss_fn_seg``, which ``train_seg`` calls once per batch: it
    counts batches and images, times them, and raises :class:`_OutOfTime` past a deadline
    (``train_seg`` has no callback; the weights it trained stay in ``net``), never before
    the first batch (as StarDist's stop, which comes after a step)."""

    def __init__(self, train_module):
        self.module = train_module
        self.original = train_module._loss_fn_seg
        self.deadline = float('inf')
        self.max_batches = float('inf')  # --match: the recorded run's batches
        self.reset()
        train_module._loss_fn_seg = self

    def reset(self):
        self.batches, self.images, self.times = 0, 0, []

    def __call__(self, lbl, y, device):
        if self.batches and (time.time() > self.deadline or self.batches >= self.max_batches):
            raise _OutOfTime()
        self.batches += 1
        self.images += len(lbl)
        self.times.append(time.time())
        return self.original(lbl, y, device)


def _grey_inputs(samples, invert_bright):
    from peer_common import invert_if_bright, read_grey, read_labels
    X, Y, n_inv = [], [], 0
    for _sid, img_path, mask_paths in samples:
        grey = read_grey(img_path)
        if invert_bright:
            grey, inv = invert_if_bright(grey)
            n_inv += inv
        X.append(grey)
        Y.append(read_labels(mask_paths))
    return X, Y, n_inv


def _check_args(args):
    """The flags' combinations, and a --init folder, checked before torch is imported (one
    line on stderr, exit 2). Returns the source's ``(settings, weights path)`` or None."""
    from peer_common import fail, read_init
    if args.init is None:
        given = [n for n in ('samples', 'learning_rate') if getattr(args, n) is not None]
        given += ['retrain_size'] if args.retrain_size else []
        if given:
            fail('--%s only with --init (a fine-tune)' % given[0].replace('_', '-'))
        if args.minutes is None:
            fail('--minutes is required when training from scratch')
        return None
    if args.match:
        fail('--match only when training from scratch (a fine-tune\'s length is --samples)')
    settings, weights = read_init(args.init, 'cellpose', 'cellpose_peer.py', 'models/cellpose_peer',
                                  needed=() if args.retrain_size else ('size_model',))
    if args.invert_bright and not settings.get('invert_bright'):
        fail('--invert-bright contradicts --init %s, trained without it: a fine-tune keeps its source\'s '
             'preprocessing' % args.init)
    return settings, weights


def _start(args, match=None):
    """What a training from scratch and a fine-tune do first: refuse an --out that holds a
    model, list the samples (as many as ``match``, a --match record, had), set the threads
    and seeds. Returns ``(threads, samples)``."""
    import numpy as np
    from peer_common import check_match_data, list_dsb
    if os.path.exists(os.path.join(args.out, 'budget.json')):
        raise SystemExit('%s already holds a model; choose another --out' % args.out)
    samples = list_dsb(args.data)
    samples = samples[:args.limit] if args.limit else samples
    if match:
        check_match_data(args.match, match, samples, args.data)
    import torch
    threads = _threads()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    return threads, samples


def _train_seg(cp_train, clock, cp, out, **kwargs):
    """Cellpose's ``train_seg`` on ``cp.net`` until it ends or ``clock``'s guard stops it;
    the weights are saved either way (the guard stops it before its own save) and ``cp``
    predicts with them. Returns ``(stopped, seconds, cpu_seconds, weights_path)``."""
    from peer_common import cpu_seconds
    cpu0, t0 = cpu_seconds(), time.time()
    stopped = False
    try:
        cp_train.train_seg(cp.net, **kwargs)
    except _OutOfTime:
        stopped = True
    seconds, cpu = time.time() - t0, cpu_seconds() - cpu0
    clock.deadline = float('inf')
    weights = os.path.join(out, 'models', 'cellpose_peer')
    cp.net.save_model(weights)
    cp.pretrained_model = weights
    return stopped, seconds, cpu, weights


def fine_tune(args, init):
    """``train --init``: Cellpose's own fine-tuning (its GUI's settings, :data:`FINE_TUNE`)
    from a model of this script, for a number of crops rather than a budget; ``--minutes``,
    when given, is a cap the batch guard keeps. The source's diam_mean (saved in its weights)
    and size model are kept unless ``--retrain-size``."""
    import shutil

    from peer_common import (Budget, cpu_seconds, fail, file_sha256, init_record, machine_busy_seconds,
                             machine_info, write_json)
    settings, src_weights = init
    budget = Budget(args.minutes if args.minutes else 1e9, start=_T0)
    busy0 = machine_busy_seconds()
    invert_bright = bool(settings.get('invert_bright'))
    threads, samples = _start(args)
    import torch
    from cellpose import dynamics, models
    from cellpose import train as cp_train
    try:
        cp = models.CellposeModel(gpu=False, pretrained_model=src_weights, model_type=None, nchan=2)
    except Exception as e:  # another network's file, or damaged
        fail('--init %s: its weights %s do not load (%s)' % (args.init, os.path.relpath(src_weights, args.init),
                                                             str(e).splitlines()[0] if str(e) else type(e).__name__))
    diam_mean = float(cp.diam_mean)
    source = init_record(args.init, src_weights, diam_mean=diam_mean, diam_labels=settings.get('diam_labels'))
    os.makedirs(os.path.join(args.out, 'models'), exist_ok=True)
    X, Y, n_inv = _grey_inputs(samples, invert_bright)
    t_flow = time.time()
    flows = dynamics.labels_to_flows(Y, device=torch.device('cpu'))
    flow_seconds = time.time() - t_flow

    settings_ft = dict(FINE_TUNE, learning_rate=args.learning_rate or FINE_TUNE['learning_rate'])
    batch = settings_ft['batch_size']
    n_epochs = args.epochs or FT_EPOCHS
    wanted = args.samples or FT_SAMPLES
    per_epoch = max(1, int(round(wanted / float(n_epochs * batch))))  # whole batches per epoch
    nimg_per_epoch = per_epoch * batch
    size_reserve = 0.0
    if args.retrain_size and args.minutes:
        size_reserve = (args.size_minutes if args.size_minutes is not None else max(0.3, 0.08 * args.minutes)) * 60
    print('%d images (%d inverted), flows in %.1f s, loaded at %.1f s; fine-tune of %s: %d epochs x %d crops '
          '(%d in all) at %g%s' % (len(X), n_inv, flow_seconds, budget.elapsed(), args.init, n_epochs, nimg_per_epoch,
                                   n_epochs * nimg_per_epoch, settings_ft['learning_rate'],
                                   ', cap %.1f min' % args.minutes if args.minutes else ''), flush=True)

    clock = _BatchClock(cp_train)
    clock.deadline = budget.deadline - size_reserve if args.minutes else float('inf')
    stopped, train_seconds, train_cpu, weights = _train_seg(
        cp_train, clock, cp, args.out, train_data=X, train_labels=flows, channels=CHANNELS, normalize=True,
        save_path=args.out, model_name='cellpose_peer', rescale=True, n_epochs=n_epochs,
        nimg_per_epoch=nimg_per_epoch, save_every=max(100, n_epochs), **settings_ft)
    batches, images = clock.batches, clock.images
    diam_labels = float(cp.net.diam_labels.item())  # train_seg sets it: the fine-tune images' mean

    size_path = weights + '_size.npy'
    t_size = time.time()
    if args.retrain_size:
        # as the from-scratch size model, on these images (all of them: min_train_masks 0)
        cp_train.train_size(cp.net, weights, train_data=X, train_labels=flows, channels=CHANNELS, normalize=True,
                            min_train_masks=0, batch_size=batch, n_epochs=10, nimg_per_epoch=max(batch, len(X)))
        size_source = 'retrained on the fine-tune\'s images (train.train_size, 10 epochs of %d crops)' % max(batch,
                                                                                                           len(X))
    else:
        shutil.copyfile(os.path.join(args.init, settings['size_model']), size_path)
        size_source = 'the source\'s, copied (%s)' % file_sha256(size_path)
    size_seconds = time.time() - t_size

    busy1 = machine_busy_seconds()
    wall = budget.elapsed()
    record = dict(
        peer='cellpose', minutes=args.minutes, wall_seconds=round(wall, 1),
        over_budget_seconds=round(max(0.0, wall - budget.seconds), 1) if args.minutes else None,
        flow_seconds=round(flow_seconds, 1), train_wall_seconds=round(train_seconds, 1),
        train_cpu_seconds=round(train_cpu, 1), cpu_seconds=round(cpu_seconds(), 1),
        seconds_per_batch=round(train_seconds / batches, 3) if batches else None,
        size_model_seconds=round(size_seconds, 1), size_model=size_source,
        machine_busy_seconds=None if busy0 is None else round(busy1 - busy0, 1),
        machine_busy_note='CPU seconds of every process on the machine during the run; this run\'s own is '
                          'cpu_seconds',
        planned_epochs=n_epochs, nimg_per_epoch=nimg_per_epoch, batches=batches, images_seen=images,
        epochs=round(batches / per_epoch, 3), stopped_by_guard=stopped,
        images_seen_note='training crops (%d px), one per image drawn; train_seg\'s first epoch runs at rate 0 '
                         '(its warm-up starts there)' % 224,
        train_images=len(X), trained_images=len(X), inverted_images=n_inv, invert_bright=invert_bright,
        diam_mean=diam_mean, diam_labels=round(diam_labels, 2), channels=CHANNELS, train_settings=settings_ft,
        seed=args.seed, data=os.path.abspath(args.data), threads=threads, versions=_versions(),
        machine=machine_info(), init=source,
        fine_tune=dict(samples=wanted, planned_crops=n_epochs * nimg_per_epoch, epochs=n_epochs,
                       settings='Cellpose GUI fine-tuning (gui.py training_params, train_model): SGD 0.1, weight '
                                'decay 1e-4, min_train_masks 0', learning_rate=settings_ft['learning_rate'],
                       validation='none (train_seg without test data)', size_model=size_source))
    write_json(os.path.join(args.out, 'budget.json'), record)
    write_json(os.path.join(args.out, 'peer.json'), dict(peer='cellpose', invert_bright=invert_bright,
                                                         weights='models/cellpose_peer',
                                                         size_model='models/cellpose_peer_size.npy',
                                                         diam_mean=diam_mean, diam_labels=diam_labels,
                                                         channels=CHANNELS, init=source))
    print('done: %d batches (%.2f of %d epochs, %d crops) in %.1f s of training%s, size model %s in %.1f s, '
          '%.1f s in all; %s' % (batches, record['epochs'], n_epochs, images, train_seconds,
                                 ' (stopped by the guard)' if stopped else '',
                                 'retrained' if args.retrain_size else 'kept', size_seconds, wall,
                                 os.path.join(args.out, 'budget.json')), flush=True)


def train(args):
    init = _check_args(args)
    if init is not None:
        return fine_tune(args, init)
    from peer_common import Budget, cpu_seconds, machine_busy_seconds, machine_info, read_match, write_json
    # --match: the recorded run's plan, batches and size model, whatever this CPU's speed
    match = read_match(args.match, 'cellpose', ('batches', 'planned_epochs', 'nimg_per_epoch', 'size_model_epochs',
                                                'size_model_images')) if args.match else None
    budget = Budget(args.minutes, start=_T0)
    epochs = args.epochs or TARGET_EPOCHS
    busy0 = machine_busy_seconds()
    size_reserve = (args.size_minutes if args.size_minutes is not None else max(0.3, 0.08 * args.minutes)) * 60
    threads, samples = _start(args, match)
    os.makedirs(args.out, exist_ok=True)
    import torch
    from cellpose import dynamics, models
    from cellpose import train as cp_train
    X, Y, n_inv = _grey_inputs(samples, args.invert_bright)
    # Flows once, here: train_seg would compute them again at each call (they are its
    # target: the gradient of a heat diffusion from each nucleus's centre).
    t_flow = time.time()
    flows = dynamics.labels_to_flows(Y, device=torch.device('cpu'))
    flow_seconds = time.time() - t_flow
    n_masks = [int(f[0].max()) for f in flows]
    kept = sum(n >= TRAIN['min_train_masks'] for n in n_masks)
    print('%d images (%d inverted; %d with >= %d nuclei are trained on), flows in %.1f s, loaded at %.1f s'
          % (len(X), n_inv, kept, TRAIN['min_train_masks'], flow_seconds, budget.elapsed()), flush=True)

    cp = models.CellposeModel(gpu=False, pretrained_model=False, model_type=None, diam_mean=DIAM_MEAN, nchan=2)
    clock = _BatchClock(cp_train)
    common = dict(train_data=X, train_labels=flows, channels=CHANNELS, normalize=True, save_path=args.out,
                  model_name='cellpose_peer', rescale=True, **TRAIN)

    # 1. the time per batch, at learning rate 0 (train_seg's first epoch is the warm-up's 0)
    t_cal = time.time()
    cp_train.train_seg(cp.net, n_epochs=1, nimg_per_epoch=CALIBRATION_BATCHES * TRAIN['batch_size'], **common)
    cal_seconds = time.time() - t_cal
    ts = clock.times
    per_batch = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else cal_seconds
    overhead = max(0.0, cal_seconds - per_batch * len(ts))  # train_seg's own set-up per call
    clock.reset()

    # 2. the plan: the batches that fit before the size model's reserve, into the CLI's epochs
    train_until = budget.deadline - size_reserve
    fit = int((train_until - time.time() - overhead) / per_batch)
    if fit < 1:  # train one batch anyway, so that the rest runs; the record shows the overrun
        print('warning: the budget leaves no time to train (%.1f s per batch); one batch only' % per_batch)
        fit = 1
    per_epoch = max(1, fit // epochs)
    n_epochs = max(1, fit // per_epoch)
    if match:
        per_epoch, n_epochs = max(1, match['nimg_per_epoch'] // TRAIN['batch_size']), match['planned_epochs']
        clock.max_batches = match['batches']
    nimg_per_epoch = per_epoch * TRAIN['batch_size']
    print('calibration: %.2f s per batch of %d, set-up %.1f s; plan: %d epochs of %d images (%d batches) until '
          '%.0f s' % (per_batch, TRAIN['batch_size'], overhead, n_epochs, nimg_per_epoch, n_epochs * per_epoch,
                      train_until - budget.start), flush=True)
    clock.deadline = max(train_until, time.time() + 1.5 * per_batch)
    stopped, train_seconds, train_cpu, weights = _train_seg(
        cp_train, clock, cp, args.out, n_epochs=n_epochs, nimg_per_epoch=nimg_per_epoch,
        save_every=max(100, n_epochs), **common)
    batches, images = clock.batches, clock.images
    stopped = stopped and not (match and batches >= match['batches'])  # the plan's end, not the guard
    clock.max_batches = float('inf')
    diam_labels = float(cp.net.diam_labels.item())

    # 3. the size model in what is left: time one batch of style vectors, then as many as fit
    t_size = time.time()
    sz_common = dict(train_data=X, train_labels=flows, channels=CHANNELS, normalize=True,
                     min_train_masks=TRAIN['min_train_masks'], batch_size=TRAIN['batch_size'])
    t1 = time.time()
    cp_train.train_size(cp.net, weights, n_epochs=1, nimg_per_epoch=TRAIN['batch_size'], **sz_common)
    one = time.time() - t1
    n_fit = max(1, int(max(0.0, budget.left() - one) / max(one, 1e-3)))  # batches (set-up is in `one` too)
    size_epochs = max(1, min(10, (n_fit * TRAIN['batch_size']) // max(1, kept)))  # train_size's default: 10
    size_nimg = max(TRAIN['batch_size'], min(kept, (n_fit * TRAIN['batch_size']) // size_epochs))
    if match:
        size_epochs, size_nimg = match['size_model_epochs'], match['size_model_images']
    params = cp_train.train_size(cp.net, weights, n_epochs=size_epochs, nimg_per_epoch=size_nimg, **sz_common)
    size_seconds = time.time() - t_size
    del params

    busy1 = machine_busy_seconds()
    wall = budget.elapsed()
    record = dict(
        peer='cellpose', minutes=args.minutes, size_minutes=round(size_reserve / 60, 3),
        wall_seconds=round(wall, 1), over_budget_seconds=round(max(0.0, wall - budget.seconds), 1),
        flow_seconds=round(flow_seconds, 1), calibration_seconds=round(cal_seconds, 1),
        seconds_per_batch=round(per_batch, 3), train_wall_seconds=round(train_seconds, 1),
        train_cpu_seconds=round(train_cpu, 1), cpu_seconds=round(cpu_seconds(), 1),
        size_model_seconds=round(size_seconds, 1), size_model_epochs=size_epochs, size_model_images=size_nimg,
        machine_busy_seconds=None if busy0 is None else round(busy1 - busy0, 1),
        machine_busy_note='CPU seconds of every process on the machine during the run; this run\'s own is '
                          'cpu_seconds',
        planned_epochs=n_epochs, nimg_per_epoch=nimg_per_epoch, batches=batches, images_seen=images,
        epochs=round(batches / per_epoch, 3), stopped_by_guard=stopped,
        images_seen_note='training crops (%d px), one per image drawn' % 224,
        train_images=len(X), trained_images=kept, inverted_images=n_inv, invert_bright=args.invert_bright,
        diam_mean=DIAM_MEAN, diam_labels=round(diam_labels, 2), channels=CHANNELS, train_settings=TRAIN,
        seed=args.seed, data=os.path.abspath(args.data), threads=threads, versions=_versions(),
        machine=machine_info(),
        match=None if not match else dict(budget_json=os.path.abspath(args.match), machine=match.get('machine'),
                                          **{k: match[k] for k in ('batches', 'planned_epochs', 'nimg_per_epoch',
                                                                   'size_model_epochs', 'size_model_images')}))
    write_json(os.path.join(args.out, 'budget.json'), record)
    write_json(os.path.join(args.out, 'peer.json'), dict(peer='cellpose', invert_bright=args.invert_bright,
                                                         weights='models/cellpose_peer',
                                                         size_model='models/cellpose_peer_size.npy',
                                                         diam_mean=DIAM_MEAN, diam_labels=diam_labels,
                                                         channels=CHANNELS))
    print('done: %d batches (%.2f of %d planned epochs, %d images) in %.1f s of training%s, size model in %.1f s, '
          '%.1f s in all (budget %.0f s); %s' % (batches, record['epochs'], n_epochs, images, train_seconds,
                                                 ' (stopped by the guard)' if stopped else '', size_seconds, wall,
                                                 budget.seconds, os.path.join(args.out, 'budget.json')), flush=True)


def predict(args):
    from peer_common import invert_if_bright, list_inputs, predict_loop, read_json, write_prediction_record
    threads = _threads()
    import numpy as np
    from cellpose import models
    settings = read_json(os.path.join(args.model, 'peer.json'))
    cp = models.CellposeModel(gpu=False, pretrained_model=os.path.join(args.model, settings['weights']),
                              nchan=2)
    size = None
    if args.diameter is None:
        size = models.SizeModel(cp_model=cp, pretrained_size=os.path.join(args.model, settings['size_model']))
    fixed = None if args.diameter is None else (args.diameter or settings['diam_labels'])
    items = list_inputs(args.input)
    if args.limit:
        items = items[:args.limit]

    def one(grey):
        inverted = False
        if settings['invert_bright']:
            grey, inverted = invert_if_bright(grey)
        # the diameter as models.Cellpose.eval gets it: the size model's estimate (styles ->
        # diameter, refined by one segmentation at that size), then segment at it
        diam = fixed if size is None else float(size.eval(grey, channels=CHANNELS)[0])
        masks = cp.eval(grey, channels=CHANNELS, diameter=diam)[0]
        return np.asarray(masks), dict(diameter=round(diam, 2), inverted=inverted)

    rows = predict_loop(items, args.output, one)
    s = write_prediction_record(args.output, rows, dict(
        peer='cellpose', model=os.path.abspath(args.model), threads=threads, versions=_versions(),
        diameter='size model' if size is not None else fixed, invert_bright=settings['invert_bright']))
    print('predicted %d images in %.1f s (median %.2f s per image, peak %.0f MiB) into %s'
          % (s['images'], s['seconds_total'], s['seconds_median'], s['peak_rss_mib_max'], args.output))


def main(argv=None):
    args = build_parser().parse_args(argv)
    train(args) if args.command == 'train' else predict(args)


if __name__ == '__main__':
    main()
