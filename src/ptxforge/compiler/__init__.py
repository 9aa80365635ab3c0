"""The graph compiler: a ``torch.compile`` backend that puts ptxforge's kernels in place of
the patterns it knows in a model's FX graph and hands the rest to Inductor.

    model = ptxforge.compiler.compile(model)              # or
    model = torch.compile(model, backend="ptxforge")      # once ptxforge.compiler is imported

See docs/design.md ("The torch.compile backend") for the passes and the fallback.
"""

from .backend import Replacement, backend, compile, rewrite

__all__ = ["Replacement", "backend", "compile", "rewrite"]
