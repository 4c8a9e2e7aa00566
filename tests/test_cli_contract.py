"""The contract every command keeps, on cases generated from the code rather than picked
by hand: the flags come from the config dataclasses, and so do their bad values.

For every numeric field of every command: one past each bound of its range (the bound
itself where it is open), huge values (1e30, 10**30, their negatives), nan, the
infinities, a non-number and nothing; for every field with a set of choices, a value
outside it; for every text field with a format, a value that breaks it; for every output
of a command, each of its inputs (the same path, and a path inside it). Each must give
exit 2, one line on stderr that names the flag, no traceback, and leave nothing behind.
A property test (Hypothesis) feeds each config's validation values of every type: it
accepts them or refuses them in one line naming the field, and never raises anything else.
"""
import contextlib
import dataclasses
import io
import math
import os
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import export_brightness_model, nuclei_png
from gluon_unet.cli import doctor_main, evaluate_main, export_main, launch_main, package_main, predict_main, train_main
from gluon_unet.cli.doctor import DoctorConfig
from gluon_unet.cli.predict import PredictCommand
from gluon_unet.config import _CHOICES, ModelConfig, TrainConfig, flag_name
from gluon_unet.errors import UserError
from gluon_unet.inference.bioimageio import PackageConfig
from gluon_unet.inference.evaluate import EvaluateConfig
from gluon_unet.inference.export_run import ExportConfig
from gluon_unet.inference.predict import PredictConfig
from gluon_unet.training.launcher import LaunchConfig

#: command -> (entry point, its config dataclasses)
COMMANDS = {'train': (train_main, (TrainConfig, ModelConfig)), 'predict': (predict_main, (PredictCommand, PredictConfig)),
            'export': (export_main, (ExportConfig,)), 'evaluate': (evaluate_main, (EvaluateConfig,)),
            'doctor': (doctor_main, (DoctorConfig,)), 'launch': (launch_main, (LaunchConfig,)),
            'package': (package_main, (PackageConfig,))}

#: Text fields with a format of their own, and a value that breaks it (then the flags that
#: use it). Every text field is a path, a choice, one of these, or in FREE_TEXT. Each bad
#: value is tried alone and with those flags: it is refused whatever the others say.
BAD_TEXT = {('train', 'scale_aug'): ['--scale-aug=2,1'], ('train', 'lr_steps'): ['--lr-steps=0.5,x',
                                                                                 '--lr-schedule=step'],
            ('train', 'predict_diameter'): ['--predict-diameter=-3', '--crop=32'], ('train', 'gpus'): ['--gpus=0-x'],
            ('predict', 'diameter'): ['--diameter=big'], ('predict', 'gpus'): ['--gpus=0-x'],
            ('doctor', 'gpus'): ['--gpus=0-x'], ('train', 'resume'): ['--resume=/no/such/run'],
            # what bioimage.io refuses in a description (bioimageio.spec 0.5)
            ('package', 'authors'): ['--authors=Lab/Ada'], ('package', 'license'): ['--license=Apache'],
            ('package', 'name'): ['--name=my.model'], ('package', 'training_data'): ['--training-data=' + 'x' * 129],
            ('package', 'training_data_cite'): ['--training-data-cite=My data, no link'],
            ('package', 'training_data_license'): ['--training-data-license=CC0'],
            ('package', 'training_data_authors'): ['--training-data-authors=a\\b']}
#: Text any value of which is valid: a file-name suffix, ONNX provider names (checked
#: when onnxruntime loads them), a network interface, launch's command.
FREE_TEXT = {('train', 'mask_suffix'), ('predict', 'providers'), ('launch', 'interface'), ('launch', 'command')}


def _flag(cls, f):
    if f.metadata.get('positional'):
        return f.name  # as the inputs below name it
    return flag_name(f.name) if cls is ModelConfig else '--' + f.metadata.get('flag', f.name).replace('_', '-')


def _fields(command):
    _, classes = COMMANDS[command]
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if (cls, f.name) != (TrainConfig, 'model'):
                tp = hints[f.name]
                yield cls, f, [a for a in typing.get_args(tp) if a is not type(None)][0] \
                    if typing.get_origin(tp) is typing.Union else tp


def _bad_numbers(rng, integer):
    """Values just outside ``rng`` (a config Range), huge, not finite, not numbers."""
    step = 1 if integer else 1e-6 * max(1.0, abs(rng.low), abs(rng.high))
    low = rng.low if rng.open in ('low', 'both') else rng.low - step
    high = rng.high if rng.open in ('high', 'both') else rng.high + step
    values = [low, high, 10 ** 30, -10 ** 30, 'abc', '']
    values += ['1.5', '1e30'] if integer else [1e30, -1e30, 'nan', 'inf', '-inf']
    return [str(int(v)) if integer and isinstance(v, float) else str(v) for v in values]


