"""The ``ptxforge`` command: info, ptx, asm, precompile, compile-report, onnx-report, bench,
demo, cache."""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

from . import arch as arch_mod
from . import jit, kernels
from . import settings
from .jit.assemble import AssemblerUnavailable, find_cuda_tool, get_assembler
from .jit.cache import DiskCache

# The largest token count of precompile --tokens and the bench suites: precompile walks
# the counts 1..N one by one (the tile choice stops changing within a few thousand), and
# no suite is sized beyond it.
MAX_TOKENS = 1 << 20
# The most layers of a transformers model (--layers): Dynamo traces each one, seconds
# apiece even on the meta device; the deepest public models have fewer than 130.
MAX_LAYERS = 256


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _target_arch(name: str | None):
    """--arch, else PTXFORGE_ARCH / the GPU, else sm_90a for CPU-only work."""
    if name:
        target, _, device = name.partition(":")
        return arch_mod.get(target, device or None)
    if os.environ.get("PTXFORGE_ARCH") or _gpu_available():
        return arch_mod.current()
    return arch_mod.get("sm_90a")


def _options(pairs: list[str]) -> dict:
    """``key=value`` words as a dict; the kernel's spec checks the names and values."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"kernel options are key=value, got {pair!r}")
        options[key] = value
    return options


def _table(headers: list, rows: list, none: str) -> str:
    """The rows as a table, or the line ``none`` when there are none: an empty report is a
    report."""
    from .bench import format_table

    return format_table(headers, rows) if rows else none


def _resource_rows(compiled_kernels) -> str:
    rows = [[c.name, c.target, c.resources.registers, c.resources.spills,
             c.resources.stack_frame, c.resources.static_shared, f"{c.seconds * 1e3:.0f}", c.source]
            for c in compiled_kernels]
    return _table(["kernel", "target", "regs", "spill B", "stack B", "static smem B", "ms",
                   "from"], rows, "(no kernels)")


# --------------------------------------------------------------------------- commands
def cmd_info(args) -> int:
    import ptxforge

    print(f"ptxforge {ptxforge.__version__}, Python {sys.version.split()[0]}")
    if _gpu_available():
        import torch

        print(f"GPU: {torch.cuda.get_device_name()} (torch {torch.__version__})")
    else:
        print("GPU: none found")
    a = _target_arch(args.arch)
    d = a.device
    print(f"arch: {a.target} / {d.name}: {d.sm_count} SMs, L2 {d.l2_bytes >> 20} MiB, "
          f"smem/block {a.max_shared_memory_per_block // 1024} KiB, "
          f"{d.memory_bandwidth_gbs} GB/s, fp8 {d.peak_tflops.get('fp8', '-')} / bf16 "
          f"{d.peak_tflops.get('bf16', '-')} TFLOPS (datasheet); features: "
          + ", ".join(f for f, on in a.features.items() if on))
    try:
        print(f"assembler: {get_assembler()!r}")
    except AssemblerUnavailable as exc:
        print(f"assembler: none ({exc})")
    cache = DiskCache(settings.cache_dir())
    state = "disabled" if settings.cache_disabled() else _cache_state(cache, cache.problem())
    print(f"cache: {cache.directory} ({state})")
    return 0


def _cache_state(cache: DiskCache, problem: str | None) -> str:
    """Entries and size, and ``problem``: why the directory cannot be written, if it cannot;
    a directory that is not there and cannot be made: only why."""
    if problem and not cache.directory.is_dir():
        return f"cannot be used: {problem}, so kernels are not saved"
    state = f"{len(cache.entries())} entries, {cache.size_bytes() / 1e6:.1f} MB"
    if problem:
        state += f"; cannot be written: {problem}, so new kernels are not saved"
    return state


def cmd_ptx(args) -> int:
    spec = kernels.get(args.kernel)
    print(spec.builder(_target_arch(args.arch), **_options(args.options)).ptx(), end="")
    return 0


def cmd_asm(args) -> int:
    spec = kernels.get(args.kernel)
    compiled = jit.build(spec.builder(_target_arch(args.arch), **_options(args.options)))
    print(_resource_rows([compiled]))
    if args.sass:
        print("\n" + sass_histogram(compiled.cubin))
    return 1 if compiled.resources.spills else 0


class DisassemblyError(RuntimeError):
    """No SASS disassembler is installed, or it failed."""


def sass_histogram(cubin: bytes) -> str:
    """Opcode counts of a cubin's SASS, through nvdisasm (or a toolkit's cuobjdump, which
    runs nvdisasm itself)."""
    tool = find_cuda_tool("nvdisasm") or find_cuda_tool("cuobjdump")
    if tool is None:
        # PyPI has these from CUDA 13.2 on; they read the cubins of ptxas 13.0.
        raise DisassemblyError("--sass needs nvdisasm: pip install nvidia-cuda-nvdisasm (13.2 "
                               "or newer; nvidia-cuda-cuobjdump works beside it)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        cmd = [tool, "--dump-sass", f.name] if tool.endswith("cuobjdump") else [tool, f.name]
        out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        message = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        raise DisassemblyError(f"{tool} failed: {message}")
    counts = collections.Counter()
    for line in out.stdout.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            counts[m.group(1).split(".")[0]] += 1
    total = sum(counts.values())
    lines = [f"SASS ({os.path.basename(tool)}): {total} instructions"]
    lines += [f"  {op:<12} {n:6d}" for op, n in counts.most_common()]
    return "\n".join(lines)


def _config_file(path: str, built_in: tuple) -> None:
    """--model's config.json: a file holding a JSON object, checked here because
    transformers takes a path it cannot find for a model on the Hugging Face Hub
    (``built_in``: the names --model takes besides a path, for the message)."""
    try:
        with open(path) as f:
            config = json.load(f)
        why = None if isinstance(config, dict) else f"it holds a JSON {type(config).__name__}"
    except OSError as exc:
        why = exc.strerror
    except ValueError as exc:   # JSONDecodeError, UnicodeDecodeError
        why = f"not JSON ({exc})"
    if why:
        raise ValueError(f"--model must be {', '.join(built_in)} or a transformers config.json, "
                         f"got {path!r}: {why}")


def _model_plan(args, a):
    """The model named by --model, built on the meta device, and the passes' plan for it."""
    import torch

    from .compiler import report
    from . import models

    if args.model not in models.BUILT_IN:
        _config_file(args.model, models.BUILT_IN)
    with torch.device("meta"):
        case = models.build(args.model, args.layers)
    return case, report.trace(case, a, fp8=not args.bf16)


