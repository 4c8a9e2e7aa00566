"""The output contract (gluon_unet/outputs.py) where the hostile round broke it: an export
never replaces another run's export unasked and two exports never share a folder at once;
predict --rle never names one of predict's own outputs; a prediction manifest says
``complete`` only when every image was written."""
import json
import os
import signal

import pytest

from conftest import export_brightness_model, nuclei_png, run_cli, tiny_config
from gluon_unet.cli import export_main, predict_main, train_main
from gluon_unet.outputs import lock_folder
from gluon_unet.paths import MANIFEST
from gluon_unet.training import fit


def _snapshot(folder):
    return {name: open(os.path.join(folder, name), 'rb').read() for name in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, name))}


def _error_line(capsys):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and 'Traceback' not in err, err
    return lines[0]


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """Two tiny trained runs, each with its own export."""
    found = []
    for name in ('a', 'b'):
        cfg = tiny_config(tmp_path_factory.mktemp(name), epochs=1, tune_postprocess=False)
        fit(cfg, verbose=False)
        found.append(cfg.output)
    return found


def _source(export):
    with open(os.path.join(export, 'model.json')) as f:
        return json.load(f).get('source')


def test_an_export_never_replaces_another_runs_export_unasked(runs, tmp_path, capsys):
    a, b = runs
    a_export = os.path.join(a, 'export')
    assert _source(a_export)['run'] == os.path.realpath(a)  # training's own export records its run
    before = _snapshot(a_export)
    assert run_cli(export_main, [b, '--output', a_export]) == 2
    line = _error_line(capsys)
    assert line.startswith('error: --output %s holds an export from %s' % (a_export, os.path.realpath(a)))
    assert '--overwrite' in line and _snapshot(a_export) == before
    assert run_cli(export_main, [a]) == 0  # the run's own export, again: no question asked
    assert run_cli(export_main, [b, '--output', a_export, '--overwrite']) == 0  # asked for
    assert _source(a_export)['run'] == os.path.realpath(b)
    assert not os.path.exists(os.path.join(a_export, '.lock'))  # the lock goes with the command


def test_an_export_of_unknown_source_is_replaced_only_at_its_runs_default_place(runs, tmp_path, capsys):
    a, b = runs
    old = tmp_path / 'old'
    assert run_cli(export_main, [b, '--output', str(old)]) == 0
    with open(old / 'model.json') as f:
        meta = json.load(f)
    del meta['source']  # as gluon_unet 0.2 wrote it
    with open(old / 'model.json', 'w') as f:
        json.dump(meta, f)
    assert run_cli(export_main, [b, '--output', str(old)]) == 2
    assert 'whose source it does not record' in _error_line(capsys)
    assert run_cli(export_main, [b, '--output', str(old), '--overwrite']) == 0


def test_two_exports_never_write_one_folder_at_once(runs, tmp_path, capsys):
    a, _ = runs
    out = tmp_path / 'shared'
    with lock_folder(str(out)):  # another export (or predict) holds it
        assert run_cli(export_main, [a, '--output', str(out)]) == 2
        line = _error_line(capsys)
        assert 'is in use by another process (pid %d' % os.getpid() in line, line
        assert os.listdir(out) == ['.lock']
    assert run_cli(export_main, [a, '--output', str(out)]) == 0
    assert '.lock' not in os.listdir(out)


@pytest.fixture
def images(tmp_path):
    folder = tmp_path / 'images'
    folder.mkdir()
    for i in range(10):
        (folder / ('i%d.png' % i)).write_bytes(nuclei_png(i))
    return str(folder)


@pytest.mark.parametrize('name', ['i0_mask.png', 'i3_labels.png', MANIFEST])
def test_predict_rle_is_never_one_of_predicts_own_outputs(tmp_path, images, capsys, name):
    model = export_brightness_model(str(tmp_path / 'export'))
    out = tmp_path / 'out'
    argv = ['--model', model, '--input', images, '--output', str(out), '--no-progress']
    assert run_cli(predict_main, argv + ['--rle', str(out / name)]) == 2
    assert 'is one of the files predict writes in --output' in _error_line(capsys)
    assert not out.exists()
    assert run_cli(predict_main, argv + ['--rle', str(out / 'submission.csv')]) == 0  # a file of its own
    with open(out / MANIFEST) as f:
        assert 'submission.csv' in json.load(f)['files']


