"""The PTX builder: emitted text, one instruction per call, and ptxas acceptance."""

import inspect
import os
import subprocess
import tempfile

import pytest

from ptxforge.jit.assemble import find_ptxas
from ptxforge.ptx import KernelBuilder, addr, sreg, vec
from ptxforge.ptx.arith import ArithmeticOps
from ptxforge.ptx.memory import MemoryOps
from ptxforge.ptx.sync import SyncOps
from ptxforge.ptx.tensor import TensorOps
from ptxforge.ptx.warp import WarpOps

PTXAS = find_ptxas()
needs_ptxas = pytest.mark.skipif(PTXAS is None, reason="no ptxas found")


def body_lines(k: KernelBuilder) -> list[str]:
    text = k.ptx()
    body = text[text.index("{") + 1:text.rindex("}")]
    return [line.strip() for line in body.splitlines()
            if line.strip() and not line.strip().startswith((".reg", "//"))]


def test_registers_params_and_header():
    k = KernelBuilder("demo", target="sm_90a", max_threads=256, min_blocks_per_sm=2)
    k.param("x", "u64")
    k.tensormap_param("tmap")
    row = k.reg("u32", "row")
    acc = k.regs("f32", 4, "acc")
    anon = k.reg("u32")
    text = k.ptx()
    assert text.startswith("// ptxforge kernel demo\n.version 8.0\n.target sm_90a\n.address_size 64")
    assert ".param .u64 x,\n\t.param .align 64 .b8 tmap[128]\n)" in text
    assert ".maxntid 256, 1, 1\n.minnctapersm 2" in text
    assert "\t.reg .u32 %row;" in text and "\t.reg .f32 %acc<4>;" in text
    assert (row.name, acc[3].name, anon.name) == ("%row", "%acc3", "%r0")


def test_register_names_never_collide():
    k = KernelBuilder("names")
    a = k.reg("u32", "x")
    b = k.reg("u32", "x")        # second use of a name -> a bank
    c = k.reg("f32", "x")        # same name, other type -> its own bank
    d = k.reg("u32", "tid")      # would read as the special register %tid
    e = k.regs("b32", 2, "v1")   # a prefix ending in a digit
    names = [r.name for r in (a, b, c, d, *e)]
    assert len(set(names)) == len(names)
    assert d.name != "%tid"
    if PTXAS is not None:  # every register is declared once, and none reads as another
        for r in (a, b, c, d, *e):
            k.mov(r, 0 if r.type != "f32" else 0.0)
        k.mov(a, sreg.tid.x)
        assert_assembles(k)


def test_golden_snippets():
    k = KernelBuilder("golden")
    u, v = k.reg("u32", "u"), k.reg("u32", "v")
    f, g = k.reg("f32", "f"), k.reg("f32", "g")
    wide = k.reg("u64", "wide")
    p = k.pred("p")
    h = k.reg("b16", "h")
    x4 = k.regs("b32", 4, "x")
    k.mad(wide, u, 16, wide, mode="wide")
    k.and_(u, v, 15)
    k.max(f, f, g, nan=True)
    k.mul(f, f, 2.0)
    k.cvt(h, f, g, dtype="e4m3x2", rnd="rn", sat="satfinite")
    k.ld(x4, addr(wide, 32), nc=True, eviction="L1::no_allocate", prefetch="L2::256B")
    k.st(addr(wide, -16), x4[:2], type="b32")
    k.mov(u, sreg.tid.x)
    with k.guard(~p):
        k.shfl_sync(g, g, 8, mode="bfly")
    k.mov(v, vec(h, h), type="b32")
    assert body_lines(k) == [
        "mad.wide.u32 %wide, %u, 16, %wide;",
        "and.b32 %u, %v, 15;",
        "max.NaN.f32 %f, %f, %g;",
        "mul.f32 %f, %f, 0f40000000;",
        "cvt.rn.satfinite.e4m3x2.f32 %h, %f, %g;",
        "ld.global.nc.L1::no_allocate.L2::256B.v4.b32 {%x0, %x1, %x2, %x3}, [%wide+32];",
        "st.global.v2.b32 [%wide-16], {%x0, %x1};",
        "mov.u32 %u, %tid.x;",
        "@!%p shfl.sync.bfly.b32 %g, %g, 8, 31, -1;".replace("-1", str(0xFFFFFFFF)),
        "mov.b32 %v, {%h, %h};",
        "ret;",
    ]


