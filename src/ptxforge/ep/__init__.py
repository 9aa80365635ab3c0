"""Expert-parallel communication (DeepEP's intranode normal mode), with kernels built by
ptxforge's builder: ``from ptxforge.ep import Buffer`` in place of ``from deep_ep import
Buffer``. The kernels are ``kernels/ep_intranode/``; the protocol is in docs/design.md.
The MoE layer across GPUs, ``ptxforge.moe_experts_fp8(..., ep=buffer)``, is ``layer``'s
(imported here, so that holding a Buffer means the op can take it)."""

from .buffer import (Buffer, Config, DispatchHandle, EPTimeoutError, EventOverlap,
                     buffer_size)
from .layer import decode_capacity, shard_experts

__all__ = ["Buffer", "Config", "DispatchHandle", "EPTimeoutError", "EventOverlap",
           "buffer_size", "decode_capacity", "shard_experts"]
