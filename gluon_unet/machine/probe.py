"""Asking MXNet's C++ side a question (does this kernel run here?) without its noise.

The GPU and the CPU probes (:mod:`gluon_unet.machine.gpus`, :mod:`gluon_unet.machine.cpu`)
run a tiny operator and read the answer; where it fails, MXNet also logs the failure on
its native stderr and keeps the error in its engine until the next ``waitall``. The
caller reports the failure in one line: these keep MXNet from saying it twice.
"""
import contextlib
import os
import sys


def run_probe(probe, *args):
    """``probe(*args)``'s result, run with MXNet's native stderr silenced (the C++ side
    logs a failure there too; the caller's one line says it) and the engine's errors of
    failed operators cleared afterwards, whatever happened (:func:`clear_engine_errors`)."""
    with native_stderr_silenced():
        try:
            return probe(*args)
        finally:
            clear_engine_errors()


def clear_engine_errors():
    """Take the errors of failed operators out of MXNet's engine.

    Reading one failed array rethrows its error, but the engine keeps every failed
    operator's error until the next ``waitall`` (``ThreadedEngine::WaitForAll``,
    ``global_exception_refs_``), and the one at exit (``MXNotifyShutdown``) would print
    it as "Exception ignored in atexit callback: _notify_shutdown ...": a second
    message after the probe's one line (seen under doctor on Zen 3, from the bfloat16
    probe's "could not create a primitive descriptor iterator"). Their message is the one already caught."""
    import mxnet as mx
    try:
        mx.nd.waitall()
    except mx.base.MXNetError:
        pass


@contextlib.contextmanager
def native_stderr_silenced():
    """Send file descriptor 2 to /dev/null for a moment. Where the probe fails, MXNet's C++
    side also logs the failure there ('[05:33:00] ../src/operator/nn/mkldnn/
    mkldnn_convolution.cc:139: could not create a primitive descriptor iterator'); that
    failure is the probe's answer, reported in one line by the caller, not news for the user."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, 'w') as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
