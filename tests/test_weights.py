"""The U-Net paper's weight map."""
import numpy as np
import pytest
from scipy import ndimage as ndi

from gluon_unet.data.synthetic import synthetic_nuclei
from gluon_unet.data.weights import MAX_CLASS_WEIGHT, class_weights, unet_weight_map


def two_close_squares():
    labels = np.zeros((64, 64), np.int32)
    labels[20:30, 10:20] = 1
    labels[20:30, 23:33] = 2             # a 3-pixel gap: columns 20, 21, 22
    return labels


def reference(labels, w0=10.0, sigma=5.0):
    """The formula straight: one full distance transform per nucleus."""
    ids = [k for k in np.unique(labels) if k > 0]
    d = np.sort(np.stack([ndi.distance_transform_edt(labels != k) for k in ids]), axis=0)
    out = class_weights(labels > 0).astype(np.float64)
    bg = labels == 0
    out[bg] += w0 * np.exp(-(d[0] + d[1])[bg] ** 2 / (2 * sigma ** 2))
    return out


def test_shape_dtype_finite():
    w = unet_weight_map(two_close_squares())
    assert w.shape == (64, 64) and w.dtype == np.float32
    assert np.isfinite(w).all()


def test_high_between_close_nuclei_and_class_weight_far_away():
    labels = two_close_squares()
    n, n_fg = labels.size, (labels > 0).sum()
    w_bg, w_fg = n / (2 * (n - n_fg)), min(n / (2 * n_fg), MAX_CLASS_WEIGHT)
    w = unet_weight_map(labels, w0=10.0, sigma=5.0)
    # middle of the gap: d1 = 2, d2 = 2 -> w0 * exp(-16 / 50)
    assert w[25, 21] == pytest.approx(w_bg + 10 * np.exp(-16 / 50), rel=1e-5)
    assert w[25, 21] > 7
    assert w[60, 60] == pytest.approx(w_bg, rel=1e-5)   # far from both
    assert w[25, 15] == pytest.approx(w_fg, rel=1e-5)   # inside a nucleus: class weight only
    assert w[25, 21] > w[17, 21] > w[12, 21] > w[60, 60]  # decays away from the gap


def test_without_class_balance_base_is_one():
    w = unet_weight_map(two_close_squares(), class_balance=False)
    assert w[60, 60] == pytest.approx(1.0)
    assert w[25, 15] == pytest.approx(1.0)
    assert w.min() == pytest.approx(1.0)


def test_single_or_no_nucleus_has_no_border_term():
    labels = np.zeros((32, 32), np.int32)
    assert np.array_equal(unet_weight_map(labels), np.ones((32, 32), np.float32))
    labels[10:20, 10:20] = 4
    w = unet_weight_map(labels, class_balance=False)
    assert np.allclose(w, 1.0)           # one nucleus: no second-nearest


def test_matches_full_formula_on_generated_nuclei():
    _, _, inst = synthetic_nuclei(3, size=128, seed=5, max_nuclei=30)
    for labels in inst:
        if len(np.unique(labels)) < 3:
            continue
        # truncation at 4 sigma drops at most w0 * exp(-8) ~ 0.0034
        assert np.abs(unet_weight_map(labels) - reference(labels)).max() < 0.004


def test_loader_sized_images_give_sane_maps():
    # A loader worker's input: 256 px, up to 60 nuclei. (Its speed, ~10 ms per image, is
    # measured by benchmarks/bench_metrics.py: a time limit here failed on a loaded machine.)
    _, _, inst = synthetic_nuclei(4, size=256, seed=3, max_nuclei=60)
    for labels in inst:
        w = unet_weight_map(labels)
        assert w.shape == labels.shape and w.dtype == np.float32 and np.isfinite(w).all() and w.min() > 0
    assert len(np.unique(inst[0])) > 10
    assert np.abs(unet_weight_map(inst[0]) - reference(inst[0])).max() < 0.004


def test_class_weights_balance_and_cap():
    fg = np.zeros((4, 4), bool)
    fg[0] = True                         # 4 of 16 pixels
    w = class_weights(fg)
    assert w[0, 0] == pytest.approx(2.0) and w[3, 3] == pytest.approx(2 / 3)
    assert w.mean() == pytest.approx(1.0)
    tiny = np.zeros((100, 100), bool)
    tiny[0, 0] = True
    assert class_weights(tiny)[0, 0] == MAX_CLASS_WEIGHT
