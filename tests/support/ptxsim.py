"""A small PTX interpreter, to run the communication and attention kernels on the CPU in
tests.

It runs the builder's PTX for the instruction subset the EP kernels and the decode
attention use (integer and predicate arithmetic, f32 adds, differences, products, fmas,
maxima, comparisons, reciprocals and ex2, bf16 and f16 packing, e4m3 conversions, loads and
stores of the global, shared and param spaces, reductions and atomic adds, ballots and
votes, shuffles, mma.sync m16n8k16 and movmatrix, named barriers, mbarriers with the
cp.async and cp.async.bulk copies that complete on them (a copy lands at once), clusters
along x (their barrier, mapa, distributed shared memory), branches, trap; prefetches do
nothing), one Python object a thread, over grids of up to three dimensions. Several
launches (one a simulated rank) run interleaved over one flat global memory, so a
kernel's loads and stores reach its peers' buffers as they would through CUDA IPC.

What it is not: a model of the GPU's memory ordering. Memory is sequentially consistent
(every access lands at once, in the order the scheduler runs the threads), so it checks
the protocol's logic (counts, offsets, ring wrap-around, waits, signatures, the order of
the sums), not whether the acquire/release annotations suffice: the design note argues
those. Threads run round-robin, QUANTUM instructions a turn, or as many as
``pace(launch name, CTA index, thread index)`` says: a sender that races ahead of its
receiver, or falls behind it, is what breaks a ring protocol whose waits are wrong. A thread's turn also ends at a
load with acquire semantics (a poll), so spinning costs little. A warp's collectives
(vote, shfl, bar.warp.sync) wait for all 32 lanes at the same instruction, and bar.sync
for its count of threads. ``%globaltimer`` counts the scheduler's passes over the
threads (1 ns each), so a kernel's timeout is a number of passes.
"""

from __future__ import annotations

import bisect
import re
import struct
from collections import defaultdict

import numpy as np

QUANTUM = 64
CLUSTER_SHIFT = 24   # a mapa address: the CTA's rank in its cluster + 1 above this bit


class Trap(RuntimeError):
    """A thread executed ``trap``."""


class Deadlock(RuntimeError):
    """No thread can run and some have not finished."""


class Memory:
    """Flat global memory: allocations at increasing addresses, bytes per allocation."""

    def __init__(self):
        self._bases, self._blocks, self._next = [], [], 1 << 20

    def alloc(self, nbytes: int, fill: int = 0) -> int:
        base = self._next
        self._bases.append(base)
        self._blocks.append(bytearray([fill]) * max(nbytes, 1))
        self._next = (base + nbytes + 4096) & ~255
        return base

    def _find(self, address: int, nbytes: int):
        i = bisect.bisect_right(self._bases, address) - 1
        if i < 0 or address + nbytes > self._bases[i] + len(self._blocks[i]):
            raise IndexError(f"access of {nbytes} bytes at {address:#x} outside every allocation")
        return self._blocks[i], address - self._bases[i]

    def read(self, address: int, nbytes: int) -> bytes:
        block, at = self._find(address, nbytes)
        return bytes(block[at:at + nbytes])

    def write(self, address: int, data: bytes) -> None:
        block, at = self._find(address, len(data))
        block[at:at + len(data)] = data

    def put(self, data: bytes) -> int:
        """A new allocation holding ``data``; its address."""
        address = self.alloc(len(data))
        self.write(address, data)
        return address


_WIDTH = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "b16": 2, "u32": 4, "s32": 4, "b32": 4,
          "f32": 4, "u64": 8, "s64": 8, "b64": 8, "f64": 8, "pred": 1}
_ADDRESS = re.compile(r"^\[([%\w$.]+)(?:([+-])(\d+))?\]$")


def _split_operands(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _f32(bits: int) -> np.float32:
    return np.frombuffer(struct.pack("<I", bits & 0xFFFFFFFF), dtype=np.float32)[0]


def _bits(value: np.float32) -> int:
    return struct.unpack("<I", np.float32(value).tobytes())[0]


def _e4m3_values() -> np.ndarray:
    """The non-negative finite e4m3 values, by code 0x00 .. 0x7E."""
    codes = np.arange(0x7F)
    exponent, mantissa = codes >> 3, codes & 7
    normal = (1 + mantissa / 8) * np.exp2(exponent - 7.0)
    return np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, normal)


_E4M3 = _e4m3_values()


