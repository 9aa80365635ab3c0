"""``Buffer``: DeepEP's intranode normal-mode API over ptxforge's kernels.

    buffer = Buffer(group, num_nvl_bytes)             # collective: every rank of the group
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
    ... the experts ...
    combined, _, _ = buffer.combine(y, handle)

A dispatch without a handle exchanges the layout's counts between the GPUs (a kernel
over NVLink, then one copy to the host: a host synchronisation, as DeepEP's CPU wait for
the received counts; none with ``num_worst_tokens``, which sizes the outputs for the
worst case instead) and returns a handle; ``dispatch(x, handle=h)`` and ``combine`` reuse it with
no host synchronisation. On a buffer with room for the worst case's rows
(``buffer_size(..., num_worst_tokens=N)``) such a dispatch writes each row straight into
its receiver's buffer, and a combine of ``combine_input(handle)`` pulls each token's rows
from its ranks' buffers: no rings either way. The kernels run on the buffer's
communication stream, after the current stream's work (or ``previous_event``); the current
stream waits for them unless ``async_finish``, and each call returns the event it can wait
on instead.

The decode path (``low_latency_dispatch`` / ``low_latency_combine``, DeepEP's names) uses
a buffer of its own, ``num_rdma_bytes`` (``get_low_latency_rdma_size_hint``), mapped by
every rank over NVLink like the normal one: no host synchronisation, fixed sizes, so the
calls can be captured in a CUDA graph; ``return_recv_hook`` splits each into its send half
(now) and its receive half (when the hook is called).

A kernel that waits longer than ``timeout_s`` for a peer writes what it waited for to
mapped host memory and traps; the CUDA context is then unusable, and the next call (or
``check_timeout()`` after a CUDA error) raises ``EPTimeoutError`` saying which wait.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from .. import jit
from ..kernels.ep_intranode import combine as combine_kernel
from ..kernels.ep_intranode import common as kernel_common
from ..kernels.ep_intranode import direct as direct_kernel
from ..kernels.ep_intranode import dispatch as dispatch_kernel
from ..kernels.ep_intranode import exchange as exchange_kernel
from ..kernels.ep_intranode import layout as layout_kernel
from ..kernels.ep_intranode import pull as pull_kernel
from ..kernels.ep_intranode.plan import (HEADER_WORDS, MAX_RANKS, RING_ALIGN, BufferPlan,
                                        DirectRegion, DispatchSlot)
from ..ops.common import device_arch
from . import checks, low_latency, tuning
from .ipc import HostRecord, PeerMemory, device_tensor
from .layout import (Message, ReceiveLayout, check_agreement, message_of, receive_layout,
                     signature_words)

DEFAULT_NUM_SMS = 20     # DeepEP's default SM budget (channels = SMs / 2)
DEFAULT_SLOTS = 128      # entries a ring holds
DEFAULT_TIMEOUT_S = 100.0

_WAITS = {kernel_common.DISPATCH_SEND: ("dispatch", "room in rank {peer}'s ring (its head)"),
          kernel_common.DISPATCH_RECEIVE: ("dispatch", "tokens from rank {peer} (their tail)"),
          kernel_common.COMBINE_SEND: ("combine", "room in rank {peer}'s ring (its head)"),
          kernel_common.COMBINE_RECEIVE: ("combine", "rows from rank {peer} (their tail)"),
          kernel_common.EXCHANGE_RECEIVE: ("count exchange", "rank {peer}'s counts"),
          kernel_common.DIRECT_RECEIVE: ("direct dispatch", "rank {peer}'s rows"),
          kernel_common.PULL_RECEIVE: ("pull combine", "rank {peer}'s combine to start")}
_MISMATCHES = {kernel_common.DISPATCH_MISMATCH: "dispatch",
               kernel_common.COMBINE_MISMATCH: "combine"}
# The decode path's waits: (kernel, what it waited for); the record's "channel" word holds
# the local expert (dispatch) or the token (combine).
_LOW_LATENCY_WAITS = {
    kernel_common.LL_DISPATCH_RECEIVE: ("low-latency dispatch",
                                        "tokens from rank {peer} for local expert {channel}"),
    kernel_common.LL_COMBINE_RECEIVE: ("low-latency combine",
                                       "token {channel}'s row from expert {peer}"),
    kernel_common.LL_COMBINE_START: ("low-latency combine", "rank {peer}'s combine to start")}


class EPTimeoutError(RuntimeError):
    """A communication kernel waited past its time limit for a peer."""


@dataclass(frozen=True)
class Config:
    """SMs a kernel runs on (two a channel) and the entries each ring holds."""

    num_sms: int = DEFAULT_NUM_SMS
    ring_slots: int = DEFAULT_SLOTS


class EventOverlap:
    """A CUDA event recorded after a call's kernels on the communication stream (DeepEP's
    name); ``current_stream_wait()`` makes the current stream wait for it."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def current_stream_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


@dataclass(frozen=True)
class DispatchHandle:
    """What a dispatch leaves for the dispatches that reuse its layout and for the combine."""

    num_tokens: int
    num_recv_tokens: int
    channels: int
    experts: int
    hidden: int
    fp8: bool
    topk: int                        # the entries' top-k room: a cached call lays them out alike
    is_token_in_rank: torch.Tensor   # bool [T, ranks]
    recv_layout: torch.Tensor        # int32 [2, ranks, channels] on the device
    recv_src_idx: torch.Tensor       # int32 [N]: each received row's token on its source rank
    layout: ReceiveLayout | None     # None: sized for the worst case, the layout on the GPU only
    num_recv: torch.Tensor           # int32 [1]: the rows received, on the device
    send_layout: torch.Tensor        # int32 [ranks, channels]: where this rank's rows begin there
    # A direct dispatch's: where its outputs (and its combine's inputs) lie in every
    # buffer, and each token's row at each rank (int32 [T, ranks]); None otherwise.
    direct: DirectRegion | None = None
    send_rows: torch.Tensor | None = None


