"""Multi-rank tests' processes: ``worker(rank, world, init_file, scenario, results)`` in
``world`` spawned processes (a gloo rendezvous through ``init_file``), each putting
``(rank, None or its traceback)`` on ``results``; the test fails with the ranks'
tracebacks, or with the ranks that did not report within ``timeout_s`` (a hang), whose
processes are then killed."""

from __future__ import annotations

import os
import queue
import tempfile
import time

import pytest
import torch


def run(worker, scenario, world: int, *, timeout_s: float) -> None:
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        processes = [context.Process(target=worker, daemon=True,
                                     args=(rank, world, init_file, scenario, results))
                     for rank in range(world)]
        for p in processes:
            p.start()
        deadline, reports = time.monotonic() + timeout_s, {}
        while len(reports) < world:
            try:
                rank, error = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            reports[rank] = error
            if time.monotonic() > deadline:
                break
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    missing = sorted(set(range(world)) - set(reports))
    failures = [f"rank {r}:\n{error}" for r, error in sorted(reports.items()) if error]
    if missing:
        failures.append(f"rank(s) {missing} did not finish within {timeout_s} s (a hang?)")
    if failures:
        name = scenario if isinstance(scenario, str) else scenario.__name__
        pytest.fail(f"scenario {name}:\n" + "\n".join(failures), pytrace=False)
