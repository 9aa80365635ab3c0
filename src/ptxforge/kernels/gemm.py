"""The GEMM problem: what a GEMM op asks for, apart from M and from how a GPU generation
computes it.

    D[M, N] = epilogue(A[M, K] . B[N, K]^T)

One ``GemmProblem`` value is built by each public GEMM op (and by the compile backend for
each GEMM of a graph) and is the one key for everything after it: the tile the
generation's model chooses for M rows, the launch plan, the kernels precompiled, and the
epilogue the kernel ends in. A generation (``kernels/sm90_gemm``, found through the
target's architecture description: ``kernels.gemm_generation``) turns a problem and M
into a config and a config into PTX.

The epilogue is a set of terms, each a fused operation the op was asked for, listed in
alphabetical order: ``accumulate`` (D is f32 and the product is added into it: d = c +
a @ b.T), ``bias`` (a bf16 [N] vector added to every row), ``residual`` (a bf16 [M, N]
matrix added), and whatever else a generation's epilogues compute. A generation registers
an epilogue for each set of terms and layout it computes (sm90_gemm/epilogue.py lists
them); a problem whose set it does not have is refused when its config is made.

What is not part of the problem: M (a run-time argument: one kernel serves every M; the
tile is chosen for it), the SM budget, the tensors' addresses and strides.
"""

from __future__ import annotations

from typing import NamedTuple

BLOCK_K = 128            # DeepGEMM's recipe: one scale per 128 of K (A: 1x128, B: 128x128)
# Rows of each group's segment in the contiguous layout: the tallest tile any generation
# uses, so that no tile spans two groups.
CONTIGUOUS_ALIGNMENT = 128

DTYPES = ("e4m3", "bf16")                    # of A and B: e4m3 with DeepGEMM's scales, or bf16
LAYOUTS = ("dense", "contiguous", "masked")  # dense; MoE grouped: B holds `groups` matrices


class GemmProblem(NamedTuple):
    """A GEMM less its M: N, K, the operands' dtype, the layout and the epilogue's terms.

    A named tuple: built on every op call, it costs what a tuple does to make, hash and
    compare (the ops' launch plans are cached on it)."""

    n: int
    k: int
    dtype: str = "e4m3"
    layout: str = "dense"
    groups: int = 0                 # contiguous and masked: the matrices B holds
    epilogue: tuple[str, ...] = ()  # terms, in alphabetical order

    @property
    def scaled(self) -> bool:
        """e4m3 operands with DeepGEMM's 1x128 / 128x128 scales."""
        return self.dtype == "e4m3"

    @property
    def masked(self) -> bool:
        return self.layout == "masked"

    @property
    def accumulate(self) -> bool:
        return "accumulate" in self.epilogue

    def require_valid(self) -> None:
        """Raise a ValueError naming what is wrong with a problem built by hand (the ops
        build valid ones)."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if (self.layout == "dense") != (self.groups == 0) or self.groups < 0:
            raise ValueError(f"groups must be 0 for the dense layout and positive for a grouped "
                             f"one, got layout={self.layout!r}, groups={self.groups}")
        if tuple(self.epilogue) != tuple(sorted(set(self.epilogue))):
            raise ValueError(f"epilogue must list distinct terms in alphabetical order, got "
                             f"{self.epilogue!r}")

    @property
    def weight_bytes(self) -> int:
        """B's bytes (and its 128x128 scales' in e4m3), every group's: what a call reads
        whatever M is (a grouped GEMM's bound, when the routing activates every group)."""
        if self.scaled:
            one = self.n * self.k + 4 * -(-self.n // BLOCK_K) * -(-self.k // BLOCK_K)
        else:
            one = 2 * self.n * self.k
        return max(self.groups, 1) * one

    def __str__(self) -> str:
        layout = "" if self.layout == "dense" else f"MoE ({self.layout}) E={self.groups} "
        extras = "".join(f" + {term}" for term in self.epilogue if term != "accumulate")
        into = " into f32" if self.accumulate else ""
        return f"{layout}{self.dtype} GEMM N={self.n} K={self.k}{extras}{into}"
