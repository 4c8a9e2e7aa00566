"""The command-line flags both peers' scripts share (``stardist_peer.py``,
``cellpose_peer.py``). The standard library only: ``--help`` runs without numpy or the
peers' frameworks (``peer_common`` imports numpy).
"""


def add_train_flags(t, out_help):
    """The ``train`` flags both peers' scripts share (argparse sub-parser ``t``), each
    peer's own added after them."""
    t.add_argument('--data', required=True, help='DSB-layout folder: <id>/images/<id>.png + <id>/masks/*.png')
    t.add_argument('--out', required=True, help=out_help)
    t.add_argument('--minutes', type=float, default=None,
                   help='wall time of the whole command, in minutes (required from scratch; with --init a cap, '
                        'default none)')
    t.add_argument('--invert-bright', action='store_true',
                   help='invert images with a bright background (median grey > 80) as gluon_unet --normalize auto '
                        '(with --init: the source\'s setting, which this may not contradict)')
    t.add_argument('--limit', type=int, default=0, help='use only the first N samples (smoke tests)')


def add_predict_flags(q, model_help):
    """The ``predict`` flags both peers' scripts share (sub-parser ``q``)."""
    q.add_argument('--model', required=True, help=model_help)
    q.add_argument('--input', required=True, help='DSB layout or a folder of images')
    q.add_argument('--output', required=True, help='folder for <id>_labels.png and the timing records')
    q.add_argument('--limit', type=int, default=0, help='predict only the first N images (smoke tests)')
