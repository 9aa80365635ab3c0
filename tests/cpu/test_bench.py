"""The benchmark suites' GPU-free parts: the decode suite's rows, byte counts, summary and
table, ``ptxforge bench decode`` from the command line with the suite's result given, and
each suite's plot, drawn beside its suite and called by the command line."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from unittest import mock

import numpy
import pytest
import torch

from ptxforge import cli
from ptxforge.bench import ep as ep_bench
from ptxforge.bench import ep_layer, ranks
from ptxforge.bench import generate as generate_bench
from ptxforge.bench import model as model_bench
from ptxforge.bench import ops as bench


def test_decode_rows_are_deepgemms_weights_at_decode_sizes():
    problems = list(bench.decode_problems())
    deepgemm_nk = {(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168),
                   (7168, 2048)}
    for family in ("fp8", "bf16"):
        dense = [(groups, m, n, k) for f, groups, m, n, k in problems if f == family]
        assert sorted(dense) == sorted((1, m, n, k) for m in (1, 2, 4, 8, 16, 32, 64, 128)
                                       for n, k in deepgemm_nk)
    masked = [(groups, m, n, k) for f, groups, m, n, k in problems if f == "masked fp8"]
    assert sorted(masked) == sorted((groups, tokens, n, k)
                                    for groups, tokens in ((8, 8), (8, 32), (32, 8), (32, 32))
                                    for n, k in ((4096, 7168), (7168, 2048)))
    llama = [(m, n, k) for f, _, m, n, k in problems if f == "fp8 llama"]
    assert sorted(llama) == sorted((m, n, k) for m in (1, 8, 32) for n, k in (
        (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)))
    assert len(problems) == 2 * 48 + 8 + 12


def test_fp8_bytes_counted_by_hand():
    # M = 1, N = 2112, K = 7168: A 7168, A's scales 4 * 56, B 2112 * 7168, B's scales
    # 4 * 17 * 56 (2112 / 128 = 16.5 blocks), D 2 * 2112.
    assert bench.gemm_bytes([1], 2112, 7168) == 7_168 + 224 + 15_138_816 + 3_808 + 4_224
    assert bench.gemm_bytes([1], 2112, 7168, fp8=False) == 14_336 + 30_277_632 + 4_224


def test_masked_bytes_count_the_weights_of_groups_with_tokens():
    # A group of 8 tokens at N = 4096, K = 7168: B 4096 * 7168, B's scales 4 * 32 * 56,
    # A 8 * 7168, A's scales 8 * 4 * 56, D 8 * 4096 * 2.
    group = 29_360_128 + 7_168 + 57_344 + 1_792 + 65_536
    assert bench.gemm_bytes([8] * 8, 4096, 7168) == 8 * group == 235_935_744
    assert bench.gemm_bytes([8, 0, 0], 4096, 7168) == group


def decode_row(family, m, of_copy, speedup, groups=1):
    ms = 0.01
    return {"family": family, "groups": groups, "m": m, "n": 4096, "k": 7168, "bytes": 15_000_000,
            "ms": ms, "copy_ms": of_copy * ms, "of_copy": of_copy, "of_roofline": 0.7 * of_copy,
            "peer_ms": speedup and speedup * ms, "speedup": speedup, "calc_diff": 1.4e-6}


ROWS = [decode_row("fp8", 1, 0.5, 2.0), decode_row("fp8", 64, 0.9, 0.5),
        decode_row("fp8", 128, 0.8, None), decode_row("masked fp8", 8, 0.7, None, groups=8)]
RESULT = {"suite": "decode", "gpu": "NVIDIA H200", "copy_gbs": 4268.0, "rows": ROWS,
          "summary": bench.decode_summary(ROWS)}


def test_decode_summary_reads_off_the_targets():
    fp8, masked = RESULT["summary"]
    assert fp8 == {"family": "fp8", "rows": 3, "peer_rows": 2, "least_of_copy_m_le_64": 0.5,
                   "least_of_copy_m_128": 0.8, "geomean_speedup": 1.0, "least_speedup": 0.5}
    assert masked == {"family": "masked fp8", "rows": 1, "peer_rows": 0,
                      "least_of_copy_m_le_64": 0.7, "least_of_copy_m_128": None,
                      "geomean_speedup": None, "least_speedup": None}


def test_decode_table():
    lines = bench.decode_table(RESULT).splitlines()
    table = [line for line in lines if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    assert len(cells) == 2 + len(ROWS)
    assert cells[0][:3] == ["family", "groups", "M"]
    assert cells[2][7:12] == ["5.0", "50%", "35%", "20.0", "2.00x"]   # copy us, %, peer
    assert cells[4][10:12] == ["n/a", "n/a"]                            # torch refused the peer
    assert lines[-2:] == [
        "fp8: least of copy 50% at M <= 64, 80% at M = 128; geomean 1.00x (least 0.50x) vs "
        "cuBLAS blockwise over 2 of 3 rows",
        "masked fp8: least of copy 70% at M <= 64, n/a at M = 128; no peer"]


def test_decode_suite_row_arithmetic(monkeypatch):
    """With a timer that reads each call's time off the call (ours 10 us, the same-size copy
    8 us, the peer 15 us) and a large copy at 4000 GB/s."""
    class ReadingTimer:
        def each(self, fns):
            return [fn() for fn in fns]

    output = torch.ones(2, 2)
    case = lambda family, *shape: (lambda: 0.010, output, output,
                                   None if family == "masked fp8" else lambda: 0.015)
    monkeypatch.setattr(bench, "_decode_case", case)
    monkeypatch.setattr(bench, "copy_of", lambda nbytes: lambda: 0.008)
    monkeypatch.setattr(bench, "copy_bandwidth_gbs", lambda timer: 4000.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "test GPU")
    result = bench.decode_suite(ReadingTimer())
    first, last = result["rows"][0], result["rows"][-1]
    assert (first["family"], first["m"], first["n"], first["k"]) == ("fp8", 1, 2112, 7168)
    assert first["bytes"] == 15_154_240
    assert first["of_copy"] == pytest.approx(0.8) and first["speedup"] == pytest.approx(1.5)
    assert first["of_roofline"] == pytest.approx(15_154_240 / 4000e9 / 10e-6)
    assert first["calc_diff"] == 0.0
    masked = [r for r in result["rows"] if r["family"] == "masked fp8"]
    assert all((r["peer_ms"], r["speedup"]) == (None, None) for r in masked)
    assert (last["family"], last["m"], last["n"], last["k"]) == ("fp8 llama", 32, 4096, 14336)
    assert last["speedup"] == pytest.approx(1.5)
    assert [s["rows"] for s in result["summary"]] == [48, 48, 8, 12]


def test_bench_decode_writes_json_and_plot(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    monkeypatch.setattr(bench, "decode_suite", lambda: RESULT)
    out_json, out_png = tmp_path / "decode.json", tmp_path / "decode.png"
    assert cli.main(["bench", "decode", "--json", str(out_json), "--plot", str(out_png)]) == 0
    assert json.loads(out_json.read_text()) == RESULT
    out = capsys.readouterr().out
    assert bench.decode_table(RESULT) in out
    if importlib.util.find_spec("matplotlib"):
        assert out_png.stat().st_size > 0
    else:
        assert "(matplotlib is not installed: no plot)" in out


def test_a_call_s_time_is_the_sum_of_its_device_work():
    """Timer.each sums each call's kernels (us) and takes the median per callable (ms)."""
    timer = bench.Timer(reps=3)
    work = {"a": [[(0.0, 1.0), (2.0, 4.0)], [(10.0, 14.0)], [(20.0, 22.0)]],
            "b": [[(0.0, 5.0)]] * 3}
    timer.intervals = lambda fns: [call for fn in fns for call in work[fn]]
    assert timer.each(["a", "b"]) == [pytest.approx(3e-3), pytest.approx(5e-3)]


