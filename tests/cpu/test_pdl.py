"""Programmatic dependent launch: every kernel lets the next one start early
(``griddepcontrol.launch_dependents``) and waits for the one before it
(``griddepcontrol.wait``) before it touches global memory that kernel may write or read.

The PTX is checked by its control flow, not its text order: the GEMM's producer and math
warps run different branches, and each must pass a wait before its own first access."""

from __future__ import annotations

import re

import pytest

from ptxforge import arch, kernels
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.kernels.gemm import GemmProblem

from test_golden_ptx import GEMM_MAKE_CONFIG

WAIT, LAUNCH = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
_INSTRUCTION = re.compile(r"^(@!?%\w+\s+)?([a-z][\w.:]*)\s*(.*?);$")


def instructions(ptx: str) -> tuple[list[tuple[bool, str, str]], dict[str, int]]:
    """The kernel body as (guarded, opcode, operands) and each label's instruction index."""
    body = ptx[ptx.index("\n{\n") + 3:ptx.rindex("\n}")]
    program, labels = [], {}
    for raw in body.splitlines():
        line = raw.split("//")[0].strip()
        if not line or line.startswith("."):
            continue
        if line.endswith(":"):
            labels[line[:-1]] = len(program)
            continue
        guard, opcode, operands = _INSTRUCTION.match(line).groups()
        program.append((guard is not None, opcode, operands))
    return program, labels


def passed_on_every_path(ptx: str, opcode: str) -> list[bool]:
    """For each instruction: whether every path from the kernel's entry to it has executed
    an ``opcode`` instruction first (a must-analysis over the branches)."""
    program, labels = instructions(ptx)
    successors = []
    for i, (guarded, op, operands) in enumerate(program):
        if op.startswith("bra"):
            successors.append([labels[operands]] + ([i + 1] if guarded else []))
        elif op in ("ret", "exit", "trap"):
            successors.append([])
        else:
            successors.append([i + 1])
    passed = [False] + [True] * (len(program) - 1)  # on entry to each instruction
    changed = True
    while changed:
        changed = False
        reached = [False] * len(program)
        # A guarded instruction may not run: only an unguarded one counts.
        after = [before or (program[i][1] == opcode and not program[i][0])
                 for i, before in enumerate(passed)]
        incoming = [True] * len(program)
        for i, targets in enumerate(successors):
            for j in targets:
                if j < len(program):
                    reached[j] = True
                    incoming[j] = incoming[j] and after[i]
        for j in range(1, len(program)):
            if reached[j] and incoming[j] != passed[j]:
                passed[j], changed = incoming[j], True
    return passed


def global_accesses(ptx: str) -> list[int]:
    """Indices of the instructions that read or write global memory: loads, stores,
    reductions, bulk and tensor copies (not prefetches, which only warm L2)."""
    program, _ = instructions(ptx)
    return [i for i, (_, op, _) in enumerate(program)
            if "global" in op.split(".") and "prefetch" not in op.split(".")]


def check_waits(ptx: str) -> None:
    program, _ = instructions(ptx)
    waited, launched = passed_on_every_path(ptx, WAIT), passed_on_every_path(ptx, LAUNCH)
    accesses = global_accesses(ptx)
    assert accesses, "no global access found: the check would prove nothing"
    early = [program[i] for i in accesses if not waited[i]]
    assert not early, f"global accesses a path reaches before {WAIT}: {early[:3]}"
    waits = [i for i, (_, op, _) in enumerate(program) if op == WAIT]
    assert waits and all(launched[i] for i in waits), f"{WAIT} before {LAUNCH} on some path"
    assert [op for _, op, _ in program].count(LAUNCH) == 1


def sm90_variants():
    a = arch.get("sm_90a")
    for spec in kernels.REGISTRY.values():
        for options in spec.variants:
            yield pytest.param(spec.builder(a, **options), id=f"{spec.name}-{options}")
    for problem, tile in GEMM_MAKE_CONFIG:
        yield pytest.param(gemm.generate(gemm.make_config(a, problem, **tile)),
                           id=f"make_config-{problem}-" + ",".join(f"{k}={v}"
                                                                   for k, v in tile.items()))


@pytest.mark.parametrize("kernel", list(sm90_variants()))
def test_every_kernel_launches_dependents_then_waits_before_global_memory(kernel):
    check_waits(kernel.ptx())


def test_no_gemm_prefetches_weights_before_waiting():
    """A first version prefetched the first tile's B boxes into L2 before the wait; on
    every launch (PDL or not) that cost the memory-bound GEMMs 3-14% (H200, M = 64-128,
    docs/performance.md), so the GEMMs issue no prefetch at all."""
    for problem, tile in GEMM_MAKE_CONFIG:
        ptx = gemm.generate(gemm.make_config(arch.get("sm_90a"), problem, **tile)).ptx()
        assert "cp.async.bulk.prefetch" not in ptx


