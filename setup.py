"""Packages by discovery: every package under cupynce/ (setup.cfg holds the rest of the
metadata), plus the top-level kernels_src/ installed as cupynce.kernels_src (setup.cfg's
package_dir); setup.cfg alone cannot combine ``find:`` with that one mapped folder."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["cupynce", "cupynce.*"]) + ["cupynce.kernels_src"])