CHAIN = {"suite": "chain", "gpu": "NVIDIA H200", "m": 8,
         "shapes": [[4096, 7168], [7168, 2048], [4096, 7168], [7168, 2048]],
         "standalone_us": [40.0, 20.0, 40.0, 20.0], "standalone_sum_us": 120.0,
         "rows": [{"pdl": False, "chain_us": 126.0, "gaps_us": [2.0, 2.0, 2.0],
                   "events_us": 131.0, "calc_diff": 2e-6, "of_standalone_sum": 1.05},
                  {"pdl": True, "chain_us": 114.0, "gaps_us": [-3.0, -2.5, -3.0],
                   "events_us": 119.0, "calc_diff": 2e-6, "of_standalone_sum": 0.95}]}


def test_chain_table():
    lines = bench.chain_table(CHAIN).splitlines()
    assert lines[0].endswith("Standalone (each kernel alone, profiler, L2 flushed): "
                             "40.0 + 20.0 + 40.0 + 20.0 = 120.0 us")
    cells = [[cell.strip() for cell in line.strip("|").split("|")]
             for line in lines if line.startswith("|")]
    assert cells[0] == ["PDL", "chain us", "of standalone sum", "gaps us", "graph us",
                        "calc_diff"]
    assert cells[2] == ["off", "126.0", "105.0%", "+2.0, +2.0, +2.0", "131.0", "2.0e-06"]
    assert cells[3] == ["on", "114.0", "95.0%", "-3.0, -2.5, -3.0", "119.0", "2.0e-06"]
    assert lines[-2:] == ["PDL off: chain 126.0 us = 105.0% of the standalone sum",
                          "PDL on: chain 114.0 us = 95.0% of the standalone sum"]