def _e4m3_value(code: int) -> float:
    """An e4m3 byte's value (0x7F and 0xFF: NaN)."""
    code &= 0xFF
    if code & 0x7F == 0x7F:
        return float("nan")
    return float(-_E4M3[code & 0x7F] if code & 0x80 else _E4M3[code & 0x7F])


def _f16_bits(value: float) -> int:
    """f16, rounded to nearest even: its bits."""
    return int(np.array(value, np.float32).astype(np.float16).view(np.uint16))


def _e4m3_rn_satfinite(bits: int) -> int:
    """f32 -> e4m3 byte, round to nearest even, finite values beyond 448 saturated, NaN
    to 0x7F."""
    value = float(_f32(bits))
    if value != value:
        return 0x7F
    sign = 0x80 if bits >> 31 else 0
    magnitude = min(abs(value), 448.0)
    code = int(np.searchsorted(_E4M3, magnitude))  # the first value >= magnitude
    if code and (code == len(_E4M3) or magnitude - _E4M3[code - 1] < _E4M3[code] - magnitude
                 or (magnitude - _E4M3[code - 1] == _E4M3[code] - magnitude
                     and (code - 1) % 2 == 0)):
        code -= 1
    return sign | code


def _max_abs_bf16(a: int, b: int) -> int:
    """max.NaN.xorsign.abs of two bf16: the larger magnitude, the xor of the signs."""
    sign = (a ^ b) & 0x8000
    ma, mb = a & 0x7FFF, b & 0x7FFF
    if ma > 0x7F80 or mb > 0x7F80:
        return 0x7FFF
    return sign | max(ma, mb)


def _max_f32(a: int, b: int) -> int:
    """max.NaN.f32: NaN if either is, else the larger (+0 over -0)."""
    x, y = _f32(a), _f32(b)
    if x != x or y != y:
        return 0x7FFFFFFF
    if x == y:
        return a & b  # +0 (sign bit clear) wins over -0
    return a if x > y else b


def _bf16_rn(bits: int) -> int:
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:
        return (bits >> 16) | 0x40
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


