"""What the multi-rank suites share (``bench/ep.py``, ``bench/ep_layer.py``): running a
measurement on every rank, each a process (under ``torchrun`` the launcher's, otherwise
spawned here: a GPU each, or all on one GPU under MPS), and timing a call at the GPU's
pace with every rank starting together.
"""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile

import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms at 2 GHz: the host's time to enqueue a batch, and more
# NVLink multicast stays off in every process a multi-rank run starts.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def run_ranks(measure, world: int, params: dict, *, what: str):
    """``measure(rank, world, params)`` on every rank, each a process: under ``torchrun``
    the launcher's (this one among them), otherwise ``world`` processes spawned here, a GPU
    each, or all on one GPU under MPS. Rank 0's result (None on the other ranks under
    torchrun); a rank that failed raises here with its traceback."""
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST)
    if "RANK" in os.environ:
        rank = int(os.environ["RANK"])
        if not dist.is_initialized():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank))
                                  % torch.cuda.device_count())
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        return measure(rank, dist.get_world_size(), params)
    if torch.cuda.device_count() < world and not mps_running():
        raise ValueError(f"world={world} ranks on {torch.cuda.device_count()} GPU(s) need MPS "
                         f"(their kernels wait for each other); start nvidia-cuda-mps-control "
                         f"or run under torchrun with a GPU a rank")
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        processes = [context.Process(target=_spawned,
                                     args=(measure, r, world, init, params, results))
                     for r in range(world)]
        for p in processes:
            p.start()
        reports = dict(results.get(timeout=3600) for _ in range(world))
        for p in processes:
            p.join(timeout=60)
    failed = [f"rank {r}: {report}" for r, report in sorted(reports.items())
              if isinstance(report, str)]
    if failed:
        raise RuntimeError(f"{what} failed:\n" + "\n".join(failed))
    return reports[0]


def mps_running() -> bool:
    """Whether an MPS control daemon serves this process's pipe directory (two ranks on one
    GPU need it: their kernels wait for each other, so they must be resident together)."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))


def _spawned(measure, rank: int, world: int, init: str, params: dict, results) -> None:
    import traceback

    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=300))
        results.put((rank, measure(rank, world, params)))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc()))


def batch_us(fn, calls: int, repeats: int, *, together: bool = True) -> float:
    """Median over ``repeats`` of a batch of ``calls`` back-to-back calls, per call (us).
    A first call, untimed, builds the kernels. Each batch starts after a host barrier
    (``together``) and behind a sleep kernel long enough for the host to enqueue the
    whole batch: the kernels then run back to back at the
    GPU's pace, not the host's, and the ranks' batches start within the barrier's skew."""
    import torch.distributed as dist

    fn()  # the first call builds and loads its kernels: outside the timing
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if together:
            dist.barrier()
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
