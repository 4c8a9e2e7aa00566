"""Process-wide speed settings (threads, engine, oneDNN): the one place that knows them.

Every knob below was measured on the 2-core development machine with
``benchmarks/bench_train.py --variant KEY=VALUE`` (alternated with the default in the
same run, U-Net width 16 at 128 px, batch 16). Measured in images per CPU-second (the
wall-clock rate on this shared machine swings 2x with other users' load), none but
the thread count moved the cost of a training image by more than 3 %, so gluon_unet
sets only that one (:func:`apply_thread_defaults`) and keeps MXNet's defaults for the
rest: this module reports them, and ``docs/performance.md`` has the figures.

======================================  ===================  ================================
variable                                read                 measured (img/CPU-s vs default)
======================================  ===================  ================================
OMP_NUM_THREADS                         at ``import mxnet``  unset = half the cores (1 here);
                                                             2 (all cores): -43 % (10.5 vs
                                                             18.4) on this loaded machine,
                                                             see apply_thread_defaults
MXNET_CPU_WORKER_NTHREADS               at ``import mxnet``  2 with 4 contexts (16 threads on
                                                             2 cores): -1.5 %
MXNET_ENGINE_TYPE=NaiveEngine           at ``import mxnet``  +2 %
OMP_WAIT_POLICY=PASSIVE                 at ``import mxnet``  +3 %
MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_*   first hybridized     200 instead of 15: -1 %
                                        forward
MXNET_SUBGRAPH_BACKEND=MKLDNN           graph binding        inference/quantization only; the
                                                             training CachedOp ignores it
======================================  ===================  ================================

"Read at ``import mxnet``" means that setting ``os.environ`` afterwards has no effect:
set them in the shell (``OMP_NUM_THREADS=1 bin/train ...``). gluon_unet sets only
``OMP_NUM_THREADS``, and only when you did not: to the physical core count at
``import gluon_unet``, then divided by the number of CPU contexts in ``bin/train``
(which reads its flags before mxnet loads). The Python API learns the contexts too
late for that; :func:`configure_runtime` then logs what to export.
"""
import os
import sys

from .runlog import get_logger

# The OMP_NUM_THREADS value apply_thread_defaults() set, kept in the environment rather than
# in a module flag so that child processes (export, bin/launch's workers) inherit it too: an
# OMP_NUM_THREADS equal to it is gluon_unet's default, anything else is the user's choice.
_OURS = '_GLUON_UNET_OMP_NUM_THREADS'


def cpu_cores():
    """CPU cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def physical_cores():
    """Physical cores among :func:`cpu_cores` (SMT siblings counted once), from sysfs."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else []
    cores = set()
    for cpu in cpus:
        path = '/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list' % cpu
        try:
            with open(path) as f:
                cores.add(f.read().strip())
        except OSError:
            return cpu_cores()
    return max(1, len(cores)) if cores else cpu_cores()


