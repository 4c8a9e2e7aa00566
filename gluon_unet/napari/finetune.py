"""The napari widget's *Fine-tune*: corrected labels become training pairs, and ``bin/train
--init`` runs in the MXNet environment.

napari's environment has no MXNet (napari needs numpy 2, MXNet 1.9.1 numpy < 1.24), so the
training runs as a subprocess of a Python the user names once (kept in
``~/.config/gluon_unet/napari.json``). The pairs are written in the paired layout
``bin/train`` reads (``NAME.png`` + ``NAME_mask.png``, the mask 16-bit instance labels so
touching nuclei stay apart), into a folder of the user's choice; the pair of an image the
widget wrote before is replaced, a file it did not write never is (its record,
``gluon_unet-pairs.json``, says which). Nothing here imports napari or Qt.
"""
import json
import os
import re
import select
import signal
import subprocess

import numpy as np

from .. import models
from ..errors import UserError
from ..training.finetune import FINE_TUNE_DEFAULTS

#: The record of the pairs the widget wrote into a pairs folder.
RECORD = 'gluon_unet-pairs.json'
#: Where the MXNet Python is remembered.
SETTINGS = os.path.join(os.environ.get('XDG_CONFIG_HOME') or os.path.join(os.path.expanduser('~'), '.config'),
                        'gluon_unet', 'napari.json')
_EPOCH = re.compile(r'\bepoch (\d+) \|')
_PLANNED = re.compile(r'the LR schedule now ends with epoch (\d+)')


def remembered_python(path=None):
    """The MXNet Python the user set before, or ''."""
    try:
        with open(path or SETTINGS) as f:
            value = json.load(f).get('mxnet_python', '')
        return value if isinstance(value, str) else ''
    except (OSError, ValueError, AttributeError):
        return ''


def remember_python(python, path=None):
    """Keep ``python`` as the MXNet Python for the next session (best effort)."""
    path = path or SETTINGS
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + '.tmp-%d' % os.getpid()
        with open(tmp, 'w') as f:
            json.dump({'mxnet_python': python}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def check_python(python):
    """'' when ``python`` runs and imports mxnet, else why not (one line)."""
    if not python:
        return 'no MXNet Python set'
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return 'MXNet Python %s: not an executable file' % python
    try:
        done = subprocess.run([python, '-c', 'import mxnet, gluon_unet'], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 'MXNet Python %s: does not run (%s)' % (python, exc)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ['exit %d' % done.returncode])[-1]
        return 'MXNet Python %s cannot import mxnet and gluon_unet (%s)' % (python, last)
    return ''


def _safe_name(name):
    return re.sub(r'[^A-Za-z0-9_.-]+', '_', name).strip('._') or 'image'


def save_pair(folder, name, image, labels):
    """Write ``image`` ((H, W, C) uint8, as :func:`~.segmenter.layer_image` gives it) and
    ``labels`` ((H, W) instance ids) as a training pair in ``folder``; returns the image's
    path. The widget's earlier pair of ``name`` is replaced; another file of that name (not
    the widget's) is left alone and the pair gets a numbered name."""
    import cv2
    labels = np.asarray(labels)
    if labels.shape != image.shape[:2]:
        raise UserError('labels %s do not match the image %s' % ('x'.join(map(str, labels.shape)),
                                                                 'x'.join(map(str, image.shape[:2]))))
    if labels.max(initial=0) > 65535 or labels.min(initial=0) < 0:
        raise UserError('labels must be ids from 0 to 65535 (got %d to %d)' % (labels.min(), labels.max()))
    if not labels.any():
        raise UserError('the labels layer is empty: draw or correct the nuclei first')
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError('training pairs %s: is a file, not a folder' % folder)
    os.makedirs(folder, exist_ok=True)
    record = _read_record(folder)
    base = _safe_name(name)
    stem, n = base, 1
    while stem not in record.get(name, []) and any(os.path.lexists(os.path.join(folder, stem + s))
                                                   for s in ('.png', '_mask.png')):
        n += 1
        stem = '%s-%d' % (base, n)
    pixels = image[..., 0] if image.shape[2] == 1 else image[..., ::-1]  # OpenCV writes BGR
    for path, data in ((os.path.join(folder, stem + '.png'), pixels),
                       (os.path.join(folder, stem + '_mask.png'), labels.astype(np.uint16))):
        tmp = path + '.tmp.png'
        if not cv2.imwrite(tmp, data):
            raise UserError('training pairs %s: cannot write %s' % (folder, os.path.basename(path)))
        os.replace(tmp, path)
    record[name] = [stem]
    tmp = os.path.join(folder, RECORD + '.tmp')
    with open(tmp, 'w') as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, os.path.join(folder, RECORD))
    return os.path.join(folder, stem + '.png')


def _read_record(folder):
    try:
        with open(os.path.join(folder, RECORD)) as f:
            record = json.load(f)
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def runs_folder(pairs):
    """Where the widget's fine-tuning runs go: beside the pairs (never inside them: the
    next run would read its own outputs as images)."""
    pairs = os.path.abspath(pairs).rstrip(os.sep)
    return pairs + '-runs'


def train_command(python, model, pairs, output):
    """``bin/train --init`` of ``model`` on the ``pairs`` folder, as argv: what the widget
    runs, and what it shows to run by hand."""
    init = models.shipped_name(model) or os.path.abspath(model)
    return [python or 'python', '-m', 'gluon_unet', 'train', '--init', init, '--data', os.path.abspath(pairs),
            '--output', output, '--no-progress']


def next_output(pairs):
    """A new run folder ``<pairs>-runs/finetune-N``."""
    root = runs_folder(pairs)
    n = 1
    while os.path.lexists(os.path.join(root, 'finetune-%d' % n)):
        n += 1
    return os.path.join(root, 'finetune-%d' % n)


def shown_command(argv):
    """``argv`` as one line to paste in a shell."""
    import shlex
    return ' '.join(shlex.quote(a) for a in argv)


def run_training(argv, log_path, poll=0.2):
    """A generator: runs ``argv``, writes its output to ``log_path``; yields ``(epoch,
    planned epochs)`` as it goes and returns ``(exit code, last line)``. Closing it (the
    widget's *Cancel*) sends SIGTERM: ``bin/train`` saves a checkpoint and stops."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    total, last, pending = FINE_TUNE_DEFAULTS['epochs'], '', ''
    with open(log_path, 'w') as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            fd = proc.stdout.fileno()
            while True:
                ready, _, _ = select.select([fd], [], [], poll)
                chunk = os.read(fd, 65536).decode(errors='replace') if ready else ''
                if ready and not chunk:
                    break
                log.write(chunk)
                log.flush()
                pending += chunk
                *lines, pending = pending.split('\n')
                epoch = None
                for line in lines:
                    if line.strip():
                        last = line.strip()
                    planned = _PLANNED.search(line)
                    if planned:
                        total = int(planned.group(1))
                    found = _EPOCH.search(line)
                    if found:
                        epoch = int(found.group(1))
                yield (epoch, total)
            return proc.wait(), (pending.strip() or last)
        finally:
            if proc.poll() is None:  # cancelled (GeneratorExit) or an error here
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            proc.stdout.close()

