"""``ptxforge bench attention``: decode attention over a bf16 KV cache (one query token a
sequence), ``attention_with_kvcache`` (its default tensor-core form, and its CUDA-core form
by ``config=``) beside torch's SDPA with each backend that runs the
shape (cuDNN, flash, efficient; enable_gqa, over the same cache in transformers' layout;
for a paged row, ours reads the cache's pages from a shuffled pool, SDPA the contiguous),
kernel time from the profiler with the L2 flushed by reading a buffer larger than it (a
write would leave 50 MB of dirty lines for the timed call to write back), median; the K
and V bytes read over the time, against the HBM peak and a same-size read (``torch.sum``)
and copy timed in the same run. Caches under the L2 are marked."""

from __future__ import annotations

import warnings

import torch

from . import format_table
from .ops import Timer, copy_of

# batch, cache tokens, query heads, KV heads (head dim 128), page size (0: contiguous; -1:
# an e4m3 cache with its scales, beside SDPA on the bf16 cache)
SHAPES = ((1, 512, 32, 8, 0), (1, 8192, 32, 8, 0), (8, 2048, 32, 8, 0), (256, 512, 32, 8, 0),
          (1, 131072, 32, 8, 0), (32, 4096, 32, 8, 0), (32, 4096, 32, 8, 64),
          (32, 4096, 32, 8, -1), (32, 4096, 64, 8, 0), (32, 4096, 32, 32, 0))
HEAD_DIM = 128
HBM_PEAK_TBS = 4.8
L2_BYTES = 50 << 20


def attention_suite(shapes=SHAPES, timer: Timer | None = None) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import ptxforge

    timer = timer or Timer(flush_by="read")
    backends = {"cuDNN": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    rows = []
    for batch, capacity, heads, kv_heads, page in shapes:
        q = torch.randn(batch, 1, heads, HEAD_DIM, device="cuda").bfloat16()
        k = torch.randn(batch, kv_heads, capacity, HEAD_DIM, device="cuda").bfloat16()
        v = torch.randn_like(k)
        lengths = torch.full((batch,), capacity, dtype=torch.int32, device="cuda")
        nbytes = 2 * k.numel() * k.element_size()
        if page < 0:   # e4m3 with a scale a (token, head); the bytes read are half
            fp8 = []
            for cache in (k, v):
                tokens = cache.transpose(1, 2)
                scale = tokens.float().abs().amax(-1).clamp_min(1e-12) / 448
                fp8 += [(tokens.float() / scale[..., None]).to(torch.float8_e4m3fn), scale]
            nbytes //= 2
            ours = lambda: ptxforge.attention_with_kvcache(q, fp8[0], fp8[2], lengths,
                                                            k_scale=fp8[1], v_scale=fp8[3])
        elif page:   # the same cache in pages of a shuffled pool ([blocks, page, Hkv, D])
            pages = capacity // page
            order = torch.randperm(batch * pages, device="cuda")
            pool = [c.transpose(1, 2).reshape(batch * pages, page, kv_heads, HEAD_DIM)[
                order.argsort()].contiguous() for c in (k, v)]
            table = order.view(batch, pages).int()
            ours = lambda: ptxforge.attention_with_kvcache(q, *pool, lengths, block_table=table)
        else:
            ours = lambda: ptxforge.attention_with_kvcache(q, k.transpose(1, 2),
                                                            v.transpose(1, 2), lengths)
        qs = q.transpose(1, 2)
        with sdpa_kernel(backends["cuDNN"]):
            expected = F.scaled_dot_product_attention(qs, k, v, enable_gqa=True)
        from ..kernels import bf16_decode_attention as kernel
        from ..ops.common import device_arch

        cuda = None if page < 0 else kernel.choose_config(
            device_arch(torch.cuda.current_device()), HEAD_DIM, heads // kv_heads, page > 0,
            tensor_cores=False)
        if page < 0:
            ours_cuda = None      # the e4m3 cache takes the tensor-core form only
        elif page:
            ours_cuda = lambda: ptxforge.attention_with_kvcache(q, *pool, lengths,
                                                                 block_table=table, config=cuda)
        else:
            ours_cuda = lambda: ptxforge.attention_with_kvcache(
                q, k.transpose(1, 2), v.transpose(1, 2), lengths, config=cuda)
        runs = [ours] + ([ours_cuda] if ours_cuda else [])
        diff = max((run().transpose(1, 2).float() - expected.float()).abs().max().item()
                   for run in runs)
        row = {"batch": batch, "capacity": capacity, "heads": heads, "kv_heads": kv_heads,
               "page": page, "bytes": nbytes, "l2_resident": nbytes < L2_BYTES,
               "ptxforge_us": timer(ours) * 1e3,
               "ptxforge_cuda_cores_us": timer(ours_cuda) * 1e3 if ours_cuda else None,
               "max_abs_diff": diff}
        for name, backend in backends.items():
            try:     # a backend that does not take the shape warns why, then raises
                with sdpa_kernel(backend), warnings.catch_warnings(action="ignore"):
                    us = timer(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True))
                row[f"{name}_us"] = us * 1e3
            except RuntimeError:
                row[f"{name}_us"] = None
        both = torch.cat([k.view(-1), v.view(-1)])
        row["read_us"] = timer(lambda: both.sum()) * 1e3
        row["copy_us"] = timer(copy_of(2 * nbytes)) * 1e3
        del both
        rows.append(row)
    return {"suite": "attention", "gpu": torch.cuda.get_device_name(), "head_dim": HEAD_DIM,
            "rows": rows}


def attention_table(result: dict) -> str:
    def rate(row, us):
        return "-" if us is None else f"{us:.1f} ({row['bytes'] / us / 1e6:.2f})"

    rows = []
    for r in result["rows"]:
        shape = f"{r['batch']} x {r['capacity']}, {r['heads']}/{r['kv_heads']}" + (
            ", e4m3" if r["page"] < 0 else f", pages of {r['page']}" if r["page"] else "")
        rows.append([shape + (" (L2)" if r["l2_resident"] else ""),
                     f"{r['bytes'] / 1e6:.1f}", rate(r, r["ptxforge_us"]),
                     f"{r['bytes'] / r['ptxforge_us'] / 1e6 / HBM_PEAK_TBS:.0%}",
                     rate(r, r["ptxforge_cuda_cores_us"]),
                     rate(r, r["cuDNN_us"]), rate(r, r["flash_us"]), rate(r, r["efficient_us"]),
                     rate(r, r["read_us"]), rate(r, r["copy_us"] / 2),
                     f"{r['max_abs_diff']:.1e}"])
    title = (f"{result['gpu']}: decode attention, one query token, bf16 cache, head dim "
             f"{result['head_dim']}; us (TB/s of K and V read), kernel time from the profiler "
             f"with the L2 flushed by a read, median; 'of peak': of {HBM_PEAK_TBS} TB/s; read: "
             f"torch.sum over the same bytes; copy: a copy of twice the bytes, its time halved; (L2): "
             f"the cache fits the L2; e4m3: the bytes are the e4m3 cache's (SDPA, read and "
             f"copy: the bf16 cache, twice them)")
    return title + "\n" + format_table(
        ["B x S, Hq/Hkv", "MB", "ptxforge", "of peak", "CUDA-core form", "SDPA cuDNN", "SDPA flash",
         "SDPA efficient", "read", "copy", "max |diff| vs cuDNN"], rows)