def apply_thread_defaults(environ=None, contexts=1):
    """Set ``OMP_NUM_THREADS`` to the physical cores per CPU context unless the user set it.

    Without it, MXNet 1.9 assumes two hyper-threads per core and runs its operators on
    ``cores / 2`` OpenMP threads (``src/engine/openmp.cc`` halves
    ``omp_get_num_procs()``): on machines without SMT (most cloud VMs, including the
    2-core development machine) oneDNN kernels use half the cores. MXNet reads the
    variable once, when ``libmxnet`` loads, so call this before the first
    ``import mxnet`` (or export the variable in the shell).

    Called by ``import gluon_unet`` (one context), and again by ``bin/train`` with the
    number of CPU contexts before it imports mxnet. With the machine to itself, two
    threads on the 2-core development machine train 1.8x faster than MXNet's one (width
    16 at 128 px: 32.5 vs 18.1 images/s, 1.35x PyTorch; docs/performance.md, finding 1).
    Each CPU context has its own engine worker thread running operators on this many
    threads, so N contexts share the cores: 4 contexts x 2 threads on 2 cores cost
    12-23 % more time per image than 1 thread each (finding 6). While another job holds
    a core, each kernel's threads wait for each other (width 16: 5.7 vs 9.0 images/s);
    on a shared machine export ``OMP_NUM_THREADS=1`` yourself.

    Parameters
    ----------
    environ : dict, optional
        The environment to change (default ``os.environ``).
    contexts : int
        CPU contexts that will train in this process.

    Returns
    -------
    bool
        True when this call set the variable. It does not when the user set it (a value
        other than the one gluon_unet set earlier), nor in ``os.environ`` once mxnet is
        loaded.
    """
    env = os.environ if environ is None else environ
    if 'OMP_NUM_THREADS' in env and env['OMP_NUM_THREADS'] != env.get(_OURS):
        return False  # the user's own value always wins
    if environ is None and 'mxnet' in sys.modules:
        # libmxnet has read the variable already; changing it now would only make
        # runtime_settings() report a thread count MXNet does not use.
        return False
    env['OMP_NUM_THREADS'] = env[_OURS] = str(max(1, physical_cores() // max(1, contexts)))
    return True


def thread_source(environ=None):
    """Who chose ``OMP_NUM_THREADS``: ``'user'``, ``'gluon_unet'`` or ``'mxnet default'``."""
    env = os.environ if environ is None else environ
    if 'OMP_NUM_THREADS' not in env:
        return 'mxnet default'
    return 'gluon_unet' if env['OMP_NUM_THREADS'] == env.get(_OURS) else 'user'


def runtime_settings():
    """The effective thread/engine settings, as MXNet will use them.

    Returns
    -------
    dict
        ``cores``, ``physical_cores``, ``omp_threads``, ``omp_source`` (see
        :func:`thread_source`), ``cpu_worker_threads``, ``engine``, ``bulk_train_fwd``,
        ``bulk_train_bwd`` (values from the environment or MXNet's defaults).
    """
    env = os.environ
    cores = cpu_cores()
    return {'cores': cores,
            'physical_cores': physical_cores(),
            # MXNet's default without the variable: half the logical CPUs (it assumes SMT).
            'omp_threads': int(env.get('OMP_NUM_THREADS', max(1, cores // 2))),
            'omp_source': thread_source(env),
            'cpu_worker_threads': int(env.get('MXNET_CPU_WORKER_NTHREADS', 1)),
            'engine': env.get('MXNET_ENGINE_TYPE', 'ThreadedEnginePerDevice'),
            'bulk_train_fwd': int(env.get('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_FWD', 15)),
            'bulk_train_bwd': int(env.get('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD', 15))}


def configure_runtime(num_contexts=1, device_type='cpu'):
    """Report the process-wide settings for training on ``num_contexts`` devices.

    Called at the start of ``fit()`` (from ``build_network``) and of ``bin/train
    --benchmark``. It logs the effective settings in one line, and a warning when
    several CPU contexts oversubscribe the cores: by now mxnet is loaded and the thread
    count is fixed (``bin/train`` chose it before; ``fit()`` from Python cannot), so the
    warning says what to export. It changes no setting: the thread count is chosen
    before mxnet loads, and no other knob measured here paid off (module docstring).

    Returns
    -------
    dict
        :func:`runtime_settings` plus ``contexts`` and ``device_type``.
    """
    settings = dict(runtime_settings(), contexts=num_contexts, device_type=device_type)
    log = get_logger()
    log.info('runtime: %d %s context(s), OMP_NUM_THREADS=%d (%s), %d physical core(s), '
             'MXNET_CPU_WORKER_NTHREADS=%d, engine %s', num_contexts, device_type,
             settings['omp_threads'], settings['omp_source'], settings['physical_cores'],
             settings['cpu_worker_threads'], settings['engine'])
    best = max(1, settings['physical_cores'] // num_contexts)
    if device_type == 'cpu' and num_contexts > 1 and settings['omp_threads'] > best:
        log.warning('warning: %d CPU contexts x OMP_NUM_THREADS=%d threads oversubscribe %d cores '
                    '(slower training); export OMP_NUM_THREADS=%d before importing mxnet or '
                    'gluon_unet (bin/train --cpus N does it unless you set it)', num_contexts,
                    settings['omp_threads'], settings['physical_cores'], best)
    return settings
