"""``gluon-unet package``: flags generated from
:class:`~gluon_unet.inference.configs.PackageConfig`, then
:func:`~gluon_unet.inference.bioimageio.write_package`.

It runs where onnxruntime is installed, without MXNet (the environment of
``requirements-onnx.txt``, or ``pip install ".[bioimageio]"``, which also validates).
"""
from ..errors import signals_raise
from ..inference.configs import PackageConfig
from .common import asks_version, config_parser, parse_configs, reports_errors

EXAMPLES = """examples:
  # a run's export as a bioimage.io Model Zoo package, its cover and tests from a validation image
  gluon-unet package runs/a --image val/img7.png --authors 'Ada Lovelace, Some Lab' --output nuclei.zip
  # the demo's model (its test image is generated)
  gluon-unet package runs/demo --authors 'Me' --output demo.zip"""


def package_parser():
    """The ``gluon-unet package`` parser: one flag per :class:`PackageConfig` field."""
    return config_parser('package', PackageConfig, epilog=EXAMPLES,
                         description='Write a bioimage.io Model Zoo package (zip, spec 0.5) of an export: its\n'
                                     'model.onnx, test tensors, a cover, the normalization as the spec can say it,\n'
                                     'and a model card saying what it cannot (the watershed). Needs onnxruntime.')


@reports_errors
def package_main(argv=None):
    """``gluon-unet package``: write the package; returns the exit code."""
    if asks_version(argv):
        return 0
    with signals_raise():  # SIGTERM: the temporary zip removed, one line, exit 143
        config, = parse_configs(package_parser(), argv, PackageConfig)
        from ..inference.bioimageio import write_package  # numpy, OpenCV: after the flags (--help needs none)
        path, notes = write_package(config)
    print('wrote %s' % path)
    for note in notes:
        print(note)
    return 0
