"""Every registered kernel variant emits the PTX it emitted when the golden list was last
written, up to comments and register names: a refactor of a generator must leave its
kernels alone, or say in its commit which changed and why (then rewrite the list):

    python tests/cpu/test_golden_ptx.py --update

Registers are renamed in order of first use and their declarations summed per type, so
renaming or regrouping registers changes nothing; any instruction, operand, order, type,
parameter or directive does.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

from ptxforge import arch, kernels
from ptxforge.kernels import sm90_gemm as gemm
from ptxforge.kernels.gemm import GemmProblem

GOLDEN = Path(__file__).with_name("golden_ptx.json")
_DECLARATION = re.compile(r"^\.reg \.(\w+) %(\w+?)(?:<(\d+)>)?;$")


def normalized(ptx: str) -> str:
    """The PTX without comments and blank lines, registers named %R0, %R1, ... by first
    use, and one ``.reg`` line per type giving how many registers of it are declared."""
    lines, singles, banks, counts = [], set(), set(), {}
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        declared = _DECLARATION.match(line)
        if declared:
            kind, name, bank = declared.groups()
            (banks if bank else singles).add(name)
            counts[kind] = counts.get(kind, 0) + (int(bank) if bank else 1)
        elif line:
            lines.append(line)
    canonical = {}

    def rename(match):
        name = match.group(1)
        bank = re.fullmatch(r"(\w+?)(\d+)", name)
        if name in singles or (bank and bank.group(1) in banks):
            return canonical.setdefault(name, f"%R{len(canonical)}")
        return match.group(0)  # a special register (%tid.x), a parameter, a label

    body = [re.sub(r"%(\w+)", rename, line) for line in lines]
    return "\n".join([f".reg .{kind} {n}" for kind, n in sorted(counts.items())] + body)


# GEMM modes the registry's heuristic choices do not reach: f32 accumulation, one and four
# producer warps, both part-buffer counts, multicast, bf16 grouped and straddling tiles with
# more scale-row splits than get a promotion of their own (block_n 40, 56, 72), the bias and
# the residual (alone, with the bias, and in a tile covering 8 rows), and the scale.
def _gemm(n, k, dtype="e4m3", layout="dense", groups=0, epilogue=(), **tile):
    return GemmProblem(n, k, dtype, layout, groups, epilogue), tile


GEMM_MAKE_CONFIG = (
    _gemm(7168, 2048, epilogue=("accumulate",), block_m=128, block_n=128),
    _gemm(4096, 7168, epilogue=("accumulate",), block_m=64, block_n=128, multicast=2),
    _gemm(4096, 7168, "bf16", epilogue=("accumulate",), block_m=128, block_n=256),
    _gemm(2112, 7168, block_m=64, block_n=96, producers=1),
    _gemm(2112, 7168, block_m=128, block_n=96, producers=4, part_buffers=1),
    _gemm(7168, 2048, block_m=128, block_n=128, part_buffers=2, multicast=2),
    _gemm(4096, 7168, "bf16", "contiguous", 4, block_m=128, block_n=128),
    _gemm(4096, 7168, "bf16", "masked", 4, block_m=64, block_n=128, multicast=2),
    _gemm(7168, 2048, block_m=64, block_n=40),
    _gemm(7168, 2048, layout="contiguous", groups=2, block_m=64, block_n=56),
    _gemm(7168, 2048, layout="masked", groups=2, block_m=128, block_n=72),
    _gemm(7168, 2048, epilogue=("bias",), block_m=128, block_n=128),
    _gemm(2112, 7168, "bf16", epilogue=("bias",), block_m=64, block_n=96),
    _gemm(7168, 2048, epilogue=("residual",), block_m=128, block_n=128),
    _gemm(2112, 7168, "bf16", epilogue=("bias", "residual"), block_m=64, block_n=96),
    _gemm(2112, 7168, epilogue=("residual",), block_m=64, block_n=24, tile_rows=8),
    _gemm(4096, 7168, layout="contiguous", groups=256, block_m=128, block_n=128, multicast=2,
          share_b=True, raster=1),
    _gemm(7168, 2048, block_m=128, block_n=192, multicast=2, share_b=True),
    _gemm(2112, 7168, epilogue=("scale",), block_m=64, block_n=96),
)


def variants() -> dict[str, str]:
    """'target/kernel/options' -> sha256 of the normalized PTX, for every registered
    variant each target supports, and the GEMM configs above."""
    hashes = {}
    for problem, tile in GEMM_MAKE_CONFIG:
        config = gemm.make_config(arch.get("sm_90a"), problem, **tile)
        ptx = normalized(gemm.generate(config).ptx())
        key = f"sm_90a/make_config/{problem}/" + ",".join(f"{k}={v}" for k, v in tile.items())
        hashes[key] = hashlib.sha256(ptx.encode()).hexdigest()
    for target in arch.targets():
        a = arch.get(target)
        for spec in kernels.REGISTRY.values():
            for options in spec.variants:
                try:
                    config = spec.config(a, **options)
                except ValueError:
                    if target == "sm_90a":   # every kernel's home: a bad variant, not a
                        raise                # missing feature
                    continue  # the kernel needs a feature the target lacks
                ptx = normalized(spec.generate(config).ptx())
                key = f"{target}/{spec.name}/" + ",".join(f"{k}={v}" for k, v in options.items())
                hashes[key] = hashlib.sha256(ptx.encode()).hexdigest()
    return hashes


def test_register_names_and_comments_do_not_count():
    a = ".reg .u32 %r<2>;\n.reg .u32 %t;\nadd.u32 %r0, %t, %r1; // sum\nmov.u32 %t, %tid.x;"
    b = ".reg .u32 %x<3>;\n// a comment\nadd.u32 %x2, %x0, %x1;\n\nmov.u32 %x0, %tid.x;"
    assert normalized(a) == normalized(b) == (
        ".reg .u32 3\nadd.u32 %R0, %R1, %R2;\nmov.u32 %R1, %tid.x;")
    assert normalized(a) != normalized(a.replace("add.u32", "sub.u32"))


def test_every_variant_emits_its_golden_ptx():
    golden = json.loads(GOLDEN.read_text())
    current = variants()
    assert sorted(current) == sorted(golden), "variants added or removed: rewrite the list"
    changed = sorted(key for key in current if current[key] != golden[key])
    assert not changed, f"{len(changed)} variants changed their PTX, e.g. {changed[:5]}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(__doc__)
    GOLDEN.write_text(json.dumps(variants(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
