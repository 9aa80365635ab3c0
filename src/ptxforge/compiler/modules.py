"""A Linear that holds its weight in FP8 already, for models stored that way: the weight
e4m3 [N, K] with f32 scales [ceil(N/128), ceil(K/128)] (DeepGEMM's layout, which FP8
checkpoints such as DeepSeek-V3's ``weight_scale_inv`` use). The backend takes it as it
is, never quantizes it again, and still fuses what makes its x and the residual after it.

    layer = Fp8Linear.from_linear(linear)        # quantize a bf16 nn.Linear once
    layer = Fp8Linear(weight, weight_scale)      # or wrap FP8 weights as they are
"""

from __future__ import annotations

import torch

from .. import ops


class Fp8Linear(torch.nn.Module):
    """The weight and its scales are kept as integer buffers with the same bytes (e4m3 as
    uint8, f32 as int32): ``model.to(torch.bfloat16)``, which casts every floating-point
    buffer, moves them to a device but leaves their bits alone. ``weight`` and
    ``weight_scale`` are their FP8 and f32 views."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or weight_scale.dtype != torch.float32:
            raise TypeError(f"weight must be float8_e4m3fn and weight_scale float32, got "
                            f"{weight.dtype} and {weight_scale.dtype}")
        self.register_buffer("weight_bytes", weight.view(torch.uint8))
        self.register_buffer("weight_scale_bits", weight_scale.view(torch.int32))
        self.register_buffer("bias", bias)

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_bytes.view(torch.float8_e4m3fn)

    @property
    def weight_scale(self) -> torch.Tensor:
        return self.weight_scale_bits.view(torch.float32)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "Fp8Linear":
        """``linear``'s bf16 weight quantized in 128x128 blocks (on its GPU)."""
        weight, scale = ops.quantize_fp8_per_block(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ptxforge.fp8_linear(x, None, self.weight, self.weight_scale, self.bias)
