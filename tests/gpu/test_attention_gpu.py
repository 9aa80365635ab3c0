"""attention_with_kvcache on a real GPU: against an fp64 reference over every length edge
(0, 1, a split's boundary, the whole cache, lengths that differ across the batch), both
cache layouts without a copy (FlashAttention's [B, S, Hkv, D] and transformers' [B, Hkv,
S, D] transposed), every head size and group, the CUDA-core and the tensor-core (mma)
forms; paged caches; the same bits run to run; a CUDA graph replayed with new lengths and
queries."""

import pytest
import torch

import ptxforge
import ptxforge.ops  # noqa: F401  registers torch.ops.ptxforge
from ptxforge.ops import attention as attention_op

pytestmark = pytest.mark.gpu


def problem(batch, capacity, heads, kv_heads, head_dim, lengths, *, layout="flash", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, 1, heads, head_dim, device="cuda", generator=g).bfloat16()
    shape = ((batch, capacity, kv_heads, head_dim) if layout == "flash"
             else (batch, kv_heads, capacity, head_dim))
    k, v = (torch.randn(*shape, device="cuda", generator=g).bfloat16() for _ in range(2))
    if layout == "transformers":
        k, v = k.transpose(1, 2), v.transpose(1, 2)     # views [B, S, Hkv, D]
    return q, k, v, torch.tensor(lengths, dtype=torch.int32, device="cuda")


def reference(q, k, v, lengths, scale=None):
    batch, _, heads, head_dim = q.shape
    group = heads // k.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b in range(batch):
        n = min(int(lengths[b]), k.shape[1])
        if n == 0:
            continue
        keys = k[b, :n].double().repeat_interleave(group, dim=1)      # [n, Hq, D]
        values = v[b, :n].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b, 0].double(), keys) * scale
        out[b, 0] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


def check(out, ref):
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert not out.isnan().any()
    err = (out.double() - ref).abs().max().item()
    assert err <= 4e-3 + 8e-3 * ref.abs().max().item(), err


CASES = [  # batch, capacity, heads, kv heads, head dim, lengths
    (1, 641, 32, 8, 128, [641]),
    (1, 641, 32, 8, 128, [512]),
    (1, 512, 32, 8, 128, [1]),
    (3, 1000, 8, 2, 64, [0, 1, 777]),
    (2, 4224, 32, 8, 128, [4224, 17]),
    (4, 256, 16, 16, 256, [256, 255, 128, 33]),
    (2, 2048, 64, 8, 128, [2048, 1000]),
    (2, 3000, 4, 4, 128, [2999, 3000]),
    (1, 100, 8, 1, 128, [100]),
]


def form_config(math, head_dim, group, paged=False):
    """The config of one form (config= forces it): ``math`` cuda (cores) or mma (tensor
    cores; the test skips a head it does not take)."""
    from ptxforge.kernels import bf16_decode_attention as kernel
    from ptxforge.ops.common import device_arch

    if math == "mma" and head_dim > kernel.MMA_HEAD_DIM:
        pytest.skip(f"the tensor-core form takes head_dim up to {kernel.MMA_HEAD_DIM}")
    return kernel.choose_config(device_arch(0), head_dim, group, paged,
                                tensor_cores=math == "mma")


