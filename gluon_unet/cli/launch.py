"""``gluon-unet launch`` / ``bin/launch``: flags generated from
:class:`~gluon_unet.training.launcher.LaunchConfig`, then :func:`~gluon_unet.training.launcher.run_launch`. It sets
no process-wide knob: each process of the job chooses its own."""
from .common import config_parser, parse_configs, reports_errors

EXAMPLES = """examples:
  # two workers and one server on this machine (loopback)
  gluon-unet launch -n 2 -s 1 -- gluon-unet train --kvstore dist_sync --cpus 1 --batch-size 8
  # four machines over ssh, four GPUs each (dist_device_sync: each worker sums its GPUs'
  # gradients on the GPUs first); data and output on shared storage
  gluon-unet launch -n 4 -s 4 --launcher ssh -H hosts -- gluon-unet train --kvstore dist_device_sync \\
      --gpus 0-3 --batch-size 32 --data /shared/dsb --output /shared/runs/a

Keep the parameter-server ports on a private network: ps-lite unpickles what it receives."""


def launch_parser():
    """The ``bin/launch`` parser: one flag per :class:`LaunchConfig` field."""
    from ..training.launcher import LaunchConfig
    return config_parser(
        'launch', LaunchConfig, epilog=EXAMPLES,
        usage='launch -n WORKERS [-s SERVERS] [--launcher {local,ssh}] [-H HOSTFILE] [--port P] -- COMMAND ...',
        description='Run COMMAND (e.g. bin/train ... --kvstore dist_sync) as a distributed MXNet job:\n'
                    'one scheduler, SERVERS parameter servers and WORKERS workers.')


@reports_errors
def launch_main(argv=None):
    """``bin/launch``: run the job; returns the exit code (0 when every worker succeeded)."""
    from ..training.launcher import LaunchConfig, run_launch
    config, = parse_configs(launch_parser(), argv, LaunchConfig)
    return run_launch(config)
