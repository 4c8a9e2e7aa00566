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
  reserve allows. ``MODEL_DIR/budget.json`` records wall and CPU seconds, epochs, steps,
  patches seen, the machine's load beside the run, versions and thresholds.
* ``predict`` records seconds, CPU seconds and peak resident memory (``VmHWM``, reset
  before each image) per image in ``OUTPUT/prediction_times.csv`` and a summary in
  ``OUTPUT/prediction.json``.

Threads: TensorFlow takes ``TF_NUM_INTRAOP_THREADS`` / ``TF_NUM_INTEROP_THREADS`` (else
``OMP_NUM_THREADS``, else every allowed core). To share the machine, pin with
``taskset -c N``. This script never imports gluon_unet (its venv has no MXNet); what it
shares with ``cellpose_peer.py`` is in ``peer_common.py`` beside it.
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


def build_parser():
    p = argparse.ArgumentParser(prog='stardist_peer.py', description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='command', required=True)
    t = sub.add_parser('train', help='train from scratch on a DSB-layout folder for a wall-time budget')
    t.add_argument('--data', required=True, help='DSB-layout folder: <id>/images/<id>.png + <id>/masks/*.png')
    t.add_argument('--out', required=True, help='model folder to create (StarDist model + budget.json)')
    t.add_argument('--minutes', type=float, required=True, help='wall time of the whole command, in minutes')
    t.add_argument('--reserve-minutes', type=float, default=None,
                   help='of the budget, kept after training for the last validation and the threshold search '
                        '(default: 10%% of --minutes, at least 0.3)')
    t.add_argument('--invert-bright', action='store_true',
                   help='invert images with a bright background (median grey > 80) as gluon_unet --normalize auto')
    t.add_argument('--limit', type=int, default=0, help='use only the first N samples (smoke tests)')
    t.add_argument('--val-fraction', type=float, default=VAL_FRACTION,
                   help='validation share (default %(default)s, the example\'s)')
    t.add_argument('--seed', type=int, default=SEED)
    t.add_argument('--max-epochs', type=int, default=100000, help='a cap besides the budget (default: none)')
    q = sub.add_parser('predict', help='predict a folder into <id>_labels.png')
    q.add_argument('--model', required=True, help='a folder made by train')
    q.add_argument('--input', required=True, help='DSB layout or a folder of images')
    q.add_argument('--output', required=True, help='folder for <id>_labels.png and the timing records')
    q.add_argument('--limit', type=int, default=0, help='predict only the first N images (smoke tests)')
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


def _prepare(grey, invert_bright):
    """The network's input from a grey uint8 image: optional inversion (gluon_unet's rule),
    then the example's per-image percentile normalization to float32."""
    from csbdeep.utils import normalize
    from peer_common import invert_if_bright
    inverted = False
    if invert_bright:
        grey, inverted = invert_if_bright(grey)
    return normalize(grey, PERCENTILES[0], PERCENTILES[1], axis=(0, 1)).astype('float32'), inverted


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


