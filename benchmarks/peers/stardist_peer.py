"""StarDist 2D as a peer of gluon_unet (issue 71): trained from scratch on a DSB-layout
folder for a wall-time budget, then predicting a folder into ``<id>_labels.png`` (16-bit
instance labels) that ``bin/evaluate`` scores like ``bin/predict``'s.

Install (its own venv, never the project's ``.venv``; Python 3.11)::

    /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/venv-stardist
    /tmp/venv-stardist/bin/pip install -r benchmarks/peers/requirements-stardist.txt

Run (from the repository root)::

    /tmp/venv-stardist/bin/python benchmarks/peers/stardist_peer.py train \\
        --data /tmp/dsb/train --out /tmp/peers/stardist --minutes 58 [--invert-bright]
    /tmp/venv-stardist/bin/python benchmarks/peers/stardist_peer.py predict \\
        --model /tmp/peers/stardist --input /tmp/dsb/holdout --output /tmp/peers/pred-stardist
    .venv/bin/python bin/evaluate --pred /tmp/peers/pred-stardist --truth /tmp/dsb/holdout --csv sd.csv
    # fine-tune that model on a few images (gluon_unet's few-shot protocol), then predict as above
    /tmp/venv-stardist/bin/python benchmarks/peers/stardist_peer.py train --init /tmp/peers/stardist \\
        --data /tmp/fewshot/brightfield/k3/train --out /tmp/peers/stardist-ft

What it does, and why:

* The network and training are those of StarDist's own 2D example (the training notebook
  of ``stardist/examples/2D``): ``Config2D(n_rays=32, grid=(2, 2))`` and the defaults
  (256 px patches, batch 4, 100 steps per epoch, Adam 3e-4 with ReduceLROnPlateau, the
  best weights by validation loss), its augmenter (random flips and 90-degree turns,
  intensity scale 0.6-2 and shift +-0.2, Gaussian noise), its 15 % validation split
  (seed 42), labels with their holes filled, and its input normalization: each image's 1st
  and 99.8th percentiles to 0 and 1. No pretrained weights (none can be downloaded here,
  and the comparison is of methods trained on the same images).
* Images are made grey as gluon_unet's ``--channels 1`` makes them (colour -> luma), so
  both see the same pixels. ``--invert-bright`` also inverts images with a bright
  background (median grey above 80: brightfield and H&E) before the normalization, as
  gluon_unet's ``--normalize auto`` does, so preprocessing is not what separates the two.
* ``--minutes`` is the wall time of the whole command, imports and data loading included
  (the recipe's 58 minutes are its whole ``bin/train``). Training stops mid-epoch when the
  time left reaches ``--reserve-minutes``, kept for the last validation pass and StarDist's
  own threshold search (``optimize_thresholds``) on as many validation images as the
  reserve allows. ``--match BUDGET_JSON`` repeats a recorded run's work instead (its steps
  and its threshold search's images), on a CPU slower or busier than the one that recorded
  it; ``--minutes`` is then only the guard. ``MODEL_DIR/budget.json`` records wall and CPU
  seconds, epochs, steps, patches seen, the machine's load beside the run, versions and
  thresholds.
* ``train --init MODEL_DIR`` fine-tunes a model this script trained: the same ``Config2D``
  (its ``config.json``), its ``weights_best.h5`` (a fine-tune's own ``peer.json`` names its
  ``weights_last.h5``), its inversion and percentiles (a contradicting ``--invert-bright``
  is refused) and its thresholds, kept as gluon_unet's fine-tune keeps its source's
  post-processing (no validation images to search them on). Defaults mirror gluon_unet's
  fine-tune (20 epochs x 128 crops at a quarter of the recipe's rate, no validation split):
  2,560 patches as 20 epochs of 32 steps x batch 4, Adam at a quarter of the source's rate
  (7.5e-5; StarDist recommends no fine-tuning rate, its maintainers' advice is to continue
  training from the model folder, stardist issue 127), every image trains (Keras's required
  validation data are the training images, a monitor only) and the last weights are kept.
  ``--minutes`` is then an optional cap. ``budget.json`` and ``peer.json`` record the source
  folder, its weights file and its SHA-256.
* ``predict`` records seconds, CPU seconds and peak resident memory (``VmHWM``, reset
  before each image) per image in ``OUTPUT/prediction_times.csv`` and a summary in
  ``OUTPUT/prediction.json``.

Threads: TensorFlow takes ``TF_NUM_INTRAOP_THREADS`` / ``TF_NUM_INTEROP_THREADS`` (else
``OMP_NUM_THREADS``, else every allowed core). To share the machine, pin with
``taskset -c N``. This script never imports gluon_unet (its venv has no MXNet); what it
shares with ``cellpose_peer.py`` is in ``peer_common.py`` and ``peer_flags.py`` beside it.
"""
import argparse
import os
import sys
import time

