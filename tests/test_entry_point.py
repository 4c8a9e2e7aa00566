"""One entry point (issue 14 item 1): ``python -m gluon_unet COMMAND`` / ``gluon-unet`` run the
same mains as bin/*, ``--version`` everywhere without loading mxnet, and ``--help`` that
shows choices, defaults once, groups and examples."""
import dataclasses
import os
import subprocess
import sys

import pytest

import gluon_unet
from gluon_unet import cli
from gluon_unet.config import _CHOICES, ModelConfig, TrainConfig, flag_name
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG_SECONDS)


def _main(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_version_string_names_all_three_without_loading_mxnet():
    code = ('import sys, gluon_unet; print(gluon_unet.version_string()); '
            'print("mxnet" in sys.modules)')
    done = _run(['-c', code])
    line, loaded = done.stdout.split('\n')[:2]
    assert line.startswith('gluon_unet %s (mxnet ' % gluon_unet.__version__) and ', Python 3.' in line, line
    assert loaded == 'False'


@pytest.mark.parametrize('command', ['', 'train', 'predict', 'evaluate', 'export', 'launch', 'doctor'])
def test_version_on_every_command_without_mxnet(command):
    code = ('import sys; from gluon_unet import cli\n'
            'code = cli.main(%r)\n'
            'print("mxnet loaded" if "mxnet" in sys.modules else "no mxnet", code)'
            % ([command, '--version'] if command else ['--version']))
    done = _run(['-c', code])
    lines = done.stdout.splitlines()
    assert lines[0] == gluon_unet.version_string() and lines[-1] == 'no mxnet 0', done.stdout + done.stderr


def test_python_m_forwards_argv_and_exit_codes():
    # the same one-line usage error and exit code as bin/train
    ours = _run(['-m', 'gluon_unet', 'train', '--epochs', 'x'])
    shim = _run([os.path.join(ROOT, 'bin', 'train'), '--epochs', 'x'])
    assert ours.returncode == shim.returncode == 2
    assert ours.stderr == shim.stderr and len(ours.stderr.strip().splitlines()) == 1
    # a UserError from the command: one line, its exit code
    done = _run(['-m', 'gluon_unet', 'export', '/no/such/run'])
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        'error: export /no/such/run: no such run folder or checkpoint file']