def buffer_size(num_ranks: int, hidden: int, topk: int, *, fp8: bool = False,
                config: Config = Config(), num_worst_tokens: int = 0) -> int:
    """The num_nvl_bytes a dispatch (and its combine) of ``hidden``-wide rows with ``topk``
    experts a token needs over ``num_ranks`` ranks with ``config``; with
    ``num_worst_tokens`` (FP8 rows), room for that many received rows in the buffer too,
    which a dispatch sized for them then writes in place (the direct dispatch), and for
    the experts' bf16 output for them, which the other ranks' combines pull from
    (``Buffer.combine_input``)."""
    plan = BufferPlan(num_ranks, config.num_sms // 2, config.ring_slots, hidden)
    rings = plan.bytes_needed(DispatchSlot(hidden, topk, fp8))
    if not (num_worst_tokens and fp8):
        return rings
    return direct_region(rings, num_worst_tokens, hidden, topk).end


def direct_region(rings_end: int, rows: int, hidden: int, topk: int) -> DirectRegion:
    """Where a direct dispatch's outputs lie: past the rings, aligned."""
    return DirectRegion(-(-rings_end // RING_ALIGN) * RING_ALIGN, rows, hidden, topk)


@functools.lru_cache(maxsize=None)
def _launcher(device_index: int, cfg):
    generate = {layout_kernel.LayoutConfig: layout_kernel.generate,
                exchange_kernel.ExchangeConfig: exchange_kernel.generate,
                direct_kernel.DirectConfig: direct_kernel.generate,
                pull_kernel.PullConfig: pull_kernel.generate,
                dispatch_kernel.DispatchConfig: dispatch_kernel.generate,
                combine_kernel.CombineConfig: combine_kernel.generate}[type(cfg)]
    return jit.build(generate(cfg)).launcher(device_index)


def _checked_num_sms(name: str, num_sms) -> int:
    """An SM budget: two SMs a channel."""
    if type(num_sms) is not int or num_sms < 2 or num_sms % 2:
        raise ValueError(f"{name} must be an even int of at least 2, got {num_sms!r}")
    return num_sms


class Buffer:
    """One communication buffer per rank of ``group`` (a torch.distributed process group
    of 2 to 8 ranks on one node, each rank on its own GPU or, for tests, sharing one),
    mapped by every rank. Creating it is collective."""

    num_sms = DEFAULT_NUM_SMS

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24, *,
                 num_sms: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        """``num_nvl_bytes``: the normal mode's buffer (``buffer_size``); ``num_rdma_bytes``
        with ``low_latency_mode``: the decode path's (``get_low_latency_rdma_size_hint``).
        ``num_qps_per_rank`` is DeepEP's RDMA setting, taken and unused: one node, no RDMA."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("Buffer needs torch.distributed initialised (the group's "
                               "rendezvous); call torch.distributed.init_process_group first")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if num_rdma_bytes and not low_latency_mode:
            raise ValueError(f"num_rdma_bytes without low_latency_mode is DeepEP's internode "
                             f"buffer, and ptxforge.ep is intranode only: got {num_rdma_bytes}")
        if not num_nvl_bytes and not num_rdma_bytes:
            raise ValueError("num_nvl_bytes and num_rdma_bytes are both 0: give the normal "
                             "mode's buffer, the low-latency one (low_latency_mode), or both")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        if not 2 <= self.group_size <= MAX_RANKS:
            raise ValueError(f"the group must have 2 to {MAX_RANKS} ranks, got "
                             f"{self.group_size}")
        if num_sms is not None:
            self.num_sms = _checked_num_sms("num_sms", num_sms)
        self.timeout_s = timeout_s
        self.device_index = torch.cuda.current_device()
        self.arch = device_arch(self.device_index)
        # Every rank writes into every other's buffer: the smallest is the size.
        self.memory = self.peers = self.low_latency_memory = self.low_latency_group = None
        self._low_latency_sizes = set()  # the decode sizes the ranks agreed on
        self._headers = {}               # a signature's words on the device
        self.num_nvl_bytes = self.num_rdma_bytes = 0
        self.record = HostRecord(self.device_index)
        if num_nvl_bytes:
            self.memory = PeerMemory(num_nvl_bytes, self.device_index, group, dist)
            self.num_nvl_bytes = min(self.memory.sizes)
            self.peers = torch.tensor(self.memory.pointers, dtype=torch.int64,
                                      device=self.device_index)
        if num_rdma_bytes:
            self.low_latency_memory = PeerMemory(num_rdma_bytes, self.device_index, group, dist)
            self.num_rdma_bytes = min(self.low_latency_memory.sizes)
            self.low_latency_group = low_latency.Group(
                self.rank, self.group_size,
                torch.tensor(self.low_latency_memory.pointers, dtype=torch.int64,
                             device=self.device_index),
                self.record.device_pointer, int(timeout_s * 1e9), self.device_index, self.arch,
                self.num_rdma_bytes)
        self.comm_stream = torch.cuda.Stream(self.device_index)
        # The stored config (ep/tuning.py), rank 0's for every rank: ranks reading
        # different files must still call with one config.
        picks = [None] * self.group_size
        dist.all_gather_object(picks, tuning.load(torch.cuda.get_device_name(self.device_index),
                                                  self.group_size), group=group)
        self._picked = {self.group_size: picks[0]}

    # ------------------------------------------------------------------ configuration
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The SM budget of the buffers that were not given one (DeepEP's class knob)."""
        Buffer.num_sms = _checked_num_sms("num_sms", new_num_sms)

    def get_dispatch_config(self, num_ranks: int | None = None) -> Config:
        """The config ``ptxforge bench ep`` stored for this GPU and ``num_ranks`` (this
        group's by default: rank 0's, read when the buffer was made), where it was picked
        within this buffer's SM budget; else the budget's SMs with DEFAULT_SLOTS a ring
        (``ep/tuning.py``). A stored config never needs more buffer than
        ``buffer_size``'s default."""
        ranks = self.group_size if num_ranks is None else num_ranks
        if ranks not in self._picked:   # read once: a call without a config asks each time
            self._picked[ranks] = tuning.load(torch.cuda.get_device_name(self.device_index),
                                              ranks)
        picked = self._picked[ranks]
        if picked is not None and picked[2] == self.num_sms:
            return Config(*picked[:2])
        return Config(self.num_sms, DEFAULT_SLOTS)

    def get_combine_config(self, num_ranks: int | None = None) -> Config:
        """The dispatch's: a combine runs on its dispatch's channels and rings."""
        return self.get_dispatch_config(num_ranks)

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank int32 [ranks], None, num_tokens_per_expert int32 [E],
        is_token_in_rank bool [T, ranks], event); expert e lives on rank e // (E / ranks),
        indices outside [0, E) count nowhere."""
        self.check_timeout()
        tokens, k, ptr = checks.layout_inputs(topk_idx, num_experts, self.group_size,
                                              self.device_index)
        cfg = layout_kernel.choose_config(self.arch, num_experts, self.group_size, k)
        with self._on_comm_stream(previous_event, allocate_on_comm_stream) as call:
            per_rank = torch.zeros(self.group_size, dtype=torch.int32, device=topk_idx.device)
            per_expert = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device)
            in_rank = torch.empty((tokens, self.group_size), dtype=torch.bool,
                                  device=topk_idx.device)
            call.start((topk_idx, per_rank, per_expert, in_rank))
            if tokens:
                grid = (-(-tokens // layout_kernel.THREADS), 1, 1)
                _launcher(self.device_index, cfg)(
                    grid, self.comm_stream.cuda_stream, topk_idx=ptr, tokens=tokens,
                    num_tokens_per_rank=per_rank.data_ptr(),
                    num_tokens_per_expert=per_expert.data_ptr(),
                    is_token_in_rank=in_rank.data_ptr())
        return per_rank, None, per_expert, in_rank, call.finish(async_finish)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, handle: DispatchHandle | None = None, num_tokens_per_rank=None,
                 num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token to the ranks of its experts. Returns ``(recv_x, recv_topk_idx,
        recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``:

        - recv_x [N, H] (with FP8 input: ``(e4m3 [N, H], f32 scales [N, H / 128])``,
          scales contiguous): rows grouped by source rank in rank order, a source's rows
          in its token order; each row the bits its source sent.
        - recv_topk_idx int64 [N, k]: the token's experts on this rank, local
          (e - rank * E / ranks), -1 for the others; recv_topk_weights f32 [N, k]: their
          weights, 0 for the others. Both None when no top-k was given (a cached call).
        - num_recv_tokens_per_expert_list: (token, expert) pairs each local expert
          received, each rounded up to ``expert_alignment``
          (``get_mk_alignment_for_contiguous_layout()`` makes them segment sizes of the
          contiguous grouped GEMM's layout).
        - handle: for ``dispatch(x, handle=handle)`` (the same layout, no host
          synchronisation; topk_idx and topk_weights optional) and ``combine``.

        Without a handle, is_token_in_rank and num_tokens_per_expert (get_dispatch_layout's)
        are needed, and the call exchanges counts with the other ranks, which must make the
        same call, and synchronises with the host: the sizes they disagree on, or top-k
        indices outside [-1, E) on any rank, raise a ValueError on every rank.

        ``num_worst_tokens`` > 0 (DeepEP's): no host synchronisation, so the call can be
        captured in a CUDA graph. The outputs have num_worst_tokens rows, the received ones
        first, then rows with top-k indices -1 (weights 0) and undefined data;
        num_recv_tokens_per_expert_list is empty; ``handle.num_recv`` holds the rows
        received, on the GPU. Every rank must receive at most that many rows (each rank
        sending at most num_worst_tokens / ranks tokens ensures it), else the exchange
        kernel traps with a record naming the rows. Sizes the ranks disagree on are caught
        by the ring entries' signatures (a trap), bad indices are dropped, not refused.
        """
        self.check_timeout()
        self._require_normal_buffer()
        if type(num_worst_tokens) is not int or not 0 <= num_worst_tokens < 2 ** 31:
            raise ValueError(f"num_worst_tokens must be an int in [0, 2^31), got "
                             f"{num_worst_tokens!r}")
        if num_worst_tokens and handle is not None:
            raise ValueError("num_worst_tokens sizes a dispatch that exchanges counts: a call "
                             "reusing a handle keeps the handle's sizes (pass one or the other)")
        config = config or self.get_dispatch_config()
        inputs, _ = checks.dispatch_inputs(x, topk_idx, topk_weights, device=self.device_index,
                                           cached=handle is not None)
        channels = self._channels(config)
        if handle is None:
            experts = checks.routing_inputs(is_token_in_rank, num_tokens_per_expert,
                                            num_tokens_per_rank, num_tokens_per_rdma_rank,
                                            tokens=inputs.tokens, ranks=self.group_size,
                                            device=self.device_index)
            topk = inputs.topk
        else:
            experts = self._check_handle(handle, inputs, channels)
            topk = handle.topk
        if type(expert_alignment) is not int or expert_alignment < 1:
            raise ValueError(f"expert_alignment must be a positive int, got {expert_alignment!r}")

        # A cached call's entries keep the first call's layout, top-k room included, whether
        # or not top-k travels: a ring the peer may still be reading is never laid out anew.
        cfg = dispatch_kernel.choose_config(self.arch, self.group_size, inputs.hidden,
                                            topk, fp8=inputs.fp8,
                                            with_topk=bool(inputs.topk), num_sms=config.num_sms,
                                            slots=config.ring_slots)
        # Built before the exchange, which every rank leaves together: a rank assembling its
        # kernel after it would let the peer's kernel spin meanwhile, on its timeout's clock.
        launcher = _launcher(self.device_index, cfg)
        if handle is None:
            handle = self._exchange(inputs, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                    experts, channels, expert_alignment, config,
                                    previous_event, num_worst_tokens)
        # After the exchange, which refuses ranks that disagree on the sizes: a buffer too
        # small is then every rank's error, not one rank's while the others wait for it.
        checks.require_buffer(self.num_nvl_bytes, cfg.plan.bytes_needed(cfg.slot),
                              f"a dispatch of {inputs.hidden}-wide rows")
        if num_worst_tokens and inputs.fp8 and inputs.topk:
            region = direct_region(cfg.plan.bytes_needed(cfg.slot), num_worst_tokens,
                                   inputs.hidden, inputs.topk)
            if region.end <= self.num_nvl_bytes:
                return self._launch_direct(region, config, inputs, x, topk_idx, topk_weights,
                                           handle, previous_event, async_finish)
        return self._launch_dispatch(launcher, cfg, inputs, x, topk_idx, topk_weights, handle,
                                     previous_event, async_finish, allocate_on_comm_stream)

    def _launch_direct(self, region, config, inputs, x, topk_idx, topk_weights, handle,
                       previous_event, async_finish):
        """The direct dispatch (kernels/ep_intranode/direct.py): the outputs are views of
        this rank's buffer, valid until the next dispatch's exchange."""
        cfg = direct_kernel.choose_config(self.arch, self.group_size, inputs.hidden, inputs.topk,
                                          num_sms=config.num_sms)
        with self._on_comm_stream(previous_event, False) as call:
            send_rows = torch.empty((inputs.tokens, self.group_size), dtype=torch.int32,
                                    device=handle.is_token_in_rank.device)
            call.start((*x, topk_idx, topk_weights, handle.is_token_in_rank, handle.send_layout,
                        handle.num_recv, send_rows))
            _launcher(self.device_index, cfg)(
                (2 * cfg.channels, 1, 1), self.comm_stream.cuda_stream, x=inputs.x,
                x_scales=inputs.scales, scale_token_stride=inputs.scale_strides[0],
                scale_group_stride=inputs.scale_strides[1], topk_idx=inputs.topk_idx,
                topk_weights=inputs.topk_weights,
                experts_per_rank=handle.experts // self.group_size,
                is_token_in_rank=handle.is_token_in_rank.data_ptr(), tokens=inputs.tokens,
                send_layout=handle.send_layout.data_ptr(), num_recv=handle.num_recv.data_ptr(),
                worst=region.rows, recv_x=region.x, recv_scales=region.scales,
                recv_topk_idx=region.topk_idx, recv_topk_weights=region.topk_weights,
                recv_src_idx=region.source, send_rows=send_rows.data_ptr(),
                **self._peer_arguments())
        event = call.finish(async_finish)
        rows, k = region.rows, inputs.topk
        received = (self._own_view(region.x, (rows, inputs.hidden), torch.float8_e4m3fn),
                    self._own_view(region.scales, (rows, inputs.hidden // 128), torch.float32))
        handle = dataclasses.replace(handle, direct=region, send_rows=send_rows)
        return (received, self._own_view(region.topk_idx, (rows, k), torch.int64),
                self._own_view(region.topk_weights, (rows, k), torch.float32), [], handle,
                event)

    def _own_view(self, at: int, shape: tuple, dtype) -> torch.Tensor:
        """A tensor over bytes ``at`` .. of this rank's buffer."""
        return device_tensor(self.memory.pointers[self.rank] + at, shape, dtype,
                             self.device_index)

    def combine_input(self, handle: DispatchHandle) -> torch.Tensor:
        """After a direct dispatch (``num_worst_tokens`` on a buffer with room for them):
        bf16 [num_worst_tokens, H], a view of this rank's buffer where the experts' output
        for the received rows may be written; a ``combine`` of this very tensor (no top-k
        weights) then pulls each token's rows from its ranks' buffers over NVLink instead
        of pushing them through rings (the same bits). Valid until the next dispatch: a
        rank's inputs are read by the other ranks' combines, which end before their next
        dispatch's exchange."""
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be what dispatch returned, got {type(handle).__name__}")
        if handle.direct is None:
            raise ValueError("combine_input takes the handle of a direct dispatch (a dispatch "
                             "with num_worst_tokens on a buffer sized by buffer_size(..., "
                             "num_worst_tokens=...)), got another dispatch's")
        region = handle.direct
        return self._own_view(region.combine_x, (region.rows, handle.hidden), torch.bfloat16)

    def _require_normal_buffer(self) -> None:
        if self.memory is None:
            raise ValueError("this Buffer has no normal-mode buffer (num_nvl_bytes=0): "
                             "create it with num_nvl_bytes=buffer_size(...)")

    def _channels(self, config: Config) -> int:
        return _checked_num_sms("config.num_sms", config.num_sms) // 2

    def _check_handle(self, handle, inputs, channels: int) -> int:
        """The handle's experts, after checking that the call matches its layout."""
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be what dispatch returned, got {type(handle).__name__}")
        if handle.num_tokens != inputs.tokens:
            raise ValueError(f"x must have the handle's {handle.num_tokens} tokens, got "
                             f"{inputs.tokens}")
        if handle.hidden != inputs.hidden:
            raise ValueError(f"x must have the handle's hidden size {handle.hidden}, got "
                             f"{inputs.hidden}")
        if handle.fp8 != inputs.fp8:
            raise ValueError(f"x must be {'FP8 (e4m3, scales)' if handle.fp8 else 'bf16'} as in "
                             f"the handle's dispatch, got {'FP8' if inputs.fp8 else 'bf16'}")
        if inputs.topk not in (0, handle.topk):
            raise ValueError(f"topk_idx must have the handle's {handle.topk} columns, got "
                             f"{inputs.topk}")
        if handle.channels != channels:
            raise ValueError(f"config.num_sms must be the handle's {2 * handle.channels}, got "
                             f"{2 * channels}")
        return handle.experts

    def _exchange(self, inputs, is_token_in_rank, num_tokens_per_expert, topk_idx, experts,
                  channels, expert_alignment, config, previous_event,
                  num_worst_tokens: int) -> DispatchHandle:
        """Every rank's counts to every rank and this rank's receive layout, on the GPU (the
        exchange kernel); then, unless ``num_worst_tokens`` sizes the outputs, one copy of
        the messages to the host (a host synchronisation), checked, for the sizes."""
        if previous_event is not None:
            previous_event.current_stream_wait()
        signature = (("hidden", inputs.hidden), ("fp8", inputs.fp8), ("topk", inputs.topk),
                     ("num_experts", experts), ("num_sms", config.num_sms),
                     ("ring_slots", config.ring_slots), ("expert_alignment", expert_alignment))
        header = self.message_header(signature, topk_idx, experts,
                                     checked=not num_worst_tokens)
        device = self.device_index
        words = HEADER_WORDS + channels * self.group_size + experts
        gathered = torch.empty((self.group_size, words), dtype=torch.int32, device=device)
        table = torch.empty((2, self.group_size, channels), dtype=torch.int32, device=device)
        num_recv = torch.empty(1, dtype=torch.int32, device=device)
        send = torch.empty((self.group_size, channels), dtype=torch.int32, device=device)
        cfg = exchange_kernel.choose_config(self.arch, self.group_size)
        _launcher(device, cfg)(
            (1, 1, 1), torch.cuda.current_stream(device).cuda_stream,
            header=header.data_ptr(), is_token_in_rank=is_token_in_rank.data_ptr(),
            tokens=inputs.tokens, num_tokens_per_expert=num_tokens_per_expert.data_ptr(),
            experts=experts,
            channels=channels, worst=num_worst_tokens, out=gathered.data_ptr(),
            recv_layout=table.data_ptr(), num_recv=num_recv.data_ptr(),
            send_layout=send.data_ptr(), **self._peer_arguments())
        layout = None
        if num_worst_tokens:
            rows = num_worst_tokens
        else:
            try:
                words = gathered.tolist()
            except RuntimeError:
                self.check_timeout()  # the exchange, or an earlier kernel, timed out
                raise
            messages = [message_of(row, channels, self.group_size) for row in words]
            check_agreement(messages)
            layout = receive_layout(messages, self.rank, experts // self.group_size,
                                    expert_alignment)
            rows = layout.num_recv_tokens
        src_idx = torch.empty(rows, dtype=torch.int32, device=device)
        return DispatchHandle(inputs.tokens, rows, channels, experts, inputs.hidden, inputs.fp8,
                              inputs.topk, is_token_in_rank, table, src_idx, layout, num_recv,
                              send)

    def message_header(self, signature: tuple, topk_idx, experts: int, *,
                       checked: bool) -> torch.Tensor:
        """A count message's first HEADER_WORDS words, int32 on the device (``ep/layout.py``:
        the signature's words, then the top-k indices outside [-1, E)); the exchange kernel
        adds the counts. ``checked`` False (a dispatch sized for the worst case, whose host
        reads no message): the bad indices are not counted, and the header is the cached
        one, so the call runs no kernel to make it."""
        header = self._headers.get(signature)
        if header is None:
            if topk_idx.is_cuda and torch.cuda.is_current_stream_capturing():
                raise ValueError(f"the first dispatch with {dict(signature)} copies its sizes to "
                                 f"the GPU, which a CUDA graph capture cannot do: run one "
                                 f"before capturing")
            header = torch.tensor(signature_words(signature) + [0], dtype=torch.int32,
                                  device=topk_idx.device)
            self._headers[signature] = header
        if not checked:
            return header
        bad = ((topk_idx < -1) | (topk_idx >= experts)).sum().view(1)
        return torch.cat([header[:-1], bad.int()])

    def _launch_dispatch(self, launcher, cfg, inputs, x, topk_idx, topk_weights, handle,
                         previous_event, async_finish, allocate_on_comm_stream):
        n, hidden, k = handle.num_recv_tokens, inputs.hidden, inputs.topk
        with self._on_comm_stream(previous_event, allocate_on_comm_stream) as call:
            device = handle.recv_layout.device
            recv_x = torch.empty((n, hidden), device=device,
                                 dtype=torch.float8_e4m3fn if inputs.fp8 else torch.bfloat16)
            outputs = {"recv_x": recv_x, "recv_src_idx": handle.recv_src_idx}
            if inputs.fp8:
                outputs["recv_scales"] = torch.empty((n, cfg.slot.scale_groups),
                                                     dtype=torch.float32, device=device)
            if k and handle.layout is None:   # sized for the worst: the rows past the received
                outputs["recv_topk_idx"] = torch.full((n, k), -1, dtype=torch.int64,
                                                      device=device)
                outputs["recv_topk_weights"] = torch.zeros((n, k), dtype=torch.float32,
                                                           device=device)
            elif k:
                outputs["recv_topk_idx"] = torch.empty((n, k), dtype=torch.int64, device=device)
                outputs["recv_topk_weights"] = torch.empty((n, k), dtype=torch.float32,
                                                           device=device)
            inputs_used = [x] if isinstance(x, torch.Tensor) else list(x)
            call.start((*inputs_used, topk_idx, topk_weights, handle.is_token_in_rank,
                        handle.recv_layout, *outputs.values()))
            arguments = dict(x=inputs.x, is_token_in_rank=handle.is_token_in_rank.data_ptr(),
                             tokens=inputs.tokens, **self._common_arguments(handle),
                             **{name: t.data_ptr() for name, t in outputs.items()})
            if inputs.fp8:
                arguments.update(x_scales=inputs.scales,
                                 scale_token_stride=inputs.scale_strides[0],
                                 scale_group_stride=inputs.scale_strides[1])
            if k:
                arguments.update(topk_idx=inputs.topk_idx, topk_weights=inputs.topk_weights,
                                 experts_per_rank=handle.experts // self.group_size)
            launcher((2 * cfg.channels, 1, 1), self.comm_stream.cuda_stream, **arguments)
        event = call.finish(async_finish)
        received = (recv_x, outputs["recv_scales"]) if inputs.fp8 else recv_x
        per_expert = [] if handle.layout is None else list(handle.layout.num_recv_tokens_per_expert)
        return (received, outputs.get("recv_topk_idx"), outputs.get("recv_topk_weights"),
                per_expert, handle, event)

    def _peer_arguments(self) -> dict:
        """What every kernel over the peers' buffers takes: this rank, the buffers, the
        watchdog's record and time limit."""
        return dict(rank=self.rank, peers=self.peers.data_ptr(),
                    error=self.record.device_pointer, timeout_ns=int(self.timeout_s * 1e9))

    def _common_arguments(self, handle) -> dict:
        return dict(recv_layout=handle.recv_layout.data_ptr(), **self._peer_arguments())

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights=None, bias=None,
                config: Config | None = None, previous_event: EventOverlap | None = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Send each received row back to its token's rank and sum there: returns
        ``(combined_x bf16 [T, H], combined_topk_weights f32 [T, k] or None, event)`` with
        combined_x[t] the f32 sum, in rank order, of the rows the ranks t went to send back
        (rows of x [N, H] in the dispatch's received order), rounded to bf16 once; +0 for
        a token that went nowhere. ``topk_weights`` (f32 [N, k], e.g. the dispatch's
        received weights) travel with the rows and are summed the same way, in f32.
        Bitwise the same run to run. ``bias`` is not taken yet. After a direct dispatch,
        x = ``combine_input(handle)`` without top-k weights is pulled instead: each rank
        loads its tokens' rows from their ranks' buffers (the same bits)."""
        self.check_timeout()
        self._require_normal_buffer()
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be what dispatch returned, got {type(handle).__name__}")
        if bias is not None:
            raise ValueError("combine does not take bias yet: add it before combining")
        config = config or self.get_combine_config()
        if self._channels(config) != handle.channels:
            raise ValueError(f"config.num_sms must be the dispatch's {2 * handle.channels}, got "
                             f"{config.num_sms}")
        hidden, ptr, topk, weights_ptr = checks.combine_inputs(
            x, topk_weights, num_recv_tokens=handle.num_recv_tokens, device=self.device_index)
        if (handle.direct is not None and not topk
                and ptr == self.memory.pointers[self.rank] + handle.direct.combine_x):
            return self._launch_pull(handle, config, previous_event, async_finish)
        cfg = combine_kernel.choose_config(self.arch, self.group_size, hidden, topk=topk,
                                           num_sms=config.num_sms, slots=config.ring_slots)
        checks.require_buffer(self.num_nvl_bytes, cfg.plan.dispatch_rings,
                              f"a combine of {hidden}-wide rows")
        with self._on_comm_stream(previous_event, allocate_on_comm_stream) as call:
            out = torch.empty((handle.num_tokens, hidden), dtype=torch.bfloat16, device=x.device)
            arguments = dict(x=ptr, is_token_in_rank=handle.is_token_in_rank.data_ptr(),
                             tokens=handle.num_tokens, out=out.data_ptr(),
                             **self._common_arguments(handle))
            out_weights = None
            if topk:
                out_weights = torch.empty((handle.num_tokens, topk), dtype=torch.float32,
                                          device=x.device)
                arguments.update(topk_weights=weights_ptr,
                                 combined_topk_weights=out_weights.data_ptr())
            call.start((x, topk_weights, handle.is_token_in_rank, handle.recv_layout, out,
                        out_weights))
            _launcher(self.device_index, cfg)((2 * cfg.channels, 1, 1),
                                              self.comm_stream.cuda_stream, **arguments)
        return out, out_weights, call.finish(async_finish)

    def _launch_pull(self, handle, config, previous_event, async_finish):
        """The pull combine (kernels/ep_intranode/pull.py) of the rows in every rank's
        combine inputs."""
        cfg = pull_kernel.choose_config(self.arch, self.group_size, handle.hidden,
                                        num_sms=config.num_sms)
        with self._on_comm_stream(previous_event, False) as call:
            out = torch.empty((handle.num_tokens, handle.hidden), dtype=torch.bfloat16,
                              device=handle.is_token_in_rank.device)
            call.start((handle.is_token_in_rank, handle.send_rows, out))
            _launcher(self.device_index, cfg)(
                (config.num_sms, 1, 1), self.comm_stream.cuda_stream, x=handle.direct.combine_x,
                send_rows=handle.send_rows.data_ptr(),
                is_token_in_rank=handle.is_token_in_rank.data_ptr(), tokens=handle.num_tokens,
                out=out.data_ptr(), **self._peer_arguments())
        return out, None, call.finish(async_finish)

    # ------------------------------------------------------------------ decode path
    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """The num_rdma_bytes the decode path needs for these sizes (top-k up to 16)."""
        return low_latency.buffer_size(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False,
                             topk_weights: torch.Tensor | None = None):
        """Send each token (bf16 [T, H], T <= num_max_dispatch_tokens_per_rank <= 256),
        quantized to e4m3 with 1 x 128 scales, to the ranks of its experts, on the current
        stream with no host synchronisation. Returns ``((recv_x e4m3 [L, M, H], recv_scales
        f32 [L, M, H / 128] MN-major), recv_count int32 [L], handle, event, hook)``: L local
        experts, M = ranks x num_max_dispatch_tokens_per_rank rows each, source rank 0's
        first, each source's in token order: the masked layout (``masked_m = recv_count``)
        of ``m_grouped_fp8_gemm_nt_masked``. ``hook``: with ``return_recv_hook``, the call
        launched the send half only and the hook launches the receive half; else None.
        Each dispatch is followed by one combine, or by nothing, before the next.
        ``topk_weights`` (f32 [T, k], optional, not DeepEP's): sent with the tokens, so that
        the combine (given the same tensor) sums a token's pairs on each experts' rank and
        returns one row a (token, rank) instead of one a pair."""
        self.check_timeout()
        self._check_low_latency_options(async_finish, cumulative_local_expert_recv_stats=(
            cumulative_local_expert_recv_stats, None), use_fp8=(use_fp8, True),
            round_scale=(round_scale, False), use_ue8m0=(use_ue8m0, False))
        sizes = low_latency.check_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            num_experts=num_experts, ranks=self.group_size, device=self.device_index,
            topk_weights=topk_weights)
        _, hidden, topk = sizes
        self._agree_on_low_latency_sizes((
            ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
            ("hidden", hidden), ("num_experts", num_experts), ("topk", topk),
            ("topk_weights", topk_weights is not None)))
        received, recv_count, handle, hook = low_latency.launch_dispatch(
            self.low_latency_group, x, topk_idx, sizes,
            max_tokens=num_max_dispatch_tokens_per_rank, num_experts=num_experts,
            return_recv_hook=return_recv_hook, topk_weights=topk_weights)
        return received, recv_count, handle, self._current_event(), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out=None):
        """Send each row of the experts' outputs (bf16 [L, M, H], the dispatch's layout)
        back to its token's rank and sum there: returns ``(combined bf16 [T, H], event,
        hook)``, combined[t] the f32 sum in k order of topk_weights[t, j] times the row of
        expert topk_idx[t, j], rounded to bf16 once (after a dispatch given the weights:
        each experts' rank's part rounded to bf16, the parts summed in rank order);
        bitwise the same run to run."""
        self.check_timeout()
        self._check_low_latency_options(async_finish, use_logfmt=(use_logfmt, False),
                                        zero_copy=(zero_copy, False), out=(out, None))
        combined, hook = low_latency.combine(self.low_latency_group, x, topk_idx, topk_weights,
                                             handle, return_recv_hook=return_recv_hook)
        return combined, self._current_event(), hook

    def _agree_on_low_latency_sizes(self, signature: tuple) -> None:
        """The first decode dispatch with these sizes builds its kernels, then checks the
        sizes with the other ranks (one ``all_gather_object``; every rank makes the same
        call): where they differ, every rank raises the same ValueError, where a kernel
        would read rows laid out for other sizes. Later calls with the same sizes exchange
        nothing."""
        import torch.distributed as dist

        if signature in self._low_latency_sizes:
            return
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(f"the first low-latency dispatch with {dict(signature)} checks "
                             f"them with the other ranks, which a CUDA graph capture cannot "
                             f"do: run one before capturing")
        sizes = dict(signature)
        low_latency.prepare(self.low_latency_group, sizes["num_max_dispatch_tokens_per_rank"],
                            sizes["hidden"], sizes["num_experts"], sizes["topk"],
                            summed=sizes["topk_weights"])
        messages = [None] * self.group_size
        dist.all_gather_object(messages, Message(signature, [], [], 0), group=self.group)
        check_agreement(messages)
        self._low_latency_sizes.add(signature)

    def _check_low_latency_options(self, async_finish: bool, **options) -> None:
        """The decode path's buffer exists; DeepEP's options it does not take are refused,
        by name, rather than ignored."""
        if self.low_latency_group is None:
            raise ValueError("this Buffer has no low-latency buffer: create it with "
                             "num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(...) and "
                             "low_latency_mode=True")
        if async_finish:
            raise ValueError("async_finish: the low-latency calls run on the current stream; "
                             "overlap them with return_recv_hook=True instead")
        for name, (value, default) in options.items():
            if value is not default:
                raise ValueError(f"{name}={value!r} is not supported by ptxforge.ep yet "
                                 f"(only {default!r})")

    def _current_event(self) -> EventOverlap:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device_index))
        return EventOverlap(event)

    # ------------------------------------------------------------------ errors, teardown
    def check_timeout(self) -> None:
        """Raise EPTimeoutError if a kernel of this buffer timed out, received an entry laid
        out for other sizes, or found more rows coming than a dispatch had room for (it
        wrote a record to host memory before trapping); nothing to do otherwise. Reads
        host memory only."""
        code, channel, peer, seen = self.record.read()
        if not code:
            return
        if code == kernel_common.EXCHANGE_OVERFLOW:
            raise EPTimeoutError(
                f"ptxforge.ep: rank {peer} receives {seen} rows, more than the dispatch's "
                f"num_worst_tokens: a rank sent more than num_worst_tokens / ranks tokens. The "
                f"exchange kernel trapped; this process's CUDA context is unusable.")
        if code in _MISMATCHES:
            raise EPTimeoutError(
                f"ptxforge.ep: rank {self.rank}'s {_MISMATCHES[code]} kernel received from rank "
                f"{peer} on channel {channel} an entry laid out for other sizes (hidden size, "
                f"top-k, dtype, SMs or ring slots differ between the ranks' calls; signature "
                f"{seen & 0xFFFFFFFF:#x}). The kernel trapped; this process's CUDA context is "
                f"unusable.")
        if code in _LOW_LATENCY_WAITS:
            kernel, waited = _LOW_LATENCY_WAITS[code]
            raise EPTimeoutError(
                f"ptxforge.ep: rank {self.rank}'s {kernel} kernel waited more than "
                f"{self.timeout_s} s for {waited.format(peer=peer, channel=channel)}, last seen "
                f"{seen:#x}: rank {peer if 'rank' in waited else '?'} died or hangs, or the "
                f"ranks' calls differ. The kernel trapped; this process's CUDA context is "
                f"unusable.")
        kernel, waited = _WAITS.get(code, ("?", f"wait {code}"))
        raise EPTimeoutError(
            f"ptxforge.ep: rank {self.rank}'s {kernel} kernel waited more than {self.timeout_s} s "
            f"on channel {channel} for {waited.format(peer=peer)}, last seen {seen}: rank "
            f"{peer} died, hangs, or was given a different layout. The kernel trapped; this "
            f"process's CUDA context is unusable.")

    def destroy(self) -> None:
        """Free the buffers: collective (every rank unmaps the others' memory first)."""
        for memory in (self.memory, self.low_latency_memory):
            if memory is not None:
                memory.close()
        self.record.close()

    def _on_comm_stream(self, previous_event, allocate_on_comm_stream):
        return _CommCall(self, previous_event, allocate_on_comm_stream)


class _CommCall:
    """One call's stream choreography: the communication stream waits for the current
    stream (or ``previous_event``); outputs are allocated on the current stream (or the
    communication stream); ``start`` marks the tensors the kernels use as used on the
    communication stream; ``finish`` records the event and, unless ``async_finish``,
    makes the current stream wait for it."""

    def __init__(self, buffer: Buffer, previous_event, allocate_on_comm_stream: bool):
        self.buffer, self.previous_event = buffer, previous_event
        self.allocate_on_comm_stream = allocate_on_comm_stream
        self.compute = torch.cuda.current_stream(buffer.device_index)
        self._context = None

    def __enter__(self):
        comm = self.buffer.comm_stream
        if self.previous_event is not None:
            comm.wait_event(self.previous_event.event)
        else:
            comm.wait_stream(self.compute)
        if self.allocate_on_comm_stream:
            self._context = torch.cuda.stream(comm)
            self._context.__enter__()
        return self

    def start(self, tensors) -> None:
        if self.allocate_on_comm_stream:
            return
        for t in tensors:
            if t is not None:
                t.record_stream(self.buffer.comm_stream)
        self.buffer.comm_stream.wait_stream(self.compute)  # the outputs' allocation

    def __exit__(self, *exc):
        if self._context is not None:
            self._context.__exit__(*exc)

    def finish(self, async_finish: bool) -> EventOverlap:
        event = torch.cuda.Event()
        event.record(self.buffer.comm_stream)
        if not async_finish:
            self.compute.wait_event(event)
        return EventOverlap(event)