@pytest.mark.parametrize("math", ["cuda", "mma"])
@pytest.mark.parametrize("layout", ["flash", "transformers"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_the_fp64_reference(case, layout, math):
    q, k, v, lengths = problem(*case, layout=layout)
    config = form_config(math, case[4], case[2] // case[3])
    out = ptxforge.attention_with_kvcache(q, k, v, lengths, config=config)
    check(out, reference(q, k, v, lengths))
    assert torch.equal(out, ptxforge.attention_with_kvcache(q, k, v, lengths, config=config))


def test_every_split_boundary_and_a_length_past_the_cache():
    """Lengths on each side of every split's first token, and past S_max (read as S_max)."""
    batch, capacity, heads, kv_heads, head_dim = 1, 2048, 32, 8, 128
    q, k, v, _ = problem(batch, capacity, heads, kv_heads, head_dim, [0])
    cfg, _ = attention_op._kernel(q.device.index, head_dim, heads // kv_heads, None)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    tokens = attention_op.split_tokens(cfg, sms, batch, kv_heads, capacity)
    assert tokens < capacity       # several splits
    for length in sorted({tokens - 1, tokens, tokens + 1, 2 * tokens + 1, capacity - 1,
                          capacity}):
        lengths = torch.tensor([length], dtype=torch.int32, device="cuda")
        check(ptxforge.attention_with_kvcache(q, k, v, lengths), reference(q, k, v, lengths))
    past = torch.tensor([capacity + 5], dtype=torch.int32, device="cuda")
    full = torch.tensor([capacity], dtype=torch.int32, device="cuda")
    assert torch.equal(ptxforge.attention_with_kvcache(q, k, v, past),
                       ptxforge.attention_with_kvcache(q, k, v, full))


def test_softmax_scale_and_the_operator():
    q, k, v, lengths = problem(2, 700, 32, 8, 128, [700, 300])
    out = torch.ops.ptxforge.attention_with_kvcache(q, k, v, lengths, softmax_scale=0.05)
    check(out, reference(q, k, v, lengths, scale=0.05))


def test_a_cuda_graph_replays_with_new_lengths_and_queries():
    q, k, v, lengths = problem(4, 1500, 32, 8, 128, [1500, 3, 700, 0])
    ptxforge.attention_with_kvcache(q, k, v, lengths)      # launcher, counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ptxforge.attention_with_kvcache(q, k, v, lengths)
    for seed, new in enumerate(([1, 1500, 2, 999], [0, 0, 0, 0], [1499, 1498, 1, 1500])):
        q.copy_(torch.randn(q.shape, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(seed)).bfloat16())
        lengths.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        check(out, reference(q, k, v, lengths))


@pytest.mark.parametrize("math", ["cuda", "mma", "default"])
@pytest.mark.parametrize("page_size", [8, 16, 64, 256])
def test_a_paged_cache_gives_the_contiguous_cache_s_bits(page_size, math):
    """Pages shuffled in a pool, a block table naming them: the bits of the same cache
    gathered into a contiguous one (the same arithmetic in the same order), and the fp64
    reference. By default, pages under 16 tokens take the CUDA-core form."""
    from ptxforge.kernels import bf16_decode_attention as kernel

    if math == "mma" and page_size < kernel.MMA_MIN_PAGE:
        pytest.skip(f"the tensor-core form takes pages of {kernel.MMA_MIN_PAGE} or more")
    batch, pages, heads, kv_heads, head_dim = 3, 4096 // page_size, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks = batch * pages + 5
    pool = [torch.randn(blocks, page_size, kv_heads, head_dim, device="cuda",
                        generator=g).bfloat16() for _ in range(2)]
    table = torch.randperm(blocks, device="cuda", generator=g)[:batch * pages]
    table = table.view(batch, pages).int()
    q = torch.randn(batch, 1, heads, head_dim, device="cuda", generator=g).bfloat16()
    lengths = torch.tensor([4096, 1000, 1], dtype=torch.int32, device="cuda")
    gathered = [cache[table.long()].view(batch, pages * page_size, kv_heads, head_dim)
                for cache in pool]
    if math == "default":   # the contiguous cache by default too (the same splits, the
        # same merge), but for pages too small for the tensor-core form
        configs = (None, form_config("cuda", head_dim, heads // kv_heads)
                   if page_size < kernel.MMA_MIN_PAGE else None)
    else:
        configs = (form_config(math, head_dim, heads // kv_heads, True),
                   form_config(math, head_dim, heads // kv_heads))
    paged = ptxforge.attention_with_kvcache(q, *pool, lengths, block_table=table,
                                            config=configs[0])
    assert torch.equal(paged, ptxforge.attention_with_kvcache(q, *gathered, lengths,
                                                              config=configs[1]))
    check(paged, reference(q, *gathered, lengths))


@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (64, 8), (8, 8)])
def test_an_e4m3_cache_matches_fp64_over_its_dequantized_values(heads, kv_heads):
    """e4m3 caches written by quantize_fp8_per_token (a 128-wide row a (token, KV head):
    one scale each, row-major), against the fp64 attention over the dequantized cache."""
    batch, capacity, head_dim = 3, 2000, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 1, heads, head_dim, device="cuda", generator=g).bfloat16()
    caches, scales, values = [], [], []
    for spread in (1.0, 3.0):
        x = spread * torch.randn(batch, capacity, kv_heads, head_dim, device="cuda", generator=g)
        q8, scale = ptxforge.quantize_fp8_per_token(x.bfloat16().view(-1, head_dim),
                                                    "row_major")
        q8, scale = q8.view(x.shape), scale.view(x.shape[:3])
        caches.append(q8)
        scales.append(scale)
        values.append(q8.float() * scale[..., None])
    lengths = torch.tensor([2000, 1, 777], dtype=torch.int32, device="cuda")
    out = ptxforge.attention_with_kvcache(q, *caches, lengths, k_scale=scales[0],
                                          v_scale=scales[1])
    ref = reference(q, *values, lengths)
    assert not out.isnan().any()
    err = (out.double() - ref).abs().max().item()
    assert err <= 1e-2 + 1e-2 * ref.abs().max().item(), err


def reference_tokens(q, k, v, lengths, causal=True):
    """q [B, q_len, Hq, D]: token j over the first L - (q_len - 1 - j) keys where causal."""
    q_len = q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for j in range(q_len):
        seen = (lengths - (q_len - 1 - j)).clamp(min=0) if causal else lengths
        out[:, j:j + 1] = reference(q[:, j:j + 1], k, v, seen)
    return out


@pytest.mark.parametrize("q_len, heads, kv_heads, head_dim, causal", [
    (2, 64, 8, 128, True), (4, 32, 8, 128, True), (8, 16, 8, 64, True),
    (3, 32, 8, 128, False), (5, 9, 3, 64, True),
    (8, 64, 8, 128, True), (3, 64, 8, 64, True)])     # 64 and 24 rows: several tiles
@pytest.mark.parametrize("layout", ["flash", "transformers"])
def test_several_query_tokens_match_fp64(q_len, heads, kv_heads, head_dim, causal, layout):
    """Speculative decoding's q_len tokens a sequence (causal among themselves, or not; past
    16 rows of q_len x group, several tiles): lengths under q_len, at a split's edge and the
    whole cache; the same bits twice."""
    batch, capacity = 4, 3000
    g = torch.Generator(device="cuda").manual_seed(3)
    _, k, v, lengths = problem(batch, capacity, heads, kv_heads, head_dim,
                               [3000, q_len - 1, 1, 1025], layout=layout)
    q = torch.randn(batch, q_len, heads, head_dim, device="cuda", generator=g).bfloat16()
    out = ptxforge.attention_with_kvcache(q, k, v, lengths, causal=causal)
    check(out, reference_tokens(q, k, v, lengths, causal))
    assert torch.equal(out, ptxforge.attention_with_kvcache(q, k, v, lengths, causal=causal))


@pytest.mark.parametrize("q_len, lengths", [(1, [2560, 1000, 1]), (2, [2560, 700, 1])])
def test_a_paged_e4m3_cache_gives_the_contiguous_one_s_bits(q_len, lengths):
    """An e4m3 pool and its scales in shuffled pages of 64 (quantize_fp8_per_token's rows),
    one query token a sequence or two: the bits of the same cache and scales gathered into
    contiguous ones, and fp64 over the dequantized cache."""
    batch, pages, page, heads, kv_heads, head_dim = 3, 40, 64, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(q_len)
    blocks = batch * pages + 5
    caches, scales = [], []
    for spread in (1.0, 3.0):
        x = spread * torch.randn(blocks * page * kv_heads, head_dim, device="cuda", generator=g)
        q8, scale = ptxforge.quantize_fp8_per_token(x.bfloat16(), "row_major")
        caches.append(q8.view(blocks, page, kv_heads, head_dim))
        scales.append(scale.view(blocks, page, kv_heads))
    table = torch.randperm(blocks, device="cuda", generator=g)[:batch * pages]
    table = table.view(batch, pages).int()
    q = torch.randn(batch, q_len, heads, head_dim, device="cuda", generator=g).bfloat16()
    lengths = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    gather = lambda x: x[table.long()].reshape(batch, pages * page, *x.shape[2:])
    paged = ptxforge.attention_with_kvcache(q, *caches, lengths, block_table=table,
                                            k_scale=scales[0], v_scale=scales[1])
    contiguous = ptxforge.attention_with_kvcache(q, *map(gather, caches), lengths,
                                                 k_scale=gather(scales[0]),
                                                 v_scale=gather(scales[1]))
    assert not paged.isnan().any() and torch.equal(paged, contiguous)
    values = [gather(c).float() * gather(s)[..., None] for c, s in zip(caches, scales)]
    ref = reference_tokens(q, *values, lengths)
    assert (paged.double() - ref).abs().max().item() <= 1e-2 + 1e-2 * ref.abs().max().item()


@pytest.mark.parametrize("paged", [False, True])
def test_new_keys_and_values_are_written_and_attended_to(paged):
    """k_new and v_new (the two query tokens' own) written at each sequence's length (one
    of them past S_max: dropped) and attended to causally in the same call; the rest of
    the cache as it was."""
    batch, capacity, heads, kv_heads, head_dim, n, page = 3, 2048, 32, 8, 128, 2, 64
    g = torch.Generator(device="cuda").manual_seed(4)
    _, k, v, lengths = problem(batch, capacity, heads, kv_heads, head_dim, [1000, 0, 2047])
    q = torch.randn(batch, n, heads, head_dim, device="cuda", generator=g).bfloat16()
    new = [torch.randn(batch, n, kv_heads, head_dim, device="cuda", generator=g).bfloat16()
           for _ in range(2)]
    expected = [cache.clone() for cache in (k, v)]
    for cache, rows in zip(expected, new):
        for b, length in enumerate(lengths.tolist()):
            fits = min(n, capacity - length)
            cache[b, length:length + fits] = rows[b, :fits]
    extra = {}
    if paged:
        pages = capacity // page
        order = torch.randperm(batch * pages, device="cuda", generator=g)
        k, v = (c.reshape(batch * pages, page, kv_heads, head_dim)[order.argsort()].contiguous()
                for c in (k, v))
        extra = {"block_table": order.view(batch, pages).int()}
    out = ptxforge.attention_with_kvcache(q, k, v, lengths, k_new=new[0], v_new=new[1],
                                          **extra)
    check(out, reference_tokens(q, *expected, (lengths + n).clamp(max=capacity)))
    if paged:
        table = extra["block_table"].long()
        k, v = (c[table].reshape(batch, capacity, kv_heads, head_dim) for c in (k, v))
    assert torch.equal(k, expected[0]) and torch.equal(v, expected[1])
