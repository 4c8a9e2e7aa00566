"""Process-wide speed settings (threads, engine, oneDNN): the one place that knows them.

Two settings pay off and gluon_unet sets them (:func:`apply_runtime_defaults`):
``OMP_NUM_THREADS`` (MXNet alone halves the core count, assuming hyper-threading) and,
for several CPU contexts, ``MXNET_CPU_TEMP_COPY`` (MXNet shares its CPU scratch buffers
among all CPU contexts, and contexts given the same buffer take turns). Others were
measured side by side (``benchmarks/bench_train.py --variant KEY=VALUE``) and made no
difference, so they stay at MXNet's defaults, which this module reports:
``MXNET_CPU_WORKER_NTHREADS``, ``MXNET_ENGINE_TYPE``, ``OMP_WAIT_POLICY``,
``MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_*`` and ``MXNET_SUBGRAPH_BACKEND`` (which the
training graph ignores). MXNet reads them when it is imported, but for the bulk-execution
sizes (at the first hybridized forward) and the subgraph backend (at graph binding). The
reasons: docs/explanation/choices.md, "All the cores"; the figures: docs/performance.md,
"Where the defaults come from".

With GPUs (``bin/train --gpus``) gluon_unet leaves ``OMP_NUM_THREADS`` unset: MXNet then
keeps one core (two from 8 OpenMP threads up) free of operator threads for the threads
that feed the GPUs (``src/engine/threaded_engine_perdevice.cc``, ``GetReserveCoreCount``
via ``OpenMP::set_reserve_cores``), which it does only when ``OMP_NUM_THREADS`` is not
set (``src/engine/openmp.cc``: with the variable set, ``GetRecommendedOMPThreadCount``
returns it as is). And it sets ``CUDA_VISIBLE_DEVICES`` to the GPUs asked for
(:func:`restrict_visible_gpus`), so ``--gpus 4-7`` creates no CUDA context on GPU 0.

"Read at ``import mxnet``" means that setting ``os.environ`` afterwards has no effect:
set them in the shell (``OMP_NUM_THREADS=1 bin/train ...``). gluon_unet sets its two only
when you did not, and never as a side effect of ``import gluon_unet``:

* the command-line entry points (``bin/train``, ``bin/predict``, ``bin/evaluate``,
  ``bin/export``) call :func:`apply_runtime_defaults` before mxnet loads, ``bin/train``
  for its number of CPU contexts (it reads its flags first);
* Python API users call :func:`use_all_cores` (``gluon_unet.use_all_cores(contexts=N)``)
  before anything imports mxnet. Without it MXNet runs on its own defaults, and ``fit()``
  on several CPU contexts logs what to export (:func:`configure_runtime`).

``bin/launch`` sets none of them: it passes the user's own values to every process of
the job, and each ``bin/train`` there chooses for its own host.

On Intel CPUs with AMX, :func:`enable_amx` (called by :func:`apply_runtime_defaults`) also
lets oneDNN use AMX, which MXNet 1.9.1 leaves off and cannot turn on safely by itself.

Why one module: these settings are read once, when mxnet loads or at its first operator,
and each depends on the others being set first (threads per context, scratch buffers per
context, the GPUs visible, AMX before the first oneDNN primitive); one module sets them
in one order, records which were its own choice (:func:`user_environ` hands the user's
alone to child processes), and reports them.
"""
import os
import re
import sys
import warnings

from ..reporting import get_logger

# NAME -> the value apply_runtime_defaults() gave os.environ[NAME] in this process. Kept in
# the process, not in the environment: a value a child process inherits from us is passed
# on by user_environ() only if it was the user's.
_applied = {}


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


