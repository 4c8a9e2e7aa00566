"""The module paths of gluon_unet 0.2, kept for one release (removed in 0.4.0).

gluon_unet 0.3.0 put its modules in folders by layer (``training/``, ``inference/``,
``machine/``). ``import gluon_unet.engine`` still works and gives the module that is now
``gluon_unet.training.loop`` (the same object, so patching it patches the new one), with a
DeprecationWarning: the package adds this folder to its ``__path__``, and each file here
replaces itself by its new module. ``gluon_unet.inference`` was a module and is now the
package: its old public names are the package's (see ``gluon_unet/inference/__init__.py``).
"""
import importlib
import sys
import warnings

#: Old module -> new module.
MOVED = {
    'averaging': 'gluon_unet.training.ema',
    'benchmark': 'gluon_unet.training.benchmark',
    'budget': 'gluon_unet.training.budget',
    'devices': 'gluon_unet.machine.devices',
    'distributed': 'gluon_unet.training.distributed',
    'doctor': 'gluon_unet.cli.doctor',
    'engine': 'gluon_unet.training.loop',
    'evaluate': 'gluon_unet.inference.evaluate',
    'export': 'gluon_unet.inference.export',
    'launch': 'gluon_unet.training.launcher',
    'limits': 'gluon_unet.machine.limits',
    'losses': 'gluon_unet.training.losses',
    'onnx_export': 'gluon_unet.inference.export_onnx',
    'onnx_numpy': 'gluon_unet.inference.onnx_numpy',
    'onnx_runner': 'gluon_unet.inference.batched_onnx',
    'optim': 'gluon_unet.training.optim',
    'overlay': 'gluon_unet.inference.overlay',
    'parallel': 'gluon_unet.training.parallel',
    'postprocess': 'gluon_unet.inference.postprocess',
    'predict': 'gluon_unet.inference.predict',
    'predictions': 'gluon_unet.inference.predict_outputs',
    'quantize': 'gluon_unet.inference.export_int8',
    'recorder': 'gluon_unet.training.recorder',
    'resume': 'gluon_unet.training.resume',
    'rundir': 'gluon_unet.training.run_folder',
    'runtime': 'gluon_unet.machine.runtime',
    'search': 'gluon_unet.inference.postprocess_search',
    'sidecar': 'gluon_unet.inference.sidecar',
    'step': 'gluon_unet.training.step',
    'stops': 'gluon_unet.training.stops',
    'submission': 'gluon_unet.inference.submission',
    'tblog': 'gluon_unet.training.tblog',
    'tiling': 'gluon_unet.inference.tiling',
    'validation': 'gluon_unet.training.validation',
}


#: Old modules split in two: the old path holds the public names of both.
SPLIT = {'hardware': ('gluon_unet.machine.gpus', 'gluon_unet.machine.cpu'),
         'scale': ('gluon_unet.inference.scale', 'gluon_unet.data.sizes')}


def alias(old):
    """Make module ``old`` (``'gluon_unet.engine'``) the module it moved to, or for a
    module that was split, give it the public names of its parts; with a warning."""
    short = old.rpartition('.')[2]
    new = SPLIT.get(short) or (MOVED[short],)
    warnings.warn('%s moved to %s in gluon_unet 0.3.0; the old path goes in 0.4.0' % (old, ' and '.join(new)),
                  DeprecationWarning, stacklevel=3)
    if short not in SPLIT:
        sys.modules[old] = importlib.import_module(new[0])
        return
    namespace = sys.modules[old].__dict__
    for name in new:
        part = importlib.import_module(name)
        namespace.update({k: v for k, v in vars(part).items() if not k.startswith('_')})
