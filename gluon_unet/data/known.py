"""Public data sets recognised by their content, not by where they lie: the 2018 Data
Science Bowl's stage 1 training set (BBBC038), by the ids of its 664 images.

A run records how many of its images carry one of those ids (:func:`data_fingerprint
<gluon_unet.data.prepare.data_fingerprint>`, the export's card): ``gluon-unet package``
cites that data set and gives its licence only when every image the model trained and
validated on is one of them - never because a folder is called ``dsb``.
"""
import functools
import os
import string

#: The DSB 2018 stage 1 training set, as the export's card and the package name it.
DSB2018 = {'name': 'DSB 2018 stage1_train (BBBC038)',
           'description': 'the 2018 Data Science Bowl stage 1 training set (BBBC038): 664 images of stained '
                          'nuclei (fluorescence, brightfield, H&E tissue) with one mask per nucleus',
           'cite': [{'text': 'Caicedo et al. Nucleus segmentation across imaging experiments: the 2018 Data Science '
                             'Bowl. Nature Methods 16, 1247-1253 (2019)', 'doi': '10.1038/s41592-019-0612-7'}],
           'license': 'CC0-1.0',
           'authors': [{'name': 'Juan C. Caicedo et al.', 'affiliation': 'Broad Institute of MIT and Harvard'}],
           'images': 664}
_IDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'dsb2018_stage1_train.txt')
#: A DSB image id: 64 lower-case hex digits; the list keeps the first 16 of each (64 bits:
#: no two of the 664 share them, and no other name matches one by chance).
_PREFIX = 16


@functools.lru_cache(maxsize=1)
def dsb2018_prefixes():
    """The first 16 hex digits of each DSB 2018 stage1_train image id (a frozenset)."""
    with open(_IDS) as f:
        return frozenset(line.strip() for line in f if line.strip() and not line.startswith('#'))


def is_dsb2018_id(name):
    """Whether the sample name ``name`` is the id of a DSB 2018 stage1_train image."""
    return (isinstance(name, str) and len(name) == 64 and all(c in string.hexdigits for c in name)
            and name[:_PREFIX].lower() in dsb2018_prefixes())


def count_dsb2018(names):
    """How many of the sample ``names`` are DSB 2018 stage1_train image ids."""
    return sum(1 for name in names if is_dsb2018_id(name))