class Kernel:
    """A parsed ``.entry``: parameter names, shared symbols and their offsets, instructions."""

    def __init__(self, ptx: str):
        self.shared, self.shared_bytes, self.dynamic_at = {}, 0, None
        for align, name, size in re.findall(r"^\.shared \.align (\d+) \.b8 (\w+)\[(\d+)\];", ptx,
                                            re.M):
            self.shared_bytes = -(-self.shared_bytes // int(align)) * int(align)
            self.shared[name] = self.shared_bytes
            self.shared_bytes += int(size)
        # Dynamic shared memory lies past the static arrays; its size comes with the launch.
        for align, name in re.findall(r"^\.extern \.shared \.align (\d+) \.b8 (\w+)\[\];", ptx,
                                      re.M):
            self.shared[name] = -(-self.shared_bytes // int(align)) * int(align)
            self.dynamic_at = self.shared[name]
        self.params = re.findall(r"\.param \.\w+ (\w+)", ptx)
        body = ptx[ptx.index("{") + 1:ptx.rindex("}")]
        self.code, self.labels, self.polls = [], {}, []
        for raw in body.splitlines():
            line = raw.split("//")[0].strip()
            if not line or line.startswith(".reg"):
                continue
            if line.endswith(":"):
                self.labels[line[:-1]] = len(self.code)
                continue
            self.code.append(line.rstrip(";"))
        self.program = [self._compile(line) for line in self.code]
        opcodes = [line.split()[1 if line.startswith("@") else 0] for line in self.code]
        self.polls = [".acquire." in op or op.startswith("mbarrier.try_wait") for op in opcodes]

    # Each instruction becomes (guard, negate, kind, function); function(thread) runs it.
    def _compile(self, line: str):
        guard, negate = None, False
        if line.startswith("@"):
            guard, line = line[1:].split(None, 1)
            if guard.startswith("!"):
                guard, negate = guard[1:], True
        parts = line.split(None, 1)
        opcode, operands = parts[0], _split_operands(parts[1]) if len(parts) > 1 else []
        q = opcode.split(".")
        return guard, negate, q[0], self._handler(opcode, q, operands)

    def _handler(self, opcode, q, ops):  # noqa: C901 - one branch per instruction family
        kind, t = q[0], q[-1]
        mask = (1 << (8 * _WIDTH.get(t, 8))) - 1 if t in _WIDTH else None
        value = self._reader
        if kind in ("griddepcontrol", "fence", "ret", "trap", "exit", "prefetch"):
            return None
        if kind == "bra":
            target = ops[0]
            return lambda th: self.labels[target]
        if kind == "mov" and ops[1].startswith("{"):  # two halves into one word, low first
            lo, hi = (value(h.strip()) for h in ops[1].strip("{}").split(","))
            half = 8 * _WIDTH[t] // 2
            return _assign(ops[0], lambda th: lo(th) | (hi(th) << half))
        if kind == "mov":
            src = value(ops[1])
            return _assign(ops[0], lambda th: src(th) & mask)
        if kind in ("add", "sub", "min", "and", "or", "xor", "shl", "shr", "div", "rem") \
                and t != "f32":
            a, b = value(ops[1]), value(ops[2])
            fn = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "min": min,
                  "and": lambda x, y: x & y, "or": lambda x, y: x | y,
                  "xor": lambda x, y: x ^ y, "shl": lambda x, y: x << y,
                  "shr": lambda x, y: x >> y, "div": lambda x, y: x // y,
                  "rem": lambda x, y: x % y}[kind]
            if t == "pred":
                return _assign(ops[0], lambda th: fn(a(th), b(th)) & 1)
            return _assign(ops[0], lambda th: fn(a(th), b(th)) & mask)
        if kind == "add" and t == "f32":
            a, b = value(ops[1]), value(ops[2])
            return _assign(ops[0], lambda th: _bits(_f32(a(th)) + _f32(b(th))))
        if kind == "sub" and t == "f32":
            a, b = value(ops[1]), value(ops[2])
            return _assign(ops[0], lambda th: _bits(_f32(a(th)) - _f32(b(th))))
        if kind == "fma" and t == "f32":   # rounded once, as fma.rn is
            a, b, c = value(ops[1]), value(ops[2]), value(ops[3])
            return _assign(ops[0], lambda th: _bits(np.float32(
                np.float64(_f32(a(th))) * np.float64(_f32(b(th))) + np.float64(_f32(c(th))))))
        if kind == "ex2" and t == "f32":   # the exact value: ex2.approx is within 2 ulp
            a = value(ops[1])
            return _assign(ops[0], lambda th: _bits(np.exp2(_f32(a(th)))))
        if kind == "max" and q[1:] == ["f32"]:   # a NaN operand gives the other
            a, b = value(ops[1]), value(ops[2])
            return _assign(ops[0], lambda th: _bits(np.fmax(_f32(a(th)), _f32(b(th)))))
        if kind == "setp" and t == "f32":
            a, b = value(ops[1]), value(ops[2])
            cmp = {"lt": np.less, "le": np.less_equal, "gt": np.greater,
                   "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal}[q[1]]
            return _assign(ops[0], lambda th: int(cmp(_f32(a(th)), _f32(b(th)))))
        if kind == "mul" and t == "f32":
            a, b = value(ops[1]), value(ops[2])
            return _assign(ops[0], lambda th: _bits(_f32(a(th)) * _f32(b(th))))
        if kind == "rcp" and t == "f32":
            a = value(ops[1])
            def reciprocal(th):
                with np.errstate(divide="ignore"):    # 1 / 0 is inf, as on the GPU
                    return _bits(np.float32(1) / _f32(a(th)))
            return _assign(ops[0], reciprocal)
        if kind == "max" and q[1] == "NaN" and t in ("f32", "bf16x2"):
            a, b = value(ops[1]), value(ops[2])
            if t == "f32":
                return _assign(ops[0], lambda th: _max_f32(a(th), b(th)))
            if "xorsign" not in q:
                raise NotImplementedError(opcode)
            return _assign(ops[0], lambda th: _max_abs_bf16(a(th) >> 16, b(th) >> 16) << 16
                           | _max_abs_bf16(a(th) & 0xFFFF, b(th) & 0xFFFF))
        if kind in ("mul", "mad"):
            a, b = value(ops[1]), value(ops[2])
            c = value(ops[3]) if kind == "mad" else (lambda th: 0)
            out = (1 << 64) - 1 if q[1] == "wide" else mask
            return _assign(ops[0], lambda th: (a(th) * b(th) + c(th)) & out)
        if kind == "selp":
            a, b, p = value(ops[1]), value(ops[2]), value(ops[3])
            return _assign(ops[0], lambda th: (a(th) if p(th) else b(th)) & mask)
        if kind == "setp":
            a, b = value(ops[1]), value(ops[2])
            cmp = {"lt": int.__lt__, "le": int.__le__, "gt": int.__gt__, "ge": int.__ge__,
                   "eq": int.__eq__, "ne": int.__ne__, "lo": int.__lt__, "ls": int.__le__,
                   "hi": int.__gt__, "hs": int.__ge__}[q[1]]
            if t[0] == "s":
                raise NotImplementedError(opcode)
            return _assign(ops[0], lambda th: int(cmp(a(th), b(th))))
        if kind == "bfe":
            a, pos, length = value(ops[1]), value(ops[2]), value(ops[3])
            return _assign(ops[0], lambda th: (a(th) >> pos(th)) & ((1 << length(th)) - 1))
        if kind == "popc":
            a = value(ops[1])
            return _assign(ops[0], lambda th: bin(a(th)).count("1"))
        if kind == "bfind":
            if t != "u32":
                raise NotImplementedError(opcode)
            a = value(ops[1])
            return _assign(ops[0], lambda th: a(th).bit_length() - 1 if a(th) else 0xFFFFFFFF)
        if kind == "cvt":
            if q[-2] == "e4m3x2":  # the first source in the upper byte
                hi, lo = value(ops[1]), value(ops[2])
                return _assign(ops[0], lambda th: (_e4m3_rn_satfinite(hi(th)) << 8)
                               | _e4m3_rn_satfinite(lo(th)))
            if q[-2] == "bf16x2":
                hi, lo = value(ops[1]), value(ops[2])
                return _assign(ops[0], lambda th: (_bf16_rn(hi(th)) << 16) | _bf16_rn(lo(th)))
            if q[-2] == "f16x2" and q[-1] == "e4m3x2":   # the upper byte to the upper half
                a = value(ops[1])
                return _assign(ops[0], lambda th: _f16_bits(_e4m3_value(a(th) >> 8)) << 16
                               | _f16_bits(_e4m3_value(a(th) & 0xFF)))
            if q[-2] == "f16x2":
                hi, lo = value(ops[1]), value(ops[2])
                return _assign(ops[0], lambda th: _f16_bits(float(_f32(hi(th)))) << 16
                               | _f16_bits(float(_f32(lo(th)))))
            a, out = value(ops[1]), (1 << (8 * _WIDTH[q[-2]])) - 1
            return _assign(ops[0], lambda th: a(th) & out)
        if kind in ("ld", "st", "red", "atom"):
            return self._memory(opcode, q, ops)
        if kind in ("mbarrier", "cp"):
            return self._async(opcode, q, ops)
        if kind == "mapa":   # another CTA's shared address: its rank + 1 above bit 24
            a, rank = value(ops[1]), value(ops[2])
            return _assign(ops[0], lambda th: ((rank(th) + 1) << CLUSTER_SHIFT)
                           | (a(th) & ((1 << CLUSTER_SHIFT) - 1)))
        if kind in ("vote", "shfl", "bar", "barrier", "mma", "movmatrix"):
            return None  # collectives and barriers: the scheduler's
        raise NotImplementedError(f"ptxsim: {opcode}")

    def _memory(self, opcode, q, ops):
        space = next(s for s in ("global", "shared", "param")
                     if s in q or (s == "shared" and any(x.startswith("shared::") for x in q)))
        t = q[-1]
        width = _WIDTH[t]
        count = int(q[-2][1:]) if q[-2].startswith("v") else 1
        address = ops[1] if q[0] in ("ld", "atom") else ops[0]
        if space == "param":
            name = address[1:-1]
            return _assign(ops[0], lambda th: th.args[name])
        where = self._address(address)
        fmt = "<" + {1: "B", 2: "H", 4: "I", 8: "Q"}[width] * count

        if q[0] == "ld":
            dests = ops[0].strip("{}").replace(" ", "").split(",")

            def load(th):
                data = th.load(space, where(th), width * count)
                for d, v in zip(dests, struct.unpack(fmt, data)):
                    th.regs[d] = v
            return load
        if q[0] == "st":
            sources = [self._reader(s) for s in ops[1].strip("{}").replace(" ", "").split(",")]
            mask = (1 << (8 * width)) - 1

            def store(th):
                th.store(space, where(th), struct.pack(fmt, *[s(th) & mask for s in sources]))
            return store
        value, mask = self._reader(ops[2 if q[0] == "atom" else 1]), (1 << (8 * width)) - 1
        if q[-2] != "add":
            raise NotImplementedError(opcode)

        def reduce(th):
            at = where(th)
            old = struct.unpack(fmt, th.load(space, at, width))[0]
            th.store(space, at, struct.pack(fmt, (old + value(th)) & mask))
            if q[0] == "atom":
                th.regs[ops[0]] = old
        return reduce

    def _async(self, opcode, q, ops):
        """mbarriers (a CTA's, by shared address: expected arrivals, pending arrivals,
        transaction bytes, phase) and the copies that complete on them. A copy lands at
        once; its bytes count against the barrier's transactions."""
        at = self._address
        if opcode.startswith("mbarrier.init"):
            bar, count = at(ops[0]), self._reader(ops[1])
            return lambda th: th.cta.mbarrier_init(bar(th), count(th))
        if opcode.startswith("mbarrier.arrive.expect_tx"):
            bar, nbytes = at(ops[1]), self._reader(ops[2])
            return lambda th: th.cta.mbarrier_update(bar(th), arrivals=1, tx=nbytes(th))
        if opcode.startswith("mbarrier.arrive"):
            bar = at(ops[1])
            return lambda th: th.cta.mbarrier_update(bar(th), arrivals=1)
        if opcode.startswith("mbarrier.try_wait.parity"):
            bar, parity = at(ops[1]), self._reader(ops[2])
            return _assign(ops[0], lambda th: int(th.cta.mbarrier_phase(bar(th)) & 1
                                                  != parity(th) & 1))
        if opcode.startswith("cp.async.mbarrier.arrive.noinc"):   # its copies have landed
            bar = at(ops[0])
            return lambda th: th.cta.mbarrier_update(bar(th), arrivals=1)
        if opcode.startswith("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx"):
            dst, src, nbytes, bar = at(ops[0]), at(ops[1]), self._reader(ops[2]), at(ops[3])

            def bulk(th):
                th.store("shared", dst(th), th.load("global", src(th), nbytes(th)))
                th.cta.mbarrier_update(bar(th), tx=-nbytes(th))
            return bulk
        if opcode.startswith(("cp.async.ca.shared.global", "cp.async.cg.shared.global")):
            dst, src, nbytes = at(ops[0]), at(ops[1]), int(ops[2])
            return lambda th: th.store("shared", dst(th), th.load("global", src(th), nbytes))
        raise NotImplementedError(f"ptxsim: {opcode}")

    def _address(self, text: str):
        """A function of the thread giving the address ``[base+offset]`` names."""
        base, sign, offset = _ADDRESS.match(text).groups()
        read, offset = self._reader(base), int(offset or 0) * (-1 if sign == "-" else 1)
        return lambda th: read(th) + offset

    def _reader(self, text: str):
        """A function of the thread giving the operand's value (bits, unsigned)."""
        if text.startswith("%"):
            special = _SPECIAL.get(text)
            if special is not None:
                return special
            return lambda th: th.regs[text]
        if text.startswith("!%"):  # a negated predicate
            name = text[1:]
            return lambda th: int(not th.regs[name])
        if text.startswith("0f"):
            bits = int(text[2:], 16)
            return lambda th: bits
        if re.fullmatch(r"-?\d+", text):
            number = int(text) & ((1 << 64) - 1)
            return lambda th: number
        if text in self.shared:
            offset = self.shared[text]
            return lambda th: offset
        raise NotImplementedError(f"ptxsim: operand {text}")


def _assign(dest: str, compute):
    def run(th):
        th.regs[dest] = compute(th)
    return run


_SPECIAL = {
    "%tid.x": lambda th: th.tid,
    "%ctaid.x": lambda th: th.cta.coords[0], "%ctaid.y": lambda th: th.cta.coords[1],
    "%ctaid.z": lambda th: th.cta.coords[2],
    "%nctaid.x": lambda th: th.launch.grid[0], "%nctaid.y": lambda th: th.launch.grid[1],
    "%nctaid.z": lambda th: th.launch.grid[2],
    "%laneid": lambda th: th.tid & 31,
    "%lanemask_lt": lambda th: (1 << (th.tid & 31)) - 1,
    "%globaltimer": lambda th: th.sim.clock,
}


class _Cta:
    def __init__(self, index: int, coords: tuple, threads: int, shared_bytes: int):
        self.index, self.coords, self.threads = index, coords, threads
        self.shared = bytearray(max(shared_bytes, 1))
        self.barriers: dict[int, list] = {}
        self.mbarriers: dict[int, list] = {}   # address: [expected, pending, tx, phase]

    def mbarrier_init(self, address: int, count: int) -> None:
        self.mbarriers[address] = [count, count, 0, 0]

    def mbarrier_update(self, address: int, arrivals: int = 0, tx: int = 0) -> None:
        """Arrivals and transaction bytes (expected: +, landed: -); the phase completes
        when no arrival is pending and no byte outstanding."""
        bar = self.mbarriers.get(address)
        if bar is None:
            raise RuntimeError(f"ptxsim: CTA {self.index} uses an mbarrier at shared "
                               f"{address:#x} that was never initialised")
        bar[1] -= arrivals
        bar[2] += tx
        if bar[1] < 0:
            raise RuntimeError(f"ptxsim: CTA {self.index}: more arrivals than expected on "
                               f"the mbarrier at shared {address:#x}")
        if bar[1] == 0 and bar[2] == 0:
            bar[1], bar[3] = bar[0], bar[3] + 1

    def mbarrier_phase(self, address: int) -> int:
        return self.mbarriers[address][3]


class _Thread:
    def __init__(self, sim, launch, cta, tid):
        self.sim, self.launch, self.cta, self.tid = sim, launch, cta, tid
        # A register read before any write reads 0 (a load a guard skipped, then unpacked
        # and discarded, as the combine's sum does for ranks a token skips).
        self.args, self.regs, self.pc = launch.args, defaultdict(int), 0
        self.blocked = self.done = False
        self.cluster_phase = 0      # cluster barriers this thread arrived at

    def load(self, space, address, nbytes):
        if space == "shared":
            cta, address = self.launch.shared_of(self.cta, address)
            return bytes(cta.shared[address:address + nbytes])
        return self.sim.memory.read(address, nbytes)

    def store(self, space, address, data):
        if space == "shared":
            self.cta.shared[address:address + len(data)] = data
        else:
            self.sim.memory.write(address, data)


class _Launch:
    def __init__(self, name, kernel, grid, block, args, shared_bytes=0, cluster=1):
        missing = set(kernel.params) - set(args)
        extra = set(args) - set(kernel.params)
        if missing or extra:
            raise TypeError(f"{name}: missing {sorted(missing)}, unknown {sorted(extra)}")
        self.name, self.kernel, self.args = name, kernel, args
        self.grid = (grid, 1, 1) if isinstance(grid, int) else tuple(grid) + (1,) * (3 - len(grid))
        x, y, z = self.grid
        size = kernel.shared_bytes if kernel.dynamic_at is None else \
            kernel.dynamic_at + shared_bytes
        self.ctas = [_Cta(i, (i % x, i // x % y, i // (x * y)), block, size)
                     for i in range(x * y * z)]
        if x % cluster:
            raise ValueError(f"{name}: a grid of {x} CTAs in x holds no whole clusters of "
                             f"{cluster}")
        self.cluster, self.block = cluster, block
        self.cluster_arrivals: dict = defaultdict(int)   # (cluster, phase): threads arrived

    def cluster_of(self, cta) -> tuple:
        x, y, z = cta.coords
        return (x // self.cluster, y, z)

    def shared_of(self, cta, address: int) -> tuple:
        """(the CTA, the offset) a shared address names: this CTA's, or a mapa address's."""
        rank = address >> CLUSTER_SHIFT
        if not rank:
            return cta, address
        x, y, z = cta.coords
        x = x // self.cluster * self.cluster + rank - 1
        gx, gy, _ = self.grid
        return self.ctas[x + gx * (y + gy * z)], address & ((1 << CLUSTER_SHIFT) - 1)


class Simulator:
    """Launches kernels over one Memory and runs them all, interleaved, to completion."""

    def __init__(self, memory: Memory, pace=None):
        self.memory, self.clock = memory, 0
        self.threads: list[_Thread] = []
        self._warps: dict = {}
        self._pace = pace

    def launch(self, name: str, ptx_or_kernel, grid, block: int, *, shared_bytes: int = 0,
               cluster: int = 1, **args) -> None:
        """``grid``: CTAs, or a tuple of up to three dimensions (x fastest);
        ``shared_bytes``: the dynamic shared memory; ``cluster``: CTAs a cluster, along x."""
        kernel = ptx_or_kernel if isinstance(ptx_or_kernel, Kernel) else Kernel(ptx_or_kernel)
        launch = _Launch(name, kernel, grid, block, args, shared_bytes, cluster)
        for cta in launch.ctas:
            for tid in range(block):
                self.threads.append(_Thread(self, launch, cta, tid))

    def run(self, max_passes: int = 10_000_000) -> int:
        """Run every launched thread to its end; the passes it took."""
        while True:
            self.clock += 1
            progress, alive = False, False
            for th in self.threads:
                if th.done:
                    continue
                alive = True
                if not th.blocked and self._step(th, self._quantum(th)):
                    progress = True
            if not alive:
                self.threads = []
                return self.clock
            if not progress:
                stuck = [(th.launch.name, th.cta.index, th.tid, th.launch.kernel.code[th.pc])
                         for th in self.threads if not th.done][:5]
                raise Deadlock(f"no thread can run; e.g. {stuck}")
            if self.clock > max_passes:
                raise Deadlock(f"more than {max_passes} passes")

    def _quantum(self, th: _Thread) -> int:
        return QUANTUM if self._pace is None else self._pace(th.launch.name, th.cta.index, th.tid)

    def _step(self, th: _Thread, quantum: int) -> bool:
        kernel = th.launch.kernel
        program, code, polls = kernel.program, kernel.code, kernel.polls
        ran = 0
        while ran < quantum and not th.blocked and not th.done:
            guard, negate, kind, fn = program[th.pc]
            ran += 1
            if guard is not None and bool(th.regs[guard]) == negate:
                th.pc += 1
                continue
            if fn is not None:
                poll = polls[th.pc]
                target = fn(th)
                th.pc = target if kind == "bra" else th.pc + 1
                if poll:
                    break
                continue
            if kind == "ret" or kind == "exit":
                th.done = True
            elif kind == "trap":
                raise Trap(f"{th.launch.name}: CTA {th.cta.index} thread {th.tid} trapped at "
                           f"{code[th.pc]!r}")
            elif kind in ("vote", "shfl", "mma", "movmatrix") \
                    or code[th.pc].startswith("bar.warp.sync"):
                self._collective(th, code[th.pc])
            elif kind == "bar":
                self._barrier(th, code[th.pc])
            elif kind == "barrier":
                if not self._cluster_barrier(th, code[th.pc]):
                    break       # waiting: the thread's turn ends, it polls again
            else:
                th.pc += 1  # fences, griddepcontrol
        return ran > 0

    def _collective(self, th: _Thread, line: str) -> None:
        key = (id(th.launch), th.cta.index, th.tid >> 5, th.pc)
        pending = self._warps.setdefault(key, {})
        pending[th.tid & 31] = th
        th.blocked = True
        if len(pending) < 32:
            return
        del self._warps[key]
        opcode, rest = line.split(None, 1)
        ops = _split_operands(rest)
        lanes = [pending[lane] for lane in range(32)]
        kernel = th.launch.kernel
        if opcode.startswith("vote.sync.ballot"):
            p = kernel._reader(ops[1])
            ballot = sum(1 << lane for lane, t in enumerate(lanes) if p(t))
            results = [ballot] * 32
        elif opcode.startswith("vote.sync.any.pred"):
            p = kernel._reader(ops[1])
            results = [int(any(p(t) for t in lanes))] * 32
        elif opcode.startswith("shfl.sync.idx"):
            a, b = kernel._reader(ops[1]), kernel._reader(ops[2])
            values = [a(t) for t in lanes]
            results = [values[b(t) & 31] for t in lanes]
        elif opcode.startswith("shfl.sync.bfly"):
            a, b = kernel._reader(ops[1]), kernel._reader(ops[2])
            values = [a(t) for t in lanes]
            results = [values[lane ^ (b(t) & 31)] for lane, t in enumerate(lanes)]
        elif opcode == "bar.warp.sync":
            results = None
        elif opcode == "movmatrix.sync.aligned.m8n8.trans.b16":
            words = [kernel._reader(ops[1])(t) for t in lanes]
            results = [_transposed_pair(words, lane) for lane in range(32)]
        elif opcode.startswith("mma.sync.aligned.m16n8k16.row.col.f32."):
            _mma_m16n8k16(kernel, lanes, ops, opcode.split(".")[-3])
            results = None
        else:
            raise NotImplementedError(f"ptxsim: {opcode}")
        for lane, t in enumerate(lanes):
            if results is not None:
                t.regs[ops[0]] = results[lane]
            t.pc += 1
            t.blocked = False

    def _cluster_barrier(self, th: _Thread, line: str) -> bool:
        """barrier.cluster.arrive counts the thread in its cluster's current phase;
        barrier.cluster.wait passes once every thread of the cluster arrived at the phase
        this thread last arrived at. Returns whether the thread went on."""
        launch = th.launch
        cluster = launch.cluster_of(th.cta)
        if line.startswith("barrier.cluster.arrive"):
            launch.cluster_arrivals[cluster, th.cluster_phase] += 1
            th.cluster_phase += 1
        elif launch.cluster_arrivals[cluster, th.cluster_phase - 1] < launch.cluster * launch.block:
            return False
        th.pc += 1
        return True

    def _barrier(self, th: _Thread, line: str) -> None:
        ops = _split_operands(line.split(None, 1)[1])
        kernel = th.launch.kernel
        ident = kernel._reader(ops[0])(th)
        count = kernel._reader(ops[1])(th) if len(ops) > 1 else th.cta.threads
        waiting = th.cta.barriers.setdefault(ident, [])
        waiting.append(th)
        th.blocked = True
        if len(waiting) < count:
            return
        del th.cta.barriers[ident]
        for t in waiting:
            t.pc += 1
            t.blocked = False


def _transposed_pair(words: list[int], lane: int) -> int:
    """movmatrix.trans: lane ``lane``'s b32 of the transposed 8 x 8 b16 matrix, whose row r
    lane 4r + c // 2 held, column c in its half c % 2."""
    def element(row, col):
        return (words[4 * row + col // 2] >> (16 * (col % 2))) & 0xFFFF
    row, col = lane >> 2, 2 * (lane & 3)
    return element(col, row) | element(col + 1, row) << 16


def _halves(word: int, dtype: str) -> tuple[float, float]:
    """The two 16-bit values of a b32 (low first) as floats."""
    lo, hi = word & 0xFFFF, word >> 16
    if dtype == "bf16":
        return float(_f32(lo << 16)), float(_f32(hi << 16))
    return (float(np.frombuffer(struct.pack("<H", lo), np.float16)[0]),
            float(np.frombuffer(struct.pack("<H", hi), np.float16)[0]))


def _registers(text: str) -> list[str]:
    return [r.strip() for r in text.strip("{}").split(",")]


def _mma_m16n8k16(kernel, lanes, ops, dtype: str) -> None:
    """mma.sync m16n8k16 .row.col with f32 accumulators, in the PTX ISA's fragment
    layouts (g = lane / 4, t = lane % 4): A's a0..a3 hold (g, 2t..2t+1), (g + 8, ...),
    (g, 2t + 8..), (g + 8, 2t + 8..); B's b0, b1 hold (k = 2t..2t+1, n = g), (k + 8, ...);
    C and D's c0..c3 (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1). The products
    are summed in f64 and rounded to f32 once."""
    d, a, b, c = (_registers(op) for op in ops)
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane, t in enumerate(lanes):
        g, tig = lane >> 2, lane & 3
        read = lambda name: kernel._reader(name)(t)
        for i, (row, col) in enumerate(((g, 2 * tig), (g + 8, 2 * tig), (g, 2 * tig + 8),
                                        (g + 8, 2 * tig + 8))):
            A[row, col:col + 2] = _halves(read(a[i]), dtype)
        for i, k in enumerate((2 * tig, 2 * tig + 8)):
            B[k:k + 2, g] = _halves(read(b[i]), dtype)
        for i, (row, col) in enumerate(((g, 2 * tig), (g, 2 * tig + 1), (g + 8, 2 * tig),
                                        (g + 8, 2 * tig + 1))):
            C[row, col] = float(_f32(read(c[i])))
    D = (A @ B + C).astype(np.float32)
    for lane, t in enumerate(lanes):
        g, tig = lane >> 2, lane & 3
        for i, (row, col) in enumerate(((g, 2 * tig), (g, 2 * tig + 1), (g + 8, 2 * tig),
                                        (g + 8, 2 * tig + 1))):
            t.regs[d[i]] = _bits(D[row, col])