def test_bench_chain_writes_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    monkeypatch.setattr(bench, "chain_suite", lambda: CHAIN)
    out_json = tmp_path / "chain.json"
    assert cli.main(["bench", "chain", "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text()) == CHAIN
    assert bench.chain_table(CHAIN) in capsys.readouterr().out


def _worst(rings_call: float, rings_kernel: float, direct_call: float,
           direct_kernel: float) -> dict:
    """A rank's worst-case timings: the combine twice the dispatch's, the exchange 10 us."""
    times = {}
    for name, call, kernel in (("rings", rings_call, rings_kernel),
                               ("direct", direct_call, direct_kernel)):
        times.update({f"{name}_dispatch_call_us": call, f"{name}_dispatch_us": kernel,
                      f"{name}_combine_call_us": 2 * call, f"{name}_combine_us": 2 * kernel,
                      f"{name}_exchange_us": 10.0})
    return times


def _ep_ranks():
    """Two ranks' reports as ``ep._measure`` gathers them (rank 1 the slower)."""
    sweep = lambda d, c: [dict(sms=8, slots=64, dispatch_us=d, combine_us=c),
                          dict(sms=20, slots=64, dispatch_us=d / 2, combine_us=c / 2),
                          dict(sms=24, slots=64, dispatch_us=d / 4, combine_us=c / 4)]
    peers = dict(p2p_copy_gbs=394.0, nccl_dispatch_bytes_us=150.0, nccl_combine_bytes_us=295.0,
                 nccl_bf16_4096x7168_us=131.0)
    kernels = dict(gemm=dict(alone_us=880.0, together_us=935.0, start_us=0.0),
                   dispatch=dict(alone_us=100.0, together_us=150.0, start_us=12.0))
    beside = lambda comm_us, both_us: dict(
        comm_us=comm_us, overlapped_us=both_us, ratio=both_us / (900.0 + comm_us),
        over_longer=both_us / 900.0, kernels=kernels)
    overlap = dict(gemm_sms=112, comm_sms=20, gemm_rows=9000, gemm_us=900.0,
                   rings=beside(300.0, 960.0), direct=beside(150.0, 945.0))
    decode = lambda d, c: dict(dispatch_us=d, combine_us=c, pair_us=d + c + 5,
                               dispatch_weighted_us=d + 1, dispatch_weighted_send_us=d / 2,
                               dispatch_weighted_receive_us=d / 2 + 1,
                               combine_summed_us=c / 2, combine_summed_send_us=c / 4,
                               combine_summed_receive_us=c / 8, summed_pair_us=d + c / 2 + 5)
    return [dict(sweep=sweep(200.0, 400.0), dispatch_bytes=30e6, combine_bytes=58e6,
                 peers=peers, overlap=overlap, recv=4000, decode=decode(14.0, 20.0),
                 worst=_worst(230.0, 210.0, 140.0, 120.0)),
            dict(sweep=sweep(220.0, 380.0), dispatch_bytes=32e6, combine_bytes=60e6,
                 peers={}, overlap=overlap, recv=4100, decode=decode(12.0, 24.0),
                 worst=_worst(225.0, 205.0, 150.0, 125.0))]


EP_PARAMS = dict(tokens=4096, hidden=7168, topk=8, experts=256, sms=[8, 20, 24], slots=[64],
                 calls=8, repeats=5)


def test_ep_summary_takes_the_slowest_rank_and_picks_within_the_budget():
    params = EP_PARAMS
    result = ep_bench._summary(_ep_ranks(), params, 2, True, "NVIDIA H200")
    first, second = result["sweep"][:2]
    assert (first["dispatch_us"], first["combine_us"]) == (220.0, 400.0)
    assert first["dispatch_gbs"] == pytest.approx(31e6 / 220.0 / 1e3)  # the ranks' mean bytes
    assert second["combine_gbs"] == pytest.approx(59e6 / 200.0 / 1e3)
    # 24 SMs is faster but over the 20-SM budget.
    assert result["picked"] == dict(sms=20, slots=64)
    table = ep_bench.ep_table(result)
    assert "|  20 |         64 |       110.0 |  282 |" in table
    assert "dispatch: 282 GB/s = 72% of the P2P copy" in table
    assert ("picked (the least dispatch + combine time on <= 20 SMs, within the default "
            "buffer): 20 SMs x 64 slots") in table
    assert "NCCL all_to_all_single bf16 4096x7168: 131.0 us" in table
    assert ("  through the rings: 300.0 us, together 960.0 us = 0.80 x their sum, 1.07 x the "
            "longer") in table
    assert ("  direct dispatch (exchange included), pull combine: 150.0 us, together 945.0 us "
            "= 0.90 x their sum, 1.05 x the longer") in table
    assert "the bf16 combine's: 295.0 us (200 GB/s)" in table
    assert ("gemm 880 -> 935 us (x1.06), starting at +0 us, dispatch 100 -> 150 us (x1.50), "
            "starting at +12 us") in table
    assert "dispatch 14.0 us, combine 24.0 us; a dispatch + combine pair 41.0 us" in table
    assert ("the weights sent with the dispatch (the layer's): dispatch 15.0 us (send 7.0, "
            "receive 8.0 apart), combine summed on the experts' ranks 12.0 us (send 6.0, "
            "receive 3.0 apart); a pair 29.0 us") in table
    # The slowest rank's each; GB/s of the ranks' mean bytes (31 MB, 59 MB).
    assert ("  direct dispatch, pull combine: dispatch 150.0 us (exchange 10.0, dispatch "
            "125.0: 248 GB/s), combine 300.0 us (kernel 250.0: 236 GB/s)") in table
    one_gpu = ep_bench._summary(_ep_ranks(), params, 2, False, "NVIDIA H200")
    assert "all on ONE GPU under MPS" in ep_bench.ep_table(one_gpu)


def _layer_summary():
    """Two ranks' layer reports as ``ep_layer.measure`` gathers them (rank 1 the slower)."""
    line = lambda us: dict(span_us=us, busy_us=us / 2, kernels=[dict(name="sm90_gemm", us=us / 2)],
                           gaps=[dict(us=us / 2, at_us=10.0, after="ep_intranode_layout",
                                      before="ep_intranode_dispatch")])
    rows = lambda scale: [dict(tokens=4096, path="contiguous", ours_us=7000.0 * scale,
                               bounded_us=6500.0 * scale, wide_us=6200.0 * scale,
                               direct_us=6300.0 * scale, graph_us=5000.0 * scale,
                               nccl_us=6000.0 * scale, grouped_mm_us=20000.0 * scale,
                               timeline=line(7000.0 * scale)),
                          dict(tokens=128, path="masked", ours_us=1000.0 * scale,
                               nccl_us=2000.0 * scale, grouped_mm_us=4000.0 * scale,
                               timeline=line(1000.0 * scale))]
    everyone = [dict(rows=rows(1.0), copy_gbs=4000.0, fp8_bytes=2.8e9),
                dict(rows=rows(1.1), copy_gbs=4100.0, fp8_bytes=2.8e9)]
    params = dict(tokens=[4096, 128], hidden=7168, inner=2048, experts=256, topk=8, calls=4,
                  repeats=5)
    return ep_layer._summary(everyone, params, 2, True, "NVIDIA H200")


def test_the_ep_report_carries_the_layer():
    layer = _layer_summary()
    ours = layer["rows"][0]
    assert ours["ours_us"] == pytest.approx(7700.0)  # the slower rank's
    assert ours["ours_tflops"] == pytest.approx(2 * 4096 * 8 * 3 * 7168 * 2048 / 7700.0 / 1e6)
    assert layer["rows"][1]["weights_read_us"] == pytest.approx(2.8e9 / 4000.0 / 1e3)
    result = dict(ep_bench._summary(_ep_ranks(), EP_PARAMS, 2, True, "NVIDIA H200"), layer=layer)
    table = ep_bench.ep_table(result)
    assert ep_layer.layer_table(layer) in table
    # Every mode of ours has its column; the best of them is set against the peers.
    assert ("| 4096 | contiguous | 7700 (375) | 7150 (404) | 6820 (423) | 6930 (416) | "
            "5500 (525) | 6600 (437) | 22000 (131) | 1.20x | 4.00x |") in re.sub(" +", " ", table)
    assert table.index("picked (the least") < table.index("MoE layer across 2 ranks")
    assert ("rank 1: GPU span 7700 us, busy 3850; sm90_gemm 3850\n    idle 3850 us at +10: "
            "ep_intranode_layout -> ep_intranode_dispatch") in table


def test_a_timeline_counts_overlapping_kernels_once_and_lists_the_gaps(monkeypatch):
    import types

    def event(name, start, end):
        return types.SimpleNamespace(name=name, device_type=types.SimpleNamespace(name="CUDA"),
                                     time_range=types.SimpleNamespace(start=start, end=end))

    events = [event("quantize", 100.0, 110.0), event("gemm", 200.0, 500.0),
              event("dispatch", 150.0, 300.0), event("combine", 505.0, 600.0),
              event("gemm", 700.0, 800.0)]

    class Profile:
        def __init__(self, **_):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *_):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)
    t = ep_layer.timeline(lambda: None)
    assert t["span_us"] == 700.0 and t["busy_us"] == 10.0 + 350.0 + 95.0 + 100.0
    assert t["kernels"][0] == dict(name="gemm", us=400.0)
    assert t["gaps"] == [dict(us=100.0, at_us=500.0, after="combine", before="gemm"),
                         dict(us=40.0, at_us=10.0, after="quantize", before="dispatch")]


