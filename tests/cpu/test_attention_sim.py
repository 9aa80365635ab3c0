"""The decode attention kernel run on the CPU (tests/support/ptxsim.py) against an fp64
reference: one split and several (the last split's merge, the counter back at zero), one
to eight query heads a KV head (three padded to four), head dims 64, 128 and 256, a
sequence of no tokens and one shorter than the cache; the output poisoned before."""

import struct

import numpy as np
import pytest

from ptxforge import arch
from ptxforge.kernels import bf16_decode_attention as kernel, generate_attention

from support.ptxsim import Memory, Simulator

LOG2E = 1.4426950408889634


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round to bf16 (to nearest even): the bits as uint16."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _reference(q, k, v, lengths, scale):
    """q [B, Hq, D], k and v [B, S, Hkv, D] as floats: out [B, Hq, D] in fp64."""
    batch, heads, _ = q.shape
    group = heads // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(batch):
        n = lengths[b]
        for h in range(heads):
            if n == 0:
                continue
            scores = k[b, :n, h // group].astype(np.float64) @ q[b, h].astype(np.float64) * scale
            p = np.exp(scores - scores.max())
            out[b, h] = p @ v[b, :n, h // group] / p.sum()
    return out


def _run(cfg, q, k, v, lengths, split_tokens, table=None, scales=None, new=None, pace=None):
    """The kernel on the simulator: out as floats [B, Hq, D] (q [B, q_len, Hq, D]: out
    [B, q_len, Hq, D]), and the counters' bytes. ``table``: a paged cache's block table (k
    and v then [blocks, page, Hkv, D]). ``scales``: an e4m3 cache's (k_scale, v_scale), f32
    [B, S, Hkv]. ``new``: (k_new, v_new) [B, n, Hkv, D] to append; then the caches after
    the call (bf16 bits) come third. ``pace``: the simulator's (instructions a turn, by
    launch, CTA and thread)."""
    q_len = q.shape[1] if q.ndim == 4 else 1
    batch, heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    kv_heads, size = k.shape[2], k.itemsize
    capacity = k.shape[1] * (table.shape[1] if table is not None else 1)
    splits, group = -(-capacity // split_tokens), heads // kv_heads
    pairs, rows = batch * kv_heads * cfg.row_tiles, cfg.tile_rows
    memory = Memory()
    out = memory.alloc(2 * batch * q_len * heads * head_dim, fill=0xFF)   # poisoned: NaNs
    counters = memory.alloc(4 * pairs)
    scale = head_dim ** -0.5
    rows = size * k.shape[1] * kv_heads * head_dim      # a sequence's, or a page's, bytes
    args = dict(
        q=memory.put(q.tobytes()), q_batch_stride=2 * q_len * heads * head_dim,
        q_head_stride=2 * head_dim,
        k=memory.put(k.tobytes()), k_batch_stride=rows, k_head_stride=size * head_dim,
        k_token_stride=size * kv_heads * head_dim,
        v=memory.put(v.tobytes()), v_batch_stride=rows, v_head_stride=size * head_dim,
        v_token_stride=size * kv_heads * head_dim,
        seqlens=memory.put(np.array(lengths, dtype=np.int32).tobytes()), capacity=capacity,
        split_tokens=split_tokens,
        scale_log2=struct.unpack("<I", struct.pack("<f", scale * LOG2E))[0],
        out=out, partial=memory.alloc(4 * pairs * splits * rows * head_dim, fill=0xFF),
        partial_ml=memory.alloc(8 * pairs * splits * rows, fill=0xFF), counters=counters)
    if q_len > 1:
        args.update(q_token_stride=2 * heads * head_dim)
    if scales is not None:
        args.update(k_scale=memory.put(scales[0].astype(np.float32).tobytes()),
                    v_scale=memory.put(scales[1].astype(np.float32).tobytes()),
                    scale_batch_stride=4 * k.shape[1] * kv_heads, scale_head_stride=4,
                    scale_token_stride=4 * kv_heads)
    if table is not None:
        args.update(block_table=memory.put(table.astype(np.int32).tobytes()),
                    block_table_stride=table.shape[1],
                    page_shift=k.shape[1].bit_length() - 1, num_blocks=k.shape[0])
    if new is not None:
        n = new[0].shape[1]
        args.update(k_new=memory.put(new[0].tobytes()), v_new=memory.put(new[1].tobytes()),
                    new_batch_stride=2 * n * kv_heads * head_dim,
                    new_token_stride=2 * kv_heads * head_dim, new_head_stride=2 * head_dim,
                    new_tokens=n)
    sim = Simulator(memory, pace=pace)
    built = generate_attention(cfg)
    sim.launch("attention", built.ptx(), (splits, kv_heads * cfg.row_tiles, batch), 128,
               shared_bytes=built.launch.shared_bytes, cluster=built.launch.cluster, **args)
    sim.run()
    got = _f32(np.frombuffer(memory.read(out, 2 * batch * q_len * heads * head_dim),
                             dtype=np.uint16))
    if new is not None:
        caches = [np.frombuffer(memory.read(args[name], k.nbytes), dtype=np.uint16)
                  .reshape(k.shape) for name in ("k", "v")]
        return got.reshape(q.shape), memory.read(counters, 4 * pairs), caches
    return got.reshape(q.shape), memory.read(counters, 4 * pairs)


@pytest.mark.parametrize("batch, capacity, heads, kv_heads, head_dim, lengths, split_tokens", [
    (1, 150, 2, 1, 64, [150], 64),        # three splits, the last merging
    (1, 64, 1, 1, 64, [50], 64),          # one split, one head a KV head
    (2, 100, 3, 1, 64, [0, 100], 64),     # three heads (padded to four), no tokens, two splits
    (1, 200, 8, 2, 128, [190], 64),       # Llama's 4 heads a KV head, four splits
    (1, 100, 8, 1, 128, [100], 32),       # 8 heads a KV head (2 tokens a thread a step)
    (1, 64, 2, 2, 256, [64], 64),         # head dim 256, one head a KV head, two KV heads
])
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_the_kernel_on_the_simulator_matches_fp64(batch, capacity, heads, kv_heads, head_dim,
                                                 lengths, split_tokens, tensor_cores):
    """Both forms within the same bound (the tensor-core one rounds Q and P to bf16 for
    the mma: about twice the CUDA-core form's error at 4 heads a KV head)."""
    if tensor_cores and head_dim > kernel.MMA_HEAD_DIM:
        pytest.skip(f"the tensor-core form takes head_dim up to {kernel.MMA_HEAD_DIM}")
    cfg = kernel.choose_config(arch.get("sm_90a"), head_dim, heads // kv_heads,
                               tensor_cores=tensor_cores)
    split_tokens = -(-split_tokens // cfg.tokens_per_step) * cfg.tokens_per_step
    rng = np.random.default_rng(0)
    q = _bf16(rng.standard_normal((batch, heads, head_dim)))
    k = _bf16(rng.standard_normal((batch, capacity, kv_heads, head_dim)))
    v = _bf16(rng.standard_normal((batch, capacity, kv_heads, head_dim)))
    got, counters = _run(cfg, q, k, v, lengths, split_tokens)
    expected = _reference(_f32(q), _f32(k), _f32(v), lengths, head_dim ** -0.5)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected, atol=4e-3, rtol=1e-2)
    assert counters == bytes(len(counters))   # zero for the next call


@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize("page_size, pages, heads, kv_heads, lengths, split_tokens", [
    (16, 8, 8, 2, [128, 45], 64),       # pages smaller than a step, two splits
    (64, 3, 4, 1, [150, 64], 64),       # three splits, a page a split
])
def test_a_paged_cache_gives_the_gathered_cache_s_result(page_size, pages, heads, kv_heads,
                                                         lengths, split_tokens, tensor_cores):
    """Pages in a shuffled pool and a block table naming them; one entry past the pool, in
    the first sequence's length: it reads the pool's last page, never outside."""
    head_dim, batch = 64, len(lengths)
    cfg = kernel.choose_config(arch.get("sm_90a"), head_dim, heads // kv_heads, paged=True,
                               tensor_cores=tensor_cores)
    rng = np.random.default_rng(1)
    blocks = batch * pages + 3
    q = _bf16(rng.standard_normal((batch, heads, head_dim)))
    k = _bf16(rng.standard_normal((blocks, page_size, kv_heads, head_dim)))
    v = _bf16(rng.standard_normal((blocks, page_size, kv_heads, head_dim)))
    table = rng.permutation(blocks)[:batch * pages].reshape(batch, pages)
    table[0, -1] = blocks + 100        # past the pool
    got, counters = _run(cfg, q, k, v, lengths, split_tokens, table)
    gathered = lambda cache: np.stack([cache[np.minimum(row, blocks - 1)].reshape(
        pages * page_size, kv_heads, head_dim) for row in table])
    expected = _reference(_f32(q), _f32(gathered(k)), _f32(gathered(v)), lengths,
                          head_dim ** -0.5)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected, atol=4e-3, rtol=1e-2)
    assert counters == bytes(len(counters))


def _e4m3(x: np.ndarray):
    """Per (token, head) scales (the row's amax / 448) and the e4m3 bytes of x / scale:
    x [B, S, Hkv, D] -> (uint8 [B, S, Hkv, D], f32 scales [B, S, Hkv], the dequantized
    values)."""
    import torch

    scales = np.maximum(np.abs(x).max(-1), 1e-12) / 448.0
    q = torch.from_numpy((x / scales[..., None]).astype(np.float32)).to(torch.float8_e4m3fn)
    return (q.view(torch.uint8).numpy(), scales.astype(np.float32),
            q.float().numpy() * scales[..., None].astype(np.float32))


@pytest.mark.parametrize("batch, capacity, heads, kv_heads, head_dim, lengths", [
    (1, 150, 8, 2, 128, [150]), (2, 100, 4, 1, 64, [0, 77]), (1, 64, 8, 1, 128, [64])])
def test_an_e4m3_cache_with_its_scales_matches_fp64_over_its_values(batch, capacity, heads,
                                                                    kv_heads, head_dim,
                                                                    lengths):
    """The tensor-core form over an e4m3 cache: each (token, KV head)'s k and v scales on
    the scores and on P, the mma in f16; against fp64 over the dequantized cache."""
    pytest.importorskip("torch")
    cfg = kernel.choose_config(arch.get("sm_90a"), head_dim, heads // kv_heads,
                               tensor_cores=True, cache_dtype="e4m3")
    rng = np.random.default_rng(2)
    q = _bf16(rng.standard_normal((batch, heads, head_dim)))
    k8, k_scale, k_values = _e4m3(rng.standard_normal((batch, capacity, kv_heads, head_dim)))
    v8, v_scale, v_values = _e4m3(3 * rng.standard_normal((batch, capacity, kv_heads,
                                                           head_dim)))
    got, counters = _run(cfg, q, k8, v8, lengths, 64, scales=(k_scale, v_scale))
    expected = _reference(_f32(q), k_values, v_values, lengths, head_dim ** -0.5)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected, atol=1e-2, rtol=1e-2)
    assert counters == bytes(len(counters))


@pytest.mark.parametrize("split_tokens", [64, 256])
def test_scores_that_keep_growing_move_the_running_max_along(split_tokens):
    """Keys along the query, longer token by token: each tile's max passes the last by
    about 6 (log2), so the tensor-core form's running max, which moves only when passed by
    more than MAX_SLACK, moves every other tile, and its O is rescaled then."""
    from ptxforge.kernels import bf16_decode_attention_mma as mma

    batch, capacity, heads, kv_heads, head_dim = 1, 200, 4, 1, 64
    cfg = kernel.choose_config(arch.get("sm_90a"), head_dim, heads // kv_heads,
                               tensor_cores=True)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((batch, heads, head_dim))
    direction = q[:, :1] / np.linalg.norm(q[:, :1], axis=-1, keepdims=True)
    growth = np.arange(capacity)[None, :, None, None] / 4 * head_dim ** 0.5 / np.linalg.norm(
        q[:, :1], axis=-1)[..., None, None]
    k = _bf16(growth * direction[:, None] + 0.1 * rng.standard_normal(
        (batch, capacity, kv_heads, head_dim)))
    v = _bf16(rng.standard_normal((batch, capacity, kv_heads, head_dim)))
    q = _bf16(q)
    got, counters = _run(cfg, q, k, v, [capacity], split_tokens)
    expected = _reference(_f32(q), _f32(k), _f32(v), [capacity], head_dim ** -0.5)
    steps = np.diff(np.log2(np.e) * head_dim ** -0.5 * (_f32(k)[0, ::mma.TILE, 0]
                                                       @ _f32(q)[0, 0]))
    assert steps.min() > 4 and steps.max() < mma.MAX_SLACK   # it moves, not every tile
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected, atol=4e-3, rtol=1e-2)
    assert counters == bytes(len(counters))


