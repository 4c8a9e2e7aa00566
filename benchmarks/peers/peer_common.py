"""What the peer scripts (``stardist_peer.py``, ``cellpose_peer.py``) share: reading a
DSB-layout folder or a folder of images, the grey conversion and the bright-background
rule of gluon_unet's ``--normalize auto``, writing ``<id>_labels.png`` as ``bin/predict``
does, the wall-time budget, CPU seconds and peak memory from ``/proc``.

It imports only the standard library and numpy at import time (image readers are imported
when used), so the peers' own environments need nothing of gluon_unet, and the main
environment's tests can check the pure rules here without any peer installed
(``tests/test_peers_tools.py``). It must NOT import gluon_unet: each peer runs in its own
venv (Python 3.11, its own numpy), where MXNet is not installed.
"""
import json
import os
import resource
import sys
import time

import numpy as np

from peer_flags import fail  # noqa: F401  (the scripts' one-line usage error, kept where --help can use it)

#: File types read as images (as gluon_unet's ``IMAGE_EXTENSIONS``, less the rarer ones).
IMAGE_EXTENSIONS = ('.png', '.tif', '.tiff', '.jpg', '.jpeg', '.bmp')
#: Median grey above which an image has a bright background (nuclei darker than it):
#: gluon_unet's ``BRIGHT_BACKGROUND`` (``gluon_unet/data/io.py``), the cut ``--normalize
#: auto`` inverts at. Copied, not imported: the peers' venvs have no gluon_unet (the test
#: checks the two agree).
BRIGHT_BACKGROUND = 80
#: ITU-R 601 luma weights, those of OpenCV's ``COLOR_RGB2GRAY`` that gluon_unet's
#: ``--channels 1`` uses, so a colour image becomes the same grey for every method
#: (:func:`to_grey` computes them in OpenCV's fixed point).
LUMA = (0.299, 0.587, 0.114)


# --------------------------------------------------------------------------- images

def is_image_file(name):
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS and not os.path.basename(name).startswith('.')


def _is_dsb_sample(folder):
    sid = os.path.basename(os.path.normpath(folder))
    img_dir = os.path.join(folder, 'images')
    return os.path.isdir(img_dir) and any(os.path.splitext(n)[0] == sid and is_image_file(n)
                                          for n in os.listdir(img_dir))


def _dsb_image(folder):
    sid = os.path.basename(os.path.normpath(folder))
    img_dir = os.path.join(folder, 'images')
    names = sorted(n for n in os.listdir(img_dir) if os.path.splitext(n)[0] == sid and is_image_file(n))
    return os.path.join(img_dir, names[0])


def list_inputs(folder):
    """``[(image_id, image_path)]`` of a folder to predict, sorted by id: the DSB layout
    (``<id>/images/<id>.png``, as ``bin/predict --input`` and ``bin/evaluate --truth``
    take it) or image files directly in ``folder`` (id = the file name's stem)."""
    if not os.path.isdir(folder):
        raise SystemExit('%s: no such directory' % folder)
    out = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isdir(path) and _is_dsb_sample(path):
            out.append((name, _dsb_image(path)))
        elif os.path.isfile(path) and is_image_file(name):
            out.append((os.path.splitext(name)[0], path))
    if not out:
        raise SystemExit('%s holds no images (expected <id>/images/<id>.png or image files)' % folder)
    return out


def list_dsb(folder):
    """``[(image_id, image_path, [mask_paths])]`` of a DSB-layout training folder (every
    ``<id>/`` with ``images/<id>.png`` and ``masks/*.png``), sorted by id; mask files sorted
    by name, as gluon_unet reads them (file k -> nucleus k)."""
    if not os.path.isdir(folder):
        raise SystemExit('--data %s: no such directory' % folder)
    out = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        mask_dir = os.path.join(path, 'masks')
        if os.path.isdir(path) and _is_dsb_sample(path) and os.path.isdir(mask_dir):
            masks = sorted(os.path.join(mask_dir, m) for m in os.listdir(mask_dir) if is_image_file(m))
            if masks:
                out.append((name, _dsb_image(path), masks))
    if not out:
        raise SystemExit('--data %s holds no DSB samples (<id>/images/<id>.png + <id>/masks/*.png)' % folder)
    return out


