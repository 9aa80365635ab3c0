"""The graph compiler: a ``torch.compile`` backend that puts ptxforge's kernels in place of
the subgraphs it knows in a model's FX graph and hands the rest to Inductor.

    model = ptxforge.compile(model)                       # or
    model = torch.compile(model, backend="ptxforge")      # found by name once installed

docs/graph.md describes the passes, the fallback, CUDA graphs and how a rewrite is added.
"""

from .backend import Replacement, backend, compile, mark_token_dims, rewrite, token_dims
from .modules import Fp8Linear

__all__ = ["Fp8Linear", "Replacement", "backend", "compile", "mark_token_dims", "rewrite",
           "token_dims"]
