"""Moved: see :mod:`gluon_unet._moved`."""
from gluon_unet._moved import alias

alias(__name__)