def test_sfu_approximations_and_packed_bf16_arithmetic():
    """The forms SwiGLU's silu uses: ex2 and rcp approximations, with and without ftz (without
    it ptxas adds subnormal handling around the SFU instruction), and bf16x2 arithmetic on
    b32 registers."""
    k = KernelBuilder("sfu", target="sm_90a")
    out = k.param("out", "u64")
    f, g = k.reg("f32", "f"), k.reg("f32", "g")
    packed = k.reg("b32", "packed")
    ptr = k.reg("u64", "ptr")
    k.mov(f, 0.5)
    k.ex2(g, f)
    k.ex2(g, g, ftz=True)
    k.rcp(g, g)
    k.rcp(g, g, rnd="approx", ftz=True)
    k.cvt(packed, g, f, dtype="bf16x2", rnd="rn")
    k.mul(packed, packed, packed, type="bf16x2", rnd="rn")
    k.ld_param(ptr, out)
    k.st(addr(ptr), packed)
    assert body_lines(k)[1:7] == [
        "ex2.approx.f32 %g, %f;",
        "ex2.approx.ftz.f32 %g, %g;",
        "rcp.rn.f32 %g, %g;",
        "rcp.approx.ftz.f32 %g, %g;",
        "cvt.rn.bf16x2.f32 %packed, %g, %f;",
        "mul.rn.bf16x2 %packed, %packed, %packed;",
    ]
    if PTXAS is not None:
        assert_assembles(k)


def test_lanes_naming_the_same_value():
    """match.any.sync takes its width from the compared register (b32 or b64); the mask of
    the lower lanes is a special register."""
    k = KernelBuilder("match", target="sm_90a")
    same, below, expert = k.reg("b32", "same"), k.reg("u32", "below"), k.reg("u32", "expert")
    index = k.reg("s64", "index")
    k.mov(expert, 3)
    k.mov(index, -1)
    k.match_any_sync(same, expert)
    k.match_any_sync(same, index, membermask=0xFFFF)
    k.mov(below, sreg.lanemask_lt)
    k.and_(same, same, below)
    assert body_lines(k)[2:6] == [
        "match.any.sync.b32 %same, %expert, 4294967295;",
        "match.any.sync.b64 %same, %index, 65535;",
        "mov.u32 %below, %lanemask_lt;",
        "and.b32 %same, %same, %below;",
    ]
    if PTXAS is not None:
        assert_assembles(k)


def test_strong_loads_and_stores_across_gpus():
    """The forms the communication kernels use: a counter published with st.release.sys and
    polled with ld.acquire.sys, payload with weak accesses and eviction hints, a record in
    host memory with a relaxed vector store."""
    k = KernelBuilder("signals", target="sm_90a")
    at, flag = k.reg("u64", "at"), k.reg("u32", "flag")
    words = k.regs("b32", 4, "w")
    k.mov(at, 0)
    k.mov(flag, 1)
    for w in words:
        k.mov(w, 0)
    k.st(addr(at), flag, sem="release", scope="sys")
    k.ld(flag, addr(at, 4), sem="acquire", scope="sys")
    k.ld(words, addr(at, 16), eviction="L1::no_allocate")
    k.st(addr(at, 32), words, eviction="L1::no_allocate")
    k.st(addr(at, 48), words, sem="relaxed", scope="sys")
    assert body_lines(k)[6:11] == [
        "st.release.sys.global.u32 [%at], %flag;",
        "ld.acquire.sys.global.u32 %flag, [%at+4];",
        "ld.global.L1::no_allocate.v4.b32 {%w0, %w1, %w2, %w3}, [%at+16];",
        "st.global.L1::no_allocate.v4.b32 [%at+32], {%w0, %w1, %w2, %w3};",
        "st.relaxed.sys.global.v4.b32 [%at+48], {%w0, %w1, %w2, %w3};",
    ]
    if PTXAS is not None:
        assert_assembles(k)


