"""Finding image/mask pairs on disk.

Three layouts, auto-detected (``layout`` forces one):

``paired``
    ``--data IMAGES/ --masks MASKS/``: ``name.ext`` pairs with ``name<mask_suffix>.ext``
    (default suffix ``_mask``, any image extension) or with ``name.ext`` of the same stem.
    Without ``--masks``, ``DATA/images/`` + ``DATA/masks/`` subfolders, or images and
    ``*_mask`` files side by side in one folder, are read the same way.
``dsb``
    The Data Science Bowl 2018 layout: ``ROOT/<id>/images/<id>.png`` and one PNG per object
    in ``ROOT/<id>/masks/``; the object masks are merged into one binary mask and into an
    instance label image (mask file k -> id k, in sorted file order).
``csv``
    A CSV file with ``image`` and ``mask`` columns; paths relative to the CSV's folder.
    An optional ``group`` column names each image's appearance group for
    ``--balance groups`` (otherwise the groups come from the pixels).

Discovery only lists files (no decoding); size mismatches are found when decoding.
"""
import csv
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import List, Optional

from ..errors import UserError
from .io import IMAGE_TYPES, is_image_file

LAYOUTS = ('auto', 'paired', 'dsb', 'csv')
log = logging.getLogger(__name__)

_EXPECTED = ("expected one of: a folder of images with --masks MASK_FOLDER (name.png <-> name%s.png "
             "or same names), a folder with images/ and masks/ subfolders, the DSB layout "
             "ROOT/<id>/images/<id>.png + ROOT/<id>/masks/*.png, or a CSV with image,mask columns")
#: The same for --val-data, which has no mask folder flag of its own.
_EXPECTED_VAL = ("expected one of: a folder of images and their masks (name.png + name%s.png), a folder with "
                 "images/ and masks/ subfolders, the DSB layout ROOT/<id>/images/<id>.png + ROOT/<id>/masks/*.png, "
                 "or a CSV with image,mask columns")


def _expected(flag, mask_suffix):
    return (_EXPECTED if flag == '--data' else _EXPECTED_VAL) % mask_suffix


@dataclass
class Sample:
    """One training example as files: an image and the mask file(s) that go with it.

    ``merge`` is True for the DSB layout, where each mask file is one object; ``group``
    the CSV's ``group`` column (None: from the pixels).
    """
    name: str
    image: str
    masks: List[str] = field(default_factory=list)
    merge: bool = False
    group: Optional[str] = None

    def files(self):
        return [self.image] + list(self.masks)


def _listdir(path):
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        raise UserError('%s: folder not found' % path) from None
    except NotADirectoryError:
        raise UserError('%s: not a folder' % path) from None
    except OSError as e:
        raise UserError('%s: cannot list folder (%s)' % (path, e.strerror or e)) from None


def list_images(folder):
    """Names of the image files directly in ``folder``, sorted (hidden files skipped)."""
    return [n for n in _listdir(folder) if is_image_file(n) and os.path.isfile(os.path.join(folder, n))]


def _unpaired(missing, total, what, skip_unpaired):
    """Fail (or warn with ``skip_unpaired``) about images that have no mask."""
    if not missing:
        return
    shown = ', '.join(missing[:5]) + (', ...' if len(missing) > 5 else '')
    msg = '%d of %d images have no mask %s: %s' % (len(missing), total, what, shown)
    if not skip_unpaired:
        raise UserError(msg + ' (pass --skip-unpaired to train on the others)')
    warnings.warn(msg + '; skipped (--skip-unpaired)', stacklevel=3)
    log.warning('%s; skipped', msg)


def is_dsb_sample(folder, part='images'):
    """True when ``folder`` is one sample of the DSB layout: it has a ``<part>/`` subfolder
    (``images`` for inputs, ``masks`` for ground truth)."""
    return os.path.isdir(os.path.join(folder, part))


def is_dsb(root, part='images'):
    """True when ``root`` is the DSB layout: a (non-hidden) entry is a DSB sample, see
    :func:`is_dsb_sample`. The one detector used by training, prediction and evaluation."""
    return any(not n.startswith('.') and is_dsb_sample(os.path.join(root, n), part) for n in _listdir(root))


def dsb_image(sample_dir):
    """The image of one DSB sample ``<id>/``: ``<id>/images/<id>.*``, else the first image
    in ``<id>/images/``; None when there is none."""
    sid = os.path.basename(os.path.normpath(sample_dir))
    img_dir = os.path.join(sample_dir, 'images')
    imgs = list_images(img_dir)
    preferred = [n for n in imgs if os.path.splitext(n)[0] == sid]
    return os.path.join(img_dir, (preferred or imgs)[0]) if imgs else None


