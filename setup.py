"""A shim for tools that look for setup.py: the project (name, dependencies, extras,
entry points, package data) is described in pyproject.toml, which setuptools reads."""
from setuptools import setup

setup()
