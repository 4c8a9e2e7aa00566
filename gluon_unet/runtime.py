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


def cpu_cores():
    """CPU cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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
    return dict(runtime_settings(), contexts=num_contexts, device_type=device_type)
