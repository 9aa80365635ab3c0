"""The ``ptxforge`` command, run in-process through ``cli.main`` (and once as a process),
as on a machine without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ptxforge import arch, cli, jit, kernels
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


def test_a_text_option_is_passed_to_the_kernel_s_configure(capsys):
    """The routing layout's ``layout`` is a word: the kernel's configure checks it."""
    assert cli.main(["asm", "moe_routing_layout", "experts=384", "layout=masked"]) == 0
    (row,) = resource_rows(capsys.readouterr().out)
    assert row["kernel"] == "i64_moe_routing_layout_masked_e384" and row["spill B"] == "0"
    assert cli.main(["ptx", "moe_routing_layout", "layout=dense"]) == 2
    assert capsys.readouterr().err == ("ptxforge ptx: layout must be one of ('contiguous', "
                                       "'masked'), got 'dense'\n")
    with pytest.raises(ValueError, match="^option layout must be text, got 1$"):
        kernels.get("moe_routing_layout").config(arch.get("sm_90a"), layout=1)


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


def test_option_without_a_value(capsys):
    assert cli.main(["ptx", "rms_norm", "4096"]) == 2
    assert capsys.readouterr().err == "ptxforge ptx: kernel options are key=value, got '4096'\n"


@pytest.mark.parametrize("kernel, option, shown", [
    ("fp8_gemm_nt", "m=abc", "'abc'"), ("fp8_gemm_nt", "m=-1", "'-1'"),
    ("fp8_gemm_nt", "m=0", "0"), ("bf16_gemm_nt", "k=1.5", "'1.5'"),
    ("m_grouped_fp8_gemm_nt_contiguous", "groups=0", "0"),
    ("m_grouped_fp8_gemm_nt_masked", "expected_m=-4", "'-4'"),
    ("m_grouped_fp8_gemm_nt_masked", "expected_m=0", "0"), ("rms_norm", "hidden=", "''"),
])
def test_an_option_value_that_is_not_a_positive_integer_is_refused(kernel, option, shown, capsys):
    assert cli.main(["asm", kernel, option]) == 2
    name = option.partition("=")[0]
    limit = kernels.OPTION_LIMITS.get(name, kernels.OPTION_LIMIT)
    assert capsys.readouterr().err == (f"ptxforge asm: option {name} must be an integer from 1 "
                                       f"to {limit}, got {shown}\n")


@pytest.mark.parametrize("kernel, option, limit", [
    ("fp8_gemm_nt", "n=1000000000000", 2**31 - 1), ("fp8_gemm_nt", "k=1000000000000", 2**31 - 1),
    ("fp8_gemm_nt", "m=1000000000000", 2**31 - 1),
    ("m_grouped_bf16_gemm_nt_masked", "expected_m=2147483648", 2**31 - 1),
    ("ep_intranode_dispatch", "slots=1048576", 4096),
    ("ep_intranode_combine", "hidden=16777216", 65536),
])
def test_an_option_beyond_its_bound_is_named_before_any_work(kernel, option, limit, capsys):
    """Too large for the kernels' 32-bit sizes (or the EP rings' offsets): the option is
    named, not the builder's instruction whose immediate overflowed, nor accepted."""
    for command in ("ptx", "asm"):
        assert cli.main([command, kernel, option]) == 2
        name, _, value = option.partition("=")
        assert capsys.readouterr() == ("", f"ptxforge {command}: option {name} must be an integer "
                                           f"from 1 to {limit}, got {value}\n")


@pytest.mark.parametrize("kernel, option, valid", [
    ("rms_norm", "hiden=4096", "hidden"), ("fp8_gemm_nt", "groups=4", "m, n, k"),
    ("m_grouped_fp8_gemm_nt_masked", "m=64", "groups, expected_m, n, k"),
    ("quantize_fp8_per_block", "hidden=4096", "none"),
])
def test_a_misspelled_option_lists_the_valid_ones(kernel, option, valid, capsys):
    assert cli.main(["ptx", kernel, option]) == 2
    key = option.partition("=")[0]
    assert capsys.readouterr().err == (f"ptxforge ptx: {kernel} has no option {key!r}; its "
                                       f"options: {valid}\n")


def test_version(capsys):
    import ptxforge

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"ptxforge {ptxforge.__version__}\n"


@pytest.mark.parametrize("argv, message", [
    (["precompile", "--model", "ffn", "--tokens", "1000000000000"],
     "--tokens must be from 1 to 1048576, got 1000000000000"),
    (["precompile", "--model", "ffn", "--tokens", "0"], "--tokens must be from 1 to 1048576, got 0"),
    (["precompile", "--workers", "0"], "--workers must be from 1 to 1024, got 0"),
    (["compile-report", "--model", "llama-8b", "--layers", "0"],
     "--layers must be from 1 to 256, got 0"),
    (["compile-report", "--model", "llama-8b", "--layers", "-3"],
     "--layers must be from 1 to 256, got -3"),
    (["bench", "ep", "--sms", "8,x"], "--sms takes comma-separated integers, got '8,x'"),
    (["bench", "ep", "--slots", "64,8192"], "--slots must be from 1 to 4096, got 8192"),
    (["bench", "memory", "--m", "0"], "--m must be from 1 to 1048576, got 0"),
])
def test_a_size_option_out_of_range_is_one_line_before_any_work(argv, message, capsys):
    """Checked before the model is built or a kernel assembled: a trillion tokens is not a
    walk over a trillion token counts, zero layers not a partial report."""
    assert cli.main(argv) == 2
    assert capsys.readouterr() == ("", f"ptxforge {argv[0]}: {message}\n")


