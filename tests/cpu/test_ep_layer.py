"""The MoE layer across GPUs without one: the e4m3 permutation kernel's code, the permute
op's quantized input, the shard helper, the decode path's capacity and the path choice,
and every argument error of ``moe_experts_fp8(..., ep=buffer)``, each raised before
anything asks for a CUDA device (a Buffer made without its constructor: the checks read
its sizes alone)."""

from __future__ import annotations

import re

import pytest
import torch

import ptxforge
from ptxforge import arch, jit, kernels
from ptxforge.ep import Buffer, buffer_size, decode_capacity, layer, shard_experts
from ptxforge.kernels import bf16_row_rmsnorm_fp8quant as row_kernel

E4M3, F32, BF16, I32, I64 = (torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.int32,
                             torch.int64)


def zeros(dtype, *shape):
    return torch.zeros(shape, dtype=dtype)


def fp8_pair(*shape):
    """e4m3 [*shape] and f32 block scales [E, N/128, K/128], as quantize_fp8_per_block's."""
    *lead, n, k = shape
    return zeros(E4M3, *shape), zeros(F32, *lead, -(-n // 128), -(-k // 128))


# --------------------------------------------------------------------------- the e4m3 permutation
def test_e4m3_permutation_moves_rows_with_the_copy_engine_alone():
    """Each row copied into shared memory and stored to each of its k rows by bulk copies,
    the pair's index at sources[row]; no thread reads the row, nothing is converted."""
    spec = kernels.get("moe_permute_fp8")
    cfg = spec.config(arch.get("sm_90a"), hidden=7168, topk=8)
    assert cfg.name == "e4m3_permute8_k7168"
    assert (cfg.threads_per_row, cfg.rows_per_cta) == (16, 8)
    assert cfg.stage_row_bytes == 7168     # one byte an element
    ptx = spec.generate(cfg).ptx()
    assert ptx.count("cp.async.bulk.global.shared::cta.bulk_group") == 8
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "cp.async.bulk.wait_group.read 0" in ptx
    for absent in ("cvt.", "ld.shared", "st.shared", "shl.b32 %x_stride_bytes", "scales"):
        assert absent not in ptx, absent
    assert re.findall(r"\.param \.\w+ (\w+)", ptx) == ["x", "x_row_stride", "rows", "q", "index",
                                                        "index_rows", "sources"]


@pytest.mark.parametrize("hidden, topk", [(7168, 8), (512, 2), (16384, 8)])
def test_e4m3_permutation_assembles_without_spills(hidden, topk):
    cfg = kernels.get("moe_permute_fp8").config(arch.get("sm_90a"), hidden=hidden, topk=topk)
    compiled = jit.build(row_kernel.generate(cfg))
    assert compiled.resources.spills == 0 and compiled.resources.stack_frame == 0


def test_the_bf16_variants_keep_their_names():
    cfg = kernels.get("moe_permute_quantize_fp8").config(arch.get("sm_90a"), hidden=7168, topk=8)
    assert cfg.name == "bf16_quant_fp8_per_token_scatter8_k7168"


@pytest.mark.parametrize("x, error, message", [
    ((zeros(BF16, 4, 256), zeros(F32, 4, 2)), TypeError,
     "x[0] must have dtype torch.float8_e4m3fn, got torch.bfloat16"),
    ((zeros(E4M3, 4, 256), zeros(F32, 4, 3)), ValueError,
     "x[1] must have shape (4, 2), got (4, 3)"),
    ((zeros(E4M3, 4, 256), zeros(BF16, 4, 2)), TypeError,
     "x[1] must have dtype torch.float32, got torch.bfloat16"),
    ((zeros(E4M3, 4, 256), zeros(F32, 4, 2)), ValueError,
     "x[0] must be on a CUDA device, got cpu"),
])
def test_the_permutation_takes_rows_quantized_already(x, error, message):
    with pytest.raises(error) as info:
        ptxforge.moe_permute_quantize_fp8(x, zeros(I32, 4, 2), (64,))
    assert str(info.value) == message


def test_quantized_rows_are_checked_against_the_routing():
    with pytest.raises(ValueError, match=r"^rows must be a contiguous int32 \[4, k\]"):
        ptxforge.moe_permute_quantize_fp8((zeros(E4M3, 4, 256), zeros(F32, 4, 2)),
                                          zeros(I32, 5, 2), (64,))


# --------------------------------------------------------------------------- sharding
def test_shard_experts_slices_each_rank_s_experts():
    gate_up = torch.arange(8 * 4 * 2, dtype=F32).view(8, 4, 2).bfloat16()
    down = torch.arange(8 * 2 * 2, dtype=F32).view(8, 2, 2).bfloat16()
    for rank in range(4):
        mine_gate_up, mine_down = shard_experts(gate_up, down, rank, 4)
        assert torch.equal(mine_gate_up, gate_up[2 * rank:2 * rank + 2])
        assert torch.equal(mine_down, down[2 * rank:2 * rank + 2])
        assert mine_gate_up.data_ptr() == gate_up[2 * rank].data_ptr()   # a view, no copy


def test_shard_experts_slices_fp8_pairs_member_by_member():
    gate_up, down = fp8_pair(16, 512, 256), fp8_pair(16, 256, 256)
    gate_up[1][5] = 1.0
    (q13, s13), (q2, s2) = shard_experts(gate_up, down, 1, 2)
    assert q13.shape == (8, 512, 256) and s13.shape == (8, 4, 2)
    assert q2.shape == (8, 256, 256) and s2.shape == (8, 2, 2)
    assert torch.equal(s13, gate_up[1][8:]) and s13.sum() == 0 and gate_up[1][:8].sum() > 0


@pytest.mark.parametrize("args, error, message", [
    ((zeros(BF16, 6, 4, 2), zeros(BF16, 6, 2, 2), 0, 4), ValueError,
     "num_ranks must divide the experts: gate_up has 6, got num_ranks=4"),
    ((zeros(BF16, 8, 4, 2), zeros(BF16, 8, 2, 2), 2, 2), ValueError,
     "rank must be in [0, num_ranks) with num_ranks >= 1, got rank=2, num_ranks=2"),
    ((zeros(BF16, 8, 4, 2), zeros(BF16, 8, 2, 2), "0", 2), TypeError,
     "rank must be an int, got str"),
    ((zeros(BF16, 8, 4, 2), zeros(BF16, 4, 2, 2), 0, 2), ValueError,
     "down must have gate_up's 8 experts, got 4"),
    ((fp8_pair(8, 512, 256), (zeros(E4M3, 8, 256, 256), zeros(F32, 4, 2, 2)), 0, 2),
     ValueError, "down must have the experts first in every member, got shapes "
                 "[(8, 256, 256), (4, 2, 2)]"),
    (([zeros(BF16, 8, 4, 2)] * 3, zeros(BF16, 8, 2, 2), 0, 2), TypeError,
     "gate_up must be a tensor [E, ...] or a pair (q, s) of them, got list"),
])
def test_shard_experts_errors_name_the_argument(args, error, message):
    with pytest.raises(error) as info:
        shard_experts(*args)
    assert str(info.value) == message


# --------------------------------------------------------------------------- the path
HIDDEN, EXPERTS, TOPK = 256, 8, 2


def fake_buffer(ranks: int = 2, *, normal: bool = True, decode_tokens: int = 0,
                nvl_bytes: int | None = None) -> Buffer:
    """A Buffer as its constructor leaves it, without the memory: the layer's checks read
    its sizes alone."""
    buffer = Buffer.__new__(Buffer)
    buffer.group_size, buffer.rank, buffer.device_index = ranks, 0, 0
    buffer._picked = {ranks: None}   # no stored config
    size = buffer_size(ranks, HIDDEN, TOPK, fp8=True)
    buffer.num_nvl_bytes = (size if nvl_bytes is None else nvl_bytes) if normal else 0
    buffer.num_rdma_bytes, buffer.low_latency_group = 0, None
    if decode_tokens:
        buffer.num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(decode_tokens, HIDDEN,
                                                                      ranks, EXPERTS)
        buffer.low_latency_group = object()
    return buffer


@pytest.mark.parametrize("tokens", [1, 7, 128, 256])
def test_decode_capacity_gives_back_the_hint_s_tokens(tokens):
    assert decode_capacity(fake_buffer(decode_tokens=tokens), HIDDEN, EXPERTS) == tokens


def test_decode_capacity_is_what_the_buffer_holds():
    buffer = fake_buffer(decode_tokens=64)
    buffer.num_rdma_bytes -= 1
    assert decode_capacity(buffer, HIDDEN, EXPERTS) == 63
    assert decode_capacity(buffer, HIDDEN // 2, EXPERTS) > 64      # narrower rows: more
    assert decode_capacity(buffer, 200, EXPERTS) == 0              # not 1x128 groups
    assert decode_capacity(fake_buffer(), HIDDEN, EXPERTS) == 0    # no low-latency buffer


@pytest.mark.parametrize("normal, decode_tokens, tokens, layout, path", [
    (True, 64, 64, None, "masked"),
    (True, 64, 65, None, "contiguous"),
    (False, 64, 0, None, "masked"),
    (True, 0, 1, None, "contiguous"),
    (True, 64, 3, "contiguous", "contiguous"),
    (True, 64, 64, "masked", "masked"),
])
def test_the_decode_path_takes_what_the_low_latency_buffer_holds(normal, decode_tokens, tokens,
                                                                 layout, path):
    buffer = fake_buffer(normal=normal, decode_tokens=decode_tokens)
    assert layer.choose_path(buffer, tokens, HIDDEN, EXPERTS, layout) == path


@pytest.mark.parametrize("normal, decode_tokens, tokens, layout, message", [
    (False, 64, 65, None, "ep has no normal-mode buffer (num_nvl_bytes=0) and its low-latency "
                          "buffer takes at most 64 tokens a rank of 256-wide rows and 8 experts, "
                          "got x with 65"),
    (True, 64, 65, "masked", "x must have at most 64 tokens for layout='masked' (ep's "
                             "low-latency buffer holds that many a rank), got 65"),
    (True, 0, 1, "masked", "layout='masked' runs ep's decode path, and ep has no low-latency "
                           "room for 256-wide rows and 8 experts (make the Buffer with "
                           "low_latency_mode and get_low_latency_rdma_size_hint's bytes)"),
    (False, 64, 1, "contiguous", "layout='contiguous' runs ep's normal path, and ep has no "
                                 "normal-mode buffer (num_nvl_bytes=0): make the Buffer with "
                                 "num_nvl_bytes=ptxforge.ep.buffer_size(...)"),
])
def test_a_path_the_buffer_cannot_run_is_refused(normal, decode_tokens, tokens, layout, message):
    buffer = fake_buffer(normal=normal, decode_tokens=decode_tokens)
    with pytest.raises(ValueError) as info:
        layer.choose_path(buffer, tokens, HIDDEN, EXPERTS, layout)
    assert str(info.value) == message


def test_received_rows_list_the_held_rows_in_order_then_none():
    rows = layer.received_rows(torch.tensor([3, 1, 0, 4], dtype=I32), 4, 10)
    assert rows.dtype == I32 and rows.shape == (10, 1) and rows.is_contiguous()
    assert rows.flatten().tolist() == [0, 1, 2, 4, 12, 13, 14, 15, -1, -1]


# --------------------------------------------------------------------------- the op's errors
def layer_arguments(tokens: int = 4, top_k: int = TOPK):
    """A rank's call with 2 ranks: 4 of the 8 experts here."""
    return {"x": zeros(BF16, tokens, HIDDEN), "topk_idx": zeros(I64, tokens, top_k),
            "topk_weights": zeros(F32, tokens, top_k),
            "gate_up": fp8_pair(EXPERTS // 2, 512, HIDDEN),
            "down": fp8_pair(EXPERTS // 2, HIDDEN, 256)}


@pytest.mark.parametrize("layout", [None, "masked", "contiguous"])
def test_every_check_comes_before_the_device(layout):
    buffer = fake_buffer(decode_tokens=64)
    with pytest.raises(ValueError, match=r"^x must be on a CUDA device, got cpu$"):
        ptxforge.moe_experts_fp8(**layer_arguments(), layout=layout, ep=buffer)


@pytest.mark.parametrize("ep, message", [
    (42, "ep must be a ptxforge.ep.Buffer (or None), got int"),
    ("buffer", "ep must be a ptxforge.ep.Buffer (or None), got str"),
])
def test_a_bad_ep_names_the_argument(ep, message):
    with pytest.raises(TypeError) as info:
        ptxforge.moe_experts_fp8(**layer_arguments(), ep=ep)
    assert str(info.value) == message


@pytest.mark.parametrize("change, buffer, error, message", [
    ({"topk_weights": zeros(torch.float64, 4, TOPK)}, {}, TypeError,
     "topk_weights must have dtype torch.float32 or torch.bfloat16, got torch.float64"),
    ({"topk_idx": zeros(I64, 5, TOPK)}, {}, ValueError,
     "topk_idx must have a row per token of x (4), got shape (5, 2)"),
    ({"down": fp8_pair(EXPERTS, HIDDEN, 256)}, {}, ValueError,
     "down[0] must be [E, H, I] = (4, 256, 256) (gate_up's E and I, x's H), got shape "
     "(8, 256, 256)"),
    ({}, {"nvl_bytes": 1 << 20}, ValueError,
     f"ep's num_nvl_bytes ({1 << 20}) must hold an FP8 dispatch of 256-wide rows with top-2 "
     f"over 2 ranks: {buffer_size(2, HIDDEN, TOPK, fp8=True)} (ptxforge.ep.buffer_size)"),
    ({"topk_idx": zeros(I64, 4, 17), "topk_weights": zeros(F32, 4, 17)},
     {"decode_tokens": 64}, ValueError, "topk_idx must have 1 to 16 columns, got 17"),
])
def test_the_layer_checks_its_arguments(change, buffer, error, message):
    with pytest.raises(error) as info:
        ptxforge.moe_experts_fp8(**{**layer_arguments(), **change}, ep=fake_buffer(**buffer))
    assert str(info.value) == message


@pytest.mark.parametrize("bound, ep, message", [
    (3, True, "x must have at most max_tokens_per_rank (3) tokens, got 4"),
    (0, True, "max_tokens_per_rank must be a positive int, got 0"),
    (4.0, True, "max_tokens_per_rank must be a positive int, got 4.0"),
    (2 ** 30, True, "max_tokens_per_rank times the 2 ranks must be below 2^31, got 1073741824"),
    (65, "masked", "max_tokens_per_rank must be at most 64 for layout='masked' (ep's "
                   "low-latency buffer holds that many a rank), got 65"),
    (8, False, "max_tokens_per_rank bounds the tokens of every rank of ep: it needs ep=, got "
               "max_tokens_per_rank=8 and ep=None"),
])
def test_max_tokens_per_rank_is_checked(bound, ep, message):
    with pytest.raises(ValueError) as info:
        ptxforge.moe_experts_fp8(**layer_arguments(), max_tokens_per_rank=bound,
                                 layout="masked" if ep == "masked" else None,
                                 ep=fake_buffer(decode_tokens=64) if ep else None)
    assert str(info.value) == message


def test_max_tokens_per_rank_picks_the_path_for_every_rank():
    """4 tokens fit the decode path's 64, but a bound of 65 does not: the normal path, as on
    a rank with 65 tokens (its last check needs the device)."""
    with pytest.raises(ValueError, match=r"^x must be on a CUDA device, got cpu$"):
        ptxforge.moe_experts_fp8(**layer_arguments(), max_tokens_per_rank=65,
                                 ep=fake_buffer(decode_tokens=64))
    assert layer.choose_path(fake_buffer(decode_tokens=64), 65, HIDDEN, EXPERTS) == "contiguous"


def test_the_normal_path_takes_1x128_rows():
    args = layer_arguments()
    args["x"] = zeros(BF16, 4, 192)
    args["gate_up"], args["down"] = fp8_pair(4, 512, 192), fp8_pair(4, 192, 256)
    with pytest.raises(ValueError, match="must be a positive multiple of 128 for e4m3 rows, got 192"):
        ptxforge.moe_experts_fp8(**args, ep=fake_buffer())


# --------------------------------------------------------------------------- the benchmark's peers
def _routed(tokens: int = 6, hidden: int = 32, top_k: int = 2, experts: int = 8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return x, idx, torch.rand(tokens, top_k, generator=g)


def test_the_peers_pack_each_token_with_its_local_top_k_per_rank():
    from ptxforge.bench import ep_layer as bench

    x, idx, weights = _routed()
    rows, ranks, tokens = bench._packed_pairs([x], idx, weights, 4, 2)
    assert rows.dtype == torch.uint8 and rows.shape[1] % 16 == 0
    assert ranks.tolist() == sorted(ranks.tolist())
    rx, r_idx, r_weights = bench._unpacked(rows, [64, 16, 8], [BF16, I64, F32])
    assert torch.equal(rx, x[tokens])
    for n, (rank, token) in enumerate(zip(ranks.tolist(), tokens.tolist())):
        mine = idx[token] // 4 == rank
        assert torch.equal(r_idx[n], torch.where(mine, idx[token] - 4 * rank, -1))
        assert torch.equal(r_weights[n], torch.where(mine, weights[token], 0.0))


def test_the_grouped_mm_peer_computes_the_experts():
    from ptxforge.bench import ep_layer as bench

    x, idx, weights = _routed()
    rows, ranks, _ = bench._packed_pairs([x], idx, weights, 4, 2)
    rx, r_idx, r_weights = (t[ranks == 1] for t in bench._unpacked(rows, [64, 16, 8],
                                                                   [BF16, I64, F32]))
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(4, 32, 32, generator=g) * 0.1).bfloat16()
    down = (torch.randn(4, 32, 16, generator=g) * 0.1).bfloat16()
    try:
        y = bench._grouped_mm_experts(rx, r_idx, r_weights, gate_up, down)
    except (NotImplementedError, RuntimeError) as error:   # grouped_mm without a CPU kernel
        pytest.skip(f"torch's grouped_mm on the CPU: {error}")
    expected = torch.zeros(rx.shape, dtype=torch.float64)
    for n in range(rx.shape[0]):
        for j in range(2):
            e = int(r_idx[n, j])
            if e >= 0:
                h = rx[n].double() @ gate_up[e].double().t()
                h = torch.nn.functional.silu(h[:16]) * h[16:]
                expected[n] += (h @ down[e].double().t()) * float(r_weights[n, j])
    torch.testing.assert_close(y.double(), expected, rtol=2 ** -6, atol=2e-3)


def test_the_layer_table_reads_its_result():
    from ptxforge.bench.ep_layer import layer_table

    params = dict(tokens=[4096, 128], hidden=7168, inner=2048, experts=256, topk=8, calls=4,
                  repeats=5, wide_sms=48)
    rows = [dict(tokens=4096, path="contiguous", ours_us=5000.0, ours_tflops=554.0,
                 bounded_us=4000.0, bounded_tflops=692.0, wide_us=3700.0,
                 wide_tflops=748.0,
                 nccl_us=6000.0, nccl_tflops=462.0, grouped_mm_us=9000.0,
                 grouped_mm_tflops=308.0, timelines=[]),
            dict(tokens=128, path="masked", ours_us=1500.0, ours_tflops=57.7, nccl_us=2500.0,
                 nccl_tflops=34.6, grouped_mm_us=4000.0, grouped_mm_tflops=21.6,
                 weights_read_us=1400.0, ours_over_read=1500 / 1400, timelines=[])]
    text = layer_table(dict(params=params, world=2, distinct_gpus=True, device="H200",
                            copy_gbs=8000.0, fp8_weights_bytes=5.6e9, rows=rows))
    assert ("| 4096 | contiguous | 5000 (554) | 4000 (692) | 3700 (748) | - | - | 6000 (462) |"
            in re.sub(" +", " ", text))
    assert "| 128 | masked | 1500 (58) | - | - | - |" in re.sub(" +", " ", text)
    assert "1.62x" in text and "2.43x" in text   # against the best of ours
    assert "no host sync, 48 SMs" in text
    assert "128 tokens a rank: ours 1500 us = 1.07 x the time to read them once (1400 us)" in text
