"""Inference: exports, prediction and the post-processing that turns maps into nuclei.

An export and its variants (``export``, ``export_onnx``, ``export_int8``, the ``sidecar``
``model.json``, the ``postprocess_search`` that tunes it); the network applied in batches
over the devices (``batched``, or onnxruntime: ``batched_onnx``), tiled (``tiling``) and
rescaled (``scale``); ``postprocess`` (maps to instance labels); ``predict`` (files in,
``predict_outputs`` out, ``submission``, ``overlay``); ``evaluate`` (scores against truth).

It never imports :mod:`gluon_unet.training`; everything ``bin/predict`` reaches on an
ONNX export imports without mxnet (``tests/test_architecture.py``).
"""
from .. import _lazy

_EXPORTS = {'load_exported': 'batched', 'load_model': 'batched', 'predict_image': 'batched',
            'PredictConfig': 'configs', 'predict_paths': 'predict', 'export_block': 'export',
            'ExportConfig': 'configs', 'run_export': 'export_run', 'instances_from_prob': 'postprocess',
            'instances_from_maps': 'postprocess', 'tune_on_maps': 'postprocess_search'}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