def read_raw(path):
    """The pixels of an image file as numpy, through whichever reader the venv has
    (tifffile for TIFF; imageio, else OpenCV, else Pillow for the rest)."""
    if path.lower().endswith(('.tif', '.tiff')):
        import tifffile
        return np.asarray(tifffile.imread(path))
    try:
        import imageio.v3 as iio
        return np.asarray(iio.imread(path))
    except ImportError:
        pass
    try:
        import cv2
        arr = cv2.imread(path, cv2.IMREAD_UNCHANGED)
        if arr is None:
            raise SystemExit('%s: cannot read' % path)
        if arr.ndim == 3:  # OpenCV reads BGR(A)
            arr = arr[..., [2, 1, 0] + ([3] if arr.shape[2] == 4 else [])]
        return arr
    except ImportError:
        from PIL import Image
        with Image.open(path) as im:
            return np.asarray(im)


def to_uint8(arr):
    """uint8 kept; other types stretched from their 0.5th to 99.5th percentile, as
    gluon_unet reads a 16-bit or float image (DSB 2018's images are all 8-bit)."""
    if arr.dtype == np.uint8:
        return arr
    if arr.dtype == bool:
        return arr.astype(np.uint8) * 255
    a = arr.astype(np.float32)
    lo, hi = np.percentile(a, (0.5, 99.5))
    if hi <= lo:
        return np.zeros(arr.shape, np.uint8)
    return np.clip(np.rint((a - lo) * (255.0 / (hi - lo))), 0, 255).astype(np.uint8)


def to_grey(arr):
    """An image as read -> (H, W) uint8 grey, as gluon_unet's ``--channels 1`` makes it:
    alpha dropped, a colour image (channels not all equal) to its luma, a grey one kept."""
    a = to_uint8(np.asarray(arr))
    if a.ndim == 2:
        return a
    if a.ndim != 3:
        raise SystemExit('image of shape %s is not one 2-D image' % (a.shape,))
    if a.shape[2] in (1, 2):  # grey (+ alpha)
        return a[..., 0]
    rgb = a[..., :3]
    if np.array_equal(rgb[..., 0], rgb[..., 1]) and np.array_equal(rgb[..., 0], rgb[..., 2]):
        return rgb[..., 0].copy()
    # OpenCV's fixed-point form of the luma (15-bit weights, rounded; the same on 200,000
    # random colours), so the grey is gluon_unet's to the grey level: a float luma differs
    # by one where it falls on a half.
    r, g, b = (rgb[..., i].astype(np.uint32) for i in range(3))
    return ((r * 9798 + g * 19235 + b * 3735 + 16384) >> 15).astype(np.uint8)


def read_grey(path):
    return to_grey(read_raw(path))


def is_bright_background(grey):
    """True when gluon_unet's ``--normalize auto`` would invert this grey image: its
    median (the background: nuclei cover a minority of pixels) is above
    :data:`BRIGHT_BACKGROUND` (brightfield, H&E tissue; fluorescence medians are 0-44)."""
    return bool(np.median(grey) > BRIGHT_BACKGROUND)


def invert_if_bright(grey):
    """``(image, inverted)``: the uint8 grey image made dark-background (nuclei bright) by
    ``255 - image`` when :func:`is_bright_background`, as ``--normalize auto`` does before
    its percentile stretch; otherwise the image itself."""
    if is_bright_background(grey):
        return (255 - grey).astype(np.uint8), True
    return grey, False