def test_a_paged_e4m3_cache_takes_its_scales_from_the_same_pages():
    """An e4m3 pool and its scales [blocks, page, Hkv], pages shuffled (one entry past the
    pool): fp64 over the gathered, dequantized cache."""
    pytest.importorskip("torch")
    head_dim, heads, kv_heads, page_size, pages, lengths = 64, 4, 2, 16, 5, [80, 33]
    batch = len(lengths)
    cfg = kernel.choose_config(arch.get("sm_90a"), head_dim, heads // kv_heads, paged=True,
                               cache_dtype="e4m3")
    rng = np.random.default_rng(4)
    blocks = batch * pages + 2
    q = _bf16(rng.standard_normal((batch, heads, head_dim)))
    k8, k_scale, k_values = _e4m3(rng.standard_normal((blocks, page_size, kv_heads, head_dim)))
    v8, v_scale, v_values = _e4m3(3 * rng.standard_normal((blocks, page_size, kv_heads,
                                                           head_dim)))
    table = rng.permutation(blocks)[:batch * pages].reshape(batch, pages)
    table[1, 1] = blocks + 7           # past the pool: its last page
    got, counters = _run(cfg, q, k8, v8, lengths, 64, table, scales=(k_scale, v_scale))
    gathered = lambda cache: np.stack([cache[np.minimum(row, blocks - 1)].reshape(
        pages * page_size, kv_heads, head_dim) for row in table])
    expected = _reference(_f32(q), gathered(k_values), gathered(v_values), lengths,
                          head_dim ** -0.5)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected, atol=1e-2, rtol=1e-2)
    assert counters == bytes(len(counters))


