"""``gluon-unet doctor``: flags generated from :class:`~gluon_unet.doctor.DoctorConfig`,
the thread settings for its ``--cpus`` chosen before mxnet loads (as ``bin/train``
does), then :func:`~gluon_unet.doctor.run_doctor`."""
from ..errors import reports_errors
from ..runtime import prepare_training_process
from .common import config_parser, parse_configs

EXAMPLES = """examples:
  # what this machine has: versions, MXNet features, GPUs, threads, bfloat16, --amp
  gluon-unet doctor
  # before a long run: one U-Net step on every GPU and a kvstore reduce across them
  gluon-unet doctor --gpus all
  # the same on CPU contexts (what the tests run)
  gluon-unet doctor --cpus 2"""


def doctor_parser():
    """The ``gluon-unet doctor`` parser: one flag per :class:`DoctorConfig` field."""
    from ..doctor import DoctorConfig
    return config_parser(
        'doctor', DoctorConfig, epilog=EXAMPLES,
        description='Check the install and the devices: versions, MXNet build features, GPUs and\n'
                    'their memory, cores and thread settings, bfloat16 support, what --amp does.\n'
                    'With --gpus or --cpus, also run one tiny U-Net training step on each device\n'
                    'and one kvstore reduce across them; exit code 1 and one line if one fails.')


@reports_errors
def doctor_main(argv=None):
    """``gluon-unet doctor``: the table, then the device checks; returns the exit code."""
    from ..doctor import DoctorConfig, run_doctor
    config, = parse_configs(doctor_parser(), argv, DoctorConfig)
    prepare_training_process(config.gpus, config.cpus or 1)  # as bin/train does, before mxnet loads
    return run_doctor(config)