def read_labels(mask_paths):
    """One DSB sample's masks -> (H, W) int32 instance labels: file k -> id k, later files
    win overlaps (gluon_unet's ``merge_object_masks``)."""
    labels = None
    for k, path in enumerate(mask_paths, start=1):
        m = np.asarray(read_raw(path))
        fg = (m > 0) if m.ndim == 2 else (m > 0).any(axis=2)
        if labels is None:
            labels = np.zeros(fg.shape, np.int32)
        if fg.shape != labels.shape:
            raise SystemExit('mask %s is %s but the others are %s' % (path, fg.shape, labels.shape))
        labels[fg] = k
    return labels


def write_labels(path, labels):
    """Instance labels as a 16-bit PNG (``bin/predict``'s ``<id>_labels.png``, which
    ``bin/evaluate`` reads by the ``_labels`` suffix). Ids are renumbered 1..n first so
    that any count below 65,536 fits."""
    lab = np.asarray(labels)
    ids = np.unique(lab[lab > 0])
    if len(ids) > 65535:
        raise SystemExit('%s: %d objects do not fit a 16-bit label image' % (path, len(ids)))
    out = np.zeros(lab.shape, np.uint16)
    if len(ids):
        lut = np.zeros(int(ids.max()) + 1, np.uint16)
        lut[ids] = np.arange(1, len(ids) + 1, dtype=np.uint16)
        out = lut[np.where(lab > 0, lab, 0)]
    tmp = path + '.tmp.png'
    try:
        import cv2
        if not cv2.imwrite(tmp, out):
            raise SystemExit('%s: cannot write' % path)
    except ImportError:
        import imageio.v3 as iio
        iio.imwrite(tmp, out)
    os.replace(tmp, path)  # whole or not at all: bin/evaluate never sees half a file


# --------------------------------------------------------------------------- measuring

def cpu_seconds():
    """User + system CPU seconds of this process and its waited-for children."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def machine_busy_seconds():
    """CPU seconds all processes used so far, machine-wide (``/proc/stat``, as
    ``benchmarks/procstat.py``): how loaded the machine was beside this run."""
    try:
        with open('/proc/stat') as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf('SC_CLK_TCK')


def rss_kib(field):
    """This process's ``field`` of ``/proc/self/status`` in KiB (``VmRSS`` now, ``VmHWM``
    the peak); 0 where the kernel does not report it."""
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith(field + ':'):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak_rss():
    """Reset ``VmHWM`` to the current RSS (writing 5 to ``/proc/self/clear_refs``, Linux
    4.0+), so the peak read after one image is that image's. True when it worked; where it
    does not, ``VmHWM`` is the process's peak so far and the record says so."""
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return True
    except OSError:
        return False


#: The CPU features that change a framework's speed here (the same model name, "AMD EPYC",
#: is a Zen 3 with AVX2 only on one machine and a Zen 4 with AVX-512 on the next).
SPEED_FLAGS = ('avx2', 'avx512f', 'avx512_bf16', 'avx512_vnni', 'amx_tile')


def cpu_model():
    """``(model name, the SPEED_FLAGS it has)`` from /proc/cpuinfo."""
    model, flags = 'unknown', set()
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                key, _, value = line.partition(':')
                if key.strip() == 'model name' and model == 'unknown':
                    model = value.strip()
                elif key.strip() == 'flags' and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, [f for f in SPEED_FLAGS if f in flags]


def machine_info():
    """What the record needs to compare runs: the CPU and its speed flags, how many cores
    this process may use, the thread settings."""
    model, flags = cpu_model()
    return dict(cpu=model, cpu_flags=flags, cores_allowed=len(os.sched_getaffinity(0)), python=sys.version.split()[0],
                threads={k: os.environ.get(k) for k in ('OMP_NUM_THREADS', 'TF_NUM_INTRAOP_THREADS',
                                                         'TF_NUM_INTEROP_THREADS', 'MKL_NUM_THREADS')})


