"""``gluon-unet doctor``: is this machine ready to train, and on what?

Prints a short table - the gluon_unet, mxnet and Python versions, the MXNet build
features that matter, the GPUs MXNet sees and their memory, the cores and the thread
settings ``bin/train`` will use, whether this CPU runs bfloat16 convolutions and what
``--amp`` does here, whether Horovod is there for ``--kvstore horovod`` and with which
controllers and tensor operations - and, with ``--gpus SPEC`` or ``--cpus N``, runs one tiny
hybridized U-Net training step on each requested device and one kvstore reduce across
them. The first failure ends the check with one line naming the device
(``doctor: GPU 3: <reason>``) and exit code 1; otherwise each check prints an ``ok`` line.

mxnet is imported only after the flags are read and the thread settings are chosen for
the requested CPU contexts (:func:`doctor_main`), as ``bin/train`` does.
"""
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Optional

from .. import __version__, mxnet_distribution
from ..config import GPU_IDS, check_fields, option, within
from ..errors import UserError, mxnet_message
from ..machine.cpu import cpu_bfloat16_support, cpu_description, cpu_int8_support
from ..machine.devices import cpu_context_count, make_contexts, parse_gpu_list
from ..machine.gpus import gpu_status
from ..machine.runtime import amx_state, prepare_training_process, recommended_settings, runtime_settings
from .common import config_parser, parse_configs, reports_errors

# The build features a multi-GPU U-Net run depends on (mx.runtime.Features names;
# MXNet 2 calls oneDNN ONEDNN, 1.x MKLDNN).
FEATURES = ('CUDA', 'CUDNN', 'NCCL', 'MKLDNN', 'ONEDNN', 'DIST_KVSTORE')
# The network of the device check: small enough to build and step in well under a second.
STEP_WIDTH, STEP_DEPTH, STEP_SIZE, STEP_BATCH = 4, 2, 32, 2


class CheckFailed(Exception):
    """One device check failed: ``str()`` is the line to print (after ``doctor: ``)."""


@dataclass
class DoctorConfig:
    """Which devices ``gluon-unet doctor`` checks; one field per flag (:func:`doctor_parser`)."""
    gpus: str = option('', 'GPUs to check, as for train: %s (default: none)' % GPU_IDS, metavar='IDS')
    cpus: Optional[int] = option(None, 'check N CPU contexts instead of GPUs (default: no device check)',
                                 within=within(1, 1024))
    kvstore: str = option('device', 'kvstore of the reduce check', choices=('device', 'local', 'nccl'))

    def validate(self):
        """Raise :class:`UserError` naming the flag of a bad value."""
        check_fields(self)
        parse_gpu_list(self.gpus)  # its syntax, as a usage error; the GPUs themselves are the check
        return self

    def contexts(self):
        """The CPU contexts the checks run on (at least one: the table's thread settings)."""
        return max(1, cpu_context_count(self.gpus, self.cpus or 1))


# -- the table ------------------------------------------------------------------------------

def _gib(n):
    return '%.1f GiB' % (n / 2.0 ** 30)


def build_features(mx):
    """``{'CUDA': False, ...}`` for :data:`FEATURES` this MXNet knows about."""
    features = mx.runtime.Features()
    return {name: features.is_enabled(name) for name in FEATURES if name in features}


def gpu_rows(mx):
    """``[('GPU 0', '15.8 GiB, 15.2 GiB free'), ...]``, or one row saying why there is none
    (the driver-level diagnosis of :func:`~gluon_unet.machine.gpus.gpu_status`)."""
    count, reason = gpu_status()
    if not count:
        return [('GPUs', 'none: %s' % reason)]
    rows = []
    for i in range(count):
        try:
            free, total = mx.context.gpu_memory_info(i)
            rows.append(('GPU %d' % i, '%s, %s free' % (_gib(total), _gib(free))))
        except mx.MXNetError as exc:
            rows.append(('GPU %d' % i, 'error: %s' % mxnet_message(exc)))
    return rows


