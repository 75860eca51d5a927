"""Shim so that `pip install -e .` works with older pip; configuration lives in pyproject.toml."""

from setuptools import setup

setup()
