"""Experiments (scripts, not part of the installed package); `experiments.data` loads datasets."""
