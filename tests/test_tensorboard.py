"""--tensorboard writes loss/lr per step, metrics per epoch and overlays, read back here."""
import builtins
import glob
import os
import struct
import subprocess
import sys

import pytest

from gluon_unet.training.loop import fit
from gluon_unet.errors import UserError
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _events(folder):
    """Every summary value in the event files of ``folder``: {tag: [(step, kind)]}."""
    from tensorboardX.proto import event_pb2
    found = {}
    for path in glob.glob(os.path.join(folder, 'events.out.tfevents.*')):
        data = open(path, 'rb').read()
        pos = 0
        while pos < len(data):  # TFRecord: length, crc, payload, crc
            (length,) = struct.unpack('<Q', data[pos:pos + 8])
            payload = data[pos + 12:pos + 12 + length]
            pos += 12 + length + 4
            event = event_pb2.Event.FromString(payload)
            for value in event.summary.value:
                kind = 'image' if value.HasField('image') else 'scalar'
                found.setdefault(value.tag, []).append((event.step, kind, value.simple_value))
    return found


def test_tensorboard_logs_steps_epochs_and_overlays(tiny):
    cfg = tiny(epochs=2, tensorboard=True, synthetic_count=24, batch_size=8, val_split=0.25,
               lr_schedule='cosine')
    history = fit(cfg, verbose=False)
    events = _events(os.path.join(cfg.output, 'tb'))
    steps = 2 * 3  # 18 training images, batch 8: 3 steps per epoch
    assert [s for s, _, _ in events['train/loss']] == list(range(1, steps + 1))
    assert [s for s, _, _ in events['train/lr']] == list(range(1, steps + 1))
    assert [round(v, 5) for _, _, v in events['val/iou']] == [round(r['val_iou'], 5) for r in history]
    assert [s for s, _, _ in events['epoch/images_per_s']] == [1, 2]
    overlays = [tag for tag in events if tag.startswith('val/overlay_')]
    assert len(overlays) == 4 and all(kind == 'image' for _, kind, _ in events[overlays[0]])


def test_tensorboard_without_tensorboardx_is_one_line_before_any_work(tiny, monkeypatch):
    real_import = builtins.__import__

    def no_tensorboardx(name, *args, **kw):
        if name.startswith('tensorboardX'):
            raise ImportError('No module named tensorboardX')
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, '__import__', no_tensorboardx)
    cfg = tiny(epochs=1, tensorboard=True)
    with pytest.raises(UserError, match='pip install tensorboardX') as err:
        fit(cfg, verbose=False)
    assert '\n' not in str(err.value) and not os.path.exists(cfg.output)


def test_tensorboard_logs_without_loading_an_installed_pytorch(tmp_path):
    # tensorboardX imports torch when it can; torch loaded beside mxnet aborted the process
    # (two OpenMP runtimes). With a stand-in torch first on the path, the log must be
    # written without loading it, and the user's own `import torch` must work afterwards.
    fake = tmp_path / 'site' / 'torch'
    fake.mkdir(parents=True)
    (fake / '__init__.py').write_text('Tensor = type("Tensor", (), {})\n')
    script = '''if True:
        import sys
        sys.path.insert(0, %r)
        for name in [m for m in sys.modules if m.startswith(('tensorboardX', 'torch'))]:
            del sys.modules[name]
        import mxnet  # the order of a training run: mxnet first
        import numpy as np
        from gluon_unet.training.tblog import TensorBoardLog, require_tensorboardx
        require_tensorboardx()
        log = TensorBoardLog(%r)
        log.step(1, loss=0.5, lr=0.1)
        log.epoch({'epoch': 1, 'val_iou': 0.7}, 1, [(np.zeros((1, 8, 8)), np.zeros((8, 8)), np.zeros((8, 8)))])
        log.close()
        assert 'torch' not in sys.modules, 'torch was loaded'
        import torch  # the guard is gone: a user's own import still works
        print('ok', torch.__file__)
    ''' % (str(tmp_path / 'site'), str(tmp_path / 'tb'))
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=HANG_SECONDS)
    assert out.returncode == 0, out.stderr[-2000:]
    assert str(fake) in out.stdout
    assert os.listdir(tmp_path / 'tb'), 'no event file written'