def _cases():
    """``(command, flag, [argv words])``: every bad value of every field of every command."""
    cases = []
    for command in COMMANDS:
        for cls, f, tp in _fields(command):
            flag, meta = _flag(cls, f), f.metadata
            if tp in (int, float) and not meta.get('positional'):
                assert 'within' in meta, '%s %s: every number has a range (config.within)' % (command, flag)
                cases += [(command, flag, ['%s=%s' % (flag, v)]) for v in _bad_numbers(meta['within'], tp is int)]
            elif tp is bool:
                cases.append((command, flag, ['%s=yes' % flag]))  # a switch takes no value
            elif tp is str and not meta.get('path') and (command, f.name) not in FREE_TEXT:
                choices = meta.get('choices') or (_CHOICES.get(f.name) if command == 'train' else None)
                if choices:
                    cases.append((command, flag, ['%s=no-such-choice' % flag]))
                else:
                    assert (command, f.name) in BAD_TEXT, '%s %s: a text field with no bad value' % (command, flag)
                    words = BAD_TEXT[command, f.name]
                    cases += [(command, flag, words[:1])] + ([(command, flag, words)] if len(words) > 1 else [])
    return cases


CASES = _cases()


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    """What each command needs besides the flag under test: an export and images for
    predict, a run with a checkpoint for export, folders for evaluate and train's data."""
    root = tmp_path_factory.mktemp('contract')
    images = root / 'images'
    images.mkdir()
    (images / 'a.png').write_bytes(nuclei_png(0))
    run = root / 'run'
    (run / 'checkpoints').mkdir(parents=True)
    (run / 'checkpoints' / 'best.ckpt').write_bytes(b'not opened before the flags are checked')
    (run / 'config.json').write_text('{}')
    for name in ('pred', 'truth', 'data'):
        (root / name).mkdir()
    return {'root': root, 'export': export_brightness_model(str(root / 'export')), 'images': str(images),
            'run': str(run)}


def _argv(command, world, out):
    """The command's required words, with ``out`` as its output."""
    return {'train': ['--epochs', '1', '--synthetic-count', '8', '--size', '32', '--width', '4', '--depth', '2',
                      '--no-progress', '--output', out],
            'predict': ['--model', world['export'], '--input', world['images'], '--output', out, '--no-progress'],
            'export': [world['run'], '--output', out],
            'evaluate': ['--pred', str(world['root'] / 'pred'), '--truth', str(world['root'] / 'truth'), '--csv', out],
            'doctor': [], 'launch': ['-n', '1', '--', 'true'],
            'package': [world['export'], '--output', out + '.zip', '--authors', 'A. Tester']}[command]