TEMP_COPIES_PER_CONTEXT = 32
# Set by bin/launch for each worker: how many worker processes share this machine's cores.
LOCAL_WORKERS = 'GLUON_UNET_LOCAL_WORKERS'
# What the launchers of a Horovod job tell each process about its place on its host:
# (local rank, local size) variables, first match wins. horovodrun's Gloo mode, Open MPI's
# mpirun (also under horovodrun --mpi and the Kubernetes MPI Operator), MPICH and Intel
# MPI (hydra). srun sets SLURM_LOCALID; its local size is read off
# SLURM_STEP_TASKS_PER_NODE (:func:`_slurm_local_size`).
LAUNCHER_LOCAL_VARS = (('HOROVOD_LOCAL_RANK', 'HOROVOD_LOCAL_SIZE'),
                       ('OMPI_COMM_WORLD_LOCAL_RANK', 'OMPI_COMM_WORLD_LOCAL_SIZE'),
                       ('MPI_LOCALRANKID', 'MPI_LOCALNRANKS'))


def _slurm_local_size(env):
    """Tasks of this step on this node, from ``SLURM_STEP_TASKS_PER_NODE`` (``'4(x2),3'``
    = 4, 4, 3 tasks on the step's nodes 0, 1, 2) and ``SLURM_NODEID``; None if unreadable."""
    counts = []
    for part in env.get('SLURM_STEP_TASKS_PER_NODE', env.get('SLURM_TASKS_PER_NODE', '')).split(','):
        m = re.fullmatch(r'\s*(\d+)(?:\(x(\d+)\))?\s*', part)
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    try:
        return counts[int(env.get('SLURM_NODEID', 0))]
    except (ValueError, IndexError):
        return None


def local_process(environ=None):
    """``(local_rank, local_size)`` of this process among those its launcher started on
    this host (horovodrun, mpirun, srun: :data:`LAUNCHER_LOCAL_VARS`), or None when no
    launcher said (a process started by hand, or by ``bin/launch``)."""
    env = os.environ if environ is None else environ
    pairs = [(env.get(r), env.get(s)) for r, s in LAUNCHER_LOCAL_VARS]
    if env.get('SLURM_LOCALID') is not None:
        size = _slurm_local_size(env)
        pairs.append((env.get('SLURM_LOCALID'), None if size is None else str(size)))
    for rank, size in pairs:
        try:
            rank, size = int(rank), int(size)
        except (TypeError, ValueError):
            continue
        if 0 <= rank < size:
            return rank, size
    return None


def local_workers(environ=None):
    """Processes of this job sharing this host's cores: ``GLUON_UNET_LOCAL_WORKERS``
    (``bin/launch``), else the launcher's local size (:func:`local_process`), else 1."""
    env = os.environ if environ is None else environ
    try:
        return max(1, int(env[LOCAL_WORKERS]))
    except (KeyError, ValueError):
        pass
    local = local_process(env)
    return local[1] if local else 1


def process_gpus(gpus, kvstore, environ=None):
    """This process's share of ``--gpus`` (a ``--gpus`` value) in a Horovod job.

    Horovod runs one process per GPU, all with the same command line, so under
    ``--kvstore horovod`` ``--gpus`` names the GPUs of the *host*, dealt in order to its
    processes by local rank (:func:`local_process`): ``--gpus 0-7`` with 8 processes per
    host gives local rank 3 GPU 3, with 4 processes GPUs 6,7 to local rank 3;
    ``--gpus all`` is GPU ``<local rank>``. Unchanged for other kvstores, CPU runs, a
    process no launcher placed, and when the user's ``CUDA_VISIBLE_DEVICES`` already
    shows each process fewer GPUs than there are processes on the host (the launcher
    bound one to each: SLURM ``--gpus-per-task``, the Kubernetes device plugin).

    Raises
    ------
    UserError
        The GPUs cannot be dealt evenly to the host's processes.
    """
    from .devices import parse_gpu_list
    from ..errors import UserError
    env = os.environ if environ is None else environ
    if kvstore != 'horovod':
        return gpus
    try:
        ids = parse_gpu_list(gpus)
    except UserError:
        return gpus  # make_contexts names the bad part
    local = local_process(env)
    if ids == [] or local is None or local[1] == 1:
        return gpus
    rank, size = local
    visible = env.get(CUDA_VISIBLE)
    shown = [v for v in (visible or '').split(',') if v.strip()]
    if visible is not None and not is_default(CUDA_VISIBLE) and len(shown) < size:
        return gpus
    if ids is None:
        return str(rank)
    if len(ids) % size:
        raise UserError('--gpus %s with --kvstore horovod: %d GPU(s) cannot be dealt evenly to the %d processes '
                        'on this host (one process per GPU: give as many GPUs as processes)'
                        % (gpus, len(ids), size))
    k = len(ids) // size
    return ','.join(str(i) for i in ids[rank * k:(rank + 1) * k])


