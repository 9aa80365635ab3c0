"""A warp copying one contiguous row of bytes, 16 bytes a lane at a time.

``warp_copy`` emits, for a row of V = nbytes / 16 vectors, ceil(V / 32) 16-byte loads and
as many stores a lane, in groups of ``unroll`` (UNROLL unless the caller has registers
for more): a group's loads are all issued before its stores, so a lane has up to
``unroll`` loads in flight. Lane l moves vectors l, l + 32, ...:
every warp-wide access is 512 contiguous bytes. Where V is no multiple of 32, the last
group's lanes past the row's end are guarded off by a predicate.

The load and store options (``nc``, ``eviction``...) are the caller's: a row another GPU
wrote while the kernel runs must not be read through the non-coherent path.
"""

from __future__ import annotations

from ..ptx import KernelBuilder, Reg, addr

VECTOR_BYTES = 16
UNROLL = 4


def warp_copy(k: KernelBuilder, dst: Reg, src: Reg, nbytes: int, lane: Reg, *,
              load: dict, store: dict, unroll: int = UNROLL) -> None:
    """Copy ``nbytes`` (a multiple of 16) from ``src`` to ``dst`` (u64 addresses, 16-byte
    aligned, the same in every lane) with the whole warp."""
    if nbytes % VECTOR_BYTES:
        raise ValueError(f"warp_copy moves whole 16-byte vectors, got {nbytes} bytes")
    vectors = nbytes // VECTOR_BYTES
    trips = -(-vectors // 32)
    src_lane, dst_lane = k.reg("u64", "copy_src"), k.reg("u64", "copy_dst")
    k.mad(src_lane, lane, VECTOR_BYTES, src, mode="wide")
    k.mad(dst_lane, lane, VECTOR_BYTES, dst, mode="wide")
    in_row = None
    if vectors % 32:
        in_row = k.pred("copy_in_row")
        k.setp("lt", in_row, lane, vectors % 32)
    data = [k.regs("b32", 4, "copy") for _ in range(min(unroll, trips))]
    for first in range(0, trips, unroll):
        group = range(first, min(first + unroll, trips))
        for trip, v in zip(group, data):
            _guarded(k, in_row if trip == trips - 1 else None,
                     lambda: k.ld(v, addr(src_lane, trip * 32 * VECTOR_BYTES), **load))
        for trip, v in zip(group, data):
            _guarded(k, in_row if trip == trips - 1 else None,
                     lambda: k.st(addr(dst_lane, trip * 32 * VECTOR_BYTES), v, **store))


def _guarded(k: KernelBuilder, pred, emit) -> None:
    if pred is None:
        emit()
        return
    with k.guard(pred):
        emit()


def lane_words_load(k: KernelBuilder, src: Reg, nwords: int, lane: Reg, *, load: dict,
                    name: str, offset: int = 0):
    """Lane j loads the 32-bit words j, j + 32, ... of the ``nwords`` at ``src + offset``
    (``src`` the same in every lane), every load issued before any is used. Returns
    ``(words, in_row)``: a b32 register and a predicate a trip of 32 words."""
    trips = -(-nwords // 32)
    words, in_row = k.regs("b32", trips, name), k.regs("pred", trips, name + "_in_row")
    at = k.reg("u64", name + "_src")
    k.mad(at, lane, 4, src, mode="wide")
    for trip in range(trips):
        k.setp("lt", in_row[trip], lane, nwords - 32 * trip)
        with k.guard(in_row[trip]):
            k.ld(words[trip], addr(at, offset + 32 * 4 * trip), **load)
    return words, in_row


def lane_words_store(k: KernelBuilder, dst: Reg, words, in_row, lane: Reg, *, store: dict,
                     name: str, offset: int = 0) -> None:
    """Store what ``lane_words_load`` loaded at ``dst + offset``, word j by lane j."""
    at = k.reg("u64", name + "_dst")
    k.mad(at, lane, 4, dst, mode="wide")
    for trip, (word, valid) in enumerate(zip(words, in_row)):
        with k.guard(valid):
            k.st(addr(at, offset + 32 * 4 * trip), word, **store)
