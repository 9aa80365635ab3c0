"""The decode path's dispatch send half alone, in one process (both ranks' buffers
allocated here, so nothing waits on a peer), timed by the profiler, and for ncu:

    PYTHONPATH=src python bench/ep_ll_probe.py
    ncu --kernel-name regex:ep_ll_dispatch_send --launch-skip 2 --launch-count 1 \
        --section WarpStateStats python bench/ep_ll_probe.py warm-up-only

DeepSeek-V3's decode shape: 128 tokens, H = 7168, top-8 of 256 experts over 2 ranks.
"""

import statistics
import sys

import torch

from ptxforge.ep import low_latency
from ptxforge.ep.ipc import HostRecord
from ptxforge.ops.common import device_arch

TOKENS, HIDDEN, EXPERTS, TOPK, RANKS = 128, 7168, 256, 8, 2


def main() -> None:
    size = low_latency.buffer_size(TOKENS, HIDDEN, RANKS, EXPERTS)
    buffers = [torch.zeros(size, dtype=torch.uint8, device="cuda") for _ in range(RANKS)]
    peers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device="cuda")
    record = HostRecord(0)
    group = low_latency.Group(0, RANKS, peers, record.device_pointer, int(5e9), 0,
                              device_arch(0), size)
    x = torch.randn(TOKENS, HIDDEN, device="cuda").bfloat16()
    idx = torch.rand(TOKENS, EXPERTS, device="cuda").topk(TOPK, 1).indices.contiguous()

    def send():
        low_latency.dispatch(group, x, idx, num_max_dispatch_tokens_per_rank=TOKENS,
                             num_experts=EXPERTS, return_recv_hook=True)

    for _ in range(3):
        send()
    torch.cuda.synchronize()
    if sys.argv[1:] == ["warm-up-only"]:
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            send()
        torch.cuda.synchronize()
    times = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            times.setdefault(event.name, []).append(event.time_range.end - event.time_range.start)
    for name, spans in times.items():
        print(f"{name:60.60s} median {statistics.median(spans):6.1f} us ({len(spans)} calls)")
    print("tokens of the busiest expert:", int(torch.bincount(idx.flatten(), minlength=EXPERTS).max()))


if __name__ == "__main__":
    main()