def cmd_precompile(args) -> int:
    a = _target_arch(args.arch)
    if args.model:
        import time

        from .compiler import precompile, report

        case, graphs = _model_plan(args, a)
        makers = precompile.builders(report.kernels(graphs), a,
                                     precompile.every_token_count(a, args.tokens))
        start = time.perf_counter()
        compiled = jit.precompile(makers, workers=args.workers)
        print(f"{case.name}: {len(compiled)} kernels for 1-{args.tokens} tokens in "
              f"{time.perf_counter() - start:.1f} s")
    else:
        compiled = jit.precompile(kernels.all_variants(a), workers=args.workers)
    print(_resource_rows(compiled))
    return 1 if any(c.resources.spills for c in compiled) else 0


def cmd_compile_report(args) -> int:
    from .compiler import report

    a = _target_arch(args.arch)
    case, graphs = _model_plan(args, a)
    _print_report(*report.report_tables(case, graphs, a), nodes="nodes")
    return 0


def cmd_onnx_report(args) -> int:
    from .onnx import onnx_report

    _print_report(*onnx_report(args.model, _target_arch(args.arch), fp8=not args.bf16),
                  nodes="ONNX nodes")
    return 0


def _print_report(title, plan, summary, kernel_rows, *, nodes: str,
                  counts=(1, 64, 2048, 16384)) -> None:
    """A compile report's tables (``compiler.report.report_tables``, at ``counts``)."""
    print(title)
    print(_table(["rewrite", nodes, "runs on", "detail"], plan,
                 "(nothing matched: every node runs with Inductor)"))
    print(f"\n{summary}\n\nkernels, by token count:")
    print(_table(["kernel", *(f"M={m}" for m in counts)], kernel_rows,
                 "(none: no node runs on a ptxforge kernel)"))