def test_the_manifest_says_complete_only_when_every_image_was_written(tmp_path, images, monkeypatch, capsys):
    from gluon_unet.inference import predict
    model = export_brightness_model(str(tmp_path / 'export'))
    out = tmp_path / 'out'
    real, written = predict.write_image_outputs, []

    def write_then_stop(*args, **kwargs):
        result = real(*args, **kwargs)
        written.append(True)
        if len(written) == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return result
    monkeypatch.setattr(predict, 'write_image_outputs', write_then_stop)
    assert run_cli(predict_main, ['--model', model, '--input', images, '--output', str(out), '--no-progress',
                                  '--batch-size', '1']) == 128 + signal.SIGTERM
    with open(out / MANIFEST) as f:
        manifest = json.load(f)
    done = len([n for n in manifest['files'] if n.endswith('_mask.png')])
    assert manifest['complete'] is False and 4 <= done < 10, manifest
    assert manifest['stopped'] == 'SIGTERM after %d of 10 images' % done
    monkeypatch.setattr(predict, 'write_image_outputs', real)
    # The same command again finishes the job, and says so.
    assert run_cli(predict_main, ['--model', model, '--input', images, '--output', str(out), '--no-progress']) == 0
    with open(out / MANIFEST) as f:
        manifest = json.load(f)
    assert manifest['complete'] is True and 'stopped' not in manifest and len(manifest['files']) == 20


def test_a_validation_folder_without_masks_names_val_data(tmp_path, capsys):
    from gluon_unet.cli import train_main
    data, val = tmp_path / 'data', tmp_path / 'val'
    for folder in (data, val):
        folder.mkdir()
    for i in range(4):
        png = nuclei_png(i)
        (data / ('i%d.png' % i)).write_bytes(png)
        (data / ('i%d_mask.png' % i)).write_bytes(png)
        (val / ('v%d.png' % i)).write_bytes(png)  # images, no masks
    assert run_cli(train_main, ['--data', str(data), '--val-data', str(val), '--output', str(tmp_path / 'run'),
                                '--epochs', '1', '--size', '32', '--width', '4', '--depth', '2', '--no-progress',
                                '--cache-dir', str(tmp_path / 'cache')]) == 2
    line = _error_line(capsys)
    assert line.startswith('error: --val-data %s: images but no masks' % val), line
    assert '--masks' not in line  # --val-data has no mask folder of its own
    assert not (tmp_path / 'run').exists()


# -- the rule "apart", for every path a command writes, in every data layout and path form -------
# (issue 70): the cache of decoded images is written as well as read, and a CSV's data is
# also the folders its images and masks lie in. Each case is generated from the layouts,
# the folders each one reads and the ways a path can be written.

LAYOUTS = ('paired', 'dsb', 'csv')
FORMS = ('relative', 'absolute', 'symlink', 'trailing-slash', 'dotdot')


def _write_layout(root, layout):
    """Four tiny samples in ``layout`` under ``root``: ``(train flags, folders the data reads)``."""
    pngs = [nuclei_png(i, size=32) for i in range(4)]
    if layout == 'paired':  # images and masks in folders of their own
        images, masks = root / 'p-images', root / 'p-masks'
        for folder in (images, masks):
            folder.mkdir()
        for i, png in enumerate(pngs):
            (images / ('i%d.png' % i)).write_bytes(png)
            (masks / ('i%d_mask.png' % i)).write_bytes(png)
        return ['--data', str(images), '--masks', str(masks)], [images, masks]
    if layout == 'dsb':
        top = root / 'dsb'
        for i, png in enumerate(pngs):
            sample = top / ('s%d' % i)
            (sample / 'images').mkdir(parents=True)
            (sample / 'masks').mkdir()
            (sample / 'images' / ('s%d.png' % i)).write_bytes(png)
            (sample / 'masks' / 'm0.png').write_bytes(png)
        return ['--data', str(top)], [top]
    # A CSV in one folder listing images and masks in two others: those are read too.
    lists, images, masks = root / 'lists', root / 'c-images', root / 'c-masks'
    for folder in (lists, images, masks):
        folder.mkdir()
    rows = ['image,mask']
    for i, png in enumerate(pngs):
        (images / ('i%d.png' % i)).write_bytes(png)
        (masks / ('i%d.png' % i)).write_bytes(png)
        rows.append('../c-images/i%d.png,../c-masks/i%d.png' % (i, i))
    (lists / 'pairs.csv').write_text('\n'.join(rows) + '\n')
    return ['--data', str(lists / 'pairs.csv')], [images, masks]


