"""An exponential moving average of the weights (``--ema``), the model that is validated,
checkpointed as best and exported.

Short runs on small data make the last weights noisy: the validation score of one epoch
can drop by 0.1 IoU and come back the next. Averaging the weights over the last few
hundred steps (Polyak averaging, timm's ``ModelEma``, Keras' ``use_ema``) gives a model
that sits between those swings. Training itself is untouched: the optimizer keeps
stepping the raw weights; the average is a shadow copy (on the first device, and each
device's own running statistics on it).
"""
import contextlib

from ..errors import UserError


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

    Every parameter is averaged, BatchNorm's running statistics too, as their mean over
    the devices (without SyncBatchNorm each device keeps its own). The mean is taken when
    the average is read (:attr:`arrays`), not at every step: each device averages its own
    statistics in place, and since both averages are linear, the mean of the devices'
    averages is the average of their means. Averaging across devices every step cost
    (devices - 1) copies per statistic and step, all into the first device: 252 small
    copies a step for the default depth-4 U-Net (36 statistics) on 8 GPUs.
    """

    def __init__(self, net, ctxs, decay):
        self.decay, self.ctx = float(decay), ctxs[0]
        self._params = net._collect_params_with_prefix()
        # name -> shadow arrays: one on ctxs[0] for trained weights (equal on every
        # device), one per device, on that device, for the others (running statistics).
        self._shadow = {name: [d.astype('float32', copy=True) for d in self._sources(p)]
                        for name, p in self._params.items()}

    @staticmethod
    def _sources(p):
        """The arrays a parameter's average follows: its first device's for a trained
        weight, every device's for one that each device keeps apart."""
        data = p.list_data()
        return data[:1] if p.grad_req != 'null' else data

    @property
    def arrays(self):
        """The average, by parameter name: float32 arrays on the first device (the
        per-device averages of the running statistics are averaged here)."""
        out = {}
        for name, shadows in self._shadow.items():
            if len(shadows) == 1:
                out[name] = shadows[0]
            else:
                out[name] = sum(s.as_in_context(self.ctx) for s in shadows) / len(shadows)
        return out

    def update(self, step):
        """Fold the weights after optimizer step ``step`` (1, 2, ...) into the average.
        Asynchronous like any MXNet operation: it queues behind the step's update; every
        array stays on its own device."""
        d = min(self.decay, (1.0 + step) / (10.0 + step))
        for name, p in self._params.items():
            for avg, src in zip(self._shadow[name], self._sources(p)):
                # In place (avg[:] = ... would add a copy per array), same arithmetic.
                avg *= d
                avg += (1.0 - d) * src.astype('float32', copy=False)

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
        """Take the average back from a checkpoint's arrays (name -> NDArray); every
        device's share of a running statistic starts from the saved mean."""
        missing = sorted(set(self._shadow) - set(arrays))
        if missing:
            raise UserError('%s has no averaged value for %s' % (path, ', '.join(missing[:3])))
        for name, shadows in self._shadow.items():
            for avg in shadows:
                avg[:] = arrays[name].astype('float32', copy=False).as_in_context(avg.context)


def applied(average):
    """``average.applied()``, or a block that changes nothing when ``average`` is None."""
    return average.applied() if average is not None else contextlib.nullcontext()


def make_average(net, ctxs, decay):
    """A :class:`WeightAverage` for ``--ema DECAY``; None when ``decay`` is 0."""
    return WeightAverage(net, ctxs, decay) if decay else None

