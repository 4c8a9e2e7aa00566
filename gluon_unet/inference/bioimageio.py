"""``gluon-unet package``: an export as a bioimage.io Model Zoo package (a zip).

The package holds a model description of the bioimage.io spec 0.5 (``bioimageio.yaml``),
the export's ``model.onnx`` as its weights, the export's ``model.json`` (so the unzipped
folder is an export ``bin/predict`` and the napari plugin take), test input and output
tensors computed by onnxruntime on a real image, a cover (that image beside its nuclei's
outlines) and a model card (``README.md``) as its documentation.

What the spec expresses is described in its own terms: the input (uint8, 1 or 3 channels,
y, x: sides a multiple of ``2**depth``; the tiling halo ``bin/predict`` uses), the
normalization the model was trained with where one of the spec's operations is that
normalization (``scale_linear`` for ``--normalize none``, ``scale_range`` + ``clip`` for the
percentile stretch), the output probabilities (``sigmoid`` or ``softmax`` of the logits). What
it cannot express - the watershed that makes instances, the denoise before the stretch, the
inversion of bright-background images, the hematoxylin of ``stain``, resizing - is listed in
the model card (:func:`limits`) and in ``docs/how-to/napari-bioimageio.md``; the test tensors
follow the description, so ``bioimageio test`` reproduces them, and the card says by how
much they differ from gluon_unet's own normalization on the test image.

It runs where onnxruntime does, without MXNet. The zip keeps the output contract
(:mod:`gluon_unet.outputs`): apart from the export and the image, locked while written,
written aside and renamed, and replaced only when it is a package of the same ``model.onnx``
(``--overwrite``: of another export; a file gluon_unet did not write: never). What the spec
constrains in the description's fields (name, licences, authors, citations, the training
data) is checked first, in :mod:`~gluon_unet.inference.bioimageio_fields`.

Why one module: the description, its test tensors, the cover and the card are made from one
export's record and must agree - the tensors follow the description's operations, and the
card lists what those operations cannot say.
"""
import datetime
import json
import os
import shlex
import zipfile

import cv2
import numpy as np

from .. import __version__
from ..data.io import read_image, input_image
from ..errors import UserError
from ..outputs import check_apart, check_inputs, check_replaceable, lock_file
from ..utils import atomic_path, check_writable, file_crc32
from .batched import match_channels, predict_image
from .batched_onnx import ONNX_FILE, load_onnx_model, sigmoid
from .bioimageio_fields import (author_list, check_model_name, model_name, spdx_ids, public_sidecar,
                                trained_on_dsb2018, training_data)
from .configs import PackageConfig  # noqa: F401 - its name here before configs.py held it
from .overlay import overlay
from .sidecar import SIDECAR, find_export
from .tiling import pooling_multiple, tile_size

#: The description's format (bioimage.io spec 0.5).
FORMAT_VERSION = '0.5.4'
#: Side of the test tensors (at most; a multiple of 2**depth).
TEST_SIDE = 256
#: The paper every package cites: the U-Net (and its training data's, when known).
UNET = {'text': 'Ronneberger, Fischer, Brox. U-Net: Convolutional Networks for Biomedical Image Segmentation. '
                'MICCAI 2015', 'doi': '10.1007/978-3-319-24574-4_28'}


# -- what the spec can say about the inputs and outputs ------------------------------------------

def preprocessing(meta):
    """The spec's operations for the model's input normalization: ``(ops, exact)``;
    ``exact`` is False when gluon_unet does more than they say (:func:`limits`)."""
    mode = meta.get('normalize') or (meta.get('config') or {}).get('normalize') or 'none'
    ops = [{'id': 'ensure_dtype', 'kwargs': {'dtype': 'float32'}}]
    if mode in ('none', 'invert'):
        ops.append({'id': 'scale_linear', 'kwargs': {'gain': 1 / 255.0, 'offset': 0.0}})
    else:  # the percentile stretch of data/io.py: 0.5th and 99.8th percentiles, all channels together
        ops += [{'id': 'scale_range', 'kwargs': {'axes': ['channel', 'y', 'x'], 'min_percentile': 0.5,
                                                 'max_percentile': 99.8}},
                {'id': 'clip', 'kwargs': {'min': 0.0, 'max': 1.0}}]
    ops.append({'id': 'ensure_dtype', 'kwargs': {'dtype': 'float32'}})
    denoise = float(meta.get('normalize_denoise') or 0) if mode in ('percentile', 'auto', 'stain') else 0.0
    return ops, mode in ('none', 'percentile') and not denoise


