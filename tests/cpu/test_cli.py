"""The ``ptxforge`` command, run in-process through ``cli.main`` (and once as a process),
as on a machine without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ptxforge import arch, cli, kernels
from ptxforge.jit.cache import DiskCache


@pytest.fixture(scope="session")
def shared_cache_dir(tmp_path_factory):
    """One cache for the session, so kernels assembled by one test are reused by the next."""
    return tmp_path_factory.mktemp("cli-cache")


@pytest.fixture(autouse=True)
def cpu_only(shared_cache_dir, monkeypatch):
    monkeypatch.setattr(cli, "_gpu_available", lambda: False)
    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(shared_cache_dir))
    for knob in ("PTXFORGE_ARCH", "PTXFORGE_DISABLE_CACHE", "PTXFORGE_DEBUG"):
        monkeypatch.delenv(knob, raising=False)


def resource_rows(table: str) -> list[dict]:
    """The rows of the CLI's resource table as {column: text}."""
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|"))))
            for line in lines[2:]]


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "GPU: none found" in out
    assert "\narch: sm_90a / H200: 132 SMs" in out
    assert "\nassembler: " in out and "assembler: none" not in out


def test_info_with_a_named_device(capsys):
    assert cli.main(["--arch", "sm_90a:H100 SXM", "info"]) == 0
    assert "arch: sm_90a / H100 SXM: 132 SMs" in capsys.readouterr().out


def test_info_as_a_process(shared_cache_dir):
    env = {k: v for k, v in os.environ.items() if k != "PTXFORGE_ARCH"}
    env.update(PTXFORGE_CACHE_DIR=str(shared_cache_dir), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "ptxforge.cli", "info"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("arch: sm_90a / ") for line in lines)
    assert any(line.startswith("assembler: ") and "none" not in line for line in lines)
    assert f"cache: {shared_cache_dir}" in proc.stdout


def test_ptx_prints_the_kernel(capsys):
    assert cli.main(["ptx", "rms_norm", "hidden=4096"]) == 0
    out = capsys.readouterr().out
    assert ".target sm_90a\n" in out
    assert ".visible .entry bf16_rmsnorm_k4096(" in out
    assert out.rstrip().endswith("}")


def test_ptx_for_a_named_device(capsys):
    assert cli.main(["--arch", "sm_90a:H100", "ptx", "rms_norm", "hidden=1024"]) == 0
    out = capsys.readouterr().out
    assert ".target sm_90a\n" in out and ".entry bf16_rmsnorm_k1024" in out


def test_asm_prints_resources_without_spills(capsys):
    assert cli.main(["asm", "quantize_fp8_per_token", "hidden=576"]) == 0
    (row,) = resource_rows(capsys.readouterr().out)
    assert row["kernel"] == "bf16_quant_fp8_per_token_k576"
    assert row["target"] == "sm_90a"
    assert int(row["regs"]) > 0
    assert row["spill B"] == "0" and row["stack B"] == "0"


def test_block_quantization_on_ada_is_refused(capsys):
    assert cli.main(["--arch", "sm_89", "asm", "quantize_fp8_per_block"]) == 2
    err = capsys.readouterr().err
    assert "bulk copies needs mbarrier_tx" in err and "sm_89" in err


def test_hopper_only_kernel_on_ada_is_refused(capsys):
    assert cli.main(["--arch", "sm_89", "ptx", "rms_norm"]) == 2
    err = capsys.readouterr().err
    assert "mbarrier_tx" in err and "sm_89" in err


def test_fp8_kernel_on_ampere_is_refused(capsys):
    assert cli.main(["--arch", "sm_80", "ptx", "quantize_fp8_per_token"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptxforge ptx: ") and "fp8" in err


def test_unknown_kernel_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["ptx", "nope"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and "rms_norm" in err


def test_bad_hidden_size(capsys):
    assert cli.main(["ptx", "rms_norm", "hidden=12"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "multiple of 8, got 12" in captured.err


def test_option_without_a_value():
    with pytest.raises(SystemExit, match="key=value"):
        cli.main(["ptx", "rms_norm", "4096"])


def test_demo_without_gpu_assembles_every_variant(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    expected = len(kernels.all_variants(arch.get("sm_90a")))
    assert f"No CUDA GPU was found: generated and assembled {expected} kernel variants for sm_90a" in out
    rows = resource_rows(out)
    assert len(rows) == expected
    assert {r["target"] for r in rows} == {"sm_90a"}
    assert all(r["spill B"] == "0" for r in rows)
    assert "bf16_quant_fp8_per_block_128x128" in {r["kernel"] for r in rows}


def test_cache_show_and_clear(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(tmp_path))
    cache = DiskCache(tmp_path)
    cache.put("a" * 64, b"x" * 1000, {})
    cache.put("b" * 64, b"y" * 1000, {})

    assert cli.main(["cache", "show"]) == 0
    assert capsys.readouterr().out == f"{tmp_path}: 2 entries, 0.0 MB\n"
    assert cli.main(["cache", "clear"]) == 0
    assert capsys.readouterr().out == f"removed 2 entries from {tmp_path}\n"
    assert cache.entries() == []
    assert cli.main(["cache"]) == 0
    assert capsys.readouterr().out == f"{tmp_path}: 0 entries, 0.0 MB\n"