class Budget:
    """A wall-time budget that starts when the command starts (imports and data loading
    count, as the recipe's 58 minutes are the wall time of the whole ``bin/train``)."""

    def __init__(self, minutes, start=None):
        self.start = time.time() if start is None else start
        self.seconds = float(minutes) * 60.0
        self.deadline = self.start + self.seconds

    def elapsed(self):
        return time.time() - self.start

    def left(self):
        return self.deadline - time.time()


def thread_count():
    """Threads the peer's framework should use: ``OMP_NUM_THREADS`` when set, else every
    core this process may run on."""
    try:
        return max(1, int(os.environ.get('OMP_NUM_THREADS', '')))
    except ValueError:
        return len(os.sched_getaffinity(0))


def write_json(path, obj):
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write('\n')
    os.replace(tmp, path)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_match(path, peer, keys):
    """``--match BUDGET_JSON``: the recorded from-scratch run of ``peer`` whose work a run
    repeats; ``keys`` are the figures it needs. Checked before any framework is imported (one
    line and exit 2 otherwise, :func:`fail`)."""
    try:
        record = read_json(path)
    except OSError as e:
        fail('--match %s: %s' % (path, e.strerror or e))
    except ValueError as e:
        fail('--match %s: not a budget.json (%s)' % (path, e))
    if not isinstance(record, dict) or record.get('peer') != peer or 'init' in record:
        fail('--match %s: not the budget.json of a %s run trained from scratch' % (path, peer))
    missing = [k for k in keys + ('train_images',) if not isinstance(record.get(k), int) or record[k] < 1]
    if missing:
        fail('--match %s: no %s in it' % (path, missing[0]))
    return record


def check_match_data(path, record, samples, data):
    """The same work needs the same images: as many samples in ``--data`` as the recorded
    run had (its training and validation images), else one line and exit 2."""
    recorded = record['train_images'] + record.get('val_images', 0)
    if recorded != len(samples):
        fail('--match %s: recorded on %d images, --data %s has %d' % (path, recorded, data, len(samples)))


def file_sha256(path):
    """SHA-256 of a file, as ``sha256:<hex>`` (the form of gluon_unet's ``--init`` digest)."""
    import hashlib
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            h.update(block)
    return 'sha256:' + h.hexdigest()


def read_init(folder, peer, script, weights_default, needed=()):
    """Check ``--init MODEL_DIR`` before any framework is imported: a folder made by
    ``script``'s own ``train`` for ``peer`` (its ``peer.json`` says so) with its weights
    file (``peer.json``'s ``weights``, else ``weights_default``) and the other files
    ``needed`` names (keys of ``peer.json``). Returns ``(settings, weights_path)``;
    anything else is one line on stderr and exit 2 (:func:`fail`)."""
    if not os.path.isdir(folder):
        fail('--init %s: no such directory' % folder)
    peer_json = os.path.join(folder, 'peer.json')
    if not os.path.isfile(peer_json):
        fail('--init %s: not a model folder made by %s train (no peer.json)' % (folder, script))
    try:
        settings = read_json(peer_json)
    except (OSError, ValueError) as e:
        fail('--init %s: its peer.json cannot be read (%s)' % (folder, str(e).splitlines()[0] if str(e) else
                                                                 type(e).__name__))
    if not isinstance(settings, dict) or settings.get('peer') != peer:
        other = settings.get('peer') if isinstance(settings, dict) else None
        fail('--init %s: a %s model, not one made by %s train' % (folder, other or 'foreign', script))
    weights = os.path.join(folder, settings.get('weights') or weights_default)
    if not os.path.isfile(weights):
        fail('--init %s: its weights %s are missing' % (folder, os.path.relpath(weights, folder)))
    for key in needed:
        if not settings.get(key) or not os.path.isfile(os.path.join(folder, settings[key])):
            fail('--init %s: its %s (%s) is missing' % (folder, key.replace('_', ' '), settings.get(key)))
    return settings, weights