def test_bench_ep_needs_mps_for_two_ranks_on_one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(ranks, "mps_running", lambda: False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="world=2 ranks on 1 GPU\\(s\\) need MPS"):
        ep_bench.ep_suite()


class FakePyplot:
    """matplotlib.pyplot as the plots use it (matplotlib is no test dependency): subplots
    whose axes take any call, and a figure whose savefig writes the file."""

    def subplots(self, nrows=1, ncols=1, *, squeeze=True, **options):
        figure = mock.MagicMock()
        figure.savefig.side_effect = lambda path, **options: Path(path).write_bytes(b"png")
        axes = numpy.empty((nrows, ncols), dtype=object)
        for index in numpy.ndindex(axes.shape):
            axes[index] = mock.MagicMock()
        if squeeze:
            axes = axes.squeeze()
            axes = axes.item() if axes.ndim == 0 else axes
        return figure, axes


GPU = "NVIDIA H200"


def _llama_8b_config():
    import types

    from ptxforge import models

    return types.SimpleNamespace(num_hidden_layers=32, **{
        name: models.LLAMA_8B[name] for name in ("hidden_size", "intermediate_size",
                                                 "num_attention_heads", "num_key_value_heads",
                                                 "vocab_size")})


def test_a_decode_step_reads_the_weights_the_lm_head_and_the_kv_cache():
    """Llama-3-8B's sizes: about 8.0 GB a step at batch 1 (FP8 weights and the bf16
    lm_head), and about 17 GB more of bf16 KV cache at batch 32 with 4096 tokens of
    context: the roofline the generate targets are stated against."""
    config = _llama_8b_config()
    one = generate_bench.step_bytes(config, 1, 512)
    assert one["weights"] == pytest.approx(32 * 218_103_808 * (1 + 4 / 128 ** 2))
    assert one["lm_head"] == 2 * 128256 * 4096
    assert 7.9e9 < one["total"] < 8.1e9
    batch = generate_bench.step_bytes(config, 32, 4096)
    assert batch["kv_cache"] == 2 * 32 * 32 * 2 * 8 * 128 * 4096
    assert 16.5e9 < batch["kv_cache"] < 17.5e9
    assert generate_bench.step_bytes(config, 1, 512, fp8=False)["weights"] == 2 * 32 * 218_103_808


