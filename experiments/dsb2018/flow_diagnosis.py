"""Where a flow model's instances lose: its flows, its foreground, or the gathering.
Every EVERY-th (default 5th) held-out image of a fold at native scale, the export's maps (--mode tile): DSB
score of the flow gathering on (predicted fg, predicted flows), (true fg, predicted flows),
(predicted fg, true flows); the distance watershed on the predicted fg; the flows' median
angular error inside the true nuclei, and the predicted directions' median length there."""
import glob, os, sys
import numpy as np
import mxnet as mx
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))
from gluon_unet.inference.batched import load_model, predict_image
from gluon_unet.data.io import input_image, merge_object_masks, read_image
from gluon_unet.data.targets import flow_map
from gluon_unet.inference.postprocess import instances_from_maps
from gluon_unet.metrics import dsb_image_score

model = load_model(sys.argv[1], [mx.cpu()])
tuned = dict(threshold=model.threshold, min_size=model.min_size, min_score=model.min_score)
print('export settings', tuned, model.markers, model.marker, model.h)
held = sys.argv[2]
ids = sorted(os.listdir(held))[::int(os.environ.get('EVERY', 5))]
rows = []
for i in ids:
    img = read_image(glob.glob(os.path.join(held, i, 'images', '*.png'))[0])
    x = input_image(img, model.channels, model.normalize, model.denoise)
    maps = predict_image(model.net, model.meta, x, [mx.cpu()], mode='tile', maps=True)
    labels = merge_object_masks(sorted(glob.glob(os.path.join(held, i, 'masks', '*.png'))), maps.shape[1:])
    true_fg = (labels > 0).astype(np.float32)
    tf = flow_map(labels)
    s = lambda m, **kw: dsb_image_score(instances_from_maps(m, **kw), labels)
    r = dict(pred=s(maps, markers='flow', **tuned),
             true_fg=s(np.concatenate([true_fg[None], maps[1:]]), markers='flow'),
             true_flow=s(np.concatenate([maps[:1], tf]), markers='flow', **tuned),
             distance=s(maps, markers='distance', h=model.h or 0.5, **tuned))
    inside = labels > 0
    py, px, ty, tx = (2 * maps[1] - 1)[inside], (2 * maps[2] - 1)[inside], (2 * tf[0] - 1)[inside], (2 * tf[1] - 1)[inside]
    ang = np.degrees(np.abs(np.angle(np.exp(1j * (np.arctan2(py, px) - np.arctan2(ty, tx))))))
    r.update(angle=float(np.median(ang)), length=float(np.median(np.hypot(py, px))))
    rows.append(r)
for k in rows[0]:
    print(k, round(float(np.mean([r[k] for r in rows])), 3))
print(len(rows), 'images')
