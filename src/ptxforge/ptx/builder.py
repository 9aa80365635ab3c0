"""The kernel builder: one object per kernel, one method call per PTX instruction.

    k = KernelBuilder("scale", target="sm_90a", max_threads=256)
    x_ptr = k.param("x", "u64")
    with k.stage("load"):
        base = k.reg("u64", "base")
        k.ld_param(base, x_ptr)
        ...
    text = k.ptx()

The builder owns declarations (parameters, registers, shared memory, labels) and
structured control flow (``guard``, ``if_``, ``loop``). Instruction families live in
sibling modules as mixins; every instruction method ends in exactly one ``emit`` call,
which a test holds them to. Multi-instruction building blocks live in
``ptxforge.patterns`` and say what they emit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from .. import arch
from .arith import ArithmeticOps
from .memory import MemoryOps
from . import sreg
from .operands import REG_TYPES, Address, NegPred, Operand, Reg, Symbol, format_operand
from .sync import SyncOps
from .tensor import TensorOps
from .warp import WarpOps

# Default register-name prefixes: distinct per type so each bank gets one `.reg .T %p<N>;`.
_DEFAULT_PREFIX = {
    "pred": "p", "b8": "bb", "b16": "h", "b32": "b", "b64": "bd", "u8": "ub", "u16": "uh",
    "u32": "r", "u64": "rd", "s8": "sb", "s16": "sh", "s32": "s", "s64": "sd", "f16": "hf",
    "f16x2": "hf2_", "bf16": "bh", "bf16x2": "bh2_", "f32": "f", "f64": "fd",
}

# How each kernel parameter type is laid out in the argument buffer (size, alignment).
PARAM_LAYOUT = {
    "u32": (4, 4), "s32": (4, 4), "f32": (4, 4), "b32": (4, 4),
    "u64": (8, 8), "s64": (8, 8), "f64": (8, 8), "b64": (8, 8),
    "tensormap": (128, 64),
}


@dataclass(frozen=True)
class TensorMap:
    """What a TMA descriptor parameter describes, besides the tensor it is made for: the
    element type (a torch dtype name), the box one copy moves (innermost dimension first,
    in elements) and the shared-memory swizzle. The kernel's copies and expect-tx counts
    use the same box; the launch encodes the descriptor from it."""

    dtype: str
    box: tuple
    swizzle: int = 0

    @property
    def box_bytes(self) -> int:
        elements = 1
        for size in self.box:
            elements *= size
        return elements * _ELEMENT_BYTES[self.dtype]


_ELEMENT_BYTES = {"float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "bfloat16": 2, "float16": 2,
                  "float32": 4, "int32": 4}


@dataclass(frozen=True)
class LaunchShape:
    """How a kernel is launched, besides its grid: threads per CTA, dynamic shared memory,
    CTAs per cluster, and the launch attributes: ``cooperative`` (every CTA resident at
    once) and ``programmatic`` (the kernel may start while the previous one on its stream
    finishes; it waits with griddepcontrol.wait)."""

    block: int
    shared_bytes: int = 0
    cluster: int = 1
    cooperative: bool = False
    programmatic: bool = False


@dataclass(frozen=True)
class Param(Symbol):
    """A kernel parameter. ``tensormap`` parameters are 128-byte, 64-aligned CUtensorMap blobs
    passed by value (the PTX form of a ``const __grid_constant__ CUtensorMap``); their
    ``tensor_map`` says what the descriptor must describe."""

    type: str = "u64"
    tensor_map: TensorMap | None = None

    @property
    def size(self) -> int:
        return PARAM_LAYOUT[self.type][0]

    @property
    def align(self) -> int:
        return PARAM_LAYOUT[self.type][1]

    def declaration(self) -> str:
        if self.type == "tensormap":
            return f".param .align 64 .b8 {self.name}[128]"
        return f".param .{self.type} {self.name}"


@dataclass(frozen=True)
class Label(Symbol):
    pass


@dataclass(frozen=True)
class SharedBuffer(Symbol):
    """Shared memory: a static array, or the kernel's dynamic shared memory (``nbytes`` None)."""

    nbytes: int | None = None
    align: int = 16

    def declaration(self) -> str:
        if self.nbytes is None:
            return f".extern .shared .align {self.align} .b8 {self.name}[];"
        return f".shared .align {self.align} .b8 {self.name}[{self.nbytes}];"


