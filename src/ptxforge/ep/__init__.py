"""Expert-parallel communication (DeepEP's intranode normal mode), with kernels built by
ptxforge's builder: ``from ptxforge.ep import Buffer`` in place of ``from deep_ep import
Buffer``. The kernels are ``kernels/ep_intranode/``; the protocol is in docs/design.md."""

from .buffer import (Buffer, Config, DispatchHandle, EPTimeoutError, EventOverlap,
                     buffer_size)

__all__ = ["Buffer", "Config", "DispatchHandle", "EPTimeoutError", "EventOverlap",
           "buffer_size"]