_T0 = time.time()  # the budget counts from here: imports and data loading are part of it

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: StarDist's 2D example: its notebook's normalization percentiles and validation share.
PERCENTILES = (1.0, 99.8)
VAL_FRACTION = 0.15
SEED = 42
#: A fine-tune's defaults (``train --init``), mirroring gluon_unet's (``FINE_TUNE_DEFAULTS``:
#: 20 epochs x 128 crops at 5e-4, a quarter of the dsb2018 recipe's 2e-3, no validation split):
#: the same 2,560 training patches as 20 epochs of 32 steps x batch 4, and a quarter of
#: StarDist's own rate (Adam 3e-4; StarDist's docs recommend no fine-tuning rate, its
#: maintainers' advice is to continue training from the model's folder, stardist issue 127).
FT_SAMPLES = 2560
FT_EPOCHS = 20
FT_LR_FACTOR = 0.25


def build_parser():
    from peer_flags import AT_LEAST_1, FRACTION, NON_NEGATIVE, POSITIVE, SEED as SEED_TYPE, OneLineParser, \
        add_predict_flags, add_train_flags
    p = OneLineParser(prog='stardist_peer.py', description=__doc__.split('\n\n')[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='command', required=True)
    t = sub.add_parser('train', help='train from scratch (or fine-tune, --init) on a DSB-layout folder')
    add_train_flags(t, 'model folder to create (StarDist model + budget.json)')
    t.add_argument('--reserve-minutes', type=NON_NEGATIVE, default=None,
                   help='of the budget, kept after training for the last validation and the threshold search '
                        '(default: 10%% of --minutes, at least 0.3; with --init 0: no threshold search)')
    t.add_argument('--val-fraction', type=FRACTION, default=None,
                   help='validation share (default %s, the example\'s; with --init 0: every image trains)'
                        % VAL_FRACTION)
    t.add_argument('--seed', type=SEED_TYPE, default=SEED)
    t.add_argument('--max-epochs', type=AT_LEAST_1, default=100000, help='a cap besides the budget (default: none)')
    f = t.add_argument_group('fine-tuning (--init)')
    f.add_argument('--init', metavar='MODEL_DIR', default=None,
                   help='start from a model folder made by this script\'s train: its config, its weights '
                        '(weights_best.h5), its normalization and its thresholds (no threshold search)')
    f.add_argument('--samples', type=AT_LEAST_1, default=None,
                   help='training patches to draw in all (default %d, gluon_unet\'s 20 x 128 crops)' % FT_SAMPLES)
    f.add_argument('--epochs', type=AT_LEAST_1, default=None,
                   help='epochs the samples are divided into (default %d, as gluon_unet\'s fine-tune)' % FT_EPOCHS)
    f.add_argument('--learning-rate', type=POSITIVE, default=None,
                   help='Adam rate (default: a quarter of the source\'s, 7.5e-5 for StarDist\'s 3e-4)')
    q = sub.add_parser('predict', help='predict a folder into <id>_labels.png')
    add_predict_flags(q, 'a folder made by train (from scratch or --init)')
    return p


def _threads():
    """Set TensorFlow's thread pools before it starts (they cannot change afterwards)."""
    from peer_common import thread_count
    n = thread_count()
    intra = int(os.environ.get('TF_NUM_INTRAOP_THREADS', n))
    inter = int(os.environ.get('TF_NUM_INTEROP_THREADS', min(n, 2)))
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)
    return dict(intra_op=intra, inter_op=inter)


