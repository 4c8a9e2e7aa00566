"""The napari plugin: a dock widget that segments an image layer with a gluon_unet export.

napari finds it through the ``napari.manifest`` entry point (``pyproject.toml``), which
names this package's ``napari.yaml``; the widget is :class:`gluon_unet.napari.widget.SegmentWidget`.
It runs where napari runs (Python 3.12, numpy 2) on the export's ``model.onnx`` through
onnxruntime, without MXNet: ``pip install ".[napari]"`` (docs/how-to/napari-bioimageio.md).
:mod:`~gluon_unet.napari.segmenter` is its work without Qt, :mod:`~gluon_unet.napari.widget`
the widget. Importing this package imports neither napari nor Qt.
"""