def _reference_tokens(q, k, v, lengths, scale, causal):
    """q [B, q_len, Hq, D], k and v [B, S, Hkv, D]: out [B, q_len, Hq, D] in fp64, query
    token j seeing the first L - (q_len - 1 - j) tokens where causal, L otherwise."""
    q_len = q.shape[1]
    out = np.zeros(q.shape)
    for j in range(q_len):
        seen = [max(0, n - (q_len - 1 - j)) if causal else n for n in lengths]
        out[:, j] = _reference(q[:, j], k, v, seen, scale)
    return out


def _check_query_tokens(cfg, capacity, lengths, split_tokens, seed):
    """cfg's kernel on the simulator over random q [B, q_len, Hq, D] and caches against the
    fp64 reference of its (causal or not) query tokens; the counters back at zero."""
    batch, heads, kv_heads = len(lengths), cfg.group, 1
    rng = np.random.default_rng(seed)
    q = _bf16(rng.standard_normal((batch, cfg.q_len, heads, cfg.head_dim)))
    k = _bf16(rng.standard_normal((batch, capacity, kv_heads, cfg.head_dim)))
    v = _bf16(rng.standard_normal((batch, capacity, kv_heads, cfg.head_dim)))
    got, counters = _run(cfg, q, k, v, lengths, split_tokens)
    expected = _reference_tokens(_f32(q), _f32(k), _f32(v), lengths, cfg.head_dim ** -0.5,
                                 cfg.causal)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected, atol=4e-3, rtol=1e-2)
    assert counters == bytes(len(counters))


