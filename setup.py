"""Build script for the optional C accelerator (everything else is in pyproject.toml).

``chatgrammar.runtime._speedups`` speeds up the per-token passes of the id fast path. It is optional:
without a C compiler the build goes on without it and chatgrammar uses its numpy code, which
gives the same results.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("chatgrammar.runtime._speedups", ["chatgrammar/runtime/_speedups.c"],
                             optional=True)])
