"""The fields of a bioimage.io description that the spec constrains, checked as
bioimageio.spec 0.5 checks them (0.5.4 to 0.5.14), and where their values come from: the
model's name, authors, licences (SPDX identifiers, ``spdx_licenses.txt``), citations, the
training data - its citation and licence from the user or from the recognised DSB 2018
data (:mod:`gluon_unet.data.known`), never from a folder's name - and the export's
``model.json`` without the paths of the machine it was made on.

``gluon-unet package`` (:mod:`gluon_unet.inference.bioimageio`) checks them all before it
writes anything: a zip the spec would refuse is never written.
"""
import functools
import json
import os
import re
import string
import warnings

from ..data.known import DSB2018
from ..errors import UserError

#: bioimage.io's limits on a model's name (bioimageio.spec 0.5: letters, digits and these).
NAME_CHARACTERS = frozenset(string.ascii_letters + string.digits + '_+- ()')
NAME_MIN, NAME_MAX = 5, 128


def check_model_name(flag, name):
    """Refuse, naming ``flag``, a model name bioimage.io rejects."""
    bad = sorted(set(name) - NAME_CHARACTERS)
    if bad:
        raise UserError('%s %r: a bioimage.io model name holds only letters, digits, spaces and _+-(), not %s'
                        % (flag, name, ' '.join(repr(c) for c in bad)))
    if not NAME_MIN <= len(name) <= NAME_MAX:
        raise UserError('%s %r: a bioimage.io model name is %d to %d characters long (this one %d)'
                        % (flag, name, NAME_MIN, NAME_MAX, len(name)))


def model_name(data_name):
    """The default model name for the training data ``data_name``, as bioimage.io takes it:
    each character it refuses becomes ``-``, the data's name cut to fit."""
    head = 'gluon_unet nuclei U-Net ('
    data = ''.join(c if c in NAME_CHARACTERS else '-' for c in data_name)[:NAME_MAX - len(head) - 1]
    return head + data + ')'


def check_authors(flag, text):
    """Refuse, naming ``flag``, no author, or a name bioimage.io rejects (``/`` or ``\\``)."""
    names = author_list(text)
    if not names:
        raise UserError("%s %r: name at least one author ('Name[, affiliation]; ...')" % (flag, text))
    for author in names:
        if '/' in author['name'] or '\\' in author['name']:
            raise UserError("%s: %r: bioimage.io refuses an author's name with / or \\ in it" % (flag, author['name']))


@functools.lru_cache(maxsize=1)
def spdx_ids():
    """``({lower-case id: id}, deprecated ids)`` of the SPDX licence list (spdx_licenses.txt)."""
    current, deprecated = {}, set()
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'spdx_licenses.txt')) as f:
        for line in f:
            word = line.split('#')[0].strip()
            if word:
                name = word.lstrip('~')
                current[name.lower()] = name
                if word.startswith('~'):
                    deprecated.add(name)
    return current, frozenset(deprecated)


def spdx_id(flag, value):
    """``value`` as the SPDX licence identifier it names (the list's spelling), or a
    UserError naming ``flag``: bioimage.io takes identifiers only."""
    known, _ = spdx_ids()
    found = known.get(str(value).strip().lower())
    if found is None:
        raise UserError('%s %r: not an SPDX licence identifier (e.g. CC-BY-4.0, CC0-1.0, MIT, BSD-3-Clause; the list: '
                        'https://spdx.org/licenses/)' % (flag, value))
    return found


def cite_entry(flag, text):
    """``'Authors. Title (2020) doi:10.1/x'`` (or ending in an http(s) URL) as the spec's
    citation ``{'text', 'doi'|'url'}``; a UserError naming ``flag`` when it names neither."""
    words = str(text).strip().split()
    link = words[-1].rstrip('.,;') if words else ''
    doi = link[4:] if link.lower().startswith('doi:') else link if link.startswith('10.') else None
    url = link if link.startswith(('http://', 'https://')) else None
    body = ' '.join(words[:-1]).rstrip(' ,;')
    if doi is not None:
        if not re.match(r'^10\.[0-9]{4}.+$', doi):  # the spec's pattern for a DOI
            raise UserError('%s: %r is not a DOI (10.NNNN/...)' % (flag, link))
    elif url is None or len(url) < 12:
        raise UserError("%s %r: end it with the data's DOI (doi:10.1234/x) or URL (https://...): bioimage.io cites "
                        "by one of them" % (flag, text))
    if not body:
        raise UserError('%s %r: give the reference (authors, title, year) before its %s' % (
            flag, text, 'DOI' if doi else 'URL'))
    return dict({'text': body}, **({'doi': doi} if doi is not None else {'url': url}))


def author_list(text):
    """``'Ada, Lab; Bo'`` -> ``[{'name': 'Ada', 'affiliation': 'Lab'}, {'name': 'Bo'}]``."""
    found = []
    for part in str(text or '').split(';'):
        name, _, affiliation = (p.strip() for p in part.partition(','))
        if name:
            found.append(dict({'name': name}, **({'affiliation': affiliation} if affiliation else {})))
    return found


