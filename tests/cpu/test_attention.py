"""attention_with_kvcache without a GPU: the split of the cache across CTAs, and the
kernel's configs."""

import pytest
import torch

import ptxforge
from ptxforge import arch
from ptxforge.kernels import bf16_decode_attention as kernel
from ptxforge.ops import attention


@pytest.mark.parametrize("batch, kv_heads, capacity", [
    (1, 8, 1), (1, 8, 512), (1, 8, 641), (1, 8, 131072), (32, 8, 4225), (256, 8, 512),
    (1, 1, 100), (4, 32, 1 << 20)])
def test_splits_cover_the_cache_in_whole_steps(batch, kv_heads, capacity):
    cfg = kernel.choose_config(arch.get("sm_90a"), 128, 4)
    tokens = attention.split_tokens(cfg, 132, batch, kv_heads, capacity)
    splits = -(-capacity // tokens)
    assert tokens % cfg.tokens_per_step == 0 and tokens >= cfg.tokens_per_step
    assert 1 <= splits <= attention.MAX_SPLITS
    assert (splits - 1) * tokens < capacity <= splits * tokens


@pytest.mark.parametrize("head_dim, group, match", [
    (96, 4, "head_dim must be one of"), (128, 0, "from 1 to 8"), (128, 16, "from 1 to 8")])
def test_sizes_the_kernel_does_not_take_are_one_line_errors(head_dim, group, match):
    with pytest.raises(ValueError, match=match):
        kernel.choose_config(arch.get("sm_90a"), head_dim, group)


def _args(batch=2, heads=8, kv_heads=2, head_dim=64, capacity=32, q_len=1, **changed):
    bf16 = torch.bfloat16
    args = {"q": torch.zeros(batch, q_len, heads, head_dim, dtype=bf16),
            "k_cache": torch.zeros(batch, capacity, kv_heads, head_dim, dtype=bf16),
            "v_cache": torch.zeros(batch, capacity, kv_heads, head_dim, dtype=bf16),
            "cache_seqlens": torch.zeros(batch, dtype=torch.int32)}
    return {**args, **changed}


@pytest.mark.parametrize("changed, error, message", [
    ({"q": torch.zeros(2, 9, 8, 64, dtype=torch.bfloat16)}, ValueError,
     r"q's 9 tokens a sequence take the tensor-core form: head_dim up to 128, pages of 16 "
     r"tokens or more and q_len up to 8; got head_dim 64, q_len 9"),
    ({"q": torch.zeros(2, 0, 8, 64, dtype=torch.bfloat16)}, ValueError,
     r"q must hold at least one token a sequence"),
    ({"causal": 1}, TypeError, "causal must be a bool, got 1"),
    ({"k_cache": torch.zeros(3, 32, 2, 64, dtype=torch.bfloat16)}, ValueError,
     r"k_cache must be \[B, S_max, Hkv, D\] with q's B = 2 and D = 64"),
    ({"v_cache": torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)}, ValueError,
     "k_cache and v_cache must have the same shape"),
    ({"k_cache": torch.zeros(2, 32, 3, 64, dtype=torch.bfloat16),
      "v_cache": torch.zeros(2, 32, 3, 64, dtype=torch.bfloat16)}, ValueError,
     r"q's heads \(8\) must be a multiple of the caches' \(3\)"),
    ({"cache_seqlens": torch.zeros(3, dtype=torch.int32)}, ValueError,
     r"cache_seqlens must be a contiguous int32 \[B\] with B = 2"),
    ({"cache_seqlens": torch.zeros(2, dtype=torch.int64)}, TypeError,
     "cache_seqlens must have dtype torch.int32"),
    ({"softmax_scale": float("nan")}, TypeError, "softmax_scale must be a finite real number"),
    ({"k_cache": torch.zeros(10000, dtype=torch.bfloat16).as_strided((2, 32, 2, 64),
                                                                      (4300, 132, 64, 1))},
     ValueError, "k_cache's strides must keep each row 16-byte aligned"),
    ({"block_table": torch.zeros(3, 4, dtype=torch.int32)}, ValueError,
     r"block_table must be int32 \[B, pages\] with B = 2 and contiguous rows"),
    ({"block_table": torch.zeros(2, 4, dtype=torch.int64)}, TypeError,
     "block_table must have dtype torch.int32"),
    ({"block_table": torch.zeros(2, 4, dtype=torch.int32),
      "k_cache": torch.zeros(5, 24, 2, 64, dtype=torch.bfloat16),
      "v_cache": torch.zeros(5, 24, 2, 64, dtype=torch.bfloat16)}, ValueError,
     "a paged cache needs a power-of-two page size and at least one page, got k_cache "
     r"\[num_blocks=5, page_size=24"),
])
def test_bad_input_is_one_line_naming_it(changed, error, message):
    with pytest.raises(error, match=message):
        ptxforge.attention_with_kvcache(**_args(**changed))


