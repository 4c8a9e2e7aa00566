"""An exponential moving average of the weights (``--ema``), the model that is validated,
checkpointed as best and exported.

Short runs on small data make the last weights noisy: the validation score of one epoch
can drop by 0.1 IoU and come back the next. Averaging the weights over the last few
hundred steps (Polyak averaging, timm's ``ModelEma``, Keras' ``use_ema``) gives a model
that sits between those swings. Training itself is untouched: the optimizer keeps
stepping the raw weights; the average is a shadow copy on the first device.
"""
import contextlib

from .errors import UserError


class WeightAverage:
    """``avg = d * avg + (1 - d) * w`` after every optimizer step, with
    ``d = min(decay, (1 + t) / (10 + t))`` at step ``t``: early on the average follows
    the weights closely (a fixed 0.99 would drag the random initialization along for
    hundreds of steps), later it averages the last ``~1 / (1 - decay)`` steps.

    Parameters
    ----------
    net : Block
        Initialized on ``ctxs``.
    ctxs : list of Context
        The training devices; the average lives on ``ctxs[0]``.
    decay : float
        In (0, 1).

    Every parameter is averaged, BatchNorm's running statistics too (averaged over the
    devices first: without SyncBatchNorm each device keeps its own).
    """

    def __init__(self, net, ctxs, decay):
        self.decay, self.ctx = float(decay), ctxs[0]
        self._params = net._collect_params_with_prefix()
        self.arrays = {name: self._current(p).copy() for name, p in self._params.items()}

    def _current(self, p):
        """The parameter's value as one float32 array on ``self.ctx``."""
        data = p.list_data()
        if p.grad_req != 'null' or len(data) == 1:  # trained weights are equal on every device
            return data[0].astype('float32', copy=False)
        return sum(d.as_in_context(self.ctx).astype('float32', copy=False) for d in data) / len(data)

    def update(self, step):
        """Fold the weights after optimizer step ``step`` (1, 2, ...) into the average.
        Asynchronous like any MXNet operation: it queues behind the step's update."""
        d = min(self.decay, (1.0 + step) / (10.0 + step))
        for name, p in self._params.items():
            avg = self.arrays[name]
            avg[:] = d * avg + (1.0 - d) * self._current(p)

    @contextlib.contextmanager
    def applied(self):
        """Within the block the network holds the average (on every device); the
        training weights are put back after it, bit for bit."""
        saved = {name: [a.copy() for a in p.list_data()] for name, p in self._params.items()}
        try:
            self._write(self.arrays)
            yield
        finally:
            for name, p in self._params.items():
                for dst, src in zip(p.list_data(), saved[name]):
                    dst[:] = src

    def _write(self, arrays):
        # Into the arrays, not Parameter.set_data: with update_on_kvstore, set_data resets
        # the Trainer's kvstore, and the optimizer state the kvstore holds (Adam's moments)
        # would start again from zero at the next step.
        for name, p in self._params.items():
            for dst in p.list_data():
                dst[:] = arrays[name].astype(dst.dtype, copy=False).as_in_context(dst.context)

    def load(self, arrays, path='checkpoint'):
        """Take the average back from a checkpoint's arrays (name -> NDArray)."""
        missing = sorted(set(self.arrays) - set(arrays))
        if missing:
            raise UserError('%s has no averaged value for %s' % (path, ', '.join(missing[:3])))
        for name, avg in self.arrays.items():
            avg[:] = arrays[name].astype('float32', copy=False).as_in_context(self.ctx)


def applied(average):
    """``average.applied()``, or a block that changes nothing when ``average`` is None."""
    return average.applied() if average is not None else contextlib.nullcontext()


def make_average(net, ctxs, decay):
    """A :class:`WeightAverage` for ``--ema DECAY``; None when ``decay`` is 0."""
    return WeightAverage(net, ctxs, decay) if decay else None