def _prepare(grey, invert_bright, percentiles=PERCENTILES):
    """The network's input from a grey uint8 image: optional inversion (gluon_unet's rule),
    then the example's per-image percentile normalization to float32."""
    from csbdeep.utils import normalize
    from peer_common import invert_if_bright
    inverted = False
    if invert_bright:
        grey, inverted = invert_if_bright(grey)
    return normalize(grey, percentiles[0], percentiles[1], axis=(0, 1)).astype('float32'), inverted


def _versions():
    import csbdeep
    import numpy
    import stardist
    import tensorflow as tf
    return dict(stardist=stardist.__version__, csbdeep=csbdeep.__version__, tensorflow=tf.__version__,
                numpy=numpy.__version__, python=sys.version.split()[0])


def _augmenter(x, y):
    """StarDist's 2D example augmenter, as written there."""
    import numpy as np
    axes = tuple(range(y.ndim))
    perm = tuple(np.random.permutation(axes))
    x = x.transpose(perm + tuple(range(y.ndim, x.ndim)))
    y = y.transpose(perm)
    for ax in axes:
        if np.random.rand() > 0.5:
            x = np.flip(x, axis=ax)
            y = np.flip(y, axis=ax)
    x = x * np.random.uniform(0.6, 2) + np.random.uniform(-0.2, 0.2)
    sig = 0.02 * np.random.uniform(0, 1)
    x = x + sig * np.random.normal(0, 1, x.shape)
    return x, y


def _pad_to(x, y, size):
    """Images smaller than the training patch are padded (zeros: background after the
    normalization) so StarDist can sample patches from them; DSB 2018's are all >= 256."""
    import numpy as np
    ph, pw = max(0, size[0] - x.shape[0]), max(0, size[1] - x.shape[1])
    if ph or pw:
        x = np.pad(x, ((0, ph), (0, pw)))
        y = np.pad(y, ((0, ph), (0, pw)))
    return x, y


def _check_args(args):
    """The flags' combinations, and a --init folder, checked before TensorFlow is imported
    (one line on stderr, exit 2). Returns the source's ``(settings, weights path)`` or None."""
    from peer_common import fail, read_init
    if args.init is None:
        given = [n for n in ('samples', 'epochs', 'learning_rate') if getattr(args, n) is not None]
        if given:
            fail('--%s only with --init (a fine-tune)' % given[0].replace('_', '-'))
        if args.minutes is None:
            fail('--minutes is required when training from scratch')
        if args.val_fraction == 0:
            fail('--val-fraction 0: training from scratch needs validation images (for its thresholds)')
        return None
    if args.match:
        fail('--match only when training from scratch (a fine-tune\'s length is --samples)')
    settings, weights = read_init(args.init, 'stardist', 'stardist_peer.py', 'weights_best.h5')
    for name in ('config.json', 'thresholds.json'):
        if not os.path.isfile(os.path.join(args.init, name)):
            fail('--init %s: its %s is missing' % (args.init, name))
    if args.invert_bright and not settings.get('invert_bright'):
        fail('--invert-bright contradicts --init %s, trained without it: a fine-tune keeps its source\'s '
             'normalization' % args.init)
    return settings, weights