def detect_layout(path, masks=None, mask_suffix='_mask', flag='--data'):
    """Name the layout of ``path``: 'paired', 'dsb' or 'csv'.

    Raises
    ------
    UserError
        Missing path, empty folder or a folder that matches no layout.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise UserError('%s %s: no such file or folder' % (flag, path))
    if os.path.isfile(path):
        if path.lower().endswith('.csv'):
            return 'csv'
        raise UserError('%s %s: a file but not a .csv; %s' % (flag, path, _expected(flag, mask_suffix)))
    if masks is not None:
        return 'paired'
    entries = [n for n in _listdir(path) if not n.startswith('.')]
    if not entries:
        raise UserError('%s %s: folder is empty' % (flag, path))
    if os.path.isdir(os.path.join(path, 'images')) and os.path.isdir(os.path.join(path, 'masks')):
        return 'paired'
    if is_dsb(path):
        return 'dsb'
    images = [n for n in entries if is_image_file(n)]
    if mask_suffix and any(os.path.splitext(n)[0].endswith(mask_suffix) for n in images):
        return 'paired'
    if images:
        raise UserError('%s %s: images but no masks (no *%s files%s); %s'
                        % (flag, path, mask_suffix, ', no --masks folder' if flag == '--data' else '',
                           _expected(flag, mask_suffix)))
    raise UserError('%s %s: matches no layout; %s' % (flag, path, _expected(flag, mask_suffix)))


def find_paired(images_dir, masks_dir=None, mask_suffix='_mask', skip_unpaired=False, flag='--data'):
    """Pairs from an image folder and a mask folder (may be the same folder).

    Returns
    -------
    list of Sample, sorted by name.
    """
    images_dir = os.fspath(images_dir)
    if masks_dir is None:
        if os.path.isdir(os.path.join(images_dir, 'images')) and os.path.isdir(os.path.join(images_dir, 'masks')):
            images_dir, masks_dir = os.path.join(images_dir, 'images'), os.path.join(images_dir, 'masks')
        else:
            masks_dir = images_dir
    masks_dir = os.fspath(masks_dir)
    if not os.path.isdir(masks_dir):
        raise UserError('--masks %s: no such folder' % masks_dir)
    same = os.path.abspath(images_dir) == os.path.abspath(masks_dir)
    image_files = list_images(images_dir)
    mask_files = image_files if same else list_images(masks_dir)
    by_stem = {}
    for n in mask_files:
        by_stem.setdefault(os.path.splitext(n)[0], n)
    if same:  # one folder: name.png + name_mask.png; the masks are not images
        if not mask_suffix:
            raise UserError('%s %s: images and masks in one folder need a --mask-suffix' % (flag, images_dir))
        image_files = [n for n in image_files if not os.path.splitext(n)[0].endswith(mask_suffix)]
    if not image_files:
        raise UserError('%s %s: no images (%s) in the folder' % (flag, images_dir, IMAGE_TYPES))
    samples, missing = [], []
    for n in image_files:
        stem = os.path.splitext(n)[0]
        m = by_stem.get(stem + mask_suffix) if mask_suffix else None
        if m is None and not same:
            m = by_stem.get(stem)
        if m is None:
            missing.append(n)
            continue
        samples.append(Sample(stem, os.path.join(images_dir, n), [os.path.join(masks_dir, m)]))
    _unpaired(missing, len(image_files), 'in %s (looked for NAME%s.* or NAME.*)' % (masks_dir, mask_suffix),
              skip_unpaired)
    return samples


def find_dsb(root, skip_unpaired=False):
    """Samples of the DSB layout ``ROOT/<id>/images/<id>.png`` + ``ROOT/<id>/masks/*.png``."""
    root = os.fspath(root)
    samples, missing, total = [], [], 0
    for sid in _listdir(root):
        d = os.path.join(root, sid)
        if sid.startswith('.') or not os.path.isdir(d):
            continue
        if not is_dsb_sample(d):
            raise UserError('%s: no images/ folder (DSB layout: ROOT/<id>/images/<id>.png)' % d)
        image = dsb_image(d)
        if image is None:
            raise UserError('%s: no image file (DSB layout: ROOT/<id>/images/<id>.png)' % os.path.join(d, 'images'))
        total += 1
        mask_dir = os.path.join(d, 'masks')
        masks = list_images(mask_dir) if os.path.isdir(mask_dir) else []
        if not masks:
            missing.append(sid)
            continue
        samples.append(Sample(sid, image, [os.path.join(mask_dir, m) for m in masks], merge=True))
    if total == 0:
        raise UserError('%s: no DSB samples (expected ROOT/<id>/images/<id>.png)' % root)
    _unpaired(missing, total, '(empty or missing <id>/masks/ folder)', skip_unpaired)
    return samples


def find_csv(csv_path, skip_unpaired=False):
    """Samples listed in a CSV with ``image`` and ``mask`` columns (relative paths) and
    an optional ``group`` column (every listed image then needs a group)."""
    csv_path = os.fspath(csv_path)
    base = os.path.dirname(os.path.abspath(csv_path))
    try:
        with open(csv_path, newline='') as f:
            reader = csv.DictReader(f)
            header = [(h or '').strip().lower() for h in (reader.fieldnames or [])]
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError('%s: cannot read CSV (%s)' % (csv_path, e)) from None
    if 'image' not in header or 'mask' not in header:
        raise UserError('%s: CSV needs "image" and "mask" columns (found: %s)'
                        % (csv_path, ', '.join(header) or 'no header'))
    samples, missing = [], []
    has_group = 'group' in header
    for line, row in enumerate(rows, start=2):
        row = {(k or '').strip().lower(): (v or '').strip() for k, v in row.items()
               if isinstance(v, str) or v is None}
        if not row['image']:
            continue
        image = os.path.join(base, row['image'])
        if not os.path.isfile(image):
            raise UserError('%s line %d: image %s not found' % (csv_path, line, row['image']))
        if not row['mask']:
            missing.append(row['image'])
            continue
        mask = os.path.join(base, row['mask'])
        if not os.path.isfile(mask):
            raise UserError('%s line %d: mask %s not found' % (csv_path, line, row['mask']))
        group = row.get('group') or None
        if has_group and group is None:
            raise UserError('%s line %d: empty group (the CSV has a group column: give every image one, '
                            'e.g. fluorescence, brightfield, tissue)' % (csv_path, line))
        samples.append(Sample(os.path.splitext(os.path.basename(image))[0], image, [mask], group=group))
    if not samples and not missing:
        raise UserError('%s: CSV lists no images' % csv_path)
    _unpaired(missing, len(samples) + len(missing), 'in the mask column of %s' % csv_path, skip_unpaired)
    return samples


def csv_folders(csv_path):
    """The folders the images and masks a CSV lists lie in (absolute, each once), resolved
    as :func:`find_csv` resolves them: inputs of a run as much as the CSV itself (an output
    there could replace a listed file, and ``--overwrite`` delete it). Empty when the CSV
    cannot be read: reading the data then says why."""
    base = os.path.dirname(os.path.abspath(os.fspath(csv_path)))
    try:
        with open(csv_path, newline='') as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error):
        return []
    found = {}
    for row in rows:
        for key, value in row.items():
            if (key or '').strip().lower() in ('image', 'mask') and isinstance(value, str) and value.strip():
                found.setdefault(os.path.dirname(os.path.join(base, value.strip())), None)
    return list(found)


def discover(path, masks=None, layout='auto', mask_suffix='_mask', skip_unpaired=False, flag='--data'):
    """Find the samples of a dataset.

    Parameters
    ----------
    path : str
        Image folder, DSB root or CSV file (``--data``).
    masks : str, optional
        Mask folder for the paired layout (``--masks``).
    layout : {'auto', 'paired', 'dsb', 'csv'}
    mask_suffix : str
        Paired layout: ``name.ext`` <-> ``name<mask_suffix>.ext``.
    skip_unpaired : bool
        Warn about images without a mask instead of raising.
    flag : str
        The flag that named ``path``, for the messages (``'--val-data'``).

    Returns
    -------
    layout : str
        The layout used.
    samples : list of Sample

    Raises
    ------
    UserError
        Missing path, empty folder, no layout matched, images without masks.
    """
    if layout not in LAYOUTS:
        raise UserError('--layout must be one of %s (got %r)' % (', '.join(LAYOUTS), layout))
    path = os.fspath(path)
    if layout == 'auto':
        layout = detect_layout(path, masks, mask_suffix, flag)
    elif not os.path.exists(path):
        raise UserError('%s %s: no such file or folder' % (flag, path))
    if layout == 'csv':
        if not os.path.isfile(path):
            raise UserError('%s %s: --layout csv needs a CSV file' % (flag, path))
        samples = find_csv(path, skip_unpaired)
    elif os.path.isfile(path):
        raise UserError('%s %s: --layout %s needs a folder' % (flag, path, layout))
    elif layout == 'dsb':
        if not is_dsb(path):
            raise UserError('%s %s: not the DSB layout (expected ROOT/<id>/images/<id>.png '
                            'and ROOT/<id>/masks/*.png)' % (flag, path))
        samples = find_dsb(path, skip_unpaired)
    else:
        samples = find_paired(path, masks, mask_suffix, skip_unpaired, flag)
    if not samples:
        raise UserError('%s %s: no image has a mask' % (flag, path))
    check_distinct(samples, flag, path)
    return layout, samples


def check_distinct(samples, flag='--data', path=''):
    """Refuse two samples with one name (``a.png`` and ``a.tif``: the split, the logs and
    the outputs name samples by it) and two images that share a mask file (a mask
    belongs to one image: one of them was paired by mistake), in one line naming both."""
    names, owners = {}, {}
    for s in samples:
        if s.name in names:
            raise UserError('%s %s: two samples are named %r (%s and %s); names must be unique, since the split, '
                            'the logs and the outputs go by them: rename one' % (flag, path, s.name,
                                                                                 names[s.name], s.image))
        names[s.name] = s.image
        for m in s.masks:
            key = os.path.realpath(m)
            if key in owners:
                raise UserError('%s %s: %s and %s both pair with the mask %s; a mask belongs to one image'
                                % (flag, path, owners[key], s.image, m))
            owners[key] = s.image