GENERATE_RESULT = {
    "suite": "generate", "gpu": GPU, "copy_gbs": 4000.0, "layers": 32, "new_tokens": 128,
    "rows": [dict(batch=1, prompt=512, candidate=c, ms=ms, tokens_per_s=1e3 / ms,
                  step_bytes=dict(weights=7.0e9, lm_head=1.0e9, kv_cache=0.1e9, total=8.1e9),
                  roofline_ms=2.025)
             for c, ms in (("eager", 30.0), ("torch.compile", 9.0), ("ptxforge forward", 4.05),
                           ("ptxforge backend", 5.0))]}


def test_a_generate_run_that_failed_is_named_in_the_table():
    rows = [dict(GENERATE_RESULT["rows"][0], candidate="torch.compile", ms=None,
                 tokens_per_s=None, error="AcceleratorError: CUDA error: device-side assert")]
    table = generate_bench.generate_table(dict(GENERATE_RESULT, rows=rows))
    assert "| 1 x 512 | torch.compile | failed | - | - |" in re.sub(" +", " ", table)
    assert "1 x 512, torch.compile failed: AcceleratorError: CUDA error" in table


def test_the_generate_table_reads_against_the_roofline():
    table = generate_bench.generate_table(GENERATE_RESULT)
    assert "| 1 x 512 | ptxforge forward | 4.05 | 247 | 2.00 |" in re.sub(" +", " ", table)
    assert ("1 x 512: a step reads 8.10 GB (FP8 weights 7.00, lm_head 1.00, KV cache 0.10): "
            "2.02 ms") in table


