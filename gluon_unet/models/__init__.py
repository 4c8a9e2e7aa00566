"""Models shipped with the package: ``--model nuclei`` segments before anything is trained.

Each shipped model is an export in a folder of this package (``nuclei/``: MXNet's
symbol and params, ``model.onnx``, ``model.json`` and the model card ``README.md``),
made by our own training on CC0 data with the command its card gives. Wherever a command
or the Python API takes a model (``bin/predict --model``, ``bin/train --init``,
``bin/export``, ``gluon-unet package``, the napari widget), a shipped model's name is
accepted in place of a path: a file or folder of that name that exists wins, as for the
recipes of ``--config``.

Importing this module loads no mxnet: the ONNX and napari environments read it too.
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))

#: name -> what it is for, one line (``gluon-unet models`` prints it). A folder of this
#: package is a shipped model only when it is listed here: nothing else is offered.
SHIPPED = {
    'nuclei': 'cell nuclei in 2D microscopy: fluorescence, brightfield and H&E tissue (Data Science Bowl 2018, '
              'CC0); a start for --init fine-tuning on your own images',
}


def names():
    """The shipped models' names, in the order :data:`SHIPPED` lists them."""
    return list(SHIPPED)


def folder(name):
    """The export folder of the shipped model ``name``, or None when no shipped model has
    that name (or its files are missing from this installation).

    ``name`` is a bare name: one with a path separator is never a shipped model."""
    if not isinstance(name, str) or name not in SHIPPED:
        return None
    found = os.path.join(HERE, name)
    return found if os.path.isfile(os.path.join(found, 'model.json')) else None


def resolve(value):
    """``value`` as a path: a shipped model's folder for its name (when no file or folder
    of that name exists), else ``value`` unchanged. For every option that takes a model."""
    if isinstance(value, str) and not os.path.lexists(value):
        return folder(value) or value
    return value


def shipped_name(path):
    """The name of the shipped model whose folder ``path`` is (or lies in), else None."""
    if not path:
        return None
    real = os.path.realpath(path)
    for name in SHIPPED:
        home = os.path.realpath(os.path.join(HERE, name))
        if real == home or real.startswith(home + os.sep):
            return name
    return None


def describe():
    """``[(name, one line, scores or '')]`` of every shipped model, for ``gluon-unet models``:
    the scores are those its ``model.json`` card records (``card.scores``)."""
    rows = []
    for name, text in SHIPPED.items():
        where = folder(name)
        scores = ''
        if where is None:
            scores = 'missing from this installation'
        else:
            try:
                with open(os.path.join(where, 'model.json')) as f:
                    card = (json.load(f).get('card') or {})
                scores = card.get('scores_line', '') if isinstance(card, dict) else ''
            except (OSError, ValueError):
                scores = 'its model.json cannot be read'
        rows.append((name, text, scores))
    return rows


def split_reference(value):
    """``('nuclei', 'sha256:ab..')`` from ``'nuclei@sha256:ab..'`` (a pinned ``--init``, or
    what a fine-tuned run's config records); ``(value, None)`` when it has no digest."""
    head, sep, tail = value.rpartition('@')
    if sep and head and ':' in tail:
        return head, tail
    return value, None


def reference_card(reference):
    """A model card's account of the model a run started from (its config's ``init``):
    ``{'model': name, 'shipped': bool, 'digest': ...}``, the name being a shipped model's
    or the file's own name - no local path. None for a run from random weights."""
    if not reference:
        return None
    label, digest = split_reference(reference)
    shipped = label in SHIPPED
    return {'model': label if shipped else os.path.basename(label.rstrip(os.sep)) or label, 'shipped': shipped,
            'digest': digest}
