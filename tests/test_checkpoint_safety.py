"""Checkpoints load without unpickling, and resume still matches an unbroken run."""
import pickle

import mxnet as mx
import numpy as np
import pytest

from gluon_unet.checkpoint import FORMAT, list_checkpoints, load_checkpoint
from gluon_unet.training.loop import fit
from gluon_unet.errors import UserError


def _params(path):
    arrays = mx.nd.load(path)
    return {k: v.asnumpy() for k, v in arrays.items() if k.startswith('param:')}


@pytest.mark.parametrize('optimizer, nesterov, schedule, cpus, update_on_kvstore', [
    ('sgd', False, 'step', 2, None),      # momentum state; a scheduler that counts in place
    ('sgd', True, 'cosine', 2, None),     # nag
    ('adam', False, 'cosine', 1, None),   # one device: no kvstore at all
    ('adamw', False, 'poly', 2, None),
    ('adam', False, 'constant', 2, True),  # the kvstore's updater holds the state
])
def test_resume_matches_an_unbroken_run_for_every_optimizer(tiny, tmp_path, optimizer, nesterov,
                                                             schedule, cpus, update_on_kvstore):
    common = dict(epochs=3, cpus=cpus, optimizer=optimizer, nesterov=nesterov, lr_schedule=schedule,
                  lr_steps='0.3,0.6', warmup_epochs=1 if schedule != 'constant' else 0,
                  update_on_kvstore=update_on_kvstore, weight_decay=1e-3, batch_norm=True,
                  synthetic_count=20, batch_size=6, lr=0.05 if optimizer == 'sgd' else 3e-3)
    fit(tiny(output=str(tmp_path / 'a'), **common), verbose=False)
    fit(tiny(output=str(tmp_path / 'b'), **common), verbose=False, callbacks=[lambda r: r['epoch'] == 1])
    history = fit(tiny(output=str(tmp_path / 'b'), resume='auto', **common), verbose=False)
    assert [r['epoch'] for r in history] == [1, 2, 3]
    a = _params(str(tmp_path / 'a' / 'checkpoints' / 'epoch0003.ckpt'))
    b = _params(str(tmp_path / 'b' / 'checkpoints' / 'epoch0003.ckpt'))
    diff = max(np.abs(a[k] - b[k]).max() for k in a if 'running' not in k)
    assert diff <= 1e-5, diff
    unbroken = load_checkpoint(str(tmp_path / 'a' / 'checkpoints' / 'epoch0003.ckpt'))
    assert [r['lr'] for r in history] == pytest.approx([r['lr'] for r in unbroken['history']])
    assert unbroken['format'] == FORMAT and 'trainer_states' not in mx.nd.load(
        str(tmp_path / 'a' / 'checkpoints' / 'epoch0003.ckpt'))


class _Payload:
    """Unpickling this creates a file: proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, 'w'))


def test_a_pickled_optimizer_state_is_refused_without_running_it(tiny, tmp_path):
    cfg = tiny(epochs=1, output=str(tmp_path / 'run'))
    fit(cfg, verbose=False)
    path = list_checkpoints(str(tmp_path / 'run' / 'checkpoints'))[-1]
    marker = tmp_path / 'code-ran'
    arrays = mx.nd.load(path)
    del arrays['digest']  # format 1 (gluon_unet < 0.2) predates digests
    blob = pickle.dumps(_Payload(str(marker)))
    arrays['trainer_states'] = mx.nd.array(np.frombuffer(blob, np.uint8), dtype=np.uint8)
    mx.nd.save(path, arrays)
    with pytest.raises(UserError, match='pickle.*refusing to resume'):
        fit(tiny(epochs=2, output=str(tmp_path / 'run'), resume='auto'), verbose=False)
    assert not marker.exists()
    # The weights stay usable for export (they are plain arrays).
    assert load_checkpoint(path)['epoch'] == 1


def test_resume_refuses_another_optimizer(tiny, tmp_path):
    fit(tiny(epochs=1, optimizer='adam', output=str(tmp_path / 'run')), verbose=False)
    with pytest.raises(UserError, match='--optimizer'):
        fit(tiny(epochs=2, optimizer='sgd', output=str(tmp_path / 'run'), resume='auto'), verbose=False)
