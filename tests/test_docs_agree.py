"""The newcomer's walk (issue 70): what the docs show is what the software says - the
--version line, the napari menu entry, the DSB command, the demo's note without onnx."""
import os
import re

import gluon_unet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def test_getting_started_shows_this_versions_version_line():
    shown = re.findall(r'`--version` prints `gluon_unet (\S+) \(mxnet', _read('docs/getting-started.md'))
    assert shown == [gluon_unet.__version__]


def test_the_napari_menu_entry_is_the_plugins_display_names():
    manifest = _read('gluon_unet/napari/napari.yaml')
    plugin = re.search(r'^display_name: (.+)$', manifest, re.M).group(1).strip()
    widget = re.search(r'^\s+display_name: (.+)$', manifest, re.M).group(1).strip()
    assert '*Plugins > %s (%s)*' % (widget, plugin) in _read('docs/how-to/napari-bioimageio.md')


def test_your_data_trains_on_dsb_with_the_readmes_flags():
    def dsb_command(text):
        return re.search(r'python bin/train --data stage1_train/ .*', text).group(0)
    readme, how_to = dsb_command(_read('README.md')), dsb_command(_read('docs/how-to/your-data.md'))
    assert '--crop 256' in readme and '--crop 256' in how_to and '--size' not in how_to


def test_the_demos_sample_output_shows_the_note_a_fresh_install_prints():
    import sys
    from gluon_unet.inference.export import ONNX_FILE, _onnx_beside
    saved = sys.modules.get('onnx')
    sys.modules['onnx'] = None  # a fresh install: requirements.txt has no onnx
    try:
        _, note = _onnx_beside('unused', None, 'auto', 'unused')
    finally:
        if saved is None:
            sys.modules.pop('onnx')
        else:
            sys.modules['onnx'] = saved
    assert note.startswith('note: no %s' % ONNX_FILE)
    head = note.split(' (import of onnx')[0]  # the import error's own words differ with how it is missing
    for doc in ('README.md', 'docs/getting-started.md'):
        assert head in _read(doc), doc
