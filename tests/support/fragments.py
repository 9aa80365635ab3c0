"""mma.sync m16n8k16 and movmatrix fragments for tests: one warp's registers as numpy
arrays [32 lanes, registers] built from whole matrices by the PTX ISA's layouts (g = lane
/ 4, t = lane % 4), and a one-warp kernel that loads them, runs the instruction and stores
what it gives. The simulator's tests and its GPU twin run the same kernel on the same
registers, so the simulator's layouts are held to the hardware's."""

from __future__ import annotations

import numpy as np

from ptxforge.ptx import KernelBuilder, LaunchShape, addr, sreg

from .ptxsim import Memory, Simulator


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to bf16 (to nearest even): the bits as uint32, in the low half."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _pair(m: np.ndarray, row: int, col: int) -> int:
    return int(m[row, col]) | int(m[row, col + 1]) << 16


def mma_fragments(a_bits, b_bits, c):
    """A [16, 16] and B [16, 8] as bf16 bits, C [16, 8] f32: the lanes' a [32, 4], b [32, 2]
    (uint32) and c [32, 4] (f32) registers."""
    a, b = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32)
    cr = np.zeros((32, 4), np.float32)
    bt = b_bits.T                                   # [n, k]: a b32 holds k and k + 1
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a[lane] = [_pair(a_bits, g, 2 * t), _pair(a_bits, g + 8, 2 * t),
                   _pair(a_bits, g, 2 * t + 8), _pair(a_bits, g + 8, 2 * t + 8)]
        b[lane] = [_pair(bt, g, 2 * t), _pair(bt, g, 2 * t + 8)]
        cr[lane] = [c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]]
    return a, b, cr


def mma_result(d: np.ndarray) -> np.ndarray:
    """The lanes' d [32, 4] f32 registers as D [16, 8]."""
    out = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        out[g, 2 * t], out[g, 2 * t + 1], out[g + 8, 2 * t], out[g + 8, 2 * t + 1] = d[lane]
    return out


def matrix_fragment(m_bits: np.ndarray) -> np.ndarray:
    """An 8 x 8 b16 matrix as the lanes' b32 (row lane / 4, columns 2 (lane % 4), + 1)."""
    return np.array([_pair(m_bits, lane >> 2, 2 * (lane & 3)) for lane in range(32)], np.uint32)


def fragment_kernel() -> KernelBuilder:
    """One warp: loads a (4), b (2), c (4) and a movmatrix source (1) a lane, stores mma's
    d (4) and movmatrix's result (1) a lane; every array lane-major."""
    k = KernelBuilder("mma_fragments", target="sm_90a", max_threads=32)
    k.launch = LaunchShape(block=32)
    names = ("a", "b", "c", "m", "d", "t")
    params = {name: k.param(name, "u64") for name in names}
    lane = k.reg("u32", "lane")
    k.mov(lane, sreg.tid.x)
    at = {name: k.reg("u64", f"{name}_at") for name in names}
    for name, words in zip(names, (4, 2, 4, 1, 4, 1)):
        k.ld_param(at[name], params[name])
        k.mad(at[name], lane, 4 * words, at[name], mode="wide")
    a, b, m, t = k.regs("b32", 4, "a"), k.regs("b32", 2, "b"), k.reg("b32", "m"), k.reg("b32", "t")
    c, d = k.regs("f32", 4, "c"), k.regs("f32", 4, "d")
    k.ld(a, addr(at["a"]))
    k.ld(b, addr(at["b"]))
    k.ld(c, addr(at["c"]))
    k.ld(m, addr(at["m"]))
    k.mma_sync(d, a, b, c)
    k.movmatrix(t, m)
    k.st(addr(at["d"]), d)
    k.st(addr(at["t"]), t)
    return k


def random_problem(seed: int = 0):
    """A, B (bf16 bits), C (f32) and an 8 x 8 b16 matrix, small integers and halves so
    that every product and sum is exact in f32."""
    rng = np.random.default_rng(seed)
    a = bf16_bits(rng.integers(-8, 8, (16, 16)) / 2)
    b = bf16_bits(rng.integers(-8, 8, (16, 8)) / 4)
    c = (rng.integers(-16, 16, (16, 8)) / 8).astype(np.float32)
    m = rng.integers(0, 1 << 16, (8, 8)).astype(np.uint32)
    return a, b, c, m


def run_on_simulator(a, b, c, m):
    """fragment_kernel on the simulator over the lanes' a, b, c and m registers: its d
    [32, 4] (f32) and movmatrix's [32] (uint32)."""
    memory = Memory()
    args = {name: memory.put(array.tobytes()) for name, array in zip("abcm", (a, b, c, m))}
    args["d"], args["t"] = memory.alloc(32 * 16), memory.alloc(32 * 4)
    sim = Simulator(memory)
    sim.launch("fragments", fragment_kernel().ptx(), 1, 32, **args)
    sim.run()
    d = np.frombuffer(memory.read(args["d"], 32 * 16), np.float32).reshape(32, 4)
    t = np.frombuffer(memory.read(args["t"], 32 * 4), np.uint32)
    return d, t
