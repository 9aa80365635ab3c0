"""Memory every rank of a group maps: one device allocation per rank, shared through CUDA
IPC handles that ``torch.distributed.all_gather_object`` carries over the user's group;
and the mapped host memory the kernels write a timeout's record to.

The allocation is the driver's own (``cuMemAlloc``), not torch's caching allocator's: an
IPC handle names a whole allocation, and opening it gives that allocation's start.
A rank uses its own pointer for itself (a process may not open its own handle). Two
processes on one GPU map each other's memory the same way (IPC needs no second device).
"""

from __future__ import annotations

import ctypes

from ..runtime.driver import ContextScope, bindings, call

HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE


class PeerMemory:
    """``nbytes`` zeroed bytes on ``device_index`` for this rank; ``pointers[r]`` is rank
    r's allocation as this process addresses it; ``sizes[r]`` its size."""

    def __init__(self, nbytes: int, device_index: int, group, dist):
        self.device_index, self.group, self.dist = device_index, group, dist
        self.rank = dist.get_rank(group)
        cu = bindings()
        with ContextScope(device_index):
            self.local = call("cuMemAlloc", nbytes)
            call("cuMemsetD8", self.local, 0, nbytes)
            call("cuCtxSynchronize")  # zero before any peer can see the memory
            handle = call("cuIpcGetMemHandle", self.local)
        blob = ctypes.string_at(handle.getPtr(), HANDLE_BYTES)
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (blob, nbytes), group=group)
        self.sizes = [size for _, size in gathered]
        self.pointers, self._opened = [], []
        with ContextScope(device_index):
            for rank, (peer_blob, _) in enumerate(gathered):
                if rank == self.rank:
                    self.pointers.append(int(self.local))
                    continue
                peer = cu.CUipcMemHandle()
                ctypes.memmove(peer.getPtr(), peer_blob, HANDLE_BYTES)
                mapped = call("cuIpcOpenMemHandle", peer,
                              int(cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
                self._opened.append(mapped)
                self.pointers.append(int(mapped))

    def close(self) -> None:
        """Unmap the peers' memory, wait for every rank to have done so, free ours."""
        with ContextScope(self.device_index):
            call("cuCtxSynchronize")
            for mapped in self._opened:
                call("cuIpcCloseMemHandle", mapped)
        self._opened = []
        self.dist.barrier(group=self.group)
        with ContextScope(self.device_index):
            call("cuMemFree", self.local)


class HostRecord:
    """``words`` int32 of pinned host memory that kernels write (mapped: its device address
    is ``device_pointer``) and the host reads at any time, with no synchronisation."""

    def __init__(self, device_index: int, words: int = 4):
        cu = bindings()
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
        with ContextScope(device_index):
            self.host = call("cuMemHostAlloc", 4 * words, flags)
            self.device_pointer = int(call("cuMemHostGetDevicePointer", self.host, 0))
        self.device_index = device_index
        self.words = (ctypes.c_int32 * words).from_address(int(self.host))
        ctypes.memset(int(self.host), 0, 4 * words)

    def read(self) -> list[int]:
        return list(self.words)

    def close(self) -> None:
        with ContextScope(self.device_index):
            call("cuMemFreeHost", self.host)


class _Span:
    """A device span as ``__cuda_array_interface__`` describes it, for torch.as_tensor."""

    def __init__(self, pointer: int, shape: tuple, typestr: str):
        self.__cuda_array_interface__ = dict(shape=shape, typestr=typestr, data=(pointer, False),
                                             strides=None, version=3)


def device_tensor(pointer: int, shape: tuple, dtype, device_index: int):
    """A torch tensor over ``pointer`` (memory this module allocated), no copy: it stays
    valid while the allocation lives."""
    import torch

    element = torch.empty((), dtype=dtype).element_size()
    raw = torch.as_tensor(_Span(pointer, (*shape[:-1], shape[-1] * element), "|u1"),
                          device=f"cuda:{device_index}")
    return raw.view(dtype)
