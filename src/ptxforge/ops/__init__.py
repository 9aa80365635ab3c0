"""The public torch-facing functions: validate, choose a config, build (cached), launch.
Which module defines each is listed in ``ptxforge.public``."""

from ..public import PTXFORGE_NAMES, load

globals().update(load(PTXFORGE_NAMES))

from . import library  # noqa: E402  torch.ops.ptxforge.<op>, for torch.compile and graphs

__all__ = list(PTXFORGE_NAMES)
