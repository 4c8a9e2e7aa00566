"""The data-parallel training step: the one place that knows there are several devices.

One step: split the global batch over the devices, run forward and loss on each
device, backpropagate all device losses together, and let the ``gluon.Trainer`` (with
its kvstore) sum the gradients across devices and apply one update. Nothing here reads
a value back to the host, so the Python thread runs ahead of the devices and the next
batch is queued while the current one computes.
"""
import threading
import time

import mxnet as mx
from mxnet import autograd, gluon

from ..errors import UserError, mxnet_message


class DeviceFailure(UserError):
    """One device failed while the others wait for it at SyncBatchNorm's barrier.

    MXNet's barrier has no timeout and its waiting operators cannot be cancelled, so
    the engine of this process will not finish any other work: ``process_unusable``
    tells a command-line entry point to exit at once after printing the message
    (a normal interpreter exit would wait for the engine forever).
    """

    def __init__(self, message, process_unusable=True):
        super().__init__(message, exit_code=1)
        self.process_unusable = process_unusable


def split_batch(arrays, ctxs):
    """Split arrays along axis 0 over the first ``min(n, len(ctxs))`` devices.

    ``split_and_load(even_split=False)`` gives the first slices one extra sample for
    uneven batches (10 on 4 devices -> 3, 3, 2, 2). A batch smaller than the device
    count would produce empty slices, which MXNet rejects, so such a batch uses only
    as many devices as it has samples.

    Returns
    -------
    list of tuple
        One tuple of NDArrays per device used, in device order.
    """
    n = arrays[0].shape[0]
    used = ctxs[:max(1, min(n, len(ctxs)))]
    parts = [gluon.utils.split_and_load(a, used, batch_axis=0, even_split=False) for a in arrays]
    return list(zip(*parts))


def check_sync_bn_batch(batch_size, ndev):
    """Refuse, in one line, a ``--batch-size`` that ``--sync-bn`` cannot split into equal
    shares over ``ndev`` devices (see :meth:`DataParallelStep.usable`)."""
    if ndev > 1 and batch_size % ndev:
        lower, upper = batch_size - batch_size % ndev, batch_size - batch_size % ndev + ndev
        choices = ('%d or %d' % (lower, upper)) if lower else str(upper)
        raise UserError('--batch-size %d does not divide over the %d devices: --sync-bn needs an equal share on '
                        'each (SyncBatchNorm averages the devices\' statistics with equal weights); use '
                        '--batch-size %s, or train without --sync-bn' % (batch_size, ndev, choices))


