"""Decode attention over a KV cache on torch tensors: FlashAttention's
``flash_attn_with_kvcache`` for one new token a sequence (``kernels/bf16_decode_attention.py``).

The kernel is specialised on the head size and the query heads a KV head; the batch, the
heads, the cache's capacity and strides, the lengths and the split of the cache across
CTAs are run-time arguments. The split comes from the cache's capacity (the lengths stay
on the GPU, so a call is capturable in a CUDA graph): for the tensor-core form, at most
one CTA an SM where the pairs of sequence and KV head allow it (one CTA streams about an
SM's share of the HBM's rate, so a CTA sharing its SM becomes the straggler, and each
split more costs a partial and its merge; H200, 1 x 131072 tokens, 8 KV heads: 16 splits
124 us, 17 (four SMs with two CTAs) 144 us, 33 133 us); for the CUDA-core form, enough
CTAs for two waves.
"""

from __future__ import annotations

import functools
import math

import torch

from .. import jit, kernels
from ..kernels import bf16_decode_attention as attention_kernel
from .common import (current_stream, device_arch, inspect, programmatic, require_cuda,
                     require_pdl, traced)

LOG2E = 1.4426950408889634
WAVES = 2            # CTAs for this many waves of the device's SMs, the cache permitting
MIN_SPLIT_STEPS = 2  # a split reads at least this many of the kernel's token steps
MAX_SPLITS = 64      # the last split merges them all, its token slots sharing the work


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, head_dim: int, group: int, pdl: bool | None,
            paged: bool = False, config=None, cache_dtype: str = "bf16",
            small_pages: bool = False, q_len: int = 1, causal: bool = True,
            cluster: int = 1, append: bool = False):
    """(config, launcher) for one device and variant; ``pdl``: the call's; ``config``: the
    caller's (``_check_config``) instead of the heuristic's; ``small_pages``: pages under
    MMA_MIN_PAGE tokens, which take the CUDA-core form; ``cluster``: the splits merged in
    a cluster of that many CTAs."""
    cfg = config
    if cfg is None:
        cfg = attention_kernel.choose_config(
            device_arch(device_index), head_dim, group, paged,
            tensor_cores=False if small_pages else None,
            cache_dtype=cache_dtype, q_len=q_len, causal=causal, cluster=cluster,
            append=append)
    elif cfg.target != device_arch(device_index).target:
        raise ValueError(f"config is for {cfg.target}, but cuda:{device_index} is "
                         f"{device_arch(device_index).target}")
    launcher = jit.build(kernels.generate_attention(cfg)).launcher(
        device_index, programmatic=programmatic(pdl))
    return cfg, launcher


def _check_config(config, head_dim: int, group: int, paged: bool, cache_dtype: str,
                  q_len: int, causal: bool, append: bool) -> None:
    """A ``config=`` must be a decode attention config for this call's head size, group,
    cache and query tokens (its target is checked against the device when it launches)."""
    if not isinstance(config, attention_kernel.DecodeAttentionConfig):
        raise TypeError(f"config must be a decode attention config (kernels."
                        f"bf16_decode_attention.choose_config), got {type(config).__name__}")
    got = (config.head_dim, config.group, config.paged, config.cache_dtype, config.q_len,
           config.causal or config.q_len == 1, config.append)
    wanted = (head_dim, group, paged, cache_dtype, q_len, causal, append)
    if got != wanted:
        raise ValueError(f"config does not fit the call: it is for (head_dim, group, paged, "
                         f"cache dtype, q_len, causal, append) {got}, the call needs "
                         f"{wanted}")


