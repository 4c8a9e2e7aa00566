"""The Python API for experiments: callbacks see the network and the run state."""
import numpy as np

from gluon_unet.engine import EpochContext, fit


class Recorder:
    """A callback object: keeps a weight norm per epoch and stops after epoch 2."""

    def __init__(self):
        self.seen = []

    def on_epoch_end(self, record, context):
        assert isinstance(context, EpochContext)
        w = context.net.collect_params()
        first = next(iter(w.values())).data(context.ctxs[0]).asnumpy()
        self.seen.append((record['epoch'], context.state.epoch, context.state.step,
                          float(np.abs(first).sum()), context.trainer.learning_rate, context.output))
        return record['epoch'] == 2


def test_callback_objects_get_the_network_and_the_run_state(tiny):
    rec, plain = Recorder(), []
    history = fit(tiny(epochs=4, synthetic_count=16, batch_size=4, val_split=0.25), verbose=False,
                  callbacks=[rec, plain.append])
    assert [r['epoch'] for r in history] == [1, 2]  # the object asked to stop after epoch 2
    assert [e for e, *_ in rec.seen] == [1, 2] and [s for _, s, *_ in rec.seen] == [1, 2]
    assert [st for _, _, st, *_ in rec.seen] == [3, 6]  # optimizer steps so far: 12 images, batch 4
    assert rec.seen[0][3] != rec.seen[1][3]  # the weights it read are the live, training ones
    assert rec.seen[0][5] == history.output
    assert [r['epoch'] for r in plain] == [1, 2]  # plain functions still get the record
