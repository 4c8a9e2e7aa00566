"""docs/reference/ is generated from the code (gluon_unet/cli/reference.py): it must match it."""
import dataclasses
import os
import subprocess
import sys

from gluon_unet import recipes
from gluon_unet.cli import COMMANDS
from gluon_unet.config import ModelConfig, TrainConfig, flag_name
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(name):
    with open(os.path.join(ROOT, 'docs', 'reference', name)) as f:
        return f.read()


def test_committed_reference_matches_the_code():
    # In a child: the entry points it asks for their parsers set process-wide knobs.
    done = subprocess.run([sys.executable, '-m', 'gluon_unet.cli.reference', '--check'], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_SECONDS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_reference_covers_every_command_field_and_recipe():
    cli, config = _read('cli.md'), _read('config.md')
    assert all('\n## %s\n' % command in cli for command in COMMANDS)
    for cls in (TrainConfig, ModelConfig):
        for f in dataclasses.fields(cls):
            if f.name != 'model':
                assert '`%s`' % flag_name(f.name) in config, f.name
                assert '`%s' % flag_name(f.name) in cli, f.name
    assert all('`%s`' % name in config for name in recipes.names())


def test_reference_reads_the_same_on_every_supported_python():
    # Python 3.9 and 3.10 append ' (default: %(default)s)' to a BooleanOptionalAction's
    # help and call the optionals group 'optional arguments'; 3.11 does neither. The
    # committed reference must not depend on which one generated it.
    import argparse
    from gluon_unet.cli import reference as gen_reference
    parser = argparse.ArgumentParser(prog='x')
    action = parser.add_argument('--progress', action=argparse.BooleanOptionalAction, default=True, help='bars')
    plain = gen_reference._help(action, 'x')
    action.help += ' (default: %(default)s)'
    assert gen_reference._help(action, 'x') == plain == 'bars'
    parser._optionals.title = 'optional arguments'
    assert '**options**' in gen_reference.render_parser(parser)
