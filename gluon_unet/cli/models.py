"""``gluon-unet models``: the models shipped with the package, one line each.

Needs nothing but the standard library: the list is read from :mod:`gluon_unet.models`
and each model's ``model.json``, so it answers in any environment (MXNet, ONNX, napari).
"""
import json
from dataclasses import dataclass

from .. import models
from ..config import option
from .common import asks_version, config_parser, parse_configs, reports_errors

EXAMPLES = """examples:
  gluon-unet models
  # segment your images with a shipped model, nothing trained
  gluon-unet predict --model nuclei --input images/ --output masks/
  # adapt it to your own images from a few annotated ones
  gluon-unet train --init nuclei --data my_pairs/ --output runs/mine"""


@dataclass
class ModelsConfig:
    """What ``gluon-unet models`` takes."""
    json: bool = option(False, 'print the list as JSON: name, description, folder and scores of each model')


def models_parser():
    """The ``gluon-unet models`` parser: one flag per :class:`ModelsConfig` field."""
    return config_parser('models', ModelsConfig, epilog=EXAMPLES,
                         description='List the models shipped with gluon_unet. Every option that takes a model\n'
                                     '(predict --model, train --init, export, package, the napari widget) takes\n'
                                     'their names.')


@reports_errors
def models_main(argv=None):
    """``gluon-unet models``: print one line per shipped model; returns the exit code."""
    if asks_version(argv):
        return 0
    config, = parse_configs(models_parser(), argv, ModelsConfig)
    rows = models.describe()
    if config.json:
        print(json.dumps([{'name': name, 'description': text, 'folder': models.folder(name), 'scores': scores}
                          for name, text, scores in rows], indent=2))
        return 0
    width = max(len(name) for name, _, _ in rows)
    for name, text, scores in rows:
        print('%-*s  %s%s' % (width, name, text, ' [%s]' % scores if scores else ''))
        print('%-*s  %s' % (width, '', models.folder(name) or 'not installed'))
    return 0