def _run(main, argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse
            code = exc.code
    return code, err.getvalue()


@pytest.mark.parametrize('command, flag, words', CASES, ids=['%s %s' % (c[0], ' '.join(c[2])) for c in CASES])
def test_every_bad_value_is_one_line_naming_its_flag_and_leaves_nothing(world, tmp_path, command, flag, words):
    out = str(tmp_path / 'out')
    main, _ = COMMANDS[command]
    argv = _argv(command, world, out)
    argv = argv[:argv.index('--')] + words + argv[argv.index('--'):] if '--' in argv else argv + words
    code, err = _run(main, argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and flag in lines[0] and 'Traceback' not in err, (code, err)
    assert not os.path.lexists(out), os.listdir(out) if os.path.isdir(out) else out


def test_the_cases_cover_every_command_and_field():
    # The count is in the issue note: fields x values tried.
    assert {c[0] for c in CASES} == set(COMMANDS)
    assert len(CASES) > 300
    numeric = [(c, f) for c in COMMANDS for _, f, tp in _fields(c) if tp in (int, float)]
    assert len({(c[0], c[1]) for c in CASES}) >= len(numeric)


# -- outputs apart from inputs ----------------------------------------------------------------

def _paths(command):
    """``(inputs, outputs)``: the flags of the command's path fields, by role."""
    found = {'in': [], 'out': []}
    for cls, f, _ in _fields(command):
        if f.metadata.get('path'):
            found[f.metadata['path']].append((_flag(cls, f), f.metadata.get('positional', False)))
    return found['in'], found['out']


def _apart_cases():
    cases = []
    for command in COMMANDS:
        inputs, outputs = _paths(command)
        for out_flag, _ in outputs:
            for in_flag, positional in inputs:
                for where in ('same', 'inside'):
                    cases.append((command, out_flag, in_flag, positional, where))
    return cases


APART = _apart_cases()


@pytest.mark.parametrize('command, out_flag, in_flag, positional, where', APART,
                         ids=['%s %s %s %s' % (c[0], c[1], c[4], c[2]) for c in APART])
def test_no_output_is_or_lies_inside_an_input(world, tmp_path, command, out_flag, in_flag, positional, where):
    inputs = {'--data': str(world['root'] / 'data'), '--masks': str(world['root'] / 'data'),
              '--val-data': str(world['root'] / 'data'), '--cache-dir': str(world['root'] / 'data'),
              '--model': os.path.dirname(world['export']) if os.path.isfile(world['export']) else world['export'],
              '--input': world['images'], 'run': world['run'], '--init': world['run'], '--pred': str(world['root'] / 'pred'),
              '--truth': str(world['root'] / 'truth'), 'export': world['export'],
              '--image': os.path.join(world['images'], 'a.png')}
    assert in_flag in inputs, 'an input of %s with no path to give it here: %s' % (command, in_flag)
    if where == 'inside' and os.path.isfile(inputs[in_flag]):
        pytest.skip('%s is a file: nothing lies inside it' % in_flag)
    name = 'x.zip' if command == 'package' else 'x.csv' if out_flag in ('--csv', '--rle') else 'x'
    # Where a command reads only part of an input folder: export reads RUN's checkpoints
    # (its export goes into RUN/export, beside them).
    read = os.path.join(inputs[in_flag], 'checkpoints') if (command, in_flag) == ('export', 'run') else inputs[in_flag]
    target = inputs[in_flag] if where == 'same' else os.path.join(read, name)
    folder = inputs[in_flag] if os.path.isdir(inputs[in_flag]) else os.path.dirname(inputs[in_flag])
    before = sorted(os.listdir(folder))
    main, _ = COMMANDS[command]
    argv = _argv(command, world, str(tmp_path / 'out'))
    if command == 'train':
        argv += ['--data', str(world['root'] / 'data')] if in_flag != '--data' else []
    if not positional:  # a positional input is in the command's words already
        argv += [in_flag, inputs[in_flag]] if in_flag not in argv else []
    argv += [out_flag, target]
    code, err = _run(main, argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and out_flag in lines[0] and 'Traceback' not in err, (code, err)
    assert sorted(os.listdir(folder)) == before  # nothing written into the input


def test_every_command_that_writes_is_checked_against_what_it_reads():
    commands = {c[0] for c in APART}
    assert commands >= {'train', 'predict', 'export', 'evaluate'}
    assert ('predict', '--rle', '--input', False, 'inside') in APART


# -- Hypothesis: validation refuses in one line, or accepts ------------------------------------

def _values():
    return st.one_of(st.none(), st.booleans(), st.integers(min_value=-10 ** 40, max_value=10 ** 40),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
                     st.lists(st.integers(), max_size=3))


CONFIGS = [TrainConfig, ModelConfig, PredictConfig, ExportConfig, EvaluateConfig, DoctorConfig]
#: What a config needs besides the field drawn (its required fields).
REQUIRED = {ExportConfig: {'run': 'runs/a'}, EvaluateConfig: {'pred': 'p', 'truth': 't'}}


@pytest.mark.parametrize('cls', CONFIGS, ids=lambda c: c.__name__)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_validation_accepts_or_refuses_in_one_line_whatever_a_field_holds(cls, data):
    names = [f.name for f in dataclasses.fields(cls) if f.name != 'model']
    name = data.draw(st.sampled_from(names))
    value = data.draw(_values())
    try:
        config = cls(**dict(REQUIRED.get(cls, {}), **{name: value}))
        (TrainConfig(model=config) if cls is ModelConfig else config).validate()
    except UserError as exc:
        text = str(exc)
        assert '\n' not in text and len(text) < 800, text
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        flag = field.metadata.get('metavar', name.upper()) if field.metadata.get('positional') else \
            flag_name(name) if cls in (TrainConfig, ModelConfig) else '--' + name.replace('_', '-')
        assert flag in text or 'config' in text, (name, value, text)
    else:
        if isinstance(value, float) and not math.isfinite(value):
            field = next(f for f in dataclasses.fields(cls) if f.name == name)
            assert 'within' not in field.metadata, (name, value)  # a range never admits nan or inf


# -- inputs that are what their flag takes ---------------------------------------------------

def _input_cases():
    cases = []
    for command in COMMANDS:
        for cls, f, _ in _fields(command):
            if f.metadata.get('path') == 'in':
                for what in ('missing', 'fifo'):
                    if (command, f.name, what) != ('train', 'cache_dir', 'missing'):  # made when missing
                        cases.append((command, _flag(cls, f), f.metadata.get('positional', False), what))
    return cases


INPUTS = _input_cases()


@pytest.mark.parametrize('command, flag, positional, what', INPUTS, ids=['%s %s %s' % (c[0], c[1], c[3])
                                                                         for c in INPUTS])
def test_an_input_that_is_missing_or_a_fifo_is_one_line(world, tmp_path, command, flag, positional, what):
    bad = str(tmp_path / 'bad')
    if what == 'fifo':
        os.mkfifo(bad)
    out = str(tmp_path / 'out')
    main, _ = COMMANDS[command]
    argv = _argv(command, world, out)
    if positional:
        argv = [bad if a in (world['run'], world['export']) else a for a in argv]
    else:
        words = [flag, bad] + (['--launcher', 'ssh'] if flag == '--hostfile' else [])
        argv = argv[:argv.index('--')] + words + argv[argv.index('--'):] if '--' in argv else argv + words
    code, err = _run(main, argv)  # a FIFO opened to be read would block this test forever
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and 'Traceback' not in err, (code, err)
    assert (bad in lines[0]) and (positional or flag in lines[0]), lines[0]
    assert not os.path.lexists(out) and not os.path.lexists(out + '.zip')


def test_every_command_checks_its_inputs():
    assert {c[0] for c in INPUTS} >= {'train', 'predict', 'export', 'evaluate', 'launch', 'package'}