def train(args):
    import numpy as np
    from peer_common import (Budget, cpu_seconds, list_dsb, machine_busy_seconds, machine_info, read_grey,
                             read_labels, split_ids, write_json)
    budget = Budget(args.minutes, start=_T0)
    busy0 = machine_busy_seconds()
    reserve = (args.reserve_minutes if args.reserve_minutes is not None else max(0.3, 0.1 * args.minutes)) * 60
    if os.path.exists(os.path.join(args.out, 'config.json')):
        raise SystemExit('%s already holds a model; choose another --out' % args.out)
    threads = _threads()
    from stardist import fill_label_holes
    from stardist.models import Config2D, StarDist2D
    import tensorflow as tf

    samples = list_dsb(args.data)
    if args.limit:
        samples = samples[:args.limit]
    conf = Config2D(n_rays=32, grid=(2, 2), n_channel_in=1, use_gpu=False)
    X, Y, ids, n_inverted = {}, {}, [], 0
    for sid, img_path, mask_paths in samples:
        x, inv = _prepare(read_grey(img_path), args.invert_bright)
        y = fill_label_holes(read_labels(mask_paths))
        X[sid], Y[sid] = _pad_to(x, y, conf.train_patch_size)
        ids.append(sid)
        n_inverted += inv
    load_seconds = budget.elapsed()
    trn, val = split_ids(ids, args.val_fraction, args.seed)
    if not val:
        raise SystemExit('StarDist needs validation images: --val-fraction > 0 and at least 2 samples')
    print('%d training, %d validation images (%d inverted) loaded in %.1f s; budget %.1f min, reserve %.1f min'
          % (len(trn), len(val), n_inverted, load_seconds, args.minutes, reserve / 60), flush=True)

    np.random.seed(args.seed)
    tf.random.set_seed(args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    model = StarDist2D(conf, name=os.path.basename(os.path.normpath(args.out)),
                       basedir=os.path.dirname(os.path.abspath(args.out)))

    class BudgetStop(tf.keras.callbacks.Callback):
        """Stop at a batch end once the time left reaches the reserve; count what ran."""
        steps = 0
        epochs_done = 0
        train_seconds = 0.0

        def on_train_begin(self, logs=None):
            self.t0 = time.time()

        def on_train_batch_end(self, batch, logs=None):
            BudgetStop.steps += 1
            if budget.left() <= reserve:
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
    model.train([X[i] for i in trn], [Y[i] for i in trn], validation_data=([X[i] for i in val], [Y[i] for i in val]),
                augmenter=_augmenter, epochs=args.max_epochs)
    train_cpu = cpu_seconds() - cpu0
    trained_at = budget.elapsed()

    # StarDist's threshold search predicts every image it is given again, then runs 3 x 20
    # NMS trials on them, which on a young model (many candidates at low thresholds) took
    # ~10x the prediction in the smoke run: time the prediction of validation images one by
    # one and give it as many as 1/12 of the time left allows, so the whole command keeps
    # to its budget (over_budget_seconds in budget.json says when it did not).
    t_opt = time.time()
    allowance = max(0.0, budget.left()) / 12
    chosen = []
    for sid in val:
        if chosen and time.time() - t_opt > allowance:
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
        wall_seconds=round(wall, 1), over_budget_seconds=round(max(0.0, wall - budget.seconds), 1),
        load_seconds=round(load_seconds, 1), train_wall_seconds=round(BudgetStop.train_seconds, 1),
        train_cpu_seconds=round(train_cpu, 1), cpu_seconds=round(cpu_seconds(), 1),
        threshold_search_seconds=round(opt_seconds, 1), threshold_images=len(chosen),
        trained_until_seconds=round(trained_at, 1),
        machine_busy_seconds=None if busy0 is None else round(busy1 - busy0, 1),
        machine_busy_note='CPU seconds of every process on the machine during the run; this run\'s own is '
                          'cpu_seconds', steps=steps,
        epochs_completed=BudgetStop.epochs_done, epochs=round(steps / conf.train_steps_per_epoch, 3),
        steps_per_epoch=conf.train_steps_per_epoch, batch_size=conf.train_batch_size,
        patch_size=list(conf.train_patch_size), images_seen=steps * conf.train_batch_size,
        images_seen_note='training patches (%dx%d crops), one per image drawn' % tuple(conf.train_patch_size),
        train_images=len(trn), val_images=len(val), inverted_images=n_inverted, invert_bright=args.invert_bright,
        normalize_percentiles=list(PERCENTILES), seed=args.seed, thresholds=dict(model.thresholds._asdict()),
        data=os.path.abspath(args.data), threads=threads, versions=_versions(), machine=machine_info(),
        config=dict(n_rays=conf.n_rays, grid=list(conf.grid), n_channel_in=conf.n_channel_in,
                    train_learning_rate=conf.train_learning_rate))
    write_json(os.path.join(args.out, 'budget.json'), record)
    write_json(os.path.join(args.out, 'peer.json'), dict(peer='stardist', invert_bright=args.invert_bright,
                                                         normalize_percentiles=list(PERCENTILES)))
    print('done: %d steps (%.2f epochs, %d patches) in %.1f s of training, %.1f s in all (budget %.0f s); '
          'thresholds %s; %s' % (steps, record['epochs'], record['images_seen'], BudgetStop.train_seconds, wall,
                                 budget.seconds, record['thresholds'], os.path.join(args.out, 'budget.json')),
          flush=True)


def predict(args):
    from peer_common import list_inputs, predict_loop, read_json, write_prediction_record
    threads = _threads()
    from stardist.models import StarDist2D
    settings = read_json(os.path.join(args.model, 'peer.json'))
    model = StarDist2D(None, name=os.path.basename(os.path.normpath(args.model)),
                       basedir=os.path.dirname(os.path.abspath(args.model)))
    items = list_inputs(args.input)
    if args.limit:
        items = items[:args.limit]

    def one(grey):
        x, inverted = _prepare(grey, settings['invert_bright'])
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