@pytest.mark.parametrize("q_len, group, lengths, split_tokens, causal", [
    (4, 4, [150, 2], 64, True),     # 16 rows, a length under q_len, three splits
    (2, 8, [64, 100], 256, True),   # 16 rows, one split
    (5, 3, [77, 130], 64, True),    # 15 rows: one row past them
    (3, 2, [0, 129], 64, False),    # 6 rows, each token sees all L
    (8, 1, [20, 140], 64, True),    # 8 rows (no second row a lane)
])
def test_several_query_tokens_see_the_cache_causally(q_len, group, lengths, split_tokens,
                                                     causal):
    """Speculative decoding's query tokens, q [B, q_len, Hq, D], the tile's rows (token j,
    head h) = j x group + h: against fp64 where token j sees the cache's first L - (q_len -
    1 - j) tokens (FlashAttention's causal, bottom-right), or all L."""
    cfg = kernel.choose_config(arch.get("sm_90a"), 64, group, q_len=q_len, causal=causal)
    _check_query_tokens(cfg, 150, lengths, split_tokens, seed=5)


@pytest.mark.parametrize("cluster, q_len, group, lengths", [
    (2, 1, 4, [128, 77]), (4, 1, 4, [256, 1]), (3, 4, 4, [190, 3])])
def test_a_cluster_merges_its_splits_through_distributed_shared_memory(cluster, q_len, group,
                                                                       lengths):
    """A pair's splits as one cluster (split = rank): CTA 0 folds the others' states from
    their shared memory, no workspace or counter touched (the counters stay zero); one and
    two rows a lane; a split past the length."""
    cfg = kernel.choose_config(arch.get("sm_90a"), 64, group, q_len=q_len, cluster=cluster)
    _check_query_tokens(cfg, 64 * cluster, lengths, 64, seed=6)