class DataParallelStep:
    """Forward, backward and one optimizer update over all devices.

    Parameters
    ----------
    net : HybridBlock
        Initialized on ``ctxs``.
    loss_fn : HybridBlock
        ``loss_fn(logits, target[, weight]) -> (N,)`` per-sample losses.
    trainer : gluon.Trainer
        Over ``net``'s parameters; its kvstore aggregates gradients.
    ctxs : list of mx.Context
    clip_grad : float
        Clip the global norm of the (batch-mean) gradient to this value; 0 = off.
        Needs ``update_on_kvstore=False`` (the Trainer must give us the summed
        gradients before it updates).
    loss_scaling : bool
        float16 AMP: losses are scaled through ``mxnet.contrib.amp`` (the trainer was
        passed to ``amp.init_trainer``). Not for bfloat16, which has float32's exponent
        range: its gradients cannot underflow, and the scaler's overflow check would
        cost a host synchronization every step.
    sync_bn : bool
        Each device's forward runs in its own thread: SyncBatchNorm waits at a barrier
        for all devices, so no device may wait for another's Python code. Batches are
        cut to a multiple of the device count (:meth:`usable`).
    workers : int
        Processes whose equal-size batches a synchronous dist kvstore sums into one
        gradient (``dist_sync``: the number of workers; 1 otherwise, also for
        ``dist_async``, where each push is its own update). Gluon does not count them:
        ``step(n)`` alone would make the update ``workers`` times too large.

    Calling the step with ``(image, target[, weight])`` NDArrays on the CPU returns
    ``{'loss_sums': [NDArray per device], 'samples': int, 'dropped': int, 'per_device':
    [int]}`` (``samples`` trained on, ``dropped`` left out: see :meth:`usable`); the
    loss sums stay on their devices until someone reads them.
    """

    # How long the other devices may still be waiting once one has failed, in the first
    # step with SyncBatchNorm, before the job is declared stuck (see _watch_first_step).
    failure_grace_s = 20.0
    # ... and how long the first step may take with no device reporting anything (a device
    # that hangs instead of failing, or waits that MXNet cannot serve: its WaitForVar runs
    # on cpu(0)'s worker, which is itself a device when training on CPU contexts).
    first_step_timeout_s = 1800.0

    def __init__(self, net, loss_fn, trainer, ctxs, clip_grad=0.0, loss_scaling=False, sync_bn=False,
                 workers=1):
        self.net, self.loss_fn, self.trainer, self.ctxs = net, loss_fn, trainer, list(ctxs)
        self.clip_grad, self.loss_scaling, self.sync_bn = clip_grad, loss_scaling, sync_bn
        self.workers = max(1, int(workers))
        self._params = None
        self._watch = sync_bn  # the first step with SyncBatchNorm runs under a watchdog
        # SyncBatchNorm on CPU contexts: each step waits for the previous one (see __call__).
        self._serialize = sync_bn and len(self.ctxs) > 1 and any(c.device_type == 'cpu' for c in self.ctxs)
        self._first_update = True

    def usable(self, batch_samples):
        """How many samples of a batch of ``batch_samples`` the step trains on: all of
        them, except with SyncBatchNorm on several devices, where the largest multiple
        of the device count (0: the batch cannot run).

        SyncBatchNorm averages the devices' means and variances with equal weights
        (MXNet 1.9.1 ``src/operator/contrib/sync_batch_norm-inl.h``,
        ``SharedND::MeanReady``: the sum over devices / ``num_devices``), and its
        barrier needs every device. With equal slices that is BatchNorm over the whole
        batch; with 3, 3, 2 it is not, so the remainder is left out (``'dropped'`` in
        the step's result). ``fit`` refuses a ``--batch-size`` that does not divide, so
        only an epoch's last batch loses samples (other ones each epoch: it shuffles).
        """
        if not self.sync_bn or len(self.ctxs) == 1:
            return batch_samples
        return batch_samples - batch_samples % len(self.ctxs)

    def runnable(self, batch_samples):
        """Whether a batch of ``batch_samples`` can run at all (see :meth:`usable`)."""
        return self.usable(batch_samples) > 0

    def __call__(self, image, target, weight=None):
        arrays = [image, target] + ([] if weight is None else [weight])
        given = image.shape[0]
        n = self.usable(given)
        if n == 0:
            raise ValueError('a batch of %d sample(s) cannot run on %d devices with SyncBatchNorm (every device '
                             'needs an equal share); check runnable() first' % (given, len(self.ctxs)))
        if n < given:
            arrays = [a[:n] for a in arrays]
        if self._serialize:
            # SyncBatchNorm's operators wait at a barrier inside the engine, holding what
            # they hold, and on CPU contexts much is shared between the devices: one pool of
            # scratch buffers for all of them (MXNET_CPU_TEMP_COPY copies, src/resource.cc;
            # an operator holds its buffer from the moment the buffer is free, also while it
            # still waits for its inputs), and the worker of cpu(0), which runs every copy
            # out of the batch and every wait of the host (ThreadedEngine::WaitForVar pushes
            # onto Context::CPU()). With the next step queued behind the unfinished one, a
            # device could wait at the barrier for another that waits for it: fit(sync_bn=True,
            # cpus=3) with MXNET_CPU_TEMP_COPY=1 hung 6 runs of 6, and width 16 at 128 px with
            # the 96 buffers bin/train sets for 3 contexts 2 of 2; with this wait none of
            # many (tests/test_syncbn_amp.py), at the same speed (3 contexts: 6.01 against
            # 6.06 images/s). GPUs have a pool and workers each: no wait.
            mx.nd.waitall()
        # Samples behind the summed gradient: every worker's batch has the same size
        # (EpochSampler pads the shards to whole batches).
        total = n * self.workers
        parts = split_batch(arrays, self.ctxs)
        if self._watch and len(parts) > 1:
            self._watch = False
            losses = self._watch_first_step(parts)
        else:
            losses = self._forward_backward(parts)
        if len(parts) < len(self.ctxs):
            self._zero_unused_grads(len(parts))
        if self._first_update:
            # The Trainer's first call broadcasts every parameter from the first device,
            # BatchNorm's running statistics included. On CPU, MXNet's BatchNorm updates
            # those statistics in its *backward* pass, while the engine is told the pass
            # only reads them; the broadcast (also a read, then a write) could copy them
            # before that update and write the old values back. Measured on 2 CPU contexts
            # with static_alloc: the first step's update was lost. Waiting once orders them.
            mx.nd.waitall()
            self._first_update = False
        if self.clip_grad > 0:
            self.trainer.allreduce_grads()
            self._clip(total)
            self.trainer.update(total)
        else:
            # rescale_grad = 1 / n: gradients are summed over devices, so this is the
            # mean over every sample of the global batch, whatever the split.
            self.trainer.step(total)
        return {'loss_sums': [l.sum() for l in losses], 'samples': n, 'dropped': given - n,
                'per_device': [p[0].shape[0] for p in parts]}

    def _forward_backward(self, parts):
        if self.sync_bn and len(parts) > 1:
            return self._threaded_forward_backward(parts)
        with autograd.record():
            # Every device's forward is queued before any loss. MXNet gives all CPU contexts
            # one pool of scratch buffers (MXNET_CPU_TEMP_COPY of them; GPUs have one pool
            # each): a hybridized graph keeps the buffer it drew first, an imperative op draws
            # the next one round-robin at each call. An op of device 0 queued ahead of device
            # 1's forward that draws device 1's buffer makes that forward wait for it, and it
            # waits for device 0's forward, and the devices take turns now and then
            # (docs/explanation/multi-device.md, "Several CPU contexts"; the measurement:
            # experiments/performance/findings.md). (The loss is hybridized for the
            # backward: step.make_step.)
            logits = [self.net(x) for x, *_ in parts]
            losses = [self.loss_fn(out, *rest) for out, (_, *rest) in zip(logits, parts)]
            scaled = self._scaled(losses)
        autograd.backward(scaled)
        return losses

    def _threaded_forward_backward(self, parts, errors=None):
        """Each device's forward and backward in its own thread. Errors are raised here,
        or, when an ``errors`` dict is given, put there by device index."""
        losses, failed = [None] * len(parts), {}

        def run(i, x, *rest):
            try:
                with autograd.record():
                    losses[i] = self.loss_fn(self.net(x), *rest)
                    scaled = self._scaled([losses[i]])
                autograd.backward(scaled)
            except Exception as exc:  # surfaced in the main thread below
                failed[i] = exc

        # Daemon threads: a thread stuck in MXNet (a failed device's peers can block at
        # the barrier) must not keep the process alive at exit.
        threads = [threading.Thread(target=run, args=(i,) + tuple(p), daemon=True) for i, p in enumerate(parts)]
        for t in threads:
            t.start()
        failed_at = None
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=0.05)
            if errors is not None and failed:  # watched: stop waiting for stuck peers
                failed_at = failed_at or time.time()
                if time.time() - failed_at > self.failure_grace_s:
                    break
        if failed and errors is None:
            raise failed[min(failed)]
        if errors is not None:
            errors.update(failed)
        return losses

    def _watch_first_step(self, parts):
        """The first SyncBatchNorm step, watched: a device that fails (out of memory at
        its first allocation, a driver error) never reaches the barrier, and the others
        would wait there forever, with Ctrl-C unseen while the main thread blocks in
        MXNet. Each device's step is awaited in its own thread; when one has failed,
        :class:`DeviceFailure` names it and its error as soon as the others have
        finished or are still waiting ``failure_grace_s`` later. Either way the
        healthy devices' operators are left inside a barrier (of the forward or of the
        backward pass), so the process cannot go on."""
        errors = {}  # device index -> exception
        losses = self._threaded_forward_backward(parts, errors)
        outcome = [errors.get(i) if losses[i] is None else None for i in range(len(parts))]

        # The first layer's gradient is the last one backward computes: once it is ready
        # on a device, that device has passed every barrier of the step.
        first_grads = self._trainable()[0].list_grad()

        def wait(i):
            try:
                losses[i].wait_to_read()
                first_grads[i].wait_to_read()
                outcome[i] = 'ok'
            except Exception as exc:  # raised asynchronously by the failed device's ops
                outcome[i] = exc

        for i in range(len(parts)):
            if losses[i] is not None:
                threading.Thread(target=wait, args=(i,), daemon=True).start()
        started = time.time()
        failed_at = started if errors else None
        while True:
            failed = {i: o for i, o in enumerate(outcome) if isinstance(o, Exception)}
            failed.update(errors)
            pending = any(o is None for o in outcome)
            if failed and failed_at is None:
                failed_at = time.time()
            if not pending or (failed and time.time() - failed_at > self.failure_grace_s):
                break
            if time.time() - started > self.first_step_timeout_s:
                stuck = ', '.join(str(self.ctxs[i]) for i, o in enumerate(outcome) if o is None)
                raise DeviceFailure('the first training step did not finish in %d s on %s, and no device reported '
                                    'an error: a device that hangs keeps the others at SyncBatchNorm\'s barrier. '
                                    'Check the devices (gluon-unet doctor) or train without --sync-bn'
                                    % (self.first_step_timeout_s, stuck))
            time.sleep(0.05)  # the main thread stays free to take Ctrl-C
        if failed:
            i, exc = min(failed.items())
            where = str(self.ctxs[i])
            raise DeviceFailure('%s failed at the first training step (%s); the other devices wait for it at '
                                'SyncBatchNorm\'s barrier, so the job stops here. Check that device (free '
                                'memory, a smaller --batch-size) or train without --sync-bn'
                                % (where, mxnet_message(exc)))
        return losses

    def _zero_unused_grads(self, used):
        """Devices left out of a short batch still hold last step's gradients, and the
        kvstore would add them in: zero them, and mark them fresh so the Trainer keeps
        every replica's weights in step."""
        for p in self._trainable():
            for data, grad in zip(p.list_data()[used:], p.list_grad()[used:]):
                grad[:] = 0
                data._fresh_grad = True

    def _trainable(self):
        if self._params is None:
            self._params = [p for p in self.net.collect_params().values() if p.grad_req != 'null']
        return self._params

    def _scaled(self, losses):
        """AMP's loss scaling; must run inside ``autograd.record`` to be differentiated."""
        if not self.loss_scaling:
            return losses
        from mxnet.contrib import amp
        with amp.scale_loss(losses, self.trainer) as scaled:
            return scaled

    def _clip(self, n):
        """Scale gradients so that the norm of their batch mean is <= clip_grad.

        The factor is computed on the device as an NDArray (no ``asscalar``), so
        clipping adds no host synchronization to the step.
        """
        if self.loss_scaling:
            from mxnet.contrib import amp
            amp.unscale(self.trainer)
        params = self._trainable()
        grads0 = [p.list_grad()[0] for p in params]
        norm = mx.nd.sqrt(mx.nd.add_n(*[(g.astype('float32') ** 2).sum() for g in grads0])) / n
        scale = mx.nd.minimum(1.0, self.clip_grad / (norm + 1e-12))
        # One copy of the factor per device, not per parameter and device (on 8 GPUs
        # that was ~400 tiny copies a step).
        on_device = {ctx: scale.as_in_context(ctx) for ctx in self.ctxs}
        for p in params:
            for g in p.list_grad():
                g *= on_device[g.context]