class KernelBuilder(ArithmeticOps, MemoryOps, SyncOps, WarpOps, TensorOps):
    """Builds the PTX of one ``.entry`` function."""

    def __init__(
        self,
        name: str,
        *,
        target: str = "sm_90a",
        ptx_version: str | None = None,
        max_threads: int | None = None,
        min_blocks_per_sm: int | None = None,
        cluster_size: int | None = None,
    ):
        if not name.isidentifier():
            raise ValueError(f"kernel name must be a C identifier, got {name!r}")
        self.name = name
        self.target = target
        if ptx_version is None:  # the target's description says which ISA version it needs
            ptx_version = arch.get(target).ptx_version
        self.ptx_version = ptx_version
        self.max_threads = max_threads
        self.min_blocks_per_sm = min_blocks_per_sm
        self.cluster_size = cluster_size
        # How the kernel is launched; a generator whose launch differs sets its own.
        self.launch = LaunchShape(block=max_threads or 1, cluster=cluster_size or 1)
        self.params: list[Param] = []
        self.shared_buffers: list[SharedBuffer] = []
        self._banks: dict[str, tuple[str, int]] = {}  # prefix -> (type, count): %prefix<count>
        self._singles: dict[str, str] = {}  # name -> type: registers declared one by one
        self._labels: dict[str, int] = {}
        self._body: list[str] = []
        self._guard: Reg | NegPred | None = None
        self._indent = 1
        self.instruction_count = 0

    # ----------------------------------------------------------------- declarations
    def param(self, name: str, type: str, tensor_map: TensorMap | None = None) -> Param:
        """Declare the next kernel parameter; launches bind it by ``name``."""
        if type not in PARAM_LAYOUT:
            raise ValueError(f"param type must be one of {sorted(PARAM_LAYOUT)}, got {type!r}")
        if not name.isidentifier():
            raise ValueError(f"param name must be an identifier, got {name!r}")
        if any(p.name == name for p in self.params):
            raise ValueError(f"kernel {self.name} already has a parameter named {name!r}")
        p = Param(name, type, tensor_map)
        self.params.append(p)
        return p

    def tensormap_param(self, name: str, tensor_map: TensorMap | None = None) -> Param:
        """A TMA descriptor passed by value (``.param .align 64 .b8 name[128]``), and what
        it must describe."""
        return self.param(name, "tensormap", tensor_map)

    def reg(self, type: str, name: str | None = None) -> Reg:
        """One register; a name used for the first time is kept as it is (``%row``)."""
        if (name and name.isidentifier() and not name[-1].isdigit() and name not in self._singles
                and name not in self._banks and name not in sreg.NAMES):
            if type not in REG_TYPES:
                raise ValueError(f"register type must be one of {sorted(REG_TYPES)}, got {type!r}")
            self._singles[name] = type
            return Reg(f"%{name}", type)
        return self.regs(type, 1, name)[0]

    def regs(self, type: str, count: int, name: str | None = None) -> list[Reg]:
        """``count`` fresh registers of one type, named ``%name0, %name1, ...``."""
        if type not in REG_TYPES:
            raise ValueError(f"register type must be one of {sorted(REG_TYPES)}, got {type!r}")
        prefix = name or _DEFAULT_PREFIX[type]
        if not prefix.replace("_", "a").isalnum():
            raise ValueError(f"register name must be letters, digits and '_', got {name!r}")
        if prefix[-1].isdigit():
            prefix += "_"
        if prefix in self._singles or (prefix in self._banks and self._banks[prefix][0] != type):
            prefix = f"{prefix}_{type}_"
        bank_type, used = self._banks.get(prefix, (type, 0))
        self._banks[prefix] = (bank_type, used + count)
        return [Reg(f"%{prefix}{used + i}", type) for i in range(count)]

    def pred(self, name: str | None = None) -> Reg:
        return self.reg("pred", name)

    def shared(self, name: str, nbytes: int, align: int = 16) -> SharedBuffer:
        """A static shared-memory array; use its name as an address operand."""
        self._check_shared_name(name)
        buf = SharedBuffer(name, nbytes, align)
        self.shared_buffers.append(buf)
        return buf

    def _check_shared_name(self, name: str) -> None:
        if any(b.name == name for b in self.shared_buffers):
            raise ValueError(f"kernel {self.name} already declares shared memory {name!r}")

    def dynamic_shared(self, name: str = "smem", align: int = 1024) -> SharedBuffer:
        """The kernel's dynamic shared memory (size chosen at launch)."""
        self._check_shared_name(name)
        buf = SharedBuffer(name, None, align)
        self.shared_buffers.append(buf)
        return buf

    def label(self, hint: str) -> Label:
        n = self._labels.get(hint, 0)
        self._labels[hint] = n + 1
        return Label(f"$L_{hint}_{n}")

    # ----------------------------------------------------------------- emission
    def emit(self, opcode: str, *operands: Operand, imm_type: str | None = None) -> None:
        """Emit one instruction: ``[@guard] opcode op0, op1, ...;``."""
        text = opcode
        if operands:
            try:
                text += " " + ", ".join(format_operand(o, imm_type) for o in operands)
            except ValueError as exc:  # an immediate the instruction's type cannot hold
                raise ValueError(f"{opcode}: {exc}") from None
        if self._guard is not None:
            text = f"@{self._guard} {text}"
        self._body.append("\t" * self._indent + text + ";")
        self.instruction_count += 1

    def place(self, label: Label) -> None:
        """Place a label at the current position."""
        self._body.append(f"{label.name}:")

    def comment(self, text: str) -> None:
        for line in text.splitlines():
            self._body.append("\t" * self._indent + f"// {line}")

    def raw(self, text: str) -> None:
        """Escape hatch: paste PTX text verbatim. No shipped kernel uses it."""
        self._body.append(text)

    @contextlib.contextmanager
    def stage(self, title: str):
        """Mark a named stage of the kernel in the emitted PTX."""
        self._body.append("")
        self.comment(f"==== {title} ====")
        yield

    # ----------------------------------------------------------------- control flow
    def bra(self, target: Label, *, uniform: bool = False) -> None:
        """Branch; ``uniform`` promises every thread takes the same way (``bra.uni``)."""
        self.emit("bra.uni" if uniform else "bra", target)

    def exit(self) -> None:
        self.emit("exit")

    def trap(self) -> None:
        self.emit("trap")

    @contextlib.contextmanager
    def guard(self, pred: Reg | NegPred):
        """Predicate every instruction emitted inside: ``@p op ...``."""
        if self._guard is not None:
            raise RuntimeError("guards do not nest; combine the predicates with and.pred")
        self._guard = pred
        try:
            yield
        finally:
            self._guard = None

    @contextlib.contextmanager
    def if_(self, pred: Reg | NegPred, hint: str = "endif", *, uniform: bool = False):
        """Run the body only where ``pred`` holds. ``uniform``: every thread of each warp
        agrees on ``pred`` (``bra.uni``), so ptxas need not guard warp-collective
        instructions in the body against divergence."""
        skip = self.label(hint)
        with self.guard(~pred):
            self.bra(skip, uniform=uniform)
        self._indent += 1
        yield
        self._indent -= 1
        self.place(skip)

    @contextlib.contextmanager
    def loop(self, counter: Reg, stop: Operand, *, start: Operand = 0, step: Operand = 1,
             hint: str = "loop", uniform: bool = False):
        """A run-time loop: ``for (counter = start; counter < stop; counter += step)``.
        ``uniform``: the trip count is the same for every thread of each warp (``bra.uni``);
        without it, shuffles in the body get divergence guards (WARPSYNC) in SASS."""
        top, done = self.label(hint), self.label(hint + "_end")
        exit_now = self.pred()
        self.mov(counter, start)
        self.place(top)
        self.setp("ge", exit_now, counter, stop)
        with self.guard(exit_now):
            self.bra(done, uniform=uniform)
        self._indent += 1
        yield counter
        self.add(counter, counter, step)
        self.bra(top, uniform=uniform)
        self._indent -= 1
        self.place(done)

    # ----------------------------------------------------------------- output
    def ptx(self) -> str:
        """The whole module: header, the entry with its parameters, declarations, body."""
        directives = []
        if self.max_threads is not None:
            directives.append(f".maxntid {self.max_threads}, 1, 1")
        if self.min_blocks_per_sm is not None:
            directives.append(f".minnctapersm {self.min_blocks_per_sm}")
        if self.cluster_size is not None:
            directives.append(f".reqnctapercluster {self.cluster_size}, 1, 1")
        params = ",\n".join("\t" + p.declaration() for p in self.params)
        decls = [f"\t.reg .{t} %{name};" for name, t in self._singles.items()]
        decls += [f"\t.reg .{t} %{prefix}<{n}>;" for prefix, (t, n) in self._banks.items()]
        # Shared memory is declared at module scope: `.extern .shared` is not allowed inside a function.
        shared = [b.declaration() for b in self.shared_buffers]
        lines = [
            f"// ptxforge kernel {self.name}",
            f".version {self.ptx_version}",
            f".target {self.target}",
            ".address_size 64",
            "",
            *shared,
            f".visible .entry {self.name}(",
            params,
            ")" + ("".join("\n" + d for d in directives)),
            "{",
            *decls,
            *self._body,
            "\tret;",
            "}",
            "",
        ]
        return "\n".join(lines)


__all__ = ["KernelBuilder", "LaunchShape", "Param", "Label", "SharedBuffer", "TensorMap",
           "Address", "Reg"]