def test_the_path_check_finds_an_access_a_branch_takes_before_the_wait():
    """The analysis itself: a load on the branch that skips the wait is caught, the same
    load after a join of two waiting branches is not."""
    def kernel(skip_wait_on_one_branch: bool) -> str:
        other = "" if skip_wait_on_one_branch else "\tgriddepcontrol.wait;\n"
        return (".visible .entry t(\n)\n{\n\tgriddepcontrol.launch_dependents;\n"
                "\t@%p bra $L_other;\n\tgriddepcontrol.wait;\n\tbra $L_join;\n$L_other:\n"
                f"{other}$L_join:\n\tld.global.u32 %r, [%a];\n\tret;\n}}\n")
    check_waits(kernel(False))
    with pytest.raises(AssertionError, match="before griddepcontrol.wait"):
        check_waits(kernel(True))


# --------------------------------------------------------------------------- the ops' launchers
class _Module:
    """A loaded module's stand-in: its launcher is the LaunchShape it was made for."""

    def launcher(self, shape):
        return shape

    def max_active_clusters(self, shape):
        return 66


@pytest.fixture
def launchers(monkeypatch, tmp_path):
    """The ops' launcher caches, empty, on an sm_90a without a GPU: a launcher is the
    LaunchShape it would launch with."""
    from importlib import import_module

    from ptxforge import jit
    from ptxforge.ops import common, block_quant, gemm as gemm_ops, routing, rowwise

    combine = import_module("ptxforge.ops.moe_combine")  # the package's moe_combine is the function

    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit.CompiledKernel, "load", lambda self, device_index=0: _Module())
    for module in (gemm_ops, rowwise, block_quant, combine, routing):
        monkeypatch.setattr(module, "device_arch", lambda device_index: arch.get("sm_90a"))
    caches = (gemm_ops._launcher, gemm_ops._plan, rowwise._kernel, block_quant._launcher,
              common.default_pdl, combine._kernel, routing._launcher)
    for cache in caches:
        cache.cache_clear()
    dense, masked = GemmProblem(4096, 7168), GemmProblem(7168, 2048, "e4m3", "masked", 4)
    row = lambda variant, hidden, pdl, fanout=1: rowwise._kernel(
        0, rowwise.VARIANTS[variant], hidden, pdl, fanout)[2]
    yield {"gemm": lambda pdl: gemm_ops._plan(0, dense, 8, 0, 132, None, pdl)[0],
           "masked gemm": lambda pdl: gemm_ops._plan(0, masked, 16, 8, 132, None, pdl)[0],
           "rms_norm": lambda pdl: row("rms_norm", 7168, pdl),
           "quantize_fp8_per_token": lambda pdl: row("quantize_fp8_per_token", 7168, pdl),
           "silu_mul_quantize_fp8": lambda pdl: row("silu_mul_quantize_fp8", 18432, pdl),
           "quantize_fp8_per_block": lambda pdl: block_quant._launcher(0, pdl),
           "moe_permute_quantize_fp8": lambda pdl: row("moe_permute_quantize_fp8", 7168, pdl),
           "moe_silu_mul_quantize_fp8": lambda pdl: row("moe_silu_mul_quantize_fp8", 2048,
                                                        pdl),
           "moe_combine": lambda pdl: combine._kernel(0, 7168, 8, "f32", pdl)[1],
           "moe_routing_layout": lambda pdl: routing._launcher(0, 256, "contiguous", pdl),
           "moe_routing_layout(masked)": lambda pdl: routing._launcher(0, 8, "masked", pdl)}
    for cache in caches:
        cache.cache_clear()


OP_LAUNCHERS = ["gemm", "masked gemm", "rms_norm", "quantize_fp8_per_token",
                "silu_mul_quantize_fp8", "quantize_fp8_per_block", "moe_permute_quantize_fp8",
                "moe_silu_mul_quantize_fp8", "moe_combine", "moe_routing_layout",
                "moe_routing_layout(masked)"]


@pytest.mark.parametrize("op", OP_LAUNCHERS)
def test_the_launch_attribute_is_there_iff_the_call_asks_for_pdl(launchers, op):
    from ptxforge.runtime.launch import launch_attributes

    pdl_attribute = (6, 1, 0)  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: 1
    on, off, default = (launchers[op](pdl) for pdl in (True, False, None))
    assert on.programmatic and pdl_attribute in launch_attributes(on)
    assert not off.programmatic and pdl_attribute not in launch_attributes(off)
    assert default == off  # PTXFORGE_PDL unset: off
    assert on == type(on)(**{**vars(off), "programmatic": True})  # nothing else differs


@pytest.mark.parametrize("op", OP_LAUNCHERS)
def test_ptxforge_pdl_sets_what_pdl_none_means(launchers, monkeypatch, op):
    monkeypatch.setenv("PTXFORGE_PDL", "1")
    assert launchers[op](None).programmatic and not launchers[op](False).programmatic
