"""The public torch-facing functions: validate, choose a config, build (cached), launch.
Which module defines each is listed in ``ptxforge.public``."""

from ..public import PTXFORGE_NAMES, load

globals().update(load(PTXFORGE_NAMES))

__all__ = list(PTXFORGE_NAMES)