def test_structured_control_flow():
    k = KernelBuilder("flow")
    i, n = k.reg("u32", "i"), k.reg("u32", "n")
    p = k.pred("hit")
    with k.loop(i, n, start=2, step=4):
        k.setp("eq", p, i, 6)
        with k.if_(p):
            k.add(n, n, 1)
    lines = body_lines(k)
    assert lines[0] == "mov.u32 %i, 2;"
    assert lines[1].startswith("$L_loop_0:")
    assert lines[2].startswith("setp.ge.u32 %p0, %i, %n;")
    assert lines[3] == "@%p0 bra $L_loop_end_0;"
    assert "@!%hit bra $L_endif_0;" in lines
    assert lines[-3:] == ["bra $L_loop_0;", "$L_loop_end_0:", "ret;"]
    with pytest.raises(RuntimeError, match="do not nest"):
        with k.guard(p):
            with k.guard(p):
                pass


def test_float_immediates_are_exact():
    k = KernelBuilder("imm")
    f, d = k.reg("f32", "f"), k.reg("f64", "d")
    k.mov(f, 1e-4)
    k.mov(d, 0.1)
    assert body_lines(k)[:2] == ["mov.f32 %f, 0f38D1B717;", "mov.f64 %d, 0d3FB999999999999A;"]


# One entry per instruction method: calling it must emit exactly one instruction.
def _instruction_calls(k):
    u, v, w = (k.reg("u32") for _ in range(3))
    f, g = k.reg("f32"), k.reg("f32")
    d64 = k.reg("u64")
    p = k.pred()
    h = k.reg("b16")
    q = k.regs("b32", 4)
    acc = k.regs("f32", 8)
    a = addr(d64)
    return {
        "mov": lambda: k.mov(u, v), "selp": lambda: k.selp(u, v, w, p),
        "add": lambda: k.add(u, v, w), "sub": lambda: k.sub(u, v, 1),
        "mul": lambda: k.mul(u, v, w, mode="lo"), "mad": lambda: k.mad(u, v, w, u),
        "fma": lambda: k.fma(f, f, g, f), "div": lambda: k.div(f, f, g, rnd="rn"),
        "rem": lambda: k.rem(u, v, 3), "min": lambda: k.min(u, v, w), "max": lambda: k.max(f, f, g),
        "abs": lambda: k.abs(f, g), "neg": lambda: k.neg(f, g), "rcp": lambda: k.rcp(f, g),
        "sqrt": lambda: k.sqrt(f, g), "rsqrt": lambda: k.rsqrt(f, g), "ex2": lambda: k.ex2(f, g),
        "and_": lambda: k.and_(u, v, 1), "or_": lambda: k.or_(u, v, 1), "xor": lambda: k.xor(u, v, 1),
        "not_": lambda: k.not_(u, v), "shl": lambda: k.shl(u, v, 1), "shr": lambda: k.shr(u, v, 1),
        "prmt": lambda: k.prmt(u, v, w, 0x3210), "bfe": lambda: k.bfe(u, v, 0, 4),
        "popc": lambda: k.popc(u, v), "bfind": lambda: k.bfind(u, v),
        "setp": lambda: k.setp("lt", p, u, v),
        "and_pred": lambda: k.and_pred(p, p, p), "cvt": lambda: k.cvt(f, u, rnd="rn"),
        "cvta": lambda: k.cvta(d64, d64, space="global"),
        "ld": lambda: k.ld(q, a), "st": lambda: k.st(a, q), "ld_param": lambda: k.ld_param(d64, k.params[0]),
        "atom": lambda: k.atom(u, a, 1, op="add"), "red": lambda: k.red(a, u, op="add"),
        "prefetch": lambda: k.prefetch(a), "prefetch_tensormap": lambda: k.prefetch_tensormap(a),
        "bar_sync": lambda: k.bar_sync(0), "bar_arrive": lambda: k.bar_arrive(1, 64),
        "barrier_cluster_arrive": lambda: k.barrier_cluster_arrive(),
        "barrier_cluster_wait": lambda: k.barrier_cluster_wait(), "mapa": lambda: k.mapa(u, v, 1),
        "fence_proxy_async": lambda: k.fence_proxy_async(), "fence_mbarrier_init": lambda: k.fence_mbarrier_init(),
        "fence": lambda: k.fence(), "mbarrier_init": lambda: k.mbarrier_init(addr(u), 1),
        "mbarrier_arrive": lambda: k.mbarrier_arrive(addr(u)),
        "mbarrier_arrive_expect_tx": lambda: k.mbarrier_arrive_expect_tx(addr(u), 64),
        "mbarrier_expect_tx": lambda: k.mbarrier_expect_tx(addr(u), 64),
        "mbarrier_try_wait_parity": lambda: k.mbarrier_try_wait_parity(p, addr(u), 0),
        "elect_sync": lambda: k.elect_sync(p), "bar_warp_sync": lambda: k.bar_warp_sync(),
        "setmaxnreg": lambda: k.setmaxnreg(240, increase=True),
        "griddepcontrol_wait": lambda: k.griddepcontrol_wait(),
        "griddepcontrol_launch_dependents": lambda: k.griddepcontrol_launch_dependents(),
        "shfl_sync": lambda: k.shfl_sync(u, v, 1, mode="down"), "redux_sync": lambda: k.redux_sync(u, v, op="add"),
        "vote_sync": lambda: k.vote_sync(u, p, mode="ballot"),
        "match_any_sync": lambda: k.match_any_sync(u, v),
        "wgmma_fence": lambda: k.wgmma_fence(), "wgmma_commit_group": lambda: k.wgmma_commit_group(),
        "wgmma_wait_group": lambda: k.wgmma_wait_group(1),
        "wgmma_mma_async": lambda: k.wgmma_mma_async(acc, d64, d64, n=16, ab_type="e4m3"),
        "ldmatrix": lambda: k.ldmatrix(q, addr(u)), "stmatrix": lambda: k.stmatrix(addr(u), q),
        "mma_sync": lambda: k.mma_sync(acc[:4], q, q[:2], acc[4:]),
        "movmatrix": lambda: k.movmatrix(u, v),
        "cp_async_bulk_tensor_load": lambda: k.cp_async_bulk_tensor_load(addr(u), d64, [v, w], addr(u)),
        "cp_async_bulk_load": lambda: k.cp_async_bulk_load(addr(u), a, 256, addr(u)),
        "cp_async_bulk_store": lambda: k.cp_async_bulk_store(a, addr(u), 256),
        "cp_async": lambda: k.cp_async(addr(u), a, 4),
        "cp_async_mbarrier_arrive": lambda: k.cp_async_mbarrier_arrive(addr(u)),
        "cp_async_bulk_tensor_store": lambda: k.cp_async_bulk_tensor_store(d64, [v, w], addr(u)),
        "cp_async_bulk_prefetch_tensor": lambda: k.cp_async_bulk_prefetch_tensor(d64, [v, w]),
        "cp_reduce_async_bulk_tensor": lambda: k.cp_reduce_async_bulk_tensor(d64, [v, w], addr(u)),
        "cp_async_bulk_commit_group": lambda: k.cp_async_bulk_commit_group(),
        "cp_async_bulk_wait_group": lambda: k.cp_async_bulk_wait_group(0),
        "bra": lambda: k.bra(k.label("x")), "exit": lambda: k.exit(), "trap": lambda: k.trap(),
    }