def test_dispatcher_usage_errors_are_one_line_exit_2(capsys):
    code, out, err = _main([], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and 'train' in err
    code, out, err = _main(['fly'], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "gluon-unet: error: unknown command 'fly' (choose from train, predict, evaluate, export, launch, doctor, models, package)"]
    code, out, err = _main(['--help'], capsys)
    assert code == 0 and all(c in out for c in cli.COMMANDS) and 'examples:' in out


def test_dispatcher_passes_argv_unchanged(monkeypatch):
    seen = {}
    for name, (entry, _) in cli.COMMANDS.items():
        monkeypatch.setattr(cli, entry, lambda argv, name=name: seen.setdefault(name, argv) and 7)
    for name in cli.COMMANDS:
        assert cli.main([name, '--epochs', '1', '--', 'x']) == 7
        assert seen[name] == ['--epochs', '1', '--', 'x']


def test_every_config_field_has_one_help_group():
    names = [f.metadata.get('flag', f.name) for c in (TrainConfig, ModelConfig) for f in dataclasses.fields(c)
             if f.name != 'model']
    grouped = [n for group in cli.train.FLAG_GROUPS.values() for n in group]
    assert sorted(set(names)) == sorted(n for n in grouped if n in names), 'a field without a group'
    assert len(grouped) == len(set(grouped)), 'a field in two groups'


def test_train_help_lists_choices_defaults_groups_and_examples():
    parser = cli.train.train_parser()
    text = parser.format_help()
    for title in cli.train.GROUP_TITLES.values():
        assert '\n%s:\n' % title in text
    for key, allowed in _CHOICES.items():
        assert '%s {%s}' % (flag_name(key), ','.join(allowed)) in text, key
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    for flag, help_text in helps.items():
        assert (help_text or '').count('default') <= 1, help_text  # each default once
    assert '--lr X' in text and helps['--lr'].endswith('(default: 0.001; a number in (0, 100]; demo without --data: '
                                                        '0.003)')
    assert helps['--augment'].endswith('(default: on)') and helps['--kvstore'].endswith('(default: device)')
    assert text.rstrip().endswith('take the same flags.)') and text.count('gluon-unet train') >= 3


@pytest.mark.parametrize('command', ['evaluate', 'export', 'launch', 'doctor'])
def test_other_helps_have_version_and_examples(command, capsys):
    code, out, err = _main([command, '--help'], capsys)
    assert code == 0 and '--version' in out and '\nexamples:\n' in out and 'gluon-unet %s' % command in out


def test_bin_shims_still_work():
    done = _run([os.path.join(ROOT, 'bin', 'launch'), '--version'])
    assert done.returncode == 0 and done.stdout.strip() == gluon_unet.version_string()


def _command_parsers():
    """command -> (its parser, the config dataclasses its flags come from, extra dests)."""
    from gluon_unet.cli import doctor, evaluate, export, launch, models, package, predict, train
    from gluon_unet.cli.doctor import DoctorConfig
    from gluon_unet.inference.evaluate import EvaluateConfig
    from gluon_unet.inference.bioimageio import PackageConfig
    from gluon_unet.inference.export_run import ExportConfig
    from gluon_unet.training.launcher import LaunchConfig
    from gluon_unet.inference.predict import PredictConfig
    return {'train': (train.train_parser(), (TrainConfig, ModelConfig), {'config'}),
            'predict': (predict.predict_parser(), (predict.PredictCommand, PredictConfig), set()),
            'evaluate': (evaluate.evaluate_parser(), (EvaluateConfig,), set()),
            'export': (export.export_parser(), (ExportConfig,), set()),
            'doctor': (doctor.doctor_parser(), (DoctorConfig,), set()),
            'launch': (launch.launch_parser(), (LaunchConfig,), set()),
            'package': (package.package_parser(), (PackageConfig,), set()),
            'models': (models.models_parser(), (models.ModelsConfig,), set())}


def test_every_commands_flags_are_its_config_fields_and_each_default_lives_there():
    # One flag per field of the command's config dataclasses and no other (bin/train's
    # --config aside); a flag left out takes the dataclass's default, not one of its own.
    import argparse
    parsers = _command_parsers()
    assert sorted(parsers) == sorted(cli.COMMANDS)
    for command, (parser, classes, extra) in parsers.items():
        dests = sorted(a.dest for a in parser._actions if not isinstance(a, argparse._HelpAction)
                       and a.dest not in (argparse.SUPPRESS, 'version', 'debug'))
        fields = sorted({f.name for c in classes for f in dataclasses.fields(c)
                         if (c, f.name) != (TrainConfig, 'model')} | extra)
        assert dests == fields, command
        assert all(a.default is argparse.SUPPRESS for a in parser._actions if a.dest in set(fields) - extra), command
        assert '--version' in parser._option_string_actions, command
        assert '--debug' in parser._option_string_actions, command  # read by the error boundary
    from gluon_unet.cli.common import parse_configs
    from gluon_unet.cli.predict import PredictCommand
    from gluon_unet.inference.predict import PredictConfig
    command, config = parse_configs(parsers['predict'][0], ['--model', 'm', '--input', 'i', '--output', 'o'],
                                    PredictCommand, PredictConfig)
    assert config == PredictConfig() and command.allow_failures is False
    _, config = parse_configs(parsers['predict'][0], ['--model', 'm', '--input', 'i', '--output', 'o', '--tta',
                                                      '--no-progress', '--min-size', '16'], PredictCommand,
                              PredictConfig)
    assert (config.tta, config.progress, config.min_size) == (True, False, 16)
