"""Build hook (the rest of the metadata is in pyproject.toml): the shipped model in
checkpoints/ travels inside the package as mtp_jax/shipped_model/, so `pip install .`
(not editable) finds it from any directory; a checkout, or an editable install, reads
checkpoints/ itself (`mtp_jax.cli.default_model_dir`)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPy(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # editable: the package is the checkout, checkpoints/ is beside it
        src = os.path.join(HERE, "checkpoints")
        if os.path.isdir(src):
            self.copy_tree(src, os.path.join(self.build_lib, "mtp_jax", "shipped_model"))


setup(cmdclass={"build_py": BuildPy})