def cmd_bench(args) -> int:
    if not _gpu_available():
        print("ptxforge bench: needs a CUDA GPU; none was found", file=sys.stderr)
        return 2
    from .bench import ops as bench

    if args.suite == "memory":
        result = bench.memory_suite(args.m, args.k)
        result["host_overhead_us"] = bench.host_overhead()
        text = bench.memory_table(result)
        text += "\n\nhost time per call (1000 back-to-back calls):\n" + "\n".join(
            f"  {name:<44} {us:6.1f} us" for name, us in result["host_overhead_us"].items())
        plot = bench.memory_plot
    elif args.suite == "bf16-gemm":
        result = bench.bf16_gemm_suite()
        text = bench.bf16_gemm_table(result)
        plot = bench.bf16_gemm_plot
    elif args.suite == "grouped-gemm":
        result = bench.grouped_gemm_suite()
        text, plot = bench.grouped_gemm_table(result), bench.grouped_gemm_plot
    elif args.suite == "decode":
        result = bench.decode_suite()
        text, plot = bench.decode_table(result), bench.decode_plot
    elif args.suite == "chain":
        result = bench.chain_suite()
        text, plot = bench.chain_table(result), None
    elif args.suite == "attention":
        from .bench import attention as attention_bench

        result = attention_bench.attention_suite()
        text, plot = attention_bench.attention_table(result), None
    elif args.suite == "onnx":
        from .bench import onnx as onnx_bench

        opsets = tuple(int(opset) for opset in args.opsets.split(","))
        result = onnx_bench.onnx_suite(opsets, _layers(args, 2))
        text, plot = onnx_bench.onnx_table(result), None
    elif args.suite == "ep":
        from .bench import ep as ep_bench

        result = ep_bench.ep_suite(tokens=args.tokens, hidden=args.k, sms=_ints(args.sms),
                                   slots=_ints(args.slots), world=args.world,
                                   layer_tokens=_ints(args.layer_tokens) if args.layer_tokens
                                   else ())
        if result is None:  # a rank other than 0 under torchrun: rank 0 reports
            return 0
        text = ep_bench.ep_table(result)
        plot = ep_bench.ep_plot
    elif args.suite == "generate":
        from .bench import generate as generate_bench

        cases = tuple(tuple(int(n) for n in case.split("x")) for case in args.cases.split(","))
        candidates = tuple(args.candidates.split(",")) if args.candidates else \
            generate_bench.CANDIDATES
        unknown = [c for c in candidates if c not in generate_bench.CANDIDATES]
        if unknown:
            raise ValueError(f"--candidates takes {', '.join(generate_bench.CANDIDATES)}; "
                             f"got {', '.join(unknown)}")
        result = generate_bench.generate_suite(cases, candidates, layers=_layers(args, 32))
        text, plot = generate_bench.generate_table(result), generate_bench.generate_plot
    elif args.suite == "model":
        from .bench import model as model_bench

        result = model_bench.model_suite(args.models.split(","), _layers(args, 2))
        text, plot = model_bench.model_table(result), model_bench.model_plot
    else:
        result = bench.gemm_suite()
        text = bench.gemm_table(result)
        plot = bench.gemm_plot
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot and plot is not None:
        plot(result, args.plot)
    print(text)
    return 0


