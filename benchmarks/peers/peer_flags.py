"""The command-line flags both peers' scripts share (``stardist_peer.py``,
``cellpose_peer.py``), and the checked number types, one-line parser and ``fail`` that every
tool here uses (``fewshot_peers.py``, ``star_ceiling.py`` too). The standard library only:
``--help`` runs without numpy or the peers' frameworks (``peer_common`` imports numpy).

Every number a flag takes is checked where it is parsed (:data:`POSITIVE` and the like, each
knowing the values it refuses, from which tests/test_peers_tools.py makes its bad values), and
a usage error is one line, ``PROG: error: argument --FLAG: ...``, exit status 2, as the
project's own commands report one.
"""
import argparse
import math
import sys


def fail(message):
    """A usage error as the project reports one: one line on stderr, exit status 2, never a
    traceback."""
    sys.stderr.write('error: %s\n' % message)
    sys.stderr.flush()
    raise SystemExit(2)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the flag and what is wrong), exit status 2."""

    def error(self, message):
        self.exit(2, '%s: error: %s\n' % (self.prog, message))


def _checked(kind, ok, needs, bad):
    """An argparse ``type``: ``kind`` (int or float, finite) for which ``ok`` holds, else a
    one-line 'must be NEEDS'. ``.bad`` lists values it refuses (the tests use them)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError('%r is not %s' % (text, 'a whole number' if kind is int else 'a number'))
        if (kind is float and not math.isfinite(value)) or not ok(value):
            raise argparse.ArgumentTypeError('%s must be %s' % (text, needs))
        return value
    parse.__name__ = needs
    parse.bad = bad
    return parse


POSITIVE = _checked(float, lambda v: v > 0, 'a number above 0', ('x', '0', '-1', 'nan', 'inf'))
NON_NEGATIVE = _checked(float, lambda v: v >= 0, 'a number of 0 or more', ('x', '-1', 'nan'))
FRACTION = _checked(float, lambda v: 0 <= v < 1, 'a fraction from 0 to below 1', ('x', '-0.1', '1', 'nan'))
AT_LEAST_1 = _checked(int, lambda v: v >= 1, 'a whole number of 1 or more', ('x', '0', '-2', '1.5'))
COUNT = _checked(int, lambda v: v >= 0, 'a whole number of 0 or more', ('x', '-1', '2.5'))
#: numpy's and torch's seeds: 0 to 2**32 - 1
SEED = _checked(int, lambda v: 0 <= v < 2 ** 32, 'a whole number from 0 to 2**32 - 1', ('x', '-1', str(2 ** 32)))
CHECKED = (POSITIVE, NON_NEGATIVE, FRACTION, AT_LEAST_1, COUNT, SEED)


def add_train_flags(t, out_help):
    """The ``train`` flags both peers' scripts share (argparse sub-parser ``t``), each
    peer's own added after them."""
    t.add_argument('--data', required=True, help='DSB-layout folder: <id>/images/<id>.png + <id>/masks/*.png')
    t.add_argument('--out', required=True, help=out_help)
    t.add_argument('--minutes', type=POSITIVE, default=None,
                   help='wall time of the whole command, in minutes (required from scratch; with --init a cap, '
                        'default none)')
    t.add_argument('--invert-bright', action='store_true',
                   help='invert images with a bright background (median grey > 80) as gluon_unet --normalize auto '
                        '(with --init: the source\'s setting, which this may not contradict)')
    t.add_argument('--limit', type=COUNT, default=0, help='use only the first N samples (smoke tests; 0: all)')
    t.add_argument('--match', metavar='BUDGET_JSON', default=None,
                   help='from scratch: do the work a recorded run of this peer did (its budget.json: its '
                        'steps or batches, its threshold search or size model) instead of what --minutes '
                        'buys, which is then only a guard: the same training on a slower or busier CPU')


def add_predict_flags(q, model_help):
    """The ``predict`` flags both peers' scripts share (sub-parser ``q``)."""
    q.add_argument('--model', required=True, help=model_help)
    q.add_argument('--input', required=True, help='DSB layout or a folder of images')
    q.add_argument('--output', required=True, help='folder for <id>_labels.png and the timing records')
    q.add_argument('--limit', type=COUNT, default=0, help='predict only the first N images (smoke tests; 0: all)')