def _instruction_methods():
    names = {"bra", "exit", "trap"}
    for family in (ArithmeticOps, MemoryOps, SyncOps, WarpOps, TensorOps):
        names |= {n for n, fn in vars(family).items() if inspect.isfunction(fn) and not n.startswith("_")}
    return names


def test_every_instruction_method_emits_exactly_one_instruction():
    k = KernelBuilder("one_each")
    k.param("x", "u64")
    calls = _instruction_calls(k)
    assert set(calls) == _instruction_methods(), "add new instruction methods to this table"
    for name, call in calls.items():
        before_count, before_lines = k.instruction_count, len(body_lines(k))
        call()
        assert k.instruction_count == before_count + 1, name
        assert len(body_lines(k)) == before_lines + 1, name


def feature_tour() -> KernelBuilder:
    """A kernel touching every instruction family the GEMM kernels need."""
    k = KernelBuilder("tour", target="sm_90a", max_threads=384, min_blocks_per_sm=1, cluster_size=2)
    tm = k.tensormap_param("tmap")
    out = k.param("out", "u64")
    smem = k.dynamic_shared("smem", 1024)
    tmap = k.reg("u64", "tmap_ptr")
    k.mov(tmap, tm)
    k.cvta(tmap, tmap, space="param")
    k.prefetch_tensormap(addr(tmap))
    base, bar = k.reg("u32", "base"), k.reg("u32", "bar")
    k.mov(base, smem)
    k.add(bar, base, 4096)
    k.mbarrier_init(addr(bar), 1)
    k.fence_mbarrier_init()
    k.barrier_cluster_arrive(sem="release")
    k.barrier_cluster_wait()
    leader = k.pred("leader")
    k.elect_sync(leader)
    c0, mask = k.reg("s32", "c0"), k.reg("b16", "mask")
    k.mov(c0, 0)
    k.mov(mask, 3)
    with k.guard(leader):
        k.mbarrier_arrive_expect_tx(addr(bar), 2048)
    k.cp_async_bulk_tensor_load(addr(base), tmap, [c0, c0], addr(bar))
    k.cp_async_bulk_tensor_load(addr(base), tmap, [c0, c0], addr(bar), multicast_mask=mask)
    k.cp_async_bulk_prefetch_tensor(tmap, [c0, c0])
    g = k.reg("u64", "g")
    k.ld_param(g, out)
    k.cp_async_bulk_load(addr(base, 1024), addr(g), 256, addr(bar))
    done = k.pred("done")
    k.mbarrier_try_wait_parity(done, addr(bar), 0)
    k.setmaxnreg(232, increase=True)
    acc = k.regs("f32", 64, "acc")
    desc = k.reg("u64", "desc")
    k.mov(desc, 0)
    k.wgmma_fence()
    k.wgmma_mma_async(acc, desc, desc, n=128, ab_type="e4m3", scale_d=0)
    k.wgmma_mma_async(acc, desc, desc, n=128, ab_type="bf16", scale_d=1)
    k.wgmma_commit_group()
    k.wgmma_wait_group(0)
    h = k.regs("b32", 4, "h")
    k.stmatrix(addr(base), h)
    k.ldmatrix(h, addr(base), trans=True)
    k.fence_proxy_async()
    k.bar_sync(1, 128)
    k.cp_async_bulk_tensor_store(tmap, [c0, c0], addr(base))
    k.cp_reduce_async_bulk_tensor(tmap, [c0, c0], addr(base), op="add")
    k.cp_async_bulk_commit_group()
    k.cp_async_bulk_wait_group(0, read=True)
    r = k.reg("u32", "r")
    k.redux_sync(r, base, op="max")
    k.shfl_sync(r, r, 1, mode="bfly")
    k.match_any_sync(r, r)
    k.match_any_sync(r, g)
    k.mov(r, sreg.lanemask_lt)
    k.red(addr(g), r, op="add")
    k.atom(r, addr(g), 1, op="add")
    f = k.reg("f32", "f")
    k.mov(f, 1.5)
    k.st(addr(g), f, cache="cs")
    k.griddepcontrol_wait()
    k.griddepcontrol_launch_dependents()
    k.mapa(r, base, 1)
    k.mbarrier_arrive(addr(r), remote=True)
    k.mbarrier_arrive(addr(bar))
    k.cp_async(addr(base), addr(g), 4)
    k.cp_async_mbarrier_arrive(addr(bar))
    k.setmaxnreg(40, increase=False)
    return k


def assert_assembles(k: KernelBuilder) -> str:
    """ptxas accepts the kernel with no warnings; returns its verbose log."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(k.ptx())
        out = subprocess.run([PTXAS, f"-arch={k.target}", "-v", src, "-o", src + ".cubin"],
                             capture_output=True, text=True)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "warning" not in log.lower(), log
    return log


@needs_ptxas
def test_ptxas_accepts_every_family_without_warnings():
    log = assert_assembles(feature_tour())
    assert "0 bytes spill stores" in log


def test_argument_layout_follows_the_parameter_list():
    from ptxforge.runtime.launch import argument_layout

    k = KernelBuilder("layout")
    k.param("n", "u32")
    k.tensormap_param("tmap")
    k.param("x", "u64")
    k.param("eps", "f32")
    fmt, offsets, size = argument_layout(k.params)
    assert offsets == [0, 64, 192, 200]  # the tensor map aligned to 64, the pointer to 8
    assert size == 204 and fmt.startswith("<I") and "128s" in fmt