def init_record(folder, weights, **extra):
    """What ``budget.json`` and ``peer.json`` say of a fine-tune's source: the folder, the
    weights file and its digest, and what the source's own ``budget.json`` says it was
    trained on (``data``, ``minutes``, ``init``: a fine-tune of a fine-tune keeps its chain)."""
    rec = dict(model=os.path.abspath(folder), weights=os.path.abspath(weights), sha256=file_sha256(weights))
    try:
        src = read_json(os.path.join(folder, 'budget.json'))
        rec.update({'source_' + k: src[k] for k in ('data', 'minutes', 'init') if k in src})
    except (OSError, ValueError):
        pass
    rec.update(extra)
    return rec


def split_ids(ids, fraction, seed):
    """``(train, val)``: a seeded shuffle puts ``round(fraction * n)`` ids (at least 1 when
    fraction > 0 and n > 1) into validation, as StarDist's example splits its data."""
    ids = list(ids)
    rng = np.random.RandomState(seed)
    order = rng.permutation(len(ids))
    n_val = 0 if fraction <= 0 or len(ids) < 2 else max(1, int(round(fraction * len(ids))))
    val = sorted(ids[i] for i in order[:n_val])
    train = sorted(ids[i] for i in order[n_val:])
    return train, val


def predict_loop(items, out_dir, predict_one, log_every=10):
    """Predict ``[(id, path)]`` one image at a time into ``out_dir/<id>_labels.png``,
    timing each and reading its peak memory. ``predict_one(grey_image) -> (labels, info)``.

    Returns the per-image records (id, size, objects, seconds, cpu_seconds,
    peak_rss_mib, ...); the first image's time includes the framework's warm-up, which is
    why the summary also gives the median."""
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for i, (image_id, path) in enumerate(items):
        grey = read_grey(path)
        exact = reset_peak_rss()
        t0, c0 = time.perf_counter(), cpu_seconds()
        labels, info = predict_one(grey)
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        peak = rss_kib('VmHWM') / 1024.0
        write_labels(os.path.join(out_dir, image_id + '_labels.png'), labels)
        row = dict(image_id=image_id, height=int(grey.shape[0]), width=int(grey.shape[1]),
                   objects=int(len(np.unique(labels[labels > 0]))), seconds=round(seconds, 4),
                   cpu_seconds=round(cpu, 3), peak_rss_mib=round(peak, 1), peak_is_per_image=exact)
        row.update(info)
        rows.append(row)
        if log_every and (i % log_every == 0 or i == len(items) - 1):
            print('[%d/%d] %s: %d objects, %.2f s, peak %.0f MiB' % (i + 1, len(items), image_id, row['objects'],
                                                                       seconds, peak), flush=True)
    return rows


def summarize_predictions(rows):
    secs = [r['seconds'] for r in rows]
    peaks = [r['peak_rss_mib'] for r in rows]
    return dict(images=len(rows), seconds_total=round(sum(secs), 3), seconds_median=round(float(np.median(secs)), 4),
                seconds_max=round(max(secs), 4), seconds_first=round(secs[0], 4),
                peak_rss_mib_max=round(max(peaks), 1), peak_rss_mib_median=round(float(np.median(peaks)), 1))


def write_prediction_record(out_dir, rows, extra):
    """``prediction_times.csv`` (one row per image) and ``prediction.json`` (the summary
    and the settings) in ``out_dir``, beside the labels (bin/evaluate reads only images)."""
    import csv
    cols = list(rows[0].keys())
    for r in rows:
        cols += [k for k in r if k not in cols]
    tmp = os.path.join(out_dir, 'prediction_times.csv.tmp')
    with open(tmp, 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, os.path.join(out_dir, 'prediction_times.csv'))
    summary = summarize_predictions(rows)
    summary.update(extra)
    summary['machine'] = machine_info()
    write_json(os.path.join(out_dir, 'prediction.json'), summary)
    return summary
