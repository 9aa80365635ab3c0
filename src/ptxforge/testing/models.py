"""Model blocks for the compiler's tests and benches (issue 14's cases)."""

from __future__ import annotations

import copy

import torch


class Ffn(torch.nn.Module):
    """The FFN block ``x + down(silu(g) * u)`` with ``g, u = gate_up(RMSNorm(x)).chunk(2)``
    (DeepSeek's dense FFN at hidden 7168, intermediate 2048)."""

    def __init__(self, hidden: int = 7168, inter: int = 2048):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, eps=1e-6)
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        g, u = self.gate_up(self.norm(x)).chunk(2, -1)
        return x + self.down(torch.nn.functional.silu(g) * u)


def in_f32(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` computing in f32: the numerics reference for its bf16 self."""
    return copy.deepcopy(model).float()