def apply_preprocessing(raw, ops):
    """The spec's ``ops`` on a (1, C, H, W) tensor, in numpy: what bioimage.io consumers do."""
    x = raw.astype(np.float32)
    for op in ops:
        kw = op['kwargs']
        if op['id'] == 'scale_linear':
            x = x * np.float32(kw['gain']) + np.float32(kw['offset'])
        elif op['id'] == 'scale_range':
            lo, hi = np.percentile(x, [kw['min_percentile'], kw['max_percentile']], axis=(1, 2, 3), keepdims=True)
            x = (x - lo) / (hi - lo + 1e-6)
        elif op['id'] == 'clip':
            x = np.clip(x, kw['min'], kw['max'])
        x = x.astype(np.float32)
    return x


def outputs_of(meta):
    """``(channel names, postprocessing ops)`` of the output: probabilities of the logits."""
    names = list(meta.get('outputs') or ['foreground'])
    classes = int(meta.get('classes') or 1)
    if classes > 1 and len(names) == 1:  # softmax classes: the first is the background
        return ['background'] + ['class%d' % i for i in range(1, classes)], \
            [{'id': 'softmax', 'kwargs': {'axis': 'channel'}}]
    return names, [{'id': 'sigmoid'}]


def apply_postprocessing(logits, ops):
    """The output ``ops`` (sigmoid or softmax over channels) on (1, K, H, W) logits."""
    if ops[0]['id'] == 'softmax':
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    return sigmoid(logits)