PLOTTED = {   # suite -> (its module, suite, table and plot functions, a result to draw)
    "memory": (bench, "memory_suite", "memory_table", "memory_plot", {
        "suite": "memory", "gpu": GPU, "copy_gbs": 4000.0,
        "rows": [{"kernel": "rms_norm", "bytes": 470e6, "gbs": 3100.0, "torch_ms": 0.3}]}),
    "fp8-gemm": (bench, "gemm_suite", "gemm_table", "gemm_plot", {
        "suite": "fp8-gemm", "gpu": GPU,
        "rows": [{"m": 64, "n": 2112, "k": 7168, "tflops": 100.0, "blockwise_tflops": 80.0}]}),
    "bf16-gemm": (bench, "bf16_gemm_suite", "bf16_gemm_table", "bf16_gemm_plot", {
        "suite": "bf16-gemm", "gpu": GPU,
        "rows": [{"m": 64, "n": 2112, "k": 7168, "tflops": 100.0, "cublas_tflops": 90.0}]}),
    "grouped-gemm": (bench, "grouped_gemm_suite", "grouped_gemm_table", "grouped_gemm_plot", {
        "suite": "grouped-gemm", "gpu": GPU,
        "rows": [{"layout": "contiguous", "groups": 4, "m_per_group": 8192, "n": 4096,
                  "k": 7168, "tflops": 600.0, "torch_tflops": 500.0},
                 {"layout": "masked", "groups": 2, "m_per_group": 64, "n": 4096, "k": 7168,
                  "tflops": 100.0, "torch_tflops": None}]}),
    "decode": (bench, "decode_suite", "decode_table", "decode_plot", RESULT),
    "model": (model_bench, "model_suite", "model_table", "model_plot", {
        "suite": "model", "gpu": GPU,
        "rows": [{"model": "FFN 7168/2048", "tokens": tokens, "candidate": candidate,
                  "wall_us": 10.0} for tokens in (64, 4096) for candidate in model_bench.CANDIDATES]}),
    "generate": (generate_bench, "generate_suite", "generate_table", "generate_plot",
                 GENERATE_RESULT),
    "ep": (ep_bench, "ep_suite", "ep_table", "ep_plot",
           dict(ep_bench._summary(_ep_ranks(), EP_PARAMS, 2, True, GPU), layer=_layer_summary())),
}


