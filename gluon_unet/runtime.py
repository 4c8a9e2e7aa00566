"""Process-wide speed settings (threads, engine, oneDNN): the one place that knows them.

Every knob below was measured on the 2-core development machine with
``benchmarks/bench_train.py --variant KEY=VALUE`` (alternated with the default in the
same run, U-Net width 16 at 128 px, batch 16). Measured in images per CPU-second (the
wall-clock rate on this shared machine swings 2x with other users' load), none moved
the cost of a training image by more than 3 %, so gluon_unet keeps MXNet's defaults:
this module reports them, and ``docs/performance.md`` has the figures.

======================================  ===================  ================================
variable                                read                 measured (img/CPU-s vs default)
======================================  ===================  ================================
OMP_NUM_THREADS                         at ``import mxnet``  1 thread: +3 % (1 context);
                                                             4 contexts x 1 thread: -0.7 %
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
set them in the shell (``OMP_NUM_THREADS=1 bin/train ...``). gluon_unet sets none of
them for you.
"""
import os

_TOO_LATE = False  # apply_thread_defaults ran after mxnet was already loaded


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


def apply_thread_defaults(environ=None):
    """Set ``OMP_NUM_THREADS`` to the physical core count unless the user set it.

    Without it, MXNet 1.9 assumes two hyper-threads per core and runs its operators on
    ``cores / 2`` OpenMP threads (``src/engine/openmp.cc`` halves
    ``omp_get_num_procs()``). On machines without SMT - most cloud VMs, including the
    2-core development machine - that leaves half the cores idle: oneDNN convolutions
    ran on one thread of two. MXNet reads the variable once, when ``libmxnet`` loads,
    so ``gluon_unet/__init__.py`` calls this before its first ``import mxnet``; it has
    no effect if mxnet was imported earlier (``configure_runtime`` then warns).

    Returns
    -------
    bool
        True when this call set the variable.
    """
    global _TOO_LATE
    env = os.environ if environ is None else environ
    if 'OMP_NUM_THREADS' in env:
        return False
    env['OMP_NUM_THREADS'] = str(physical_cores())
    if environ is None:
        import sys
        _TOO_LATE = 'mxnet' in sys.modules
    return True


def runtime_settings():
    """The effective thread/engine settings, as MXNet will use them.

    Returns
    -------
    dict
        ``cores``, ``omp_threads``, ``cpu_worker_threads``, ``engine``,
        ``bulk_train_fwd``, ``bulk_train_bwd`` (values from the environment or
        MXNet's defaults).
    """
    env = os.environ
    cores = cpu_cores()
    return {'cores': cores,
            'omp_threads': int(env.get('OMP_NUM_THREADS', cores)),
            'cpu_worker_threads': int(env.get('MXNET_CPU_WORKER_NTHREADS', 1)),
            'engine': env.get('MXNET_ENGINE_TYPE', 'ThreadedEnginePerDevice'),
            'bulk_train_fwd': int(env.get('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_FWD', 15)),
            'bulk_train_bwd': int(env.get('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD', 15))}


def configure_runtime(num_contexts=1, device_type='cpu'):
    """The process-wide settings for training on ``num_contexts`` devices.

    Called at the start of ``fit()`` and of ``bin/train --benchmark`` so that there is
    one hook for process-wide tuning. It changes nothing today: no knob measured here
    paid off (module docstring), including for several CPU contexts, whose data-parallel
    overhead is within 1 % of one context in CPU time with MXNet's defaults.

    Returns
    -------
    dict
        :func:`runtime_settings` plus ``contexts`` and ``device_type``.
    """
    settings = dict(runtime_settings(), contexts=num_contexts, device_type=device_type)
    if _TOO_LATE:
        import warnings
        warnings.warn('mxnet was imported before gluon_unet with OMP_NUM_THREADS unset: MXNet '
                      'uses half the cores on machines without hyper-threading; set '
                      'OMP_NUM_THREADS=%d or import gluon_unet first' % physical_cores())
    return settings
