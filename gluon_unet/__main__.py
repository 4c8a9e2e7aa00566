"""``python -m gluon_unet COMMAND ARGS``: the same as the ``gluon-unet`` command."""
import sys

from .cli import main

if __name__ == '__main__':
    sys.exit(main(prog='python -m gluon_unet'))