def recommended_settings(contexts=1, environ=None, gpus=False, memory='speed'):
    """The values :func:`apply_runtime_defaults` chooses for ``contexts`` CPU contexts
    (the processes sharing the host from ``environ``: :func:`local_workers`), whoever set what: a dict of
    ``OMP_NUM_THREADS`` and, for 2 or more contexts, ``MXNET_CPU_TEMP_COPY``, as strings.
    Empty when training on GPUs (``gpus``): MXNet's own thread choice keeps cores free for
    feeding them (module docstring). With one context and ``memory`` (``--memory``) other
    than ``'speed'``, ``MXNET_CPU_TEMP_COPY=1``: see :func:`apply_runtime_defaults`."""
    if gpus:
        return {}
    env = os.environ if environ is None else environ
    contexts = max(1, contexts)
    wanted = {'OMP_NUM_THREADS': str(max(1, physical_cores() // (contexts * local_workers(env))))}
    if contexts > 1:
        wanted['MXNET_CPU_TEMP_COPY'] = str(TEMP_COPIES_PER_CONTEXT * contexts)
    elif memory != 'speed':
        wanted['MXNET_CPU_TEMP_COPY'] = '1'
    return wanted


def apply_runtime_defaults(environ=None, contexts=1, gpus=False, memory='speed', amx=True):
    """Set MXNet's load-time variables for ``contexts`` CPU contexts, unless the user did.

    MXNet reads both once, when ``libmxnet`` loads, so call this before the first
    ``import mxnet`` (or export them in the shell). The CLI entry points call it before
    they import mxnet (``bin/train`` with its number of CPU contexts); API users call
    :func:`use_all_cores`. A value this process set earlier may be replaced; the user's
    never.

    ``OMP_NUM_THREADS`` = physical cores / contexts (and / the worker processes that
    ``bin/launch``, horovodrun, mpirun or srun started on this machine:
    :func:`local_workers`). Without it,
    MXNet 1.9 assumes two hyper-threads per core and runs operators on ``cores / 2``
    OpenMP threads (``src/engine/openmp.cc`` halves ``omp_get_num_procs()``): without SMT
    (most cloud VMs) oneDNN would use half the cores. Each CPU context has its own
    engine worker running operators on this many threads, hence the division. While
    another job holds a core, a kernel's threads wait for each other, so on a shared
    machine export ``OMP_NUM_THREADS=1`` yourself (docs/performance.md, "Where the
    defaults come from", has the figures).

    ``MXNET_CPU_TEMP_COPY`` = 32 x contexts, for 2 or more contexts only. MXNet keeps
    one pool of CPU scratch buffers (default 4) for *all* CPU contexts
    (``src/resource.cc``), and an operator holding a buffer blocks every operator
    assigned the same one, on any context: BatchNorm and the convolutions' backward take
    one, so the contexts ran one at a time. With 32 copies per context they run side by
    side; the buffers cost memory (each grows to the largest request it serves), which is
    why one context keeps the default. One context with ``--memory balanced`` or ``low``
    gets 1: one context's operators run one at a time anyway, and fewer buffers hold
    less memory (docs/explanation/multi-device.md, "Several CPU contexts"; the figures:
    docs/performance.md).

    Parameters
    ----------
    environ : dict, optional
        The environment to change (default ``os.environ``; left alone once mxnet is
        loaded, when a change would only make the logged settings lie). In another
        dict (a child process's environment) every value present is the user's.
    contexts : int
        CPU contexts that will train in this process.
    memory : {'speed', 'balanced', 'low'}
        ``--memory``: with one CPU context, anything but ``'speed'`` sets
        ``MXNET_CPU_TEMP_COPY=1``.
    gpus : bool
        The process trains on GPUs: set nothing, and take back an ``OMP_NUM_THREADS``
        this process set earlier (never the user's). With ``OMP_NUM_THREADS`` unset MXNet
        runs operators on half the logical CPUs less one or two it keeps for the threads
        feeding the GPUs (``src/engine/threaded_engine_perdevice.cc`` GetReserveCoreCount,
        ``src/engine/openmp.cc`` set_reserve_cores); with it set, MXNet reserves nothing
        (openmp.cc: GetRecommendedOMPThreadCount returns the variable's value as is), so
        all-cores operator threads would compete with the feeders.

    amx : bool
        In this process (``environ`` None), also let oneDNN use AMX where the CPU has
        it (:func:`enable_amx`).

    Returns
    -------
    dict
        The variables this call set.
    """
    own = environ is None
    env = os.environ if own else environ
    if own and 'mxnet' in sys.modules:
        return {}
    if gpus and own and is_default('OMP_NUM_THREADS'):
        del env['OMP_NUM_THREADS']
        _applied.pop('OMP_NUM_THREADS')
    done = {}
    for key, value in recommended_settings(contexts, env, gpus=gpus, memory=memory).items():
        if key in env and not (own and is_default(key)):
            continue  # the user's own value always wins
        env[key] = done[key] = value
    if own:
        _applied.update(done)
        if amx and not gpus:
            enable_amx()
    return done


ISA_VARIABLE = 'DNNL_MAX_CPU_ISA'
AMX_ISA = 'AVX512_CORE_AMX'
# (used, reason) once enable_amx() has decided for this process; None before.
_amx = None


def enable_amx():
    """Let MXNet's oneDNN run bfloat16 and int8 convolutions on AMX, where the CPU has it.

    MXNet 1.9.1's oneDNN 2.4.4 leaves AMX off unless ``DNNL_MAX_CPU_ISA=AVX512_CORE_AMX``,
    and with that alone the process dies (SIGILL) at its first bfloat16 convolution:
    Linux hands out AMX tile state only to processes that ask
    (:func:`~gluon_unet.machine.cpu.request_amx_tiles`). So, on CPUs with AMX only, this asks
    and then sets the variable - as this process's own choice, which :func:`user_environ`
    leaves out, so the processes gluon_unet starts choose (and ask) for themselves; and
    :func:`settle_amx` takes it out of the environment once oneDNN has read it, so that no
    other program started later inherits an AMX setting without the permission that goes
    with it (the permission survives ``fork()``, not ``exec()``). The user's own
    ``DNNL_MAX_CPU_ISA`` is never changed; when it names AMX the permission is still
    requested, so that it works instead of crashing.

    Why on by default: bfloat16 training ran 2.2x (width 16) to 4.4x (width 64) faster on
    a 2-core Xeon with AMX (docs/performance.md, "bfloat16 (--amp on CPU)"); float32 does not use
    AMX. To turn it off: ``export DNNL_MAX_CPU_ISA=AVX512_CORE_BF16``.

    Returns
    -------
    (bool, str)
        Whether oneDNN may use AMX in this process, and why, in one line.
    """
    global _amx
    if _amx is not None:
        return _amx
    from .cpu import cpu_has_amx, request_amx_tiles
    user = os.environ.get(ISA_VARIABLE)
    if user is not None and not is_default(ISA_VARIABLE):
        if user.strip().upper() in (AMX_ISA, 'ALL'):
            ok, reason = request_amx_tiles()
            _amx = ok, '%s=%s (yours): %s' % (ISA_VARIABLE, user, reason)
        else:
            _amx = False, '%s=%s (yours) leaves AMX off' % (ISA_VARIABLE, user)
        return _amx
    if not cpu_has_amx():
        _amx = False, 'no AMX on this CPU'
        return _amx
    if 'mxnet' in sys.modules:
        # oneDNN may have read the variable already; setting it now could only half-work.
        _amx = False, ('AMX left off: mxnet was loaded before gluon_unet could turn it on (call '
                       'gluon_unet.use_all_cores() first)')
        return _amx
    ok, reason = request_amx_tiles()
    if not ok:
        _amx = False, reason
        return _amx
    os.environ[ISA_VARIABLE] = _applied[ISA_VARIABLE] = AMX_ISA
    _amx = True, 'AMX on: %s' % reason
    return _amx


def settle_amx():
    """Once mxnet is loaded: make oneDNN read ``DNNL_MAX_CPU_ISA`` (one tiny convolution;
    it reads the variable once, at its first primitive, and keeps it), then take this
    process's value out of the environment again (:func:`enable_amx` says why). A no-op
    where :func:`enable_amx` set nothing."""
    if not is_default(ISA_VARIABLE) or 'mxnet' not in sys.modules:
        return
    import mxnet as mx
    x = mx.nd.ones((1, 1, 4, 4))
    mx.nd.Convolution(x, mx.nd.ones((1, 1, 1, 1)), kernel=(1, 1), num_filter=1, no_bias=True).wait_to_read()
    del os.environ[ISA_VARIABLE]


def amx_state():
    """What :func:`enable_amx` decided in this process: (used, reason); (False, 'not
    requested') when nothing asked it (mxnet then runs without AMX)."""
    return _amx if _amx is not None else (False, 'not requested in this process')


CUDA_VISIBLE = 'CUDA_VISIBLE_DEVICES'


def restrict_visible_gpus(gpus):
    """Show MXNet only the GPUs ``--gpus`` asks for: ``CUDA_VISIBLE_DEVICES``, set before
    mxnet loads.

    ``--gpus 4-7`` gives ``CUDA_VISIBLE_DEVICES=4,5,6,7``: MXNet's ``gpu(0..3)`` are then
    GPUs 4-7, and nothing can create a CUDA context on GPU 0. Without it MXNet does, even
    when training on 4-7: the kvstore stages gradients through ``cpu_pinned(0)``
    (``src/kvstore/comm.h``: ``pinned_ctx_ = Context::CPUPinned(0)``) and pinned memory is
    allocated with device 0 current (``src/storage/pinned_memory_storage.h``:
    ``DeviceStore device_store(handle->ctx.real_dev_id())`` before ``cudaHostAlloc``) -
    a CUDA context of some 300 MB on a card that may be someone else's.

    The ids keep their meaning: CUDA interprets ``CUDA_VISIBLE_DEVICES`` in the same
    order (``CUDA_DEVICE_ORDER``) as it numbers the GPUs without it.
    :func:`gluon_unet.machine.devices.make_contexts` maps the user's ids onto the renumbered
    devices (``--gpus 4-7`` -> ``gpu(0..3)``; error messages and logs still say GPU 4-7:
    :func:`gluon_unet.machine.devices.context_names`).

    Changes nothing (returns ``{}``) when the user set ``CUDA_VISIBLE_DEVICES`` (theirs
    wins, and ``--gpus`` counts within it, as CUDA does), for ``--gpus all`` and for CPU
    runs, when mxnet is already loaded (CUDA has read the variable), or for a ``--gpus``
    value that does not parse (:func:`~gluon_unet.machine.devices.make_contexts` reports it).
    The value is this process's choice: :func:`user_environ` leaves it out, so
    ``bin/launch``'s processes and the export subprocess choose their own.

    Returns
    -------
    dict
        ``{mxnet_gpu_index: gpu_id}`` (``{0: 4, 1: 5, 2: 6, 3: 7}``), empty when nothing
        was changed.
    """
    from .devices import parse_gpu_list
    from .gpus import set_gpu_renumbering
    from ..errors import UserError
    if 'mxnet' in sys.modules:
        return {}
    if CUDA_VISIBLE in os.environ and not is_default(CUDA_VISIBLE):
        return {}
    try:
        ids = parse_gpu_list(gpus)
    except UserError:
        return {}
    if not ids:  # CPU, or 'all'
        if is_default(CUDA_VISIBLE):  # an earlier call's choice no longer applies
            del os.environ[CUDA_VISIBLE]
            _applied.pop(CUDA_VISIBLE)
            set_gpu_renumbering(None)
        return {}
    value = ','.join(map(str, ids))
    os.environ[CUDA_VISIBLE] = _applied[CUDA_VISIBLE] = value
    set_gpu_renumbering(ids)
    return dict(enumerate(ids))


def gpu_renumbering():
    """:func:`gluon_unet.machine.gpus.gpu_renumbering`: the GPU ids this process made visible."""
    from .gpus import gpu_renumbering as renumbering
    return renumbering()


def prepare_training_process(gpus, cpus=1, memory='speed'):
    """Everything ``bin/train`` sets before mxnet loads, once its flags are known:
    :func:`restrict_visible_gpus` for ``--gpus``, then :func:`apply_runtime_defaults` for
    its CPU contexts and ``--memory`` (nothing about threads when training on GPUs).

    Returns
    -------
    dict
        :func:`restrict_visible_gpus`'s renumbering (``{0: 4, ...}``; empty if none).
    """
    from .devices import cpu_context_count
    renumbered = restrict_visible_gpus(gpus)
    cpu_contexts = cpu_context_count(gpus, cpus)
    apply_runtime_defaults(contexts=max(1, cpu_contexts), gpus=cpu_contexts == 0, memory=memory)
    return renumbered


def use_all_cores(contexts=1):
    """Let MXNet use all the physical cores, divided among ``contexts`` CPU contexts.

    For Python API users; the command-line tools do it themselves. Call it before
    anything imports mxnet (MXNet reads these settings once, when it loads)::

        import gluon_unet
        gluon_unet.use_all_cores(contexts=4)      # before mxnet loads
        gluon_unet.fit(gluon_unet.TrainConfig(cpus=4, ...))

    Sets ``OMP_NUM_THREADS`` (physical cores / contexts) and, for several contexts,
    ``MXNET_CPU_TEMP_COPY`` in ``os.environ`` (so also for child processes), each only
    if you have not set it (:func:`apply_runtime_defaults` says why they matter). Once
    mxnet is loaded it changes nothing and warns.

    Returns
    -------
    dict
        The variables it set.
    """
    if 'mxnet' in sys.modules:
        warnings.warn('gluon_unet.use_all_cores() called after mxnet was imported: MXNet has already '
                      'read OMP_NUM_THREADS and MXNET_CPU_TEMP_COPY; call it first', RuntimeWarning,
                      stacklevel=2)
        return {}
    return apply_runtime_defaults(contexts=contexts)


def is_default(name):
    """True when ``os.environ[name]`` holds the value this process gave it
    (:func:`apply_runtime_defaults`), False for the user's own value or none."""
    return name in _applied and os.environ.get(name) == _applied[name]


def user_environ():
    """``os.environ`` without the values this process chose (:func:`apply_runtime_defaults`):
    the environment to hand to processes that choose their own (``bin/launch``'s, the
    export subprocess)."""
    return {k: v for k, v in os.environ.items() if not is_default(k)}


def thread_source():
    """Who chose ``OMP_NUM_THREADS``: ``'user'``, ``'gluon_unet'`` or ``'mxnet default'``."""
    if 'OMP_NUM_THREADS' not in os.environ:
        return 'mxnet default'
    return 'gluon_unet' if is_default('OMP_NUM_THREADS') else 'user'


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
            'omp_source': thread_source(),
            'cpu_worker_threads': int(env.get('MXNET_CPU_WORKER_NTHREADS', 1)),
            'cpu_temp_copy': int(env.get('MXNET_CPU_TEMP_COPY', 4)),
            'engine': env.get('MXNET_ENGINE_TYPE', 'ThreadedEnginePerDevice'),
            'bulk_train_fwd': int(env.get('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_FWD', 15)),
            'bulk_train_bwd': int(env.get('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD', 15))}


def configure_runtime(num_contexts=1, device_type='cpu'):
    """Report the process-wide settings for training on ``num_contexts`` devices.

    Called at the start of ``fit()`` (from ``build_network``) and of ``bin/train
    --benchmark``. It logs the effective settings in one line, and a warning when
    several CPU contexts would train slower than they could (too many threads, too few
    scratch buffers: :func:`apply_runtime_defaults`): by now mxnet is loaded and both are
    fixed (``bin/train`` chose them before; ``fit()`` from Python cannot, unless the
    caller ran :func:`use_all_cores` first), so the warning says what to export. It
    changes no setting.

    Returns
    -------
    dict
        :func:`runtime_settings` plus ``contexts`` and ``device_type``.
    """
    settle_amx()
    settings = dict(runtime_settings(), contexts=num_contexts, device_type=device_type)
    source = settings['omp_source']
    if device_type == 'gpu' and source == 'mxnet default':
        # MXNet keeps 1 core (2 from 8 threads up) for the GPU feeder threads
        # (threaded_engine_perdevice.cc GetReserveCoreCount): only without OMP_NUM_THREADS.
        reserve = 2 if settings['omp_threads'] >= 8 else 1
        settings['omp_threads'] = max(1, settings['omp_threads'] - reserve)
        source = 'mxnet default, %d core(s) kept for feeding the GPUs' % reserve
    log = get_logger()
    log.info('runtime: %d %s context(s), OMP_NUM_THREADS=%d (%s), %d physical core(s), '
             'MXNET_CPU_TEMP_COPY=%d, MXNET_CPU_WORKER_NTHREADS=%d, engine %s', num_contexts,
             device_type, settings['omp_threads'], source, settings['physical_cores'],
             settings['cpu_temp_copy'], settings['cpu_worker_threads'], settings['engine'])
    if device_type == 'cpu' and num_contexts > 1:
        # What bin/train would have chosen here (also dividing among bin/launch's workers).
        wanted = recommended_settings(num_contexts)
        fix = ['OMP_NUM_THREADS=%s' % wanted['OMP_NUM_THREADS']] \
            if settings['omp_threads'] > int(wanted['OMP_NUM_THREADS']) else []
        if settings['cpu_temp_copy'] < int(wanted['MXNET_CPU_TEMP_COPY']):
            fix.append('MXNET_CPU_TEMP_COPY=%s' % wanted['MXNET_CPU_TEMP_COPY'])
        if fix:
            log.warning('warning: %d CPU contexts with OMP_NUM_THREADS=%d and MXNET_CPU_TEMP_COPY=%d '
                        'on %d cores train slower (oversubscribed cores, contexts waiting for '
                        'shared scratch buffers); export %s before importing mxnet (or call '
                        'gluon_unet.use_all_cores(%d) first; bin/train --cpus N does it unless you '
                        'set them)', num_contexts, settings['omp_threads'], settings['cpu_temp_copy'],
                        settings['physical_cores'], ' '.join(fix), num_contexts)
    return settings