def halo(meta):
    """The border (px) ``bin/predict`` discards of each tile: half the tiles' overlap
    (``--overlap`` 0.25), in multiples of ``2**depth``."""
    size, multiple = tile_size(meta), pooling_multiple(meta)
    step = max(multiple, int(size * 0.75) // multiple * multiple)
    return (size - step) // 2 // multiple * multiple


def tensors(meta, test_side):
    """The ``inputs`` and ``outputs`` entries of the description (``test_side``: the test
    tensors' side, for a model trained on images resized to one size)."""
    channels = int(meta.get('in_channels') or 1)
    names, post = outputs_of(meta)
    ops, _ = preprocessing(meta)
    multiple, border = pooling_multiple(meta), halo(meta)
    if meta.get('resize_mode') == 'resize':  # the whole image at the training size
        space = [{'type': 'space', 'id': a, 'size': test_side} for a in ('y', 'x')]
        out_space = [{'type': 'space', 'id': a, 'size': {'tensor_id': 'raw', 'axis_id': a}} for a in ('y', 'x')]
    else:
        space = [{'type': 'space', 'id': a, 'size': {'min': 2 * border + multiple, 'step': multiple}}
                 for a in ('y', 'x')]
        out_space = [dict({'type': 'space', 'id': a, 'size': {'tensor_id': 'raw', 'axis_id': a}},
                          **({'halo': border} if border else {})) for a in ('y', 'x')]
    grey = channels == 1
    raw = {'id': 'raw', 'description': 'the image as uint8 (%s); see the model card' % ('grey' if grey else 'RGB'),
           'axes': [{'type': 'batch'}, {'type': 'channel', 'channel_names': ['grey'] if grey else
                                        ['red', 'green', 'blue'][:channels] + ['c%d' % i for i in range(3, channels)]}]
           + space, 'test_tensor': {'source': 'test_input.npy'}, 'data': {'type': 'uint8'}, 'preprocessing': ops}
    prob = {'id': 'probability', 'description': 'per-pixel probabilities; instances: the watershed of the model card',
            'axes': [{'type': 'batch'}, {'type': 'channel', 'channel_names': names}] + out_space,
            'test_tensor': {'source': 'test_output.npy'}, 'data': {'type': 'float32'}, 'postprocessing': post}
    return [raw], [prob]


def limits(meta):
    """What gluon_unet does that the description cannot say, one sentence each."""
    mode = meta.get('normalize') or (meta.get('config') or {}).get('normalize') or 'none'
    denoise = float(meta.get('normalize_denoise') or 0)
    tuned = meta.get('postprocess') if isinstance(meta.get('postprocess'), dict) else {}
    if tuned.get('markers') == 'flow':
        instances = ('**Instances.** The first output is the foreground probability; the other two are the '
                     'direction from each pixel to its nucleus\' centre, y and x, each as (1 + v) / 2. gluon_unet '
                     'follows the directions from every foreground pixel and gathers each nucleus where they meet '
                     '(threshold %s, minimum size %s, chosen on validation images), which the spec\'s '
                     'post-processing operations cannot describe. Run it with gluon_unet (above).'
                     % (tuned.get('threshold', meta.get('threshold', 0.5)), tuned.get('min_size', 0)))
    else:
        instances = ('**Instances.** The outputs are probabilities. gluon_unet separates touching nuclei with a marker '
                     'watershed (threshold %s, h %s, minimum size %s, chosen on validation images); the spec\'s '
                     'post-processing operations (sigmoid, softmax, binarize, ...) cannot describe a watershed. Run it '
                     'with gluon_unet (above).' % (tuned.get('threshold', meta.get('threshold', 0.5)),
                                                  tuned.get('h', 0.5), tuned.get('min_size', 0)))
    found = [instances,
             '**Other image types.** gluon_unet scales 16-bit and float images to uint8 by their 0.5th and 99.5th '
             'percentiles first; the input here is uint8.',
             '**Channels.** gluon_unet converts colour to grey (luma) for a grey model and repeats grey for a colour '
             'one; give this model %s images.' % ('grey' if int(meta.get('in_channels') or 1) == 1 else 'RGB')]
    if mode in ('invert', 'auto', 'stain'):
        found.append('**Bright backgrounds.** gluon_unet inverts an image whose median grey is above 80 (brightfield, '
                     'tissue) before the normalization (`--normalize %s`); the spec has no per-image condition, so '
                     'this description is right for dark-background (fluorescence) images only: invert the others '
                     'first.' % mode)
    if mode == 'stain':
        found.append('**Stained tissue.** gluon_unet turns colour images into their hematoxylin channel (colour '
                     'deconvolution, `--normalize stain`), which no operation of the spec computes.')
    if mode in ('percentile', 'auto', 'stain') and denoise:
        found.append('**Denoise.** gluon_unet blurs the image (Gaussian, sigma %g px) before the percentile '
                     'stretch and rounds the result to uint8; the spec\'s scale_range does neither.' % denoise)
    if meta.get('resize_mode') == 'resize':
        found.append('**Size.** The model was trained on images resized to %s px: resize each image to it (area '
                     'interpolation) and the output back, as gluon_unet does.' % meta.get('train_size'))
    else:
        found.append('**Tiling.** gluon_unet tiles large images with tiles of %d px overlapping by a quarter and '
                     'blends them smoothly; the halo here (%d px) is the border it discards.'
                     % (tile_size(meta), halo(meta)))
    return found


# -- the test image, the tensors and the cover ---------------------------------------------------

def test_image(config, meta, folder):
    """``(image as read (H, W, C) uint8, where it came from)``: ``--image``, else the first
    of the new images the demo segmented (``<run>/demo_inputs/``) for its own model. Where
    it came from is its file name: the package shows no path of this machine."""
    if config.image:
        return read_image(config.image), os.path.basename(config.image)
    inputs = os.path.join(os.path.dirname(folder), 'demo_inputs')
    names = sorted(n for n in os.listdir(inputs) if n.endswith('.png')) if os.path.isdir(inputs) else []
    if not names:
        data = ((meta.get('card') or {}).get('data') or {}).get('path')
        raise UserError('--image is needed: name a validation or test image of the data the model trained on (%s); '
                        'the test tensors and the cover are made from it' % (data or 'not recorded'))
    return read_image(os.path.join(inputs, names[0])), 'the demo\'s new image %s' % names[0]


def test_tensors(model, image):
    """``(input, output, gluon_unet's own probabilities)`` on the image's central crop: the
    (1, C, h, w) uint8 input, the (1, K, h, w) float32 output of the spec's pre- and
    post-processing around onnxruntime, and the foreground of gluon_unet's normalization."""
    meta, multiple = model.meta, pooling_multiple(model.meta)
    x = match_channels(image, model.channels, 'the test image')
    if meta.get('resize_mode') == 'resize':
        side = tile_size(meta)
        x = cv2.resize(x, (side, side), interpolation=cv2.INTER_AREA).reshape(side, side, -1)
    else:
        need = 2 * halo(meta) + multiple
        pad = [max(0, need - n) for n in x.shape[:2]]
        x = np.pad(x, ((0, pad[0]), (0, pad[1]), (0, 0)), mode='reflect') if any(pad) else x
        h, w = (min(n, TEST_SIDE) // multiple * multiple for n in x.shape[:2])
        top, left = (x.shape[0] - h) // 2, (x.shape[1] - w) // 2
        x = x[top:top + h, left:left + w]
    raw = np.ascontiguousarray(x.transpose(2, 0, 1)[None])
    ops, _ = preprocessing(meta)
    _, post = outputs_of(meta)
    output = apply_postprocessing(model.net(apply_preprocessing(raw, ops)), post)
    own = input_image(x, model.channels, model.normalize, model.denoise).transpose(2, 0, 1)[None] / np.float32(255)
    theirs = probability_maps_of(model, own)
    return raw, output, theirs


def probability_maps_of(model, x):
    """gluon_unet's foreground probability of a (1, C, h, w) float input (one pass)."""
    from .batched_onnx import probability_maps
    from .batched import second_map
    return probability_maps(model.net(x.astype(np.float32)), second_map(model.meta))[0, 0]


def cover(model, image):
    """The cover (2:1): the image, and beside it its nuclei's outlines as ``bin/predict``
    finds them with the model's own settings; at most 512 px high. Also the object count."""
    net_input = input_image(image, model.channels, model.normalize, model.denoise,
                            convert=lambda img, channels: match_channels(img, channels, 'the test image'))
    mode, tta = model.prediction()  # as bin/predict without flags: the way the post-processing was chosen
    maps = predict_image(model.net, model.meta, net_input, model.ctxs, mode, tta, maps=True)
    labels = model.instances(maps)
    shown = image if image.shape[2] == 3 else np.repeat(image, 3, axis=2)
    both = np.concatenate([shown, overlay(shown, labels)], axis=1)
    scale = min(1.0, 512.0 / both.shape[0])
    if scale < 1:
        both = cv2.resize(both, (int(both.shape[1] * scale), 512), interpolation=cv2.INTER_AREA)
    return both, int(labels.max())


# -- the description and the card ----------------------------------------------------------------

def description(config, meta, onnx_meta, image_source, test_side, dsb):
    """The ``bioimageio.yaml`` content (a dict) of the package; its fields as bioimage.io
    takes them (:meth:`PackageConfig.validate`, :func:`training_data`), no local path."""
    data_name, dataset = training_data(config, meta, dsb)
    card = meta.get('card') or {}
    inputs, outputs = tensors(meta, test_side)
    name = config.name or model_name(data_name)
    check_model_name('--name', name)
    rdf = {
        'type': 'model', 'format_version': FORMAT_VERSION, 'name': name,
        'description': ('A U-Net that finds cell nuclei in 2-D microscopy images (trained with gluon_unet %s on %s). '
                        'It predicts per-pixel probabilities; gluon_unet turns them into separate nuclei with a '
                        'watershed (see the model card).' % (card.get('gluon_unet', __version__), data_name))[:1024],
        'authors': author_list(config.authors), 'cite': [UNET] + (dataset['cite'] if dataset else []),
        'license': config.license,
        'tags': ['nuclei', 'segmentation', 'instance-segmentation', 'unet', '2d', 'onnx', 'gluon_unet'],
        'documentation': 'README.md', 'covers': ['cover.png'], 'attachments': [{'source': SIDECAR}],
        'timestamp': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ'),
        'training_data': dataset, 'inputs': inputs, 'outputs': outputs,
        'weights': {'onnx': {'source': ONNX_FILE, 'opset_version': int(onnx_meta.get('opset') or 17),
                             'comment': 'converted from the MXNet export by %s' % onnx_meta.get('converter', '?')}},
        'config': {'gluon_unet': {'version': __version__, 'test_image': image_source,
                                  'normalize': meta.get('normalize') or 'none',
                                  'postprocess': meta.get('postprocess') or {'threshold': meta.get('threshold')}}},
    }
    if dataset is None:
        del rdf['training_data']
    return rdf


def model_card(rdf, meta, agreement, objects, zip_name, data_name):
    """The package's ``README.md``: what the model is, how to run it (``zip_name``: the
    package's file name), what the spec cannot say."""
    card = meta.get('card') or {}
    metrics = card.get('best_metrics') or {}
    scores = ', '.join('%s %.3f' % (k, metrics[k]) for k in ('val_iou', 'val_dice', 'val_dsb')
                       if isinstance(metrics.get(k), float))
    counts = card.get('data') or {}
    trained = rdf['training_data']['description'] if rdf.get('training_data') else '%s: %s training and %s ' \
        'validation images' % (data_name, counts.get('train_images', '?'), counts.get('val_images', '?'))
    folder = os.path.splitext(zip_name)[0] + '-model'
    lines = ['# %s' % rdf['name'], '', rdf['description'], '',
             '- Trained on: %s' % trained,
             '- Validation: %s (best epoch %s)' % (scores or 'not recorded', card.get('best_epoch', '?')),
             '- Input: %s, uint8, sides a multiple of %s px; output: %s' % (
                 ' / '.join(rdf['inputs'][0]['axes'][1]['channel_names']), pooling_multiple(meta),
                 ', '.join(rdf['outputs'][0]['axes'][1]['channel_names'])),
             '- Cover: %d nuclei found by gluon_unet in the test image (%s)' % (
                 objects, rdf['config']['gluon_unet']['test_image']), '',
             '## Nuclei, not only probabilities: run it with gluon_unet', '',
             'The folder this zip unpacks to is a gluon_unet export (`model.onnx` + `model.json`):', '',
             '```', 'unzip %s -d %s' % (shlex.quote(zip_name), shlex.quote(folder)),
             'pip install ".[onnx]"   # in a clone of gluon_unet, in an environment with or without MXNet',
             'gluon-unet predict --model %s --input images/ --output masks/' % shlex.quote(folder), '```', '',
             'writes 16-bit instance labels per image, tiling large images, with the watershed settings of '
             '`model.json`. In napari, the gluon_unet plugin (`pip install ".[napari]"`) takes the same folder.', '',
             '## Validation', '',
             'On its %s validation images: %s. The search of the post-processing chose: %s.' % (
                 (card.get('data') or {}).get('val_images', '?'), scores or 'not recorded',
                 (card.get('postprocess') or {}).get('chosen', 'the training defaults')), '',
             '## What this description cannot say', '']
    lines += ['- %s' % text for text in limits(meta)]
    lines += ['', 'On the test image, the spec\'s preprocessing and gluon_unet\'s own give probabilities that differ '
              'by at most %.3f, and foregrounds (probability > %.2f) that agree on %.2f %% of the pixels.'
              % (agreement['max_diff'], agreement['threshold'], 100 * agreement['same']), '',
              '## Cite', ''] + ['- %s. doi:%s' % (c['text'], c['doi']) for c in rdf['cite']]
    return '\n'.join(lines) + '\n'


def to_yaml(value, indent=0):
    """``value`` (dicts, lists, strings, numbers) as block YAML; scalars as JSON, which
    YAML reads as they are."""
    pad = '  ' * indent
    if isinstance(value, dict) and value:
        return '\n'.join('%s%s:\n%s' % (pad, k, to_yaml(v, indent + 1)) if isinstance(v, (dict, list)) and v
                         else '%s%s: %s' % (pad, k, to_yaml(v)) for k, v in value.items())
    if isinstance(value, list) and value:
        items = []
        for v in value:
            if isinstance(v, (dict, list)) and v:
                text = to_yaml(v, indent + 1)
                items.append(pad + '- ' + text[len(pad) + 2:])
            else:
                items.append(pad + '- ' + to_yaml(v))
        return '\n'.join(items)
    if isinstance(value, (dict, list)):
        return '{}' if isinstance(value, dict) else '[]'
    return json.dumps(value)


# -- writing the zip -----------------------------------------------------------------------------

def check_output(config, folder, onnx_path):
    """Refuse, before any work, an output inside the export or the image, a file that is
    not a package gluon_unet wrote, or one of another export without ``--overwrite``."""
    if os.path.isdir(config.output):
        raise UserError('--output %s: is a folder; give a .zip file name' % config.output)
    check_replaceable(config.output, 'PK\x03\x04', '--output', 'a zip')
    if os.path.lexists(config.output):
        try:
            with zipfile.ZipFile(config.output) as z:
                names = set(z.namelist())
                crc = z.getinfo(ONNX_FILE).CRC if ONNX_FILE in names else None
                ours = {'bioimageio.yaml', SIDECAR} <= names and b'gluon_unet-export' in z.read(SIDECAR)
        except (zipfile.BadZipFile, OSError, KeyError):
            ours = False
        if not ours:
            raise UserError('--output %s exists and is not a package gluon_unet wrote; choose another file, or move '
                            'it' % config.output)
        if crc != file_crc32(onnx_path) and not config.overwrite:
            raise UserError('--output %s holds a package of another model.onnx; package into another file, or add '
                            '--overwrite to replace it' % config.output)
    check_writable(config.output, '--output', is_file=True)


def write_package(config):
    """``gluon-unet package``: write the bioimage.io package of ``config.export``.

    Returns
    -------
    (str, list of str)
        The zip's path and what to tell the user (the spec's limits, the validation).

    Raises
    ------
    UserError
        Bad flags, no export or ``model.onnx`` (or a damaged one), no onnxruntime, an
        output the output contract refuses: one line, nothing written.
    """
    config.validate()
    from .batched_onnx import import_onnxruntime, onnx_path
    check_inputs([('EXPORT', config.export, 'file|folder'), ('--image', config.image, 'file')])
    folder = os.path.dirname(os.path.abspath(find_export(config.export, 'EXPORT')))
    # Outputs before any work (docs/reference/outputs.md): apart from what is read first.
    check_apart([('--output', config.output)], [('EXPORT', folder), ('--image', config.image)], 'package')
    path, meta = onnx_path(config.export, 'EXPORT')
    # What the description says of the training data and the name made from it, checked
    # as bioimage.io would before anything is written (an invalid zip is never kept either).
    dsb = trained_on_dsb2018(meta)
    description(config, meta, meta.get('onnx') or {}, '', TEST_SIDE, dsb)
    check_output(config, folder, path)
    import_onnxruntime()
    with lock_file(config.output, '--output'):  # held while the work is done and the zip renamed into place
        model = load_onnx_model(config.export, threads=None)
        image, source = test_image(config, meta, folder)
        raw, output, own = test_tensors(model, image)
        fg = 1 - output[0, 0] if outputs_of(meta)[1][0]['id'] == 'softmax' else output[0, 0]
        agreement = {'max_diff': float(np.abs(fg - own).max()), 'threshold': float(model.threshold),
                     'same': float(np.mean((fg > model.threshold) == (own > model.threshold)))}
        picture, objects = cover(model, image)
        rdf = description(config, meta, meta['onnx'], source, raw.shape[-1], dsb)
        data_name, _ = training_data(config, meta, dsb)
        with open(os.path.join(folder, SIDECAR)) as f:
            sidecar = public_sidecar(json.load(f), dsb)
        files = {'bioimageio.yaml': to_yaml(rdf) + '\n',
                 'README.md': model_card(rdf, meta, agreement, objects, os.path.basename(config.output), data_name),
                 'test_input.npy': _npy(raw), 'test_output.npy': _npy(output),
                 'cover.png': cv2.imencode('.png', picture[..., ::-1])[1].tobytes(),
                 SIDECAR: json.dumps(sidecar, indent=2)}
        with atomic_path(config.output) as tmp, zipfile.ZipFile(tmp, 'w', zipfile.ZIP_DEFLATED) as z:
            for name, content in files.items():
                z.writestr(name, content)
            z.write(path, ONNX_FILE)
            z.close()
            checked = validation_line(tmp, config.output)  # before the rename: an invalid zip is not kept
    notes = ['the spec cannot express: %s' % '; '.join(t.split('**')[1].rstrip('.') for t in limits(meta))]
    deprecated = spdx_ids()[1]
    notes += ['note: %s %s is a deprecated SPDX identifier: bioimage.io accepts it with a warning' % (flag, value)
              for flag, value in (('--license', config.license), ('--training-data-license',
                                                                  config.training_data_license)) if value in deprecated]
    if not rdf.get('training_data'):
        notes.append('note: the description has no training_data: what %s trained on is not recognised data; give '
                     '--training-data-cite and --training-data-license to describe it' % data_name)
    return config.output, notes + [checked]


def _npy(array):
    import io
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def validation_line(path, shown):
    """One line: what bioimageio.spec says of the package at ``path`` (without following its
    web links), or that it is not installed here; an invalid one is a UserError naming ``shown``."""
    try:
        from bioimageio.spec import ValidationContext, load_description
    except ImportError:
        return 'not validated: bioimageio.spec is not installed here (pip install ".[bioimageio]")'
    with ValidationContext(perform_io_checks=False):
        described = load_description(os.path.abspath(path), perform_io_checks=False)
    summary = described.validation_summary
    if summary.status in ('passed', 'valid-format'):
        return 'bioimageio.spec %s: the description is valid (format %s)' % (
            _version('bioimageio.spec'), getattr(described, 'format_version', '?'))
    errors = '; '.join('%s: %s' % ('.'.join(str(p) for p in e.loc), e.msg) for e in summary.errors[:3])
    raise UserError('%s: bioimageio.spec finds the description invalid (a bug in gluon_unet, please report it): %s'
                    % (shown, errors or summary.status), exit_code=1)


def _version(name):
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return '?'