def _layers(args, default: int) -> int:
    """bench --layers, the suite's default where not given."""
    return default if args.layers is None else args.layers


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def cmd_demo(args) -> int:
    if not _gpu_available():
        a = _target_arch(args.arch)
        compiled = jit.precompile(kernels.all_variants(a), progress=False)
        print(_resource_rows(compiled))
        assembled = sum(c.source == "assembled" for c in compiled)
        print(f"\nNo CUDA GPU was found: generated {len(compiled)} kernel variants for "
              f"{a.target} ({assembled} assembled, {len(compiled) - assembled} loaded from the "
              f"cache); nothing was run.")
        return 1 if any(c.resources.spills for c in compiled) else 0
    from .bench import ops as bench
    from .testing import checks

    results = checks.run_all(big=True)
    print(bench.format_table(["check", "shape", "metric", "value", "limit", ""],
                             [r.row() for r in results]))
    failed = [r for r in results if not r.passed]
    print(f"\n{len(results) - len(failed)} of {len(results)} checks passed\n")
    print(bench.memory_table(bench.memory_suite()))
    print()
    print(bench.gemm_table(bench.gemm_suite([(64, 7168, 2048), (128, 24576, 1536),
                                             (4096, 7168, 16384)])))
    return 1 if failed else 0


def cmd_cache(args) -> int:
    cache = DiskCache(settings.cache_dir())
    if args.action == "show":
        problem = cache.problem()
        print(f"{cache.directory}: {_cache_state(cache, problem)}")
        return 2 if problem else 0
    try:
        removed = cache.clear()
    except OSError as exc:
        print(f"ptxforge cache: cannot remove {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    print(f"removed {removed} entries from {cache.directory}")
    return 0


# Each command's integer options: (low, high), or for a comma-separated list each item's;
# checked before any work.
_RANGES = {
    "precompile": {"--tokens": (1, MAX_TOKENS), "--layers": (1, MAX_LAYERS),
                   "--workers": (1, 1024)},
    "compile-report": {"--layers": (1, MAX_LAYERS)},
    "bench": {"--m": (1, MAX_TOKENS), "--k": (1, kernels.OPTION_LIMITS["hidden"]),
              "--layers": (1, MAX_LAYERS), "--tokens": (1, MAX_TOKENS),
              "--sms": (1, 256), "--slots": (1, kernels.OPTION_LIMITS["slots"]),
              "--world": (2, 8), "--layer-tokens": (1, MAX_TOKENS)},
}


def _check_ranges(args) -> None:
    """A ValueError naming the first integer option of ``args.command`` out of its range."""
    for option, (low, high) in _RANGES.get(args.command, {}).items():
        value = getattr(args, option[2:].replace("-", "_"))
        if value is None or value == "":   # not given, no default: the command picks; none
            continue
        for item in value.split(",") if isinstance(value, str) else [value]:
            if isinstance(item, str):
                if not item.strip().isdigit():
                    raise ValueError(f"{option} takes comma-separated integers, got {value!r}")
                item = int(item)
            if not low <= item <= high:
                raise ValueError(f"{option} must be from {low} to {high}, got {item}")


def main(argv=None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="ptxforge", description=__doc__)
    parser.add_argument("--version", action="version", version=f"ptxforge {__version__}")
    # --arch before the command or after it: the subcommands' copy keeps the main one's value
    # unless given (SUPPRESS: no default of its own).
    arch_help = ("target[:device], e.g. sm_90a or sm_90a:H200 (default: PTXFORGE_ARCH, the GPU, "
                 "or sm_90a)")
    arch_option = argparse.ArgumentParser(add_help=False)
    arch_option.add_argument("--arch", default=argparse.SUPPRESS, help=arch_help)
    parser.add_argument("--arch", default=None, help=arch_help)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, helptext, **kwargs):
        return sub.add_parser(name, help=helptext, parents=[arch_option], **kwargs)

    command("info", "GPU, architecture description, assembler, cache")
    kernel_list = "kernels and their options (default values): " + "; ".join(
        f"{s.name} ({', '.join(f'{k}={v}' for k, v in s.options.items()) or 'no options'}): "
        f"{s.doc}" for s in kernels.REGISTRY.values())
    for name, helptext in (("ptx", "print a kernel's PTX"),
                           ("asm", "assemble a kernel and print its resources")):
        p = command(name, helptext, epilog=kernel_list)
        p.add_argument("kernel", choices=list(kernels.REGISTRY))
        p.add_argument("options", nargs="*", help="key=value kernel options, e.g. hidden=4096")
        if name == "asm":
            p.add_argument("--sass", action="store_true", help="also print a SASS opcode histogram")
    model_help = ("ffn, llama-8b (Llama-3-8B layer sizes), deepseek-v3-moe, mixtral-moe (a MoE "
                  "block) or a transformers config.json")

    def model_options(p, required):
        p.add_argument("--model", required=required, help=model_help)
        p.add_argument("--layers", type=int, default=2, help="layers of a transformers model")
        p.add_argument("--bf16", action="store_true", help="the backend's fp8=False plan")

    p = command("precompile", "assemble every kernel variant (or a model's kernels) in parallel")
    p.add_argument("--workers", type=int, default=None)
    model_options(p, required=False)
    p.add_argument("--tokens", type=int, default=16384,
                   help="with --model: every token count from 1 to this")
    p = command("compile-report", "what the torch.compile backend does to a model (no GPU "
                "needed)")
    model_options(p, required=True)
    p = command("onnx-report", "which nodes of an ONNX model become which kernels (no GPU "
                "needed)")
    p.add_argument("model", help="an .onnx file (its external data beside it)")
    p.add_argument("--bf16", action="store_true", help="the backend's fp8=False plan")
    p = command("bench", "GPU benchmark side by side with torch")
    p.add_argument("suite", choices=["memory", "fp8-gemm", "grouped-gemm", "bf16-gemm", "decode",
                                     "chain", "attention", "model", "onnx", "ep",
                                     "generate"])
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--k", type=int, default=7168)
    p.add_argument("--json", help="write the full results here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--models", default="ffn,llama-8b", help="model suite: which models")
    p.add_argument("--layers", type=int, help="model and onnx suites: transformers layers "
                   "(default 2); generate suite: Llama-3-8B's layers (default all 32)")
    p.add_argument("--opsets", default="18,23", help="onnx suite: the opsets to export at")
    p.add_argument("--tokens", type=int, default=4096, help="ep suite: tokens a rank (--k: "
                   "the hidden size)")
    p.add_argument("--sms", default="8,12,16,20,24", help="ep suite: the SM budgets swept")
    p.add_argument("--slots", default="64,128,256", help="ep suite: the ring sizes swept")
    p.add_argument("--world", type=int, default=2,
                   help="ep suite: ranks (a GPU each, or all on one GPU under MPS; under "
                        "torchrun the launcher's)")
    p.add_argument("--cases", default="1x512,32x4096",
                   help="generate suite: batch x prompt tokens, comma-separated")
    p.add_argument("--candidates", help="generate suite: which candidates, comma-separated "
                   "(default all)")
    p.add_argument("--layer-tokens", default="4096,128",
                   help="ep suite: the MoE layer's tokens a rank ('' for none)")
    command("demo", "run (GPU) or assemble (CPU) every kernel, with checks")
    p = command("cache", "show or clear the on-disk cubin cache")
    p.add_argument("action", choices=["show", "clear"], nargs="?", default="show")
    args = parser.parse_args(argv)
    handler = {"info": cmd_info, "ptx": cmd_ptx, "asm": cmd_asm, "precompile": cmd_precompile,
               "compile-report": cmd_compile_report, "onnx-report": cmd_onnx_report,
               "bench": cmd_bench, "demo": cmd_demo,
               "cache": cmd_cache}[args.command]
    try:
        _check_ranges(args)
        return handler(args)
    except (ValueError, jit.AssemblyError, jit.AssemblerUnavailable, jit.SpillError,
            DisassemblyError) as exc:
        print(f"ptxforge {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
