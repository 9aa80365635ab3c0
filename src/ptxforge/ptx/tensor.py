"""Hopper tensor instructions: wgmma, the warp-level mma.sync and movmatrix, bulk tensor
copies (TMA), ldmatrix/stmatrix.

Shared-memory operands are 32-bit ``.shared::cta`` addresses (registers or symbols).
Tensor maps are named by a 64-bit generic address of the ``.param`` blob; see
``KernelBuilder.tensormap_param`` and ``cvta(space="param")``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import arch
from .operands import Address, Operand, Reg, vec


@dataclass(frozen=True)
class TensorCoords:
    """The ``[tmap, {c0, c1, ...}]`` operand of bulk tensor copies (innermost coordinate first)."""

    tensormap: Operand
    coords: tuple

    def __str__(self) -> str:
        return f"[{self.tensormap}, {{{', '.join(str(c) for c in self.coords)}}}]"


class TensorOps:
    # ---------------------------------------------------------------- wgmma
    def wgmma_fence(self) -> None:
        """Order register/shared accesses before the next wgmma reads them."""
        self.emit("wgmma.fence.sync.aligned")

    def wgmma_commit_group(self) -> None:
        self.emit("wgmma.commit_group.sync.aligned")

    def wgmma_wait_group(self, pending: int) -> None:
        """Wait until at most ``pending`` committed wgmma groups are still running."""
        self.emit("wgmma.wait_group.sync.aligned", pending)

    def wgmma_mma_async(self, acc: list[Reg], a_desc: Operand, b_desc: Operand, *, n: int,
                        ab_type: str, scale_d: Operand = 1, trans_a: int = 0,
                        trans_b: int = 0) -> None:
        """``wgmma.mma_async.sync.aligned.m64n{n}k{K}.f32.{ab_type}.{ab_type}``:
        acc (+)= A (shared-memory descriptor) x B (shared-memory descriptor).

        ``scale_d`` 0 overwrites the accumulators, 1 (or a predicate) accumulates. fp8 types
        take no transpose immediates: both operands must be K-major. The operand types, the
        K each consumes and the range of n are the target's (its data file's ``[mma]``)."""
        target = arch.get(self.target)
        target.require("wgmma", "wgmma.mma_async")
        mma = target.mma
        if ab_type not in mma["k"]:
            raise ValueError(f"wgmma ab_type must be one of {', '.join(mma['k'])} on "
                             f"{self.target}, got {ab_type!r}")
        k = mma["k"][ab_type]
        if len(acc) != n // 2:
            raise ValueError(f"m64n{n} needs {n // 2} f32 accumulators per thread, got {len(acc)}")
        if n % mma["n_step"] or not mma["n_min"] <= n <= mma["n_max"]:
            raise ValueError(f"wgmma n must be a multiple of {mma['n_step']} in "
                             f"[{mma['n_min']}, {mma['n_max']}] on {self.target}, got {n}")
        opcode = f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ab_type}.{ab_type}"
        if ab_type in ("e4m3", "e5m2"):
            if trans_a or trans_b:
                raise ValueError("fp8 wgmma has no transpose: both operands must be K-major")
            self.emit(opcode, vec(acc), a_desc, b_desc, scale_d, 1, 1)
        else:
            self.emit(opcode, vec(acc), a_desc, b_desc, scale_d, 1, 1, trans_a, trans_b)

    # ---------------------------------------------------------------- warp-level mma
    def mma_sync(self, d: list[Reg], a: list[Reg], b: list[Reg], c: list[Reg], *,
                 ab_type: str = "bf16") -> None:
        """``mma.sync.aligned.m16n8k16.row.col.f32.{ab_type}.{ab_type}.f32``: d = A x B + c
        over one warp, A 16 x 16 (4 b32 a thread, each two values), B 16 x 8 (2 b32), C and
        D 16 x 8 f32 (4 a thread), in the PTX ISA's fragment layouts."""
        if ab_type not in ("bf16", "f16"):
            raise ValueError(f"mma_sync ab_type must be bf16 or f16, got {ab_type!r}")
        if (len(d), len(a), len(b), len(c)) != (4, 4, 2, 4):
            raise ValueError(f"m16n8k16 takes 4 d, 4 a, 2 b and 4 c registers a thread, got "
                             f"{len(d)}, {len(a)}, {len(b)}, {len(c)}")
        self.emit(f"mma.sync.aligned.m16n8k16.row.col.f32.{ab_type}.{ab_type}.f32",
                  vec(d), vec(a), vec(b), vec(c))

    def movmatrix(self, d: Reg, a: Reg) -> None:
        """``movmatrix.sync.aligned.m8n8.trans.b16``: an 8 x 8 b16 matrix held by the warp
        (row lane / 4, columns 2 (lane % 4) and + 1 in one b32) transposed, in the same
        layout."""
        self.emit("movmatrix.sync.aligned.m8n8.trans.b16", d, a)

    # ---------------------------------------------------------------- matrix load/store
    def ldmatrix(self, regs: list[Reg], address: Address, *, trans: bool = False) -> None:
        num = {1: "x1", 2: "x2", 4: "x4"}[len(regs)]
        self.emit(f"ldmatrix.sync.aligned.m8n8.{num}" + (".trans" if trans else "") + ".shared.b16",
                  vec(regs), address)

    def stmatrix(self, address: Address, regs: list[Reg], *, trans: bool = False) -> None:
        """Each register holds two b16 values of an 8x8 matrix fragment (x1, x2 or x4 matrices)."""
        num = {1: "x1", 2: "x2", 4: "x4"}[len(regs)]
        self.emit(f"stmatrix.sync.aligned.m8n8.{num}" + (".trans" if trans else "") + ".shared.b16",
                  address, vec(regs))

    # ---------------------------------------------------------------- bulk tensor copies
    def cp_async_bulk_tensor_load(self, dst: Address, tensormap: Operand, coords: list,
                                  bar: Address, *, multicast_mask: Operand | None = None,
                                  cache_hint: Operand | None = None) -> None:
        """Global -> shared tile copy completing on ``bar`` (tx bytes = the box size). With
        ``multicast_mask`` the tile lands in every CTA of the cluster named by the mask."""
        opcode = (f"cp.async.bulk.tensor.{len(coords)}d.shared::cluster.global.tile"
                  ".mbarrier::complete_tx::bytes")
        operands = [dst, TensorCoords(tensormap, tuple(coords)), bar]
        if multicast_mask is not None:
            opcode += ".multicast::cluster"
            operands.append(multicast_mask)
        if cache_hint is not None:
            opcode += ".L2::cache_hint"
            operands.append(cache_hint)
        self.emit(opcode, *operands)

    def cp_async(self, dst: Address, src: Address, nbytes: int, *, cache: str = "ca") -> None:
        """Global -> shared copy of 4, 8 or 16 bytes, tracked by
        ``cp_async_mbarrier_arrive`` (or cp.async groups). ``cache``: ca (through L1) or
        cg (L2 only; 16 bytes)."""
        if cache not in ("ca", "cg") or (cache == "cg" and nbytes != 16):
            raise ValueError(f"cp.async copies 4, 8 or 16 bytes through L1 (ca) or 16 bytes "
                             f"through L2 only (cg), got {nbytes} bytes {cache!r}")
        self.emit(f"cp.async.{cache}.shared.global", dst, src, nbytes)

    def cp_async_mbarrier_arrive(self, bar: Address) -> None:
        """An arrival on the mbarrier at ``bar`` once this thread's cp.async copies so far
        have landed. ``.noinc``: the barrier's expected count includes this arrival."""
        self.emit("cp.async.mbarrier.arrive.noinc.shared::cta.b64", bar)

    def cp_async_bulk_load(self, dst: Address, src: Address, nbytes: Operand, bar: Address) -> None:
        """Global -> shared copy of ``nbytes`` contiguous bytes (16-byte aligned, a multiple of
        16) completing on ``bar`` as ``nbytes`` transaction bytes."""
        self.emit("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                  dst, src, nbytes, bar)

    def cp_async_bulk_store(self, dst: Address, src: Address, nbytes: Operand) -> None:
        """Shared -> global copy of ``nbytes`` contiguous bytes (16-byte aligned, a multiple
        of 16); completion is tracked by bulk groups."""
        self.emit("cp.async.bulk.global.shared::cta.bulk_group", dst, src, nbytes)

    def cp_async_bulk_tensor_store(self, tensormap: Operand, coords: list, src: Address) -> None:
        """Shared -> global tile copy; completion is tracked by bulk groups."""
        self.emit(f"cp.async.bulk.tensor.{len(coords)}d.global.shared::cta.tile.bulk_group",
                  TensorCoords(tensormap, tuple(coords)), src)

    def cp_reduce_async_bulk_tensor(self, tensormap: Operand, coords: list, src: Address, *,
                                    op: str = "add") -> None:
        """Shared -> global tile reduction (``op``: add, min, max, ...; the element type is the
        tensor map's): global = global op tile, element by element. Tracked by bulk groups."""
        self.emit(f"cp.reduce.async.bulk.tensor.{len(coords)}d.global.shared::cta.{op}.tile"
                  ".bulk_group", TensorCoords(tensormap, tuple(coords)), src)

    def cp_async_bulk_prefetch_tensor(self, tensormap: Operand, coords: list) -> None:
        """Pull a tile into L2 without a destination in shared memory."""
        self.emit(f"cp.async.bulk.prefetch.tensor.{len(coords)}d.L2.global.tile",
                  TensorCoords(tensormap, tuple(coords)))

    def cp_async_bulk_commit_group(self) -> None:
        self.emit("cp.async.bulk.commit_group")

    def cp_async_bulk_wait_group(self, pending: int, *, read: bool = False) -> None:
        """Wait for bulk groups; ``read``: only until their shared-memory sources were read."""
        self.emit("cp.async.bulk.wait_group" + (".read" if read else ""), pending)
