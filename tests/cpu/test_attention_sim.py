"""The decode attention kernel run on the CPU (tests/support/ptxsim.py) against an fp64
reference: one split and several (the last split's merge, the counter back at zero), one
to eight query heads a KV head (three padded to four), head dims 64, 128 and 256, a
sequence of no tokens and one shorter than the cache; the output poisoned before."""

import struct

import numpy as np
import pytest

from ptxforge import arch
from ptxforge.kernels import bf16_decode_attention as kernel

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


@pytest.mark.parametrize("batch, capacity, heads, kv_heads, head_dim, lengths, split_tokens", [
    (1, 150, 2, 1, 64, [150], 64),        # three splits, the last merging
    (1, 64, 1, 1, 64, [50], 64),          # one split, one head a KV head
    (2, 100, 3, 1, 64, [0, 100], 64),     # three heads (padded to four), no tokens, two splits
    (1, 200, 8, 2, 128, [190], 64),       # Llama's 4 heads a KV head, four splits
    (1, 100, 8, 1, 128, [100], 32),       # 8 heads a KV head (2 tokens a thread a step)
    (1, 64, 2, 2, 256, [64], 64),         # head dim 256, one head a KV head, two KV heads
])
def test_the_kernel_on_the_simulator_matches_fp64(batch, capacity, heads, kv_heads, head_dim,
                                                 lengths, split_tokens):
    cfg = kernel.choose_config(arch.get("sm_90a"), head_dim, heads // kv_heads)
    assert split_tokens % cfg.tokens_per_step == 0
    rng = np.random.default_rng(0)
    q = _bf16(rng.standard_normal((batch, heads, head_dim)))
    k = _bf16(rng.standard_normal((batch, capacity, kv_heads, head_dim)))
    v = _bf16(rng.standard_normal((batch, capacity, kv_heads, head_dim)))
    splits = -(-capacity // split_tokens)
    pairs = batch * kv_heads
    memory = Memory()
    group = heads // kv_heads
    out = memory.alloc(2 * batch * heads * head_dim, fill=0xFF)   # poisoned: NaN bf16s
    counters = memory.alloc(4 * pairs)
    scale = head_dim ** -0.5
    args = dict(
        q=memory.put(q.tobytes()), q_batch_stride=2 * heads * head_dim,
        q_head_stride=2 * head_dim,
        k=memory.put(k.tobytes()), k_batch_stride=2 * capacity * kv_heads * head_dim,
        k_head_stride=2 * head_dim, k_token_stride=2 * kv_heads * head_dim,
        v=memory.put(v.tobytes()), v_batch_stride=2 * capacity * kv_heads * head_dim,
        v_head_stride=2 * head_dim, v_token_stride=2 * kv_heads * head_dim,
        seqlens=memory.put(np.array(lengths, dtype=np.int32).tobytes()), capacity=capacity,
        split_tokens=split_tokens,
        scale_log2=struct.unpack("<I", struct.pack("<f", scale * LOG2E))[0],
        out=out, partial=memory.alloc(4 * pairs * splits * group * head_dim, fill=0xFF),
        partial_ml=memory.alloc(8 * pairs * splits * group, fill=0xFF), counters=counters)
    sim = Simulator(memory)
    sim.launch("attention", kernel.generate(cfg).ptx(), (splits, kv_heads, batch), 128, **args)
    sim.run()
    got = _f32(np.frombuffer(memory.read(out, 2 * batch * heads * head_dim), dtype=np.uint16))
    expected = _reference(_f32(q), _f32(k), _f32(v), lengths, scale)
    got = got.reshape(expected.shape)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected, atol=4e-3, rtol=1e-2)
    assert memory.read(counters, 4 * pairs) == bytes(4 * pairs)   # zero for the next call