def amp_plan(gpu_count, bf16_ok):
    """What ``--amp`` does here, in words."""
    gpu = 'float16 on the GPUs' if gpu_count else 'float16 on GPUs (none here)'
    cpu = 'bfloat16 on CPU' if bf16_ok else 'on CPU it stops: no bfloat16 convolutions'
    return '%s; %s' % (gpu, cpu)


def horovod_status():
    """What ``--kvstore horovod`` would find here, in words: Horovod's version, whether it
    was built for MXNet, its controllers (MPI, Gloo) and tensor operations (NCCL, DDL,
    CCL, MPI, Gloo), as ``horovodrun --check-build`` lists them, and where horovodrun is.
    Imports mxnet (``horovod.mxnet`` does)."""
    import shutil
    from ..training.distributed import HOROVOD_INSTALL
    try:
        import horovod
    except ImportError:
        return 'not installed (only --kvstore horovod needs it: pip install -r %s)' % HOROVOD_INSTALL
    version = getattr(horovod, '__version__', '?')
    try:
        import horovod.mxnet as hvd
    except ImportError as exc:  # check_extension: built without HOROVOD_WITH_MXNET
        return '%s, but not built for MXNet (%s); rebuild it: see %s' % (
            version, str(exc).splitlines()[0][:100] if str(exc) else 'ImportError', HOROVOD_INSTALL)

    def listed(checks):
        return ', '.join('%s %s' % (name, 'yes' if built() else 'no') for name, built in checks)
    controllers = listed((('MPI', hvd.mpi_built), ('Gloo', hvd.gloo_built)))
    operations = listed((('NCCL', hvd.nccl_built), ('DDL', hvd.ddl_built), ('CCL', hvd.ccl_built),
                         ('MPI', hvd.mpi_built), ('Gloo', hvd.gloo_built)))
    runner = shutil.which('horovodrun')
    return '%s for MXNet; controllers: %s; tensor operations: %s; horovodrun %s' % (
        version, controllers, operations, runner or 'not on PATH')


def amx_row():
    """The AMX row: whether bfloat16 training and int8 inference use AMX in gluon_unet's
    programs (:func:`~gluon_unet.machine.runtime.enable_amx`, which doctor's own start ran), and why."""
    used, reason = amx_state()
    if used:
        return 'yes: %s; bin/train --amp and --precision int8 use it' % reason
    return 'no: %s' % reason