@pytest.mark.parametrize("suite", PLOTTED)
def test_each_suite_s_plot_draws_its_result(suite, monkeypatch, tmp_path):
    module, _, _, plot, result = PLOTTED[suite]
    monkeypatch.setattr(module, "pyplot", FakePyplot)
    getattr(module, plot)(result, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").read_bytes() == b"png"


@pytest.mark.parametrize("suite", PLOTTED)
def test_bench_plot_draws_the_suite_s_result_with_its_plot(suite, monkeypatch, tmp_path):
    module, run, table, plot, result = PLOTTED[suite]
    drawn = []
    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    monkeypatch.setattr(bench, "host_overhead", lambda: {})
    monkeypatch.setattr(module, run, lambda *args, **options: result)
    monkeypatch.setattr(module, table, lambda result: "the table")
    monkeypatch.setattr(module, plot, lambda result, path: drawn.append((result, path)))
    path = str(tmp_path / "plot.png")
    assert cli.main(["bench", suite, "--plot", path]) == 0
    assert drawn == [(result, path)]


def test_bench_generate_takes_its_cases_candidates_and_layers(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    monkeypatch.setattr(bench, "host_overhead", lambda: {})
    monkeypatch.setattr(generate_bench, "generate_suite", lambda cases, candidates, layers:
                        seen.append((cases, candidates, layers)) or GENERATE_RESULT)
    assert cli.main(["bench", "generate", "--cases", "1x512,8x128", "--layers", "4"]) == 0
    assert cli.main(["bench", "generate", "--candidates", "torch.compile,ptxforge steps"]) == 0
    assert seen == [(((1, 512), (8, 128)), generate_bench.CANDIDATES, 4),
                    (((1, 512), (32, 4096)), ("torch.compile", "ptxforge steps"), 32)]
    assert cli.main(["bench", "generate", "--candidates", "eager,inductor"]) == 2
    assert "--candidates takes eager, " in capsys.readouterr().err
    assert len(seen) == 2


def test_each_generate_candidate_gets_the_model_as_it_comes():
    """Each candidate runs in a process of its own: "ptxforge forward" compiles its forward
    (and its generate's compiled call becomes its plain call); the others take the model as
    transformers made it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config).eval()
    plain = type(model).forward
    generate_bench._prepared(model, "torch.compile")
    assert model.forward.__func__ is plain and "forward" not in model.__dict__
    generate_bench._prepared(model, "ptxforge forward")
    assert "forward" in model.__dict__ and "get_compiled_call" in model.__dict__
    assert model.forward.steps is None
    del model.forward
    generate_bench._prepared(model, "ptxforge steps")    # its decode steps as CUDA graphs
    assert model.forward.steps is not None
    del model.forward
    generate_bench._prepared(model, "ptxforge generate")  # the same, ptxforge's loop
    assert model.forward.steps is not None
    eager = generate_bench._generation_config("eager", 3)
    assert eager.disable_compile and eager.min_new_tokens == eager.max_new_tokens == 3
    assert generate_bench._generation_config("ptxforge backend", 3).compile_config.backend == \
        "ptxforge"


def test_the_ep_report_gives_the_copy_engines_to_every_peer():
    """With three ranks or more, rank 0's copies to every other GPU at once (a dispatch by
    the copy engines alone) sit beside the one-peer P2P copy."""
    ranks = _ep_ranks()
    ranks[0]["peers"] = dict(ranks[0]["peers"], p2p_every_peer_gbs=1020.0)
    table = ep_bench.ep_table(ep_bench._summary(ranks, EP_PARAMS, 4, True, "NVIDIA H200"))
    assert ("copy engines, GPU 0 to the 3 others at once (256 MiB each): 1020 GB/s out\n"
            "P2P copy engine, 1 GiB one direction: 394 GB/s") in table
    assert "copy engines" not in ep_bench.ep_table(
        ep_bench._summary(_ep_ranks(), EP_PARAMS, 2, True, "NVIDIA H200"))
