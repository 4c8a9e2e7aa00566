"""Which 1x1 convolutions kill MXNet 1.9.1 on this CPU, against gluon_unet.machine.limits' rule.

Each shape runs in its own process: one inference-mode 1x1 convolution of 4 input
channels over (1, 4, H, W) to OUT outputs. A process killed by SIGFPE ("Floating point
exception", exit code 136 in a shell) crashed. The rule (``limits.conv1x1_crashes``) says
which should; the last line counts the shapes where it and the CPU agree. On CPUs without
AVX-512 none crashes (oneDNN takes other kernels): the rule is then stricter than needed.

    python benchmarks/conv1x1_crash.py                       # the shapes of tests/test_big_shapes.py
    python benchmarks/conv1x1_crash.py 2048x2048 512x512:512  # HxW[:OUT]
"""
import argparse
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = ['2048x2048', '2048x2048:16', '2048x1024', '1024x2048', '4096x1024', '1024x4096', '4096x256', '256x4096',
          '2048x512', '6144x2048', '8192x64', '65536x1', '16x65536', '2040x2040', '2048x2047', '2049x2048',
          '2064x2048', '3000x3000', '2047x4096', '4096x2047', '4194304x1', '4194303x1', '5242880x1', '4210688x1',
          '512x512:512', '512x512:256', '512x1024:512', '1024x1024:16']

RUN = ('import sys, mxnet as mx; h, w, k = map(int, sys.argv[1:4]); '
       'mx.nd.Convolution(mx.nd.ones((1, 4, h, w)), mx.nd.ones((k, 4, 1, 1)), mx.nd.zeros(k), kernel=(1, 1), '
       'num_filter=k).wait_to_read()')


def parse(text):
    """``'HxW'`` or ``'HxW:OUT'`` -> (H, W, OUT)."""
    size, _, out = text.partition(':')
    h, w = size.lower().split('x')
    return int(h), int(w), int(out or 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('shapes', nargs='*', default=SHAPES, help='HxW or HxW:OUT (default: a list around 2048)')
    args = p.parse_args(argv)
    try:
        shapes = [parse(s) for s in args.shapes]
    except ValueError:
        p.error('shapes are HxW or HxW:OUT, e.g. 2048x1024 or 512x512:512')
    sys.path.insert(0, ROOT)
    from gluon_unet.machine.cpu import cpu_description
    from gluon_unet.machine.limits import conv1x1_crashes
    print('CPU: %s' % cpu_description())
    agree = 0
    for h, w, k in shapes:
        code = subprocess.run([sys.executable, '-c', RUN, str(h), str(w), str(k)], capture_output=True).returncode
        outcome = 'SIGFPE' if code == -signal.SIGFPE else 'ran' if code == 0 else 'exit %d' % code
        said = conv1x1_crashes(h, w, k)
        agree += said == (code == -signal.SIGFPE)
        print('%6d x %-8d -> %-4d %-7s rule: %s' % (h, w, k, outcome, 'crashes' if said else 'runs'), flush=True)
    print('the rule and this CPU agree on %d of %d shapes' % (agree, len(shapes)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