def split_tokens(cfg, sms: int, batch: int, kv_heads: int, capacity: int,
                 splits: int = 1) -> int:
    """Tokens a split reads: the cache's capacity over ``splits`` (above 1: a cluster's),
    or over the splits that give the tensor-core form at most one CTA an SM (one split a
    pair where the pairs outnumber the SMs), the CUDA-core form WAVES waves of CTAs (at
    most MAX_SPLITS), at least MIN_SPLIT_STEPS of the kernel's steps each, a whole number
    of steps."""
    step = cfg.tokens_per_step
    pairs = batch * kv_heads
    if splits > 1:
        return _ceil_div(_ceil_div(capacity, splits), step) * step
    if cfg.tensor_cores:
        wanted = max(1, sms // pairs)
    else:
        wanted = _ceil_div(WAVES * sms * cfg.ctas_per_sm, pairs)
    splits = max(1, min(wanted, capacity // (MIN_SPLIT_STEPS * step), MAX_SPLITS))
    return _ceil_div(_ceil_div(capacity, splits), step) * step


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# Each device's counters, one a (sequence, KV head): zero between calls (the kernel's last
# split of a pair sets its counter back).
_counters: dict[int, torch.Tensor] = {}


def _counters_for(device_index: int, pairs: int) -> torch.Tensor:
    held = _counters.get(device_index)
    if held is None or held.numel() < pairs:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"attention_with_kvcache needs {pairs} counters and holds "
                               f"{0 if held is None else held.numel()}: call it once with "
                               f"this batch and these heads before capturing it")
        held = torch.zeros(max(pairs, 4096), dtype=torch.int32,
                           device=torch.device("cuda", device_index))
        _counters[device_index] = held
    return held


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cache_seqlens: torch.Tensor, *,
                           block_table: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           softmax_scale: float | None = None, causal: bool = True,
                           k_new: torch.Tensor | None = None,
                           v_new: torch.Tensor | None = None,
                           config=None, pdl: bool | None = None) -> torch.Tensor:
    """Attention of a sequence's newest tokens (one, or a few: speculative decoding's)
    over its cached keys and values, as FlashAttention's ``flash_attn_with_kvcache(q,
    k_cache, v_cache, cache_seqlens=..., causal=...)`` computes it:

        out[b, j, h] = softmax(softmax_scale * q[b, j, h] . k_cache[b, :L_j, h // g].T)
                       @ v_cache[b, :L_j, h // g]

    with L = cache_seqlens[b] (the cache holding the q_len new tokens' keys last; with
    k_new, cache_seqlens[b] + its tokens) and L_j = L - (q_len - 1 - j) where ``causal``
    (token j sees itself and the tokens before it), L otherwise; in f32, rounded to bf16
    once; a token that sees no key gives zeros.

    q: bf16 [B, q_len, Hq, D], D 64, 128 or 256 (unit stride; the other strides free);
    q_len above 1 takes the tensor-core form: D up to 128, q_len up to 8 (past 16 rows of
    q_len x Hq / Hkv, each 16 read the cache once more).
    k_cache, v_cache: bf16 [B, S_max, Hkv, D], D unit stride, the other strides free:
    transformers' static cache, [B, Hkv, S_max, D], is passed as ``cache.transpose(1, 2)``
    (a view, no copy). Hq a multiple of Hkv, at most 8 query heads a KV head.
    cache_seqlens: int32 [B] on the GPU, each from 0 to S_max (read on the GPU; a length
    past S_max, or negative, counts as S_max: nothing outside the cache is read).
    block_table: int32 [B, pages] on the GPU, rows contiguous, or None. Given, the caches
    are paged as vLLM's and FlashAttention's: [num_blocks, page_size, Hkv, D], token t of
    sequence b in page block_table[b, t // page_size] at row t % page_size; page_size a
    power of two; S_max = pages x page_size. A page index outside [0, num_blocks) reads
    the last page (never outside the pool; the table is on the GPU, unchecked here).
    k_scale, v_scale: with e4m3 caches (torch.float8_e4m3fn, D up to 128), each (token, KV
    head)'s f32 scale, [B, S_max, Hkv] (paged: [num_blocks, page_size, Hkv], paged as the
    caches; the strides free, the same for both): the cached k is k_cache * k_scale, v
    likewise. The scores and the weights
    take them; the tensor cores read the e4m3 values as f16 pairs (Q and P in f16). At D
    = 128, ``quantize_fp8_per_token(k.view(-1, 128), "row_major")`` writes new rows so:
    one scale a (token, KV head), amax / 448.
    k_new, v_new: bf16 [B, n, Hkv, D] (D unit stride, the same strides for both), or None:
    written into the caches at positions cache_seqlens[b] .. + n (those under S_max; the
    lengths themselves are not changed) and attended to, in the same kernel (the
    tensor-core form, a bf16 cache; not under torch.compile, whose operator does not
    declare the caches written).
    softmax_scale: by default D ** -0.5. config: a kernel config instead of the default
    (``kernels.bf16_decode_attention.choose_config(arch, D, Hq // Hkv, paged, ...)``: by
    default the tensor-core form, mma.sync, for D up to 128 and pages of 16 tokens or
    more; ``tensor_cores=False``: the CUDA-core form), checked against the call. ``pdl``:
    as ``rms_norm``'s. Returns a new bf16 [B, q_len, Hq, D].

    Differences from FlashAttention's: causal by default; q_len up to 8; no rotary, no
    dropout or softcap; page sizes any power of two.
    """
    if torch.compiler.is_dynamo_compiling():
        if k_new is not None or v_new is not None:
            raise ValueError("attention_with_kvcache: k_new and v_new write the caches, which "
                             "its operator does not declare: under torch.compile write them "
                             "first and count them in cache_seqlens")
        return traced("attention_with_kvcache", q, k_cache, v_cache, cache_seqlens,
                      block_table=block_table, k_scale=k_scale, v_scale=v_scale,
                      softmax_scale=softmax_scale, causal=causal, pdl=pdl, config=config)
    (batch, q_len, heads, head_dim), q_strides, q_ptr, device = inspect(
        "q", q, torch.bfloat16, 4)
    if q_len < 1:
        raise ValueError(f"q must hold at least one token a sequence ([B, q_len, Hq, D]), "
                         f"got shape {tuple(q.shape)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    causal = causal or q_len == 1     # one token: nothing to mask, one kernel either way
    e4m3 = isinstance(k_cache, torch.Tensor) and k_cache.dtype is torch.float8_e4m3fn
    cache_dtype = torch.float8_e4m3fn if e4m3 else torch.bfloat16
    caches = []
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        shape, strides, ptr, _ = inspect(name, cache, cache_dtype, 4, device=device)
        if block_table is not None and shape[3] != head_dim:
            raise ValueError(f"{name} must be [num_blocks, page_size, Hkv, D] with q's D = "
                             f"{head_dim}, got shape {tuple(shape)}")
        if block_table is None and (shape[0] != batch or shape[3] != head_dim):
            raise ValueError(f"{name} must be [B, S_max, Hkv, D] with q's B = {batch} and "
                             f"D = {head_dim}, got shape {tuple(shape)}")
        if any(stride % 8 for stride in strides[:3]):
            raise ValueError(f"{name}'s strides must keep each row 16-byte aligned (multiples "
                             f"of 8 elements), got {tuple(strides)}")
        caches.append((shape, strides, ptr))
    (_, capacity, kv_heads, _), _, _ = caches[0]
    if caches[1][0] != caches[0][0]:
        raise ValueError(f"k_cache and v_cache must have the same shape, got "
                         f"{tuple(caches[0][0])} and {tuple(caches[1][0])}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q's heads ({heads}) must be a multiple of the caches' "
                         f"({kv_heads})")
    attention_kernel.check_problem(head_dim, heads // kv_heads)
    if q_strides[1] % 8 or q_strides[2] % 8 or q_strides[0] % 8:
        raise ValueError(f"q's strides must keep each head's row 16-byte aligned (multiples "
                         f"of 8 elements), got {tuple(q_strides)}")
    lengths_shape, _, lengths_ptr, _ = inspect("cache_seqlens", cache_seqlens, torch.int32, 1,
                                               align=4, device=device, rows=False)
    if tuple(lengths_shape) != (batch,) or cache_seqlens.stride(0) != 1:
        raise ValueError(f"cache_seqlens must be a contiguous int32 [B] with B = {batch}, got "
                         f"shape {tuple(lengths_shape)}")
    paging, scaling = {}, {}
    if block_table is not None:
        capacity, paging = _pages(block_table, caches[0], batch, device)
    if e4m3 or k_scale is not None or v_scale is not None:
        scaling = _scales(k_scale, v_scale, e4m3, caches[0][0], head_dim, block_table, device)
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
            or not math.isfinite(softmax_scale)):
        raise TypeError(f"softmax_scale must be a finite real number, got {softmax_scale!r}")
    page_size = caches[0][0][1] if paging else attention_kernel.MMA_MIN_PAGE
    if q_len > 1 and (head_dim > attention_kernel.MMA_HEAD_DIM
                      or page_size < attention_kernel.MMA_MIN_PAGE
                      or q_len > attention_kernel.MAX_Q_LEN):
        raise ValueError(f"q's {q_len} tokens a sequence take the tensor-core form: head_dim "
                         f"up to {attention_kernel.MMA_HEAD_DIM}, pages of "
                         f"{attention_kernel.MMA_MIN_PAGE} tokens or more and q_len up to "
                         f"{attention_kernel.MAX_Q_LEN}; got head_dim {head_dim}, q_len "
                         f"{q_len}" + (f", page_size {page_size}" if paging else ""))
    appending = {}
    if k_new is not None or v_new is not None:
        appending = _new_tokens(k_new, v_new, caches[0][0], batch, head_dim, e4m3, page_size,
                                device)
    if config is not None:
        _check_config(config, head_dim, heads // kv_heads, block_table is not None,
                      "e4m3" if e4m3 else "bf16", q_len, causal, bool(appending))
        if config.tensor_cores and page_size < attention_kernel.MMA_MIN_PAGE:
            raise ValueError(f"the tensor-core form takes pages of "
                             f"{attention_kernel.MMA_MIN_PAGE} tokens or more, got page_size "
                             f"{page_size}")
    if pdl is not None:
        require_pdl(pdl)
    require_cuda("q", q, device)
    out = torch.empty((batch, q_len, heads, head_dim), dtype=torch.bfloat16, device=q.device)
    if batch == 0 or heads == 0:
        return out
    group = heads // kv_heads
    cfg, launcher = _kernel(device, head_dim, group, pdl, bool(paging), config,
                            "e4m3" if e4m3 else "bf16",
                            page_size < attention_kernel.MMA_MIN_PAGE, q_len, causal, 1,
                            bool(appending))
    # grid y: each KV head's tiles of query rows (one, but past MMA_ROWS rows)
    tiles = kv_heads * cfg.row_tiles
    tokens = split_tokens(cfg, device_arch(device).sm_count, batch, tiles, max(capacity, 1),
                          cfg.cluster)
    splits = max(1, _ceil_div(capacity, tokens))
    if config is not None and splits != cfg.cluster > 1:
        raise ValueError(f"config merges {cfg.cluster} splits in a cluster, but a cache of "
                         f"{capacity} tokens splits {splits} ways in steps of "
                         f"{cfg.tokens_per_step}")
    if config is None and cfg.tensor_cores and 2 <= splits <= attention_kernel.MAX_CLUSTER:
        # a few splits: merged in a cluster, through distributed shared memory
        cfg, launcher = _kernel(device, head_dim, group, pdl, bool(paging), None,
                                "e4m3" if e4m3 else "bf16", False, q_len, causal, splits,
                                bool(appending))
    pairs = batch * tiles
    rows = cfg.tile_rows
    merged = splits > 1 and cfg.cluster == 1    # through the workspace
    partial = torch.empty(pairs * splits * rows * head_dim if merged else 1,
                          dtype=torch.float32, device=q.device)
    partial_ml = torch.empty(pairs * splits * rows * 2 if merged else 1,
                             dtype=torch.float32, device=q.device)
    tokens_stride = {"q_token_stride": 2 * q_strides[1]} if q_len > 1 else {}
    (_, k_strides, k_ptr), (_, v_strides, v_ptr) = caches
    size = 1 if e4m3 else 2      # bytes a cached value
    launcher((splits, tiles, batch), current_stream(device),
             q=q_ptr, q_batch_stride=2 * q_strides[0], q_head_stride=2 * q_strides[2],
             k=k_ptr, k_batch_stride=size * k_strides[0], k_head_stride=size * k_strides[2],
             k_token_stride=size * k_strides[1],
             v=v_ptr, v_batch_stride=size * v_strides[0], v_head_stride=size * v_strides[2],
             v_token_stride=size * v_strides[1],
             seqlens=lengths_ptr, capacity=capacity, split_tokens=tokens,
             scale_log2=float(softmax_scale) * LOG2E,
             out=out.data_ptr(), partial=partial.data_ptr(), partial_ml=partial_ml.data_ptr(),
             counters=_counters_for(device, pairs).data_ptr(), **paging, **scaling,
             **tokens_stride, **appending)
    return out


def _new_tokens(k_new, v_new, cache_shape, batch: int, head_dim: int, e4m3: bool,
                page_size: int, device: int) -> dict:
    """Check k_new and v_new (both, bf16 [B, n, Hkv, D], the same strides; a bf16 cache
    the tensor-core form takes): the kernel's append arguments by parameter name."""
    if k_new is None or v_new is None:
        raise ValueError("k_new and v_new go together: got only "
                         + ("k_new" if v_new is None else "v_new"))
    if e4m3 or head_dim > attention_kernel.MMA_HEAD_DIM \
            or page_size < attention_kernel.MMA_MIN_PAGE:
        raise ValueError(f"k_new and v_new take a bf16 cache, head_dim up to "
                         f"{attention_kernel.MMA_HEAD_DIM} and pages of "
                         f"{attention_kernel.MMA_MIN_PAGE} tokens or more (the tensor-core "
                         f"form), got {'an e4m3 cache' if e4m3 else f'head_dim {head_dim}'}"
                         + (f", page_size {page_size}"
                            if page_size < attention_kernel.MMA_MIN_PAGE else ""))
    found = []
    for name, new in (("k_new", k_new), ("v_new", v_new)):
        shape, strides, ptr, _ = inspect(name, new, torch.bfloat16, 4, device=device)
        wanted = (batch, cache_shape[2], head_dim)
        if (shape[0], shape[2], shape[3]) != wanted or shape[1] < 1:
            raise ValueError(f"{name} must be bf16 [B, n, Hkv, D] with (B, Hkv, D) = "
                             f"{wanted} and n >= 1, got shape {tuple(shape)}")
        if any(stride % 8 for stride in strides[:3]):
            raise ValueError(f"{name}'s strides must keep each row 16-byte aligned (multiples "
                             f"of 8 elements), got {tuple(strides)}")
        found.append((tuple(shape), tuple(strides), ptr))
    if found[0][:2] != found[1][:2]:
        raise ValueError(f"k_new and v_new must have the same shape and strides, got "
                         f"{found[0][:2]} and {found[1][:2]}")
    (shape, strides, k_ptr), (_, _, v_ptr) = found
    return dict(k_new=k_ptr, v_new=v_ptr, new_batch_stride=2 * strides[0],
                new_token_stride=2 * strides[1], new_head_stride=2 * strides[2],
                new_tokens=shape[1])


def _scales(k_scale, v_scale, e4m3: bool, cache_shape, head_dim: int, block_table,
            device: int) -> dict:
    """Check an e4m3 cache's scales (and that only an e4m3 cache has them): the kernel's
    scale arguments by parameter name."""
    if not e4m3:
        raise ValueError("k_scale and v_scale go with e4m3 caches (torch.float8_e4m3fn); "
                         "the caches are bf16")
    if k_scale is None or v_scale is None:
        raise ValueError("e4m3 caches need k_scale and v_scale: f32 [B, S_max, Hkv], each "
                         "(token, KV head)'s scale")
    if head_dim > attention_kernel.MMA_HEAD_DIM:
        raise ValueError(f"e4m3 caches take head_dim up to {attention_kernel.MMA_HEAD_DIM}, "
                         f"got {head_dim}")
    found = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        shape, strides, ptr, _ = inspect(name, scale, torch.float32, 3, align=4, device=device,
                                         rows=False)
        if tuple(shape) != tuple(cache_shape[:3]):
            layout = "[num_blocks, page_size, Hkv]" if block_table is not None else \
                "[B, S_max, Hkv]"
            raise ValueError(f"{name} must be f32 {layout} = {list(cache_shape[:3])}, got "
                             f"shape {tuple(shape)}")
        found.append((strides, ptr))
    if found[0][0] != found[1][0]:
        raise ValueError(f"k_scale and v_scale must have the same strides, got "
                         f"{found[0][0]} and {found[1][0]}")
    strides = found[0][0]
    if block_table is not None and 4 * strides[0] >= 1 << 32:
        raise ValueError(f"paged scales' page stride must be under 4 GiB, got {strides[0]} "
                         f"elements")
    return dict(k_scale=found[0][1], v_scale=found[1][1], scale_batch_stride=4 * strides[0],
                scale_token_stride=4 * strides[1], scale_head_stride=4 * strides[2])


def _pages(block_table, k_cache, batch: int, device: int) -> tuple[int, dict]:
    """Check a block table against the paged caches: (S_max, the kernel's paging
    arguments by parameter name)."""
    (blocks, page_size, _, _), strides, _ = k_cache
    shape, table_strides, ptr, _ = inspect("block_table", block_table, torch.int32, 2,
                                           align=4, device=device, rows=False)
    if shape[0] != batch or table_strides[1] != 1:
        raise ValueError(f"block_table must be int32 [B, pages] with B = {batch} and "
                         f"contiguous rows, got shape {tuple(shape)}, strides "
                         f"{tuple(table_strides)}")
    if page_size & (page_size - 1) or blocks == 0:
        raise ValueError(f"a paged cache needs a power-of-two page size and at least one "
                         f"page, got k_cache [num_blocks={blocks}, page_size={page_size}, ...]")
    if 2 * strides[0] >= 1 << 32:
        raise ValueError(f"a paged cache's page stride must be under 4 GiB, got "
                         f"{strides[0]} elements")
    return shape[1] * page_size, dict(block_table=ptr, block_table_stride=table_strides[0],
                                      page_shift=page_size.bit_length() - 1,
                                      num_blocks=blocks)