@pytest.mark.parametrize("paged, cluster, lengths", [
    (False, 1, [70, 0]), (True, 1, [100, 47]), (False, 2, [126, 5])])
def test_new_keys_and_values_are_appended_and_attended_to(paged, cluster, lengths):
    """k_new and v_new (two tokens a sequence, the two query tokens' own) written into the
    cache at each sequence's length (a length of 126 in 128: the second is past S_max and
    dropped) and attended to causally in the same call; the rest of the cache untouched.
    The first split, which writes them, runs an instruction a turn, the others 64: the
    others read the new rows before they are in the cache, from k_new and v_new."""
    head_dim, heads, kv_heads, n, capacity = 64, 4, 2, 2, 128
    batch = len(lengths)
    cfg = kernel.choose_config(arch.get("sm_90a"), head_dim, heads // kv_heads, paged=paged,
                               q_len=n, cluster=cluster, append=True)
    rng = np.random.default_rng(7)
    q = _bf16(rng.standard_normal((batch, n, heads, head_dim)))
    k = _bf16(rng.standard_normal((batch, capacity, kv_heads, head_dim)))
    v = _bf16(rng.standard_normal((batch, capacity, kv_heads, head_dim)))
    new = [_bf16(rng.standard_normal((batch, n, kv_heads, head_dim))) for _ in range(2)]
    expected_caches = [cache.copy() for cache in (k, v)]
    for cache, rows in zip(expected_caches, new):
        for b, length in enumerate(lengths):
            fits = min(n, capacity - length)
            cache[b, length:length + fits] = rows[b, :fits]
    seen = [min(length + n, capacity) for length in lengths]
    table = None
    if paged:     # pages of 16, the pool shuffled
        page, pages = 16, capacity // 16
        order = rng.permutation(batch * pages)
        table = order.reshape(batch, pages)
        pool = lambda x: x.reshape(batch * pages, page, kv_heads, head_dim)[np.argsort(order)]
        k, v = pool(k), pool(v)
    got, counters, caches = _run(cfg, q, k, v, lengths, 64, table, new=new,
                                 pace=lambda name, cta, tid: 1 if cta % 2 == 0 else 64)
    if paged:
        caches = [c[table].reshape(batch, capacity, kv_heads, head_dim) for c in caches]
    expected = _reference_tokens(_f32(q), _f32(expected_caches[0]), _f32(expected_caches[1]),
                                 seen, head_dim ** -0.5, True)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected, atol=4e-3, rtol=1e-2)
    for cache, want in zip(caches, expected_caches):
        np.testing.assert_array_equal(cache, want)
    assert counters == bytes(len(counters))


@pytest.mark.parametrize("q_len, group, lengths, split_tokens, cluster", [
    (4, 8, [150, 3], 64, 1),     # 32 rows: two tiles, three splits merged globally
    (3, 8, [100, 0], 64, 1),     # 24 rows: the second tile half full
    (8, 8, [128, 40], 64, 2),    # 64 rows: four tiles, two splits in a cluster
])
def test_more_rows_than_a_tile_take_a_tile_each(q_len, group, lengths, split_tokens, cluster):
    """Past 16 rows (q_len x group) each tile of 16 is its own CTAs, grid y counting KV
    heads and tiles: every row against fp64."""
    cfg = kernel.choose_config(arch.get("sm_90a"), 64, group, q_len=q_len, cluster=cluster)
    assert cfg.row_tiles == -(-q_len * group // 16)
    capacity = 150 if cluster == 1 else 64 * cluster
    _check_query_tokens(cfg, capacity, lengths, split_tokens, seed=8)
