"""Process-wide speed settings (threads, engine, oneDNN): the one place that knows them.

Every knob below was measured on the 2-core development machine with
``benchmarks/bench_train.py --variant KEY=VALUE`` (alternated with the default in the
same run, U-Net width 16 at 128 px, batch 16). Measured in images per CPU-second (the
wall-clock rate on this shared machine swings 2x with other users' load), none but
the thread count moved the cost of a training image by more than 3 %, and more threads
lost here, so gluon_unet keeps MXNet's defaults: this module reports them, and
``docs/performance.md`` has the figures.

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
set them in the shell (``OMP_NUM_THREADS=1 bin/train ...``). gluon_unet sets none of
them for you.
"""
import os


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
    ``omp_get_num_procs()``): on machines without SMT (most cloud VMs, including the
    2-core development machine) oneDNN kernels use half the cores. MXNet reads the
    variable once, when ``libmxnet`` loads, so call this before the first
    ``import mxnet`` (or export the variable in the shell).

    Called by ``import gluon_unet``. With the machine to itself, two threads on the
    2-core development machine train 1.8x faster than MXNet's one (width 16 at 128 px:
    32.5 vs 18.1 images/s, 1.35x PyTorch; docs/performance.md, finding 1). The price:
    while another job holds a core, each kernel's threads wait for each other and a
    process runs slower than with one thread (width 16: 5.7 vs 9.0 images/s), and
    several CPU contexts in one process oversubscribe the cores. On a shared machine,
    or for ``--cpus N`` runs, export ``OMP_NUM_THREADS=1`` (cores / N) yourself.

    Returns
    -------
    bool
        True when this call set the variable.
    """
    env = os.environ if environ is None else environ
    if 'OMP_NUM_THREADS' in env:
        return False
    env['OMP_NUM_THREADS'] = str(physical_cores())
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
            # MXNet's default without the variable: half the logical CPUs (it assumes SMT).
            'omp_threads': int(env.get('OMP_NUM_THREADS', max(1, cores // 2))),
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
    return dict(runtime_settings(), contexts=num_contexts, device_type=device_type)
