"""Named training recipes shipped with the package: ``bin/train --config NAME``.

Each recipe is a JSON file of :class:`~gluon_unet.config.TrainConfig` values in this folder
(``dsb2018.json`` is ``--config dsb2018``). A recipe holds no path: the data, the cache and
the run folder come from ``--data``, ``--cache-dir`` and ``--output``, and any flag
overrides the recipe's value. ``docs/how-to/tuning.md`` says what each one is for,
``docs/reference/config.md`` lists their settings.
"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def names():
    """The recipe names, sorted: ``['dsb2018', 'dsb2018-gpu', 'keras-seed']``."""
    return sorted(f[:-len('.json')] for f in os.listdir(HERE) if f.endswith('.json'))


def path(name):
    """The file of recipe ``name``, or None when no recipe has that name.

    ``name`` is a bare name such as ``'dsb2018'``; a name with a path separator is never a
    recipe (it is a file the caller should open as given).
    """
    if not name or os.sep in name or (os.altsep and os.altsep in name) or name.startswith('.'):
        return None
    found = os.path.join(HERE, name + '.json')
    return found if os.path.isfile(found) else None