def test_a_config_json_that_cannot_be_read_is_one_line(tmp_path, capsys):
    (tmp_path / "bad.json").write_text('{"model_type": "llama",')
    (tmp_path / "list.json").write_text("[1, 2]")
    choices = "ffn, llama-8b, deepseek-v3-moe, mixtral-moe or a transformers config.json"
    for path, why in ((tmp_path / "missing.json", "No such file or directory"),
                      (tmp_path, "Is a directory"),
                      (tmp_path / "bad.json", "not JSON (Expecting property name enclosed in "
                                               "double quotes: line 1 column 24 (char 23))"),
                      (tmp_path / "list.json", "it holds a JSON list")):
        for command in ("compile-report", "precompile"):
            assert cli.main([command, "--model", str(path)]) == 2
            assert capsys.readouterr() == ("", f"ptxforge {command}: --model must be {choices}, "
                                               f"got {str(path)!r}: {why}\n")


def test_a_model_with_no_ptxforge_kernel_is_an_empty_report(tmp_path, capsys):
    """A config.json of a Llama too small for any kernel (hidden size 4): the plan says why,
    and the kernel tables say there are none."""
    config = {"model_type": "llama", "hidden_size": 4, "intermediate_size": 4,
              "num_attention_heads": 1, "num_key_value_heads": 1, "vocab_size": 16}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main(["compile-report", "--model", str(tmp_path / "config.json"),
                     "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "0 of 7 Linears on ptxforge GEMMs" in out
    assert out.endswith("kernels, by token count:\n(none: no node runs on a ptxforge kernel)\n")
    assert cli.main(["precompile", "--model", str(tmp_path / "config.json"), "--layers", "1",
                     "--tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("LlamaModel, 1 layer: 0 kernels for 1-64 tokens in ")
    assert out.endswith("\n(no kernels)\n")


def test_a_type_error_is_a_bug_not_a_user_error(monkeypatch):
    """Only the errors the commands raise for bad input are one line; anything else (a
    TypeError in ptxforge's code) is a traceback to report."""
    def broken(args):
        return len(3)

    monkeypatch.setattr(cli, "cmd_info", broken)
    with pytest.raises(TypeError):
        cli.main(["info"])


def test_arch_after_the_command(capsys):
    assert cli.main(["info", "--arch", "sm_90a:H100 SXM"]) == 0
    assert "arch: sm_90a / H100 SXM: 132 SMs" in capsys.readouterr().out
    assert cli.main(["ptx", "rms_norm", "hidden=1024", "--arch", "sm_89"]) == 2
    assert "sm_89" in capsys.readouterr().err
    assert cli.main(["--arch", "sm_89", "ptx", "rms_norm", "--arch", "sm_90a"]) == 0  # the last


def test_bench_without_a_gpu_is_one_line_on_stderr(capsys):
    assert cli.main(["bench", "memory"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "ptxforge bench: needs a CUDA GPU; none was found\n"


def test_sass_without_a_disassembler_names_the_packages(monkeypatch, capsys):
    monkeypatch.setattr(cli, "find_cuda_tool", lambda name: None)
    assert cli.main(["asm", "quantize_fp8_per_token", "hidden=576", "--sass"]) == 2
    captured = capsys.readouterr()
    assert resource_rows(captured.out)[0]["kernel"] == "bf16_quant_fp8_per_token_k576"
    assert captured.err == ("ptxforge asm: --sass needs nvdisasm: pip install "
                            "nvidia-cuda-nvdisasm (13.2 or newer; nvidia-cuda-cuobjdump works "
                            "beside it)\n")


@pytest.fixture
def disassembler():
    from ptxforge.jit.assemble import find_cuda_tool

    tool = find_cuda_tool("nvdisasm") or find_cuda_tool("cuobjdump")
    if tool is None:
        pytest.skip("no nvdisasm or cuobjdump (pip install nvidia-cuda-nvdisasm)")
    return tool


def test_sass_histogram(disassembler, capsys):
    assert cli.main(["asm", "quantize_fp8_per_token", "hidden=576", "--sass"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("SASS ("))
    total = int(header.split(": ")[1].split()[0])
    counts = {line.split()[0]: int(line.split()[1]) for line in out.splitlines()
              if line.startswith("  ")}
    assert total == sum(counts.values()) > 100
    assert counts["F2FP"] > 0 and counts["SHFL"] > 0  # e4m3 packing and the amax butterfly


def test_sass_of_a_damaged_cubin_is_an_error(disassembler):
    with pytest.raises(cli.DisassemblyError, match=" failed: "):
        cli.sass_histogram(b"\x7fELF not a cubin")


def test_demo_without_gpu_assembles_every_variant(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "_memory", {})
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    expected = len(kernels.all_variants(arch.get("sm_90a")))
    assert (f"No CUDA GPU was found: generated {expected} kernel variants for sm_90a "
            f"({expected} assembled, 0 loaded from the cache); nothing was run.") in out
    rows = resource_rows(out)
    assert len(rows) == expected
    assert {r["target"] for r in rows} == {"sm_90a"}
    assert all(r["spill B"] == "0" for r in rows)
    assert "bf16_quant_fp8_per_block_128x128" in {r["kernel"] for r in rows}

    monkeypatch.setattr(jit, "_memory", {})  # a new process: the disk cache alone
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert f"(0 assembled, {expected} loaded from the cache)" in out
    assert {r["from"] for r in resource_rows(out)} == {"disk"}


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


def test_cache_clear_removes_temporary_files_and_kept_ptx(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(tmp_path))
    DiskCache(tmp_path).put("a" * 64, b"x" * 1000, {})
    (tmp_path / ".aaaaaaaaaaaaaaaa.x1y2z3.tmp").write_bytes(b"left by a writer that died")
    (tmp_path / "ptx").mkdir()
    (tmp_path / "ptx" / "k.0123456789ab.ptx").write_text("// kept by PTXFORGE_DEBUG")
    assert cli.main(["cache", "clear"]) == 0
    assert capsys.readouterr().out == f"removed 1 entries from {tmp_path}\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["ptx"]


def test_cache_clear_with_a_directory_where_an_entry_should_be(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(tmp_path))
    cache = DiskCache(tmp_path)
    cache.put("a" * 64, b"x" * 1000, {})
    cache.path("b" * 64).mkdir()
    assert cli.main(["cache", "clear"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"ptxforge cache: cannot remove {cache.path('b' * 64)}: Is a directory\n")
    assert cache.entries() == [cache.path("b" * 64)]  # the real entry went all the same


@pytest.mark.parametrize("under_a_file", [False, True], ids=["a-file", "under-a-file"])
def test_info_and_cache_show_say_when_the_cache_cannot_be_used(under_a_file, tmp_path,
                                                              monkeypatch, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache directory should be")
    directory = blocker / "cache" if under_a_file else blocker
    monkeypatch.setenv("PTXFORGE_CACHE_DIR", str(directory))
    why = (f"it sits under {blocker}, which is not a directory" if under_a_file
           else f"{blocker} is not a directory")
    state = f"cannot be used: {why}, so kernels are not saved"
    assert cli.main(["info"]) == 0
    assert f"\ncache: {directory} ({state})\n" in capsys.readouterr().out
    assert cli.main(["cache", "show"]) == 2
    assert capsys.readouterr().out == f"{directory}: {state}\n"


def test_a_cache_directory_that_cannot_be_made_is_named_with_why(monkeypatch, capsys):
    """/proc takes no new folder, whatever its permission bits say (and root is refused
    too): the cache is unusable, and info and cache show say so and why."""
    monkeypatch.setenv("PTXFORGE_CACHE_DIR", "/proc/x")
    state = ("cannot be used: cannot create a folder in /proc: No such file or directory, so "
             "kernels are not saved")
    assert cli.main(["info"]) == 0
    assert f"\ncache: /proc/x ({state})\n" in capsys.readouterr().out
    assert cli.main(["cache", "show"]) == 2
    assert capsys.readouterr().out == f"/proc/x: {state}\n"


def test_a_read_only_cache(tmp_path, unprivileged):
    cache = DiskCache(tmp_path / "cache")
    cache.put("a" * 64, b"x" * 1000, {})
    cache.directory.chmod(0o555)
    env = {k: v for k, v in os.environ.items() if k != "PTXFORGE_ARCH"}
    env.update(PTXFORGE_CACHE_DIR=str(cache.directory), CUDA_VISIBLE_DEVICES="")

    def ptxforge(*args):
        return subprocess.run(unprivileged + [sys.executable, "-m", "ptxforge.cli", *args],
                              env=env, capture_output=True, text=True, timeout=120)

    show = ptxforge("cache", "show")
    assert show.returncode == 2
    assert show.stdout == (f"{cache.directory}: 1 entries, 0.0 MB; cannot be written: cannot "
                           f"create a file in {cache.directory}: Permission denied, so new "
                           f"kernels are not saved\n")
    clear = ptxforge("cache", "clear")
    assert clear.returncode == 2 and clear.stdout == ""
    assert clear.stderr == f"ptxforge cache: cannot remove {cache.path('a' * 64)}: Permission denied\n"
    assert cache.entries() == [cache.path("a" * 64)]
    assert f"\ncache: {cache.directory} (1 entries" in ptxforge("info").stdout
