#!/usr/bin/env python3
"""``bin/train`` with every BatchNorm's statistics frozen (an experiment of issue 69).

BatchNorm's ``use_global_stats=True``: the layers normalize with the running mean and
variance they came with (the ``--init`` model's) and never update them; their scale and
shift still train. The question it answers: does a few-shot fine-tune collapse on
fluo-crowded because 2,560 crops of k images replace the statistics the source model
learned on hundreds? Arguments are bin/train's::

    python experiments/dsb2018/train_frozen_bn.py --init runs/g1 --data K3 --output /tmp/ft
"""
import functools
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..')))

from mxnet.gluon import nn  # noqa: E402

nn.BatchNorm = functools.partial(nn.BatchNorm, use_global_stats=True)

from gluon_unet.cli import train_main  # noqa: E402

if __name__ == '__main__':
    sys.exit(train_main())