def test_a_config_must_fit_the_call():
    sm90 = arch.get("sm_90a")
    with pytest.raises(TypeError, match="config must be a decode attention config"):
        ptxforge.attention_with_kvcache(**_args(), config="mma")
    wrong = kernel.choose_config(sm90, 128, 4, tensor_cores=True)
    with pytest.raises(ValueError, match=r"config does not fit the call: it is for \(head_dim, "
                       r"group, paged, cache dtype, q_len, causal, append\) \(128, 4, False, "
                       r"'bf16', 1, True, False\), the call needs \(64, 4, False, 'bf16', 1, "
                       r"True, False\)"):
        ptxforge.attention_with_kvcache(**_args(), config=wrong)
    right = kernel.choose_config(sm90, 64, 4, tensor_cores=True)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):   # past the check
        ptxforge.attention_with_kvcache(**_args(), config=right)


@pytest.mark.parametrize("changed, message", [
    ({"k_new": torch.zeros(2, 1, 2, 64, dtype=torch.bfloat16)},
     "k_new and v_new go together: got only k_new"),
    ({"k_new": torch.zeros(2, 1, 2, 64, dtype=torch.bfloat16),
      "v_new": torch.zeros(2, 1, 3, 64, dtype=torch.bfloat16)},
     r"v_new must be bf16 \[B, n, Hkv, D\] with \(B, Hkv, D\) = \(2, 2, 64\) and n >= 1, "
     r"got shape \(2, 1, 3, 64\)"),
    ({"k_new": torch.zeros(2, 1, 2, 64, dtype=torch.bfloat16),
      "v_new": torch.zeros(2, 2, 2, 64, dtype=torch.bfloat16)},
     "k_new and v_new must have the same shape and strides"),
])
def test_new_keys_and_values_are_checked(changed, message):
    with pytest.raises(ValueError, match=message):
        ptxforge.attention_with_kvcache(**_args(**changed))


def test_new_keys_and_values_pass_the_checks_that_need_no_gpu():
    new = torch.zeros(2, 2, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        ptxforge.attention_with_kvcache(**_args(k_new=new, v_new=new.clone()))


def test_the_tensor_core_form_refuses_pages_under_16_tokens():
    config = kernel.choose_config(arch.get("sm_90a"), 64, 4, paged=True, tensor_cores=True)
    pool = torch.zeros(4, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the tensor-core form takes pages of 16 tokens or "
                       "more, got page_size 8"):
        ptxforge.attention_with_kvcache(**_args(k_cache=pool, v_cache=pool,
                                                block_table=torch.zeros(2, 4, dtype=torch.int32)),
                                         config=config)


def test_the_tensor_core_form_refuses_heads_it_would_spill():
    with pytest.raises(ValueError, match="takes head_dim up to 128, got 256"):
        kernel.choose_config(arch.get("sm_90a"), 256, 4, tensor_cores=True)


def _e4m3_args(**changed):
    args = _args(k_cache=torch.zeros(2, 32, 2, 64, dtype=torch.float8_e4m3fn),
                 v_cache=torch.zeros(2, 32, 2, 64, dtype=torch.float8_e4m3fn),
                 k_scale=torch.ones(2, 32, 2), v_scale=torch.ones(2, 32, 2))
    return {**args, **changed}


@pytest.mark.parametrize("args, message", [
    (_e4m3_args(k_scale=None), "e4m3 caches need k_scale and v_scale"),
    (_e4m3_args(v_scale=torch.ones(2, 16, 2)), r"v_scale must be f32 \[B, S_max, Hkv\]"),
    (_e4m3_args(v_scale=torch.ones(2, 2, 32).transpose(1, 2)),
     "k_scale and v_scale must have the same strides"),
    (_e4m3_args(block_table=torch.zeros(2, 1, dtype=torch.int32),
                v_scale=torch.ones(2, 16, 2)),
     r"v_scale must be f32 \[num_blocks, page_size, Hkv\] = \[2, 32, 2\]"),
    (_args(k_scale=torch.ones(2, 32, 2), v_scale=torch.ones(2, 32, 2)),
     "k_scale and v_scale go with e4m3 caches"),
])
def test_an_e4m3_cache_and_its_scales_are_checked(args, message):
    with pytest.raises(ValueError, match=message):
        ptxforge.attention_with_kvcache(**args)


def test_a_well_formed_e4m3_call_passes_the_checks_that_need_no_gpu():
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        ptxforge.attention_with_kvcache(**_e4m3_args())
