"""The machine: what its hardware can do and the process-wide settings that use it.

GPUs and the CUDA driver (``gpus``), the CPU's features - bfloat16, AMX, int8 - (``cpu``),
``--gpus`` / ``--cpus`` as MXNet contexts (``devices``), threads, scratch buffers and
visible GPUs (``runtime``, applied by the command line before mxnet loads), and the
input shapes MXNet 1.9.1's CPU build cannot run (``limits``).

The bottom layer: it imports only :mod:`gluon_unet.errors`, :mod:`gluon_unet.utils` and
the logger, never the model, data, training or inference (``tests/test_architecture.py``).
"""