def _given(target, form, root, folder):
    """``target`` (an absolute path in or at the input ``folder``, under ``root``, the
    working folder) written as ``form``."""
    if form == 'relative':
        return os.path.relpath(target, root)
    if form == 'absolute':
        return str(target)
    if form == 'symlink':  # through a link to the input folder
        link = root / ('link-to-' + folder.name)
        if not os.path.lexists(link):
            os.symlink(folder, link)
        return os.path.normpath(os.path.join(str(link), os.path.relpath(target, folder)))
    if form == 'trailing-slash':
        return str(target) + '/'
    (root / 'elsewhere').mkdir(exist_ok=True)
    return os.path.join(str(root), 'elsewhere', '..', os.path.relpath(target, root))


def _tree(folders):
    return {str(f): sorted(os.path.relpath(os.path.join(d, n), f) for d, subs, names in os.walk(f)
                           for n in subs + names) for f in folders}


@pytest.fixture(scope='module')
def layouts(tmp_path_factory):
    """Per layout: ``(root, train flags, folders its data reads, a tiny run trained on it
    with its cache at root/cache)``."""
    found = {}
    for layout in LAYOUTS:
        root = tmp_path_factory.mktemp(layout)
        flags, folders = _write_layout(root, layout)
        run = root / 'run'
        assert run_cli(train_main, flags + ['--output', str(run), '--cache-dir', str(root / 'cache')] + TINY) == 0
        found[layout] = (root, flags, folders, str(run))
    return found


TINY = ['--epochs', '1', '--size', '32', '--width', '4', '--depth', '2', '--workers', '0', '--val-split', '0.25',
        '--no-tune-postprocess', '--no-progress']


def _train_cases():
    # (layout, which folder of its data, the output, is it the folder or inside it)
    folders = {'paired': 2, 'dsb': 1, 'csv': 2}
    return [(layout, k, out, where) for layout in LAYOUTS for k in range(folders[layout])
            for out, where in (('--output', 'inside'), ('--cache-dir', 'same'), ('--cache-dir', 'inside'))]


@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('layout, k, flag, where', _train_cases(),
                         ids=['%s-%d %s %s' % c for c in _train_cases()])
def test_train_writes_nothing_into_its_data_nor_its_cache_there(layouts, monkeypatch, capsys, layout, k, flag,
                                                                 where, form):
    root, flags, folders, _ = layouts[layout]
    monkeypatch.chdir(root)
    folder = folders[k]
    target = folder if where == 'same' else folder / 'x'
    given = _given(target, form, root, folder)
    paths = {'--output': str(root / 'new-run'), '--cache-dir': str(root / 'cache')}
    paths[flag] = given
    before = _tree(folders)
    argv = flags + ['--output', paths['--output'], '--cache-dir', paths['--cache-dir']] + TINY
    assert run_cli(train_main, argv) == 2
    line = _error_line(capsys)
    assert line.startswith('error: %s %s' % (flag, given)) and 'train reads' in line, line
    assert _tree(folders) == before and not (root / 'new-run').exists()


def _export_cases():
    folders = {'paired': 2, 'dsb': 1, 'csv': 2}
    return [(layout, str(k), 'inside') for layout in LAYOUTS for k in range(folders[layout])] + \
        [(layout, 'cache', where) for layout in LAYOUTS for where in ('same', 'inside')]


