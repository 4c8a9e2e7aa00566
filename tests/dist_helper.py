"""Run ``engine.fit`` from a JSON config and dump each worker's trainable parameters.

Used by tests/test_distributed.py as the command of ``bin/launch`` (and alone for the
single-process reference): after every epoch it writes ``<dump>/rank<R>-epoch<E>.npz``
with every parameter that has a gradient, one array per device replica.
Usage: ``python tests/dist_helper.py CONFIG.json DUMP_DIR [marker]`` (the marker only
tags the command line so the test can find the job's processes).
"""
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), '..')))

from gluon_unet.cli import train_main  # noqa: E402


def main(config_path, dump):
    import numpy as np
    from gluon_unet.training import distributed, loop as engine
    from gluon_unet.config import TrainConfig
    seen = {}
    real_strategy, real_build = distributed.make_strategy, engine.build_network

    def make_strategy(kvstore):
        strategy = real_strategy(kvstore)
        seen['rank'] = strategy.rank
        return strategy

    def build_network(cfg, ctxs, *args):
        seen['net'] = real_build(cfg, ctxs, *args)
        return seen['net']

    def dump_params(row):
        arrays = {}
        for name, p in seen['net']._collect_params_with_prefix().items():
            if p.grad_req != 'null':
                for i, d in enumerate(p.list_data()):
                    arrays['%s@%d' % (name, i)] = d.asnumpy()
        np.savez(os.path.join(dump, 'rank%d-epoch%d.npz' % (seen['rank'], row['epoch'])), **arrays)

    distributed.make_strategy, engine.build_network = make_strategy, build_network
    with open(config_path) as f:
        cfg = TrainConfig.from_dict(json.load(f))
    engine.fit(cfg, verbose=True, callbacks=[dump_params])
    return 0


if __name__ == '__main__':
    if os.environ.get('DMLC_ROLE') in ('server', 'scheduler'):
        sys.exit(train_main())  # serves, like bin/train in these roles
    sys.exit(main(sys.argv[1], sys.argv[2]))