def trained_on_dsb2018(meta):
    """Whether every image the export's run trained and validated on is one of the DSB 2018
    stage1_train images, by their ids: the count its card records (``dsb2018_ids``), else,
    for exports made before it did, the ids in its data folder when that is still here."""
    data = (meta.get('card') or {}).get('data') or {}
    total = sum(n for n in (data.get('train_images'), data.get('val_images')) if isinstance(n, int))
    found = data.get('dsb2018_ids')
    if not isinstance(found, int):
        found = _dsb2018_ids_in_data(meta, data.get('path'))
    return total > 0 and found == total


def _dsb2018_ids_in_data(meta, path):
    """How many of the samples of the run's data (still on disk at ``path``, as the run
    read it) are DSB 2018 stage1_train images; None when it cannot be read."""
    from ..data.known import count_dsb2018
    from ..data.layouts import discover
    cfg = meta.get('config') if isinstance(meta.get('config'), dict) else {}
    if not isinstance(path, str) or not os.path.isabs(path) or not os.path.exists(path):
        return None
    masks = cfg.get('masks')
    if masks and not os.path.isabs(masks):
        return None  # given where the run was made, which the export does not say
    def names(folder, masks=None):
        _, samples = discover(folder, masks=masks, layout=cfg.get('layout') or 'auto',
                              mask_suffix=cfg.get('mask_suffix') or '_mask', skip_unpaired=True)
        return [sample.name for sample in samples]
    val = cfg.get('val_data')
    if val and not os.path.isabs(val):
        return None
    try:
        with warnings.catch_warnings():  # images without masks: the run skipped them or refused the data
            warnings.simplefilter('ignore')
            found = names(path, masks) + (names(val) if val else [])
    except (UserError, OSError, ValueError):
        return None
    return count_dsb2018(found)


def training_data(config, meta, dsb):
    """``(name of the training data, the description's training_data entry or None)``;
    ``dsb``: whether it is the DSB 2018 data (:func:`trained_on_dsb2018`).

    Its citation and licence come from ``--training-data-cite`` / ``--training-data-license``,
    else from the DSB 2018 data when the run trained on it alone (:func:`trained_on_dsb2018`);
    without either the entry is left out - never guessed from a folder's name. One of the
    two without the other is a UserError: bioimage.io needs both.
    """
    data = (meta.get('card') or {}).get('data') or {}
    path = str(data.get('path') or 'not recorded')
    name = (config.training_data or (DSB2018['name'] if dsb else path if path.startswith('generated')
                                     else os.path.basename(path.rstrip('/\\')) or path)).strip()[:NAME_MAX]
    cite = [cite_entry('--training-data-cite', config.training_data_cite)] if config.training_data_cite else \
        DSB2018['cite'] if dsb else None
    licence = config.training_data_license or (DSB2018['license'] if dsb else None)
    if bool(cite) != bool(licence):
        given, missing = ('--training-data-cite', '--training-data-license') if cite else \
            ('--training-data-license', '--training-data-cite')
        raise UserError('%s without %s: bioimage.io describes training data by both its citation and its licence; '
                        'give both, or neither (the description then has no training_data)' % (given, missing))
    if not cite:
        return name, None
    authors = author_list(config.training_data_authors) if config.training_data_authors else \
        DSB2018['authors'] if dsb else author_list(config.authors)
    words = '%s: %s training and %s validation images' % (name, data.get('train_images', '?'),
                                                          data.get('val_images', '?'))
    if dsb:
        words += '; %s' % DSB2018['description']
    return name, {'type': 'dataset', 'format_version': '0.3.0', 'name': name, 'description': words[:1024],
                  'cite': cite, 'license': licence, 'authors': authors}


def public_sidecar(meta, dsb):
    """The export's ``model.json`` as the package holds it: the absolute paths of the
    machine it was made on (the run, the checkpoint, the data, the cache) cut to their
    last part, and, for the DSB 2018 data, the count of its images the card records (``dsb``)."""
    meta = json.loads(json.dumps(meta))

    def last(value):
        local = isinstance(value, str) and (os.path.isabs(value) or value.startswith('~'))
        return os.path.basename(value.rstrip('/\\')) or value if local else value
    if isinstance(meta.get('source'), dict):
        meta['source'] = {k: last(v) for k, v in meta['source'].items()}
    if isinstance(meta.get('config'), dict):
        meta['config'] = {k: last(v) for k, v in meta['config'].items()}
    data = (meta.get('card') or {}).get('data')
    if isinstance(data, dict):
        data['path'] = last(data.get('path'))
        if dsb:
            data['dsb2018_ids'] = sum(n for n in (data.get('train_images'), data.get('val_images'))
                                      if isinstance(n, int))
    meta['cwd'] = last(meta.get('cwd'))
    if meta['cwd'] is None:
        del meta['cwd']
    return meta