@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('layout, what, where', _export_cases(), ids=['%s %s %s' % c for c in _export_cases()])
def test_export_tune_postprocess_writes_nothing_into_the_runs_data_or_cache(layouts, monkeypatch, capsys, layout,
                                                                           what, where, form):
    root, _, folders, run = layouts[layout]
    monkeypatch.chdir(root)
    folder = root / 'cache' if what == 'cache' else folders[int(what)]
    target = folder if where == 'same' else folder / 'x'
    given = _given(target, form, root, folder)
    before = _tree(folders + [root / 'cache'])
    assert run_cli(export_main, [run, '--tune-postprocess', '--output', given]) == 2
    line = _error_line(capsys)
    assert line.startswith('error: --output %s' % given) and "the run's --" in line, line
    assert _tree(folders + [root / 'cache']) == before


def test_export_int8_writes_nothing_into_the_folders_a_runs_csv_lists(layouts, monkeypatch, capsys):
    from gluon_unet.machine.cpu import cpu_int8_support
    if not cpu_int8_support()[0]:
        pytest.skip('no int8 on this CPU: %s' % cpu_int8_support()[1])
    root, _, folders, run = layouts['csv']
    before = _tree(folders)
    assert run_cli(export_main, [run, '--int8', '--output', str(folders[0] / 'x')]) == 2
    assert "lies inside the run's --data (its CSV lists files in)" in _error_line(capsys)
    assert _tree(folders) == before


def test_a_runs_cache_inside_its_data_is_refused_wherever_it_would_be_written(tmp_path):
    from gluon_unet.config import TrainConfig
    from gluon_unet.data.prepare import check_data_apart
    from gluon_unet.errors import UserError
    flags, folders = _write_layout(tmp_path, 'csv')
    cfg = TrainConfig(data=flags[1])
    for cache in (folders[0], folders[1] / 'cache', tmp_path / 'lists' / 'pairs.csv'):
        with pytest.raises(UserError, match="the run's --cache-dir .* which export --int8 reads"):
            check_data_apart([('--output', str(tmp_path / 'out'))], cfg, str(cache), 'export --int8',
                             whose="the run's ")
    check_data_apart([('--output', str(tmp_path / 'out'))], cfg, str(tmp_path / 'lists' / 'cache'), 'export --int8')


@pytest.fixture(scope='module')
def readers_world(tmp_path_factory):
    """An export and a folder of images (predict, package), prediction and truth folders
    (evaluate)."""
    root = tmp_path_factory.mktemp('readers')
    images = root / 'images'
    images.mkdir()
    (images / 'a.png').write_bytes(nuclei_png(0))
    for name in ('pred', 'truth'):
        (root / name).mkdir()
        (root / name / 'a.png').write_bytes(nuclei_png(0))
    return root, export_brightness_model(str(root / 'export'))


READERS = [('predict', '--output', 'images'), ('predict', '--rle', 'images'), ('predict', '--output', 'export'),
           ('evaluate', '--csv', 'truth'), ('evaluate', '--csv', 'pred'), ('package', '--output', 'export')]


@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('command, flag, read', READERS, ids=['%s %s in %s' % c for c in READERS])
def test_no_command_writes_inside_what_it_reads_however_the_path_is_written(readers_world, monkeypatch, capsys,
                                                                            command, flag, read, form):
    from gluon_unet.cli import evaluate_main, package_main
    if (command, form) == ('package', 'trailing-slash'):
        pytest.skip('a .zip name ending in / is no file name: refused as such first')
    root, export = readers_world
    monkeypatch.chdir(root)
    folder = root / read
    given = _given(folder / ('x.zip' if command == 'package' else 'x.csv' if flag != '--output' else 'x'),
                   form, root, folder)
    main, argv = {'predict': (predict_main, ['--model', export, '--input', str(root / 'images'), '--no-progress',
                                             '--output', str(root / 'out')]),
                  'evaluate': (evaluate_main, ['--pred', str(root / 'pred'), '--truth', str(root / 'truth')]),
                  'package': (package_main, [export, '--authors', 'A. Tester'])}[command]
    before = _tree([folder])
    assert run_cli(main, argv + [flag, given]) == 2
    line = _error_line(capsys)
    assert line.startswith('error: %s %s lies inside' % (flag, given)), line
    assert _tree([folder]) == before