class MirroredStep(DataParallelStep):
    """:class:`DataParallelStep` with less memory: forward and backward run through a
    bound symbol of ``net`` + ``loss_fn`` (MXNet's symbolic executor) that recomputes
    parts of the forward pass during backward instead of keeping them
    (:func:`gluon_unet.model.recompute`), ``--memory balanced`` and ``low``.

    Gluon's hybridized CachedOp cannot do this in MXNet 1.9 (it never mirrors), and its
    static allocation plans forward and backward buffers apart; one executor plans both
    together. Same math as the parent: per-sample losses, their gradients summed on
    each device (the executor writes straight into the parameters' gradient arrays,
    bound together with their weights and BatchNorm statistics, so the Trainer, the
    kvstore and checkpoints see the same arrays as ever).

    Parameters
    ----------
    recompute : {'activations', 'blocks'}
        See :func:`gluon_unet.model.recompute`.

    Not for float16 loss scaling or SyncBatchNorm (``TrainConfig.validate`` refuses
    them): both work through ``autograd``.
    """

    def __init__(self, net, loss_fn, trainer, ctxs, recompute='blocks', **kwargs):
        super().__init__(net, loss_fn, trainer, ctxs, **kwargs)
        self.recompute = recompute
        self._symbol = None
        self._execs = {}  # (device index, input shapes) -> (executor, the arrays it binds)

    def _graph(self, with_weight):
        from ..model import recompute
        inputs = [mx.sym.var('data'), mx.sym.var('target')] + ([mx.sym.var('weight')] if with_weight else [])
        with recompute(self.net, self.recompute):
            losses = self.loss_fn(self.net(inputs[0]), *inputs[1:])
        # MakeLoss: backward starts from a gradient of ones, as autograd.backward(losses).
        return mx.sym.make_loss(losses)

    def _executor(self, i, arrays):
        key = (i, tuple(a.shape for a in arrays))
        bound = self._execs.get(key)
        ctx = self.ctxs[i]
        params = self.net.collect_params()
        if bound is not None and all(params[n].data(ctx) is a for n, a in bound[1].items()):
            return bound[0]
        sym = self._graph(len(arrays) == 3)
        names = ['data', 'target', 'weight'][:len(arrays)]
        by_name = {p.name: p for p in params.values()}
        args, grads, reqs, aux, weights = {}, {}, {}, {}, {}
        for name in sym.list_arguments():
            if name in names:
                a = arrays[names.index(name)]
                args[name], reqs[name] = mx.nd.zeros(a.shape, ctx=ctx, dtype=a.dtype), 'null'
                continue
            p = by_name[name]
            args[name] = weights[name] = p.data(ctx)
            reqs[name] = 'null' if p.grad_req == 'null' else 'write'
            if reqs[name] == 'write':
                grads[name] = p.grad(ctx)
        for name in sym.list_auxiliary_states():
            aux[name] = weights[name] = by_name[name].data(ctx)
        # Executors of the same device share one memory pool (a short last batch binds
        # a second one).
        shared = next((e for (j, _), (e, _) in self._execs.items() if j == i), None)
        ex = sym.bind(ctx, args=args, args_grad=grads, grad_req=reqs, aux_states=aux, shared_exec=shared)
        self._execs[key] = (ex, weights)
        return ex

    def _forward_backward(self, parts):
        losses = []
        for i, arrays in enumerate(parts):
            ex = self._executor(i, arrays)
            for name, a in zip(('data', 'target', 'weight'), arrays):
                a.copyto(ex.arg_dict[name])
            ex.forward(is_train=True)
            ex.backward()
            losses.append(ex.outputs[0])
        # The Trainer updates only parameters whose gradient autograd marked fresh; the
        # executor wrote every gradient of the devices that ran.
        for p in self._trainable():
            for data in p.list_data()[:len(parts)]:
                data._fresh_grad = True
        return losses
