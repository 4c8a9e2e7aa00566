"""Retake ``napari-widget.png``: the widget docked from the plugin's manifest, on the shipped
``nuclei`` model, after segmenting one image - what a user sees, taken in the napari
environment (``pip install ".[napari]"``, PyQt6) on a virtual display::

    XDG_CONFIG_HOME=$(mktemp -d) xvfb-run -a -s '-screen 0 1400x820x24' \\
        ~/venvs/gluon-unet-napari/bin/python docs/how-to/img/napari_screenshot.py IMAGE \\
        docs/how-to/img/napari-widget.png

(an empty ``XDG_CONFIG_HOME``: the widget's remembered MXNet Python is not in the picture).
Take it on a quiet CPU: the status line shows the time the segmentation took.

The docs' image is ``stage1_train/a65bbfc5...`` of the 2018 Data Science Bowl (CC0), one
of the random hold-out's images, which ``nuclei`` never trained on.
"""
import sys
import time

import napari
from qtpy.QtWidgets import QApplication


def _wait(panel, timeout=300):
    """Run Qt's event loop until the widget's worker (load or segment) has finished."""
    end = time.time() + timeout
    while panel.worker is not None:
        if time.time() > end:
            raise SystemExit('error: the widget did not finish in %d s' % timeout)
        QApplication.processEvents()
        time.sleep(0.05)


def main(image, out):
    viewer = napari.Viewer()
    viewer.window._qt_window.resize(1400, 820)
    layer = viewer.open(image)[0]
    _, dock = viewer.window.add_plugin_dock_widget('gluon_unet', 'Segment nuclei')
    panel = dock.native._gluon_unet_panel
    _wait(panel)  # it opens on the shipped model
    panel.layer.value = layer
    panel.probability.value = True
    panel.run()
    _wait(panel)
    # the widget's own view: outlines, the probability hidden under them
    viewer.layers.selection.active = viewer.layers['%s nuclei' % layer.name]
    viewer.reset_view()
    for _ in range(20):  # let the canvas draw the new layers before the grab
        QApplication.processEvents()
        time.sleep(0.05)
    viewer.screenshot(out, canvas_only=False)
    print('wrote %s: %s' % (out, panel.status.value))
    viewer.close()


if __name__ == '__main__':
    if len(sys.argv) != 3:
        raise SystemExit('usage: napari_screenshot.py IMAGE OUT.png')
    main(sys.argv[1], sys.argv[2])