def table_rows(contexts=1):
    """The ``(name, value)`` rows of the table (imports mxnet)."""
    import mxnet as mx
    features = build_features(mx)
    gpus = gpu_rows(mx)
    gpu_count = sum(1 for name, value in gpus if name.startswith('GPU ') and not value.startswith('error'))
    settings = runtime_settings()
    threads = 'OMP_NUM_THREADS=%d (%s)' % (settings['omp_threads'], settings['omp_source'])
    wanted = recommended_settings(contexts)
    if settings['omp_source'] != 'gluon_unet' and str(settings['omp_threads']) != wanted['OMP_NUM_THREADS']:
        threads += ', gluon_unet would choose %s' % wanted['OMP_NUM_THREADS']
    threads += ', MXNET_CPU_TEMP_COPY=%d, MXNET_CPU_WORKER_NTHREADS=%d, engine %s' % (
        settings['cpu_temp_copy'], settings['cpu_worker_threads'], settings['engine'])
    bf16_ok, bf16_reason = cpu_bfloat16_support()
    int8_ok, int8_reason = cpu_int8_support()
    rows = [('gluon_unet', '%s (%s)' % (__version__, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
            ('mxnet', '%s (package %s, %s)' % (mx.__version__, mxnet_distribution().split()[0],
                                                os.path.dirname(os.path.abspath(mx.__file__)))),
            ('Python', '%s (%s)' % (platform.python_version(), sys.executable)),
            ('build', ', '.join('%s %s' % (k, 'yes' if v else 'no') for k, v in features.items()))]
    rows += gpus
    rows += [('CPU', '%s; %d cores (%d physical)' % (cpu_description(), settings['cores'],
                                                      settings['physical_cores'])),
             ('threads', '%s (for %d CPU context%s)' % (threads, contexts, '' if contexts == 1 else 's')),
             ('bfloat16', '%s: %s' % ('yes' if bf16_ok else 'no', bf16_reason)),
             ('AMX', amx_row()),
             ('int8', '%s: %s' % ('yes' if int8_ok else 'no', int8_reason)),
             ('--amp', amp_plan(gpu_count, bf16_ok)),
             ('horovod', horovod_status())]
    return rows


def without_mxnet_rows():
    """The table's rows where mxnet is not installed: what runs here without it."""
    try:
        import onnxruntime
        predict = "bin/predict runs an export's model.onnx on onnxruntime %s" % onnxruntime.__version__
    except ImportError:
        predict = 'bin/predict needs MXNet or onnxruntime (pip install -r requirements-onnx.txt, for model.onnx)'
    return [('gluon_unet', '%s (%s)' % (__version__, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
            ('mxnet', 'not installed: bin/train and bin/export need it (pip install -r requirements.txt)'),
            ('Python', '%s (%s)' % (platform.python_version(), sys.executable)),
            ('CPU', cpu_description()),
            ('predict', predict)]


def format_table(rows):
    width = max(len(name) for name, _ in rows)
    return '\n'.join('%-*s  %s' % (width, name, value) for name, value in rows)


# -- the device checks ----------------------------------------------------------------------

def device_name(ctx):
    """``'GPU 3'`` / ``'CPU 1'``: how the one-line failure names a device."""
    return '%s %d' % (ctx.device_type.upper(), ctx.device_id)


def device_step(ctx):
    """One hybridized U-Net training step (width 4, depth 2, 32 px, batch 2) on ``ctx``,
    through the same step as training (``step.make_step``); returns the loss."""
    import mxnet as mx
    import numpy as np
    from ..config import ModelConfig, TrainConfig
    from ..training.step import make_step
    from ..model import build_model
    cfg = TrainConfig(model=ModelConfig(in_channels=1, width=STEP_WIDTH, depth=STEP_DEPTH), size=STEP_SIZE,
                      batch_size=STEP_BATCH, optimizer='sgd', lr=0.01, kvstore='device')
    net = build_model(cfg.model)
    net.initialize(mx.init.Xavier(), ctx=[ctx])
    net.hybridize(static_alloc=True, static_shape=True)
    rng = np.random.RandomState(0)
    image = mx.nd.array(rng.uniform(0, 1, (STEP_BATCH, 1, STEP_SIZE, STEP_SIZE)))
    target = (image > 0.5).astype('float32')
    with mx.autograd.predict_mode():  # resolve the deferred shapes, as training does
        net(image.as_in_context(ctx)).wait_to_read()
    step = make_step(cfg, net, [ctx])
    loss = float(step(image, target)['loss_sums'][0].asscalar()) / STEP_BATCH
    for param in net.collect_params().values():
        param.data(ctx).wait_to_read()
    if not np.isfinite(loss):
        raise CheckFailed('%s: the training step gave a non-finite loss (%r)' % (device_name(ctx), loss))
    return loss


def kvstore_reduce(ctxs, kind='device'):
    """Push ``i + 1`` from the i-th device, pull the sum to every device, check it."""
    import mxnet as mx
    import numpy as np
    kv = mx.kv.create(kind)
    shape = (4, 8)
    kv.init('doctor', mx.nd.zeros(shape, ctx=ctxs[0]))
    kv.push('doctor', [mx.nd.full(shape, i + 1, ctx=c) for i, c in enumerate(ctxs)])
    outs = [mx.nd.zeros(shape, ctx=c) for c in ctxs]
    kv.pull('doctor', out=outs)
    expected = len(ctxs) * (len(ctxs) + 1) / 2
    for c, out in zip(ctxs, outs):
        got = out.asnumpy()
        if not np.allclose(got, expected):
            raise CheckFailed('kvstore %s: %s received %s instead of the sum %s'
                              % (kind, device_name(c), np.unique(got)[:3].tolist(), expected))
    return expected


def run_checks(ctxs, kvstore='device', out=None):
    """The step on each device, then the reduce; raises :class:`CheckFailed` at the first
    failure, prints an ``ok`` line for each success (to ``out``, default stdout)."""
    import mxnet as mx
    out = out or sys.stdout
    for ctx in ctxs:
        start = time.time()
        try:
            loss = device_step(ctx)
        except CheckFailed:
            raise
        except (mx.MXNetError, UserError, RuntimeError, ValueError, MemoryError) as exc:
            raise CheckFailed('%s: %s' % (device_name(ctx), mxnet_message(exc))) from None
        print('ok  %s: U-Net training step (width %d, depth %d, %d px, hybridized), loss %.4f, %.2f s'
              % (device_name(ctx), STEP_WIDTH, STEP_DEPTH, STEP_SIZE, loss, time.time() - start), file=out)
    try:
        total = kvstore_reduce(ctxs, kvstore)
    except CheckFailed:
        raise
    except (mx.MXNetError, UserError, RuntimeError, ValueError) as exc:
        raise CheckFailed('kvstore %s: %s' % (kvstore, mxnet_message(exc))) from None
    print('ok  kvstore %s: reduce over %d device%s (%s) gives %g everywhere'
          % (kvstore, len(ctxs), '' if len(ctxs) == 1 else 's', ', '.join(device_name(c) for c in ctxs), total),
          file=out)


def requested_contexts(gpus, cpus):
    """The contexts ``--gpus`` / ``--cpus`` ask for (a :class:`CheckFailed` naming
    ``--gpus`` when there is no such GPU); empty when neither was given."""
    import mxnet as mx
    if (gpus or '').strip():
        try:
            return make_contexts(gpus)  # the probe bin/train runs: one line per bad card
        except UserError as exc:
            raise CheckFailed(str(exc)) from None
    if cpus is not None:
        return [mx.cpu(i) for i in range(cpus)]
    return []


def run_doctor(config):
    """The table, then the device checks of ``config`` (a :class:`DoctorConfig`); returns
    the exit code (1 and a one-line ``doctor: ...`` on stderr when a check fails)."""
    try:
        rows = table_rows(config.contexts())
    except ModuleNotFoundError as exc:
        if (exc.name or '').split('.')[0] != 'mxnet':
            raise
        # The command a user runs exactly when something is missing: say what is there.
        print(format_table(without_mxnet_rows()))
        print('doctor: mxnet is not installed in this Python: bin/train and bin/export need it (pip install -r '
              'requirements.txt, or requirements-cu117.txt for GPUs)', file=sys.stderr)
        return 1
    print(format_table(rows))
    sys.stdout.flush()
    try:
        ctxs = requested_contexts(config.gpus, config.cpus)
        if ctxs:
            run_checks(ctxs, config.kvstore)
        elif config.kvstore != 'device':
            raise UserError('--kvstore needs --gpus or --cpus (the devices to reduce across)')
    except CheckFailed as exc:
        sys.stdout.flush()
        print('doctor: %s' % exc, file=sys.stderr)
        return 1
    if ctxs:
        print('ok')
    return 0


# -- the command ----------------------------------------------------------------------------

EXAMPLES = """examples:
  # what this machine has: versions, MXNet features, GPUs, threads, bfloat16, --amp
  gluon-unet doctor
  # before a long run: one U-Net step on every GPU and a kvstore reduce across them
  gluon-unet doctor --gpus all
  # the same on CPU contexts (what the tests run)
  gluon-unet doctor --cpus 2"""


def doctor_parser():
    """The ``gluon-unet doctor`` parser: one flag per :class:`DoctorConfig` field."""
    return config_parser(
        'doctor', DoctorConfig, epilog=EXAMPLES,
        description='Check the install and the devices: versions, MXNet build features, GPUs and\n'
                    'their memory, cores and thread settings, bfloat16 support, what --amp does.\n'
                    'With --gpus or --cpus, also run one tiny U-Net training step on each device\n'
                    'and one kvstore reduce across them; exit code 1 and one line if one fails.')


@reports_errors
def doctor_main(argv=None):
    """``gluon-unet doctor``: the table, then the device checks; returns the exit code."""
    config, = parse_configs(doctor_parser(), argv, DoctorConfig)
    prepare_training_process(config.gpus, config.cpus or 1)  # as bin/train does, before mxnet loads
    return run_doctor(config)