def _fine_tune_config(init_dir, args):
    """The source's Config2D (its network and training settings, as saved in its config.json)
    with a fine-tune's schedule: --samples patches as --epochs epochs of whole batches, the
    rate, and no best-by-validation checkpoint (the last weights are kept, as gluon_unet's
    fine-tune without a validation split keeps its last)."""
    from csbdeep.utils import load_json
    from stardist.models import Config2D
    d = Config2D.update_loaded_config(load_json(os.path.join(init_dir, 'config.json')))
    source_lr = d.get('train_learning_rate', 3e-4)
    epochs = args.epochs or FT_EPOCHS
    samples = args.samples or FT_SAMPLES
    batch = d.get('train_batch_size', 4)
    steps = max(1, int(round(samples / float(epochs * batch))))
    d.update(train_learning_rate=args.learning_rate or float('%.6g' % (source_lr * FT_LR_FACTOR)),
             train_steps_per_epoch=steps,
             train_epochs=epochs, train_checkpoint=None)
    return Config2D(**d), source_lr


def train(args):
    import numpy as np
    from peer_common import (Budget, check_match_data, cpu_seconds, fail, init_record, list_dsb, machine_busy_seconds,
                             machine_info, read_grey, read_json, read_labels, read_match, split_ids, write_json)
    init = _check_args(args)
    fine_tune = init is not None
    # --match: the recorded run's steps and threshold-search images, whatever this CPU's speed
    match = read_match(args.match, 'stardist', ('steps', 'threshold_images')) if args.match else None
    # a fine-tune without --minutes has no cap: its length is --samples
    budget = Budget(args.minutes if args.minutes else 1e9, start=_T0)
    busy0 = machine_busy_seconds()
    if args.reserve_minutes is not None:
        reserve = args.reserve_minutes * 60
    else:
        reserve = 0.0 if fine_tune else max(0.3, 0.1 * args.minutes) * 60
    if os.path.exists(os.path.join(args.out, 'config.json')):
        raise SystemExit('%s already holds a model; choose another --out' % args.out)
    if fine_tune:
        settings, src_weights = init
        invert_bright = bool(settings['invert_bright'])
        percentiles = tuple(settings.get('normalize_percentiles', PERCENTILES))
        val_fraction = 0.0 if args.val_fraction is None else args.val_fraction
    else:
        invert_bright, percentiles = args.invert_bright, PERCENTILES
        val_fraction = VAL_FRACTION if args.val_fraction is None else args.val_fraction
    samples = list_dsb(args.data)
    if args.limit:
        samples = samples[:args.limit]
    if match:
        check_match_data(args.match, match, samples, args.data)
    threads = _threads()
    from stardist import fill_label_holes
    from stardist.models import Config2D, StarDist2D
    import tensorflow as tf

    if fine_tune:
        conf, source_lr = _fine_tune_config(args.init, args)
    else:
        conf = Config2D(n_rays=32, grid=(2, 2), n_channel_in=1, use_gpu=False)
    X, Y, ids, n_inverted = {}, {}, [], 0
    for sid, img_path, mask_paths in samples:
        x, inv = _prepare(read_grey(img_path), invert_bright, percentiles)
        y = fill_label_holes(read_labels(mask_paths))
        X[sid], Y[sid] = _pad_to(x, y, conf.train_patch_size)
        ids.append(sid)
        n_inverted += inv
    load_seconds = budget.elapsed()
    trn, val = split_ids(ids, val_fraction, args.seed)
    if not val and not fine_tune:
        raise SystemExit('StarDist needs validation images: --val-fraction > 0 and at least 2 samples')
    # Keras's fit needs validation data; a fine-tune without a split gives it the training
    # images (one unaugmented patch each): a monitor of the training loss, never used to pick
    # weights (no best checkpoint) nor thresholds (the source's are kept).
    val_ids = val or trn
    print('%d training, %d validation images%s (%d inverted) loaded in %.1f s; %s'
          % (len(trn), len(val), '' if val else ' (the training images are Keras\'s validation data)', n_inverted,
             load_seconds, ('fine-tune of %s: %d epochs x %d steps x batch %d at %g%s'
                            % (args.init, conf.train_epochs, conf.train_steps_per_epoch, conf.train_batch_size,
                               conf.train_learning_rate, ', cap %.1f min' % args.minutes if args.minutes else ''))
             if fine_tune else 'budget %.1f min, reserve %.1f min' % (args.minutes, reserve / 60)), flush=True)

    np.random.seed(args.seed)
    tf.random.set_seed(args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    model = StarDist2D(conf, name=os.path.basename(os.path.normpath(args.out)),
                       basedir=os.path.dirname(os.path.abspath(args.out)))
    source = None
    if fine_tune:
        try:
            model.keras_model.load_weights(src_weights)
        except Exception as e:  # a weights file of another network, or damaged
            fail('--init %s: its weights %s do not load into its own config (%s)'
                 % (args.init, os.path.basename(src_weights), str(e).splitlines()[0] if str(e) else type(e).__name__))
        thresholds = read_json(os.path.join(args.init, 'thresholds.json'))
        source = init_record(args.init, src_weights, thresholds=thresholds)

    class BudgetStop(tf.keras.callbacks.Callback):
        """Stop at a batch end once the time left reaches the reserve; count what ran."""
        steps = 0
        epochs_done = 0
        train_seconds = 0.0

        def on_train_begin(self, logs=None):
            self.t0 = time.time()

        def on_train_batch_end(self, batch, logs=None):
            BudgetStop.steps += 1
            if budget.left() <= reserve or (match and BudgetStop.steps >= match['steps']):
                self.model.stop_training = True

        def on_epoch_end(self, epoch, logs=None):
            BudgetStop.epochs_done = epoch + 1
            if budget.left() <= reserve:
                self.model.stop_training = True

        def on_train_end(self, logs=None):
            BudgetStop.train_seconds = time.time() - self.t0

    model.prepare_for_training()
    model.callbacks.append(BudgetStop())
    cpu0 = cpu_seconds()
    model.train([X[i] for i in trn], [Y[i] for i in trn],
                validation_data=([X[i] for i in val_ids], [Y[i] for i in val_ids]), augmenter=_augmenter,
                epochs=conf.train_epochs if fine_tune else args.max_epochs)
    train_cpu = cpu_seconds() - cpu0
    trained_at = budget.elapsed()

    t_opt = time.time()
    chosen = []
    if fine_tune:
        # gluon_unet's fine-tune without validation keeps its source's post-processing; so
        # does this one: the source's thresholds, no search on the k training images
        model.thresholds = dict(thresholds)
        write_json(os.path.join(args.out, 'thresholds.json'), dict(thresholds))
    else:
        # StarDist's threshold search predicts every image it is given again, then runs 3 x 20
        # NMS trials on them, which on a young model (many candidates at low thresholds) took
        # ~10x the prediction in the smoke run: time the prediction of validation images one by
        # one and give it as many as 1/12 of the time left allows, so the whole command keeps
        # to its budget (over_budget_seconds in budget.json says when it did not).
        allowance = max(0.0, budget.left()) / 12
        for sid in val:
            if (match and len(chosen) >= match['threshold_images']) or (
                    not match and chosen and time.time() - t_opt > allowance):
                break
            model.predict(X[sid])
            chosen.append(sid)
        model.optimize_thresholds([X[i] for i in chosen], [Y[i] for i in chosen])
    opt_seconds = time.time() - t_opt
    busy1 = machine_busy_seconds()
    wall = budget.elapsed()
    steps = BudgetStop.steps
    record = dict(
        peer='stardist', minutes=args.minutes, reserve_minutes=round(reserve / 60, 3),
        wall_seconds=round(wall, 1),
        over_budget_seconds=round(max(0.0, wall - budget.seconds), 1) if args.minutes else None,
        load_seconds=round(load_seconds, 1), train_wall_seconds=round(BudgetStop.train_seconds, 1),
        train_cpu_seconds=round(train_cpu, 1), cpu_seconds=round(cpu_seconds(), 1),
        threshold_search_seconds=round(opt_seconds, 1), threshold_images=len(chosen),
        trained_until_seconds=round(trained_at, 1),
        machine_busy_seconds=None if busy0 is None else round(busy1 - busy0, 1),
        machine_busy_note='CPU seconds of every process on the machine during the run; this run\'s own is '
                          'cpu_seconds', steps=steps,
        match=None if not match else dict(budget_json=os.path.abspath(args.match), steps=match['steps'],
                                          threshold_images=match['threshold_images'],
                                          machine=match.get('machine')),
        epochs_completed=BudgetStop.epochs_done, epochs=round(steps / conf.train_steps_per_epoch, 3),
        steps_per_epoch=conf.train_steps_per_epoch, batch_size=conf.train_batch_size,
        patch_size=list(conf.train_patch_size), images_seen=steps * conf.train_batch_size,
        images_seen_note='training patches (%dx%d crops), one per image drawn' % tuple(conf.train_patch_size),
        train_images=len(trn), val_images=len(val), inverted_images=n_inverted, invert_bright=invert_bright,
        normalize_percentiles=list(percentiles), seed=args.seed, thresholds=dict(model.thresholds._asdict()),
        data=os.path.abspath(args.data), threads=threads, versions=_versions(), machine=machine_info(),
        config=dict(n_rays=conf.n_rays, grid=list(conf.grid), n_channel_in=conf.n_channel_in,
                    train_learning_rate=conf.train_learning_rate))
    peer = dict(peer='stardist', invert_bright=invert_bright, normalize_percentiles=list(percentiles))
    if fine_tune:
        record.update(init=source, fine_tune=dict(
            samples=args.samples or FT_SAMPLES, epochs=conf.train_epochs, steps_per_epoch=conf.train_steps_per_epoch,
            planned_patches=conf.train_epochs * conf.train_steps_per_epoch * conf.train_batch_size,
            learning_rate=conf.train_learning_rate, source_learning_rate=source_lr,
            validation='split %.2f' % val_fraction if val else 'none: the training images are Keras\'s '
                                                               'validation data (a monitor only)',
            weights_kept='weights_last.h5 (the last, no best-by-validation checkpoint)',
            thresholds='the source\'s (no search)'))
        peer.update(weights='weights_last.h5', init=source)
    write_json(os.path.join(args.out, 'budget.json'), record)
    write_json(os.path.join(args.out, 'peer.json'), peer)
    print('done: %d steps (%.2f epochs, %d patches) in %.1f s of training, %.1f s in all%s; '
          'thresholds %s; %s' % (steps, record['epochs'], record['images_seen'], BudgetStop.train_seconds, wall,
                                 ' (budget %.0f s)' % budget.seconds if args.minutes else '', record['thresholds'],
                                 os.path.join(args.out, 'budget.json')), flush=True)


def predict(args):
    from peer_common import list_inputs, predict_loop, read_json, write_prediction_record
    threads = _threads()
    from stardist.models import StarDist2D
    settings = read_json(os.path.join(args.model, 'peer.json'))
    model = StarDist2D(None, name=os.path.basename(os.path.normpath(args.model)),
                       basedir=os.path.dirname(os.path.abspath(args.model)))
    if settings.get('weights'):  # a fine-tune keeps its last weights (it has no best checkpoint)
        model.load_weights(settings['weights'])
    items = list_inputs(args.input)
    if args.limit:
        items = items[:args.limit]

    def one(grey):
        x, inverted = _prepare(grey, settings['invert_bright'], settings.get('normalize_percentiles', PERCENTILES))
        labels, _ = model.predict_instances(x)
        return labels, dict(inverted=inverted)

    rows = predict_loop(items, args.output, one)
    s = write_prediction_record(args.output, rows, dict(peer='stardist', model=os.path.abspath(args.model),
                                                        threads=threads, versions=_versions(),
                                                        invert_bright=settings['invert_bright']))
    print('predicted %d images in %.1f s (median %.2f s per image, peak %.0f MiB) into %s'
          % (s['images'], s['seconds_total'], s['seconds_median'], s['peak_rss_mib_max'], args.output))


def main(argv=None):
    args = build_parser().parse_args(argv)
    train(args) if args.command == 'train' else predict(args)


if __name__ == '__main__':
    main()
