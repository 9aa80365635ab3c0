"""PTX special registers, as operands for ``mov``.

    k.mov(tid, sreg.tid.x)
    k.mov(lane, sreg.laneid)
"""

from __future__ import annotations

from types import SimpleNamespace

from .operands import Special


def _xyz(name: str) -> SimpleNamespace:
    return SimpleNamespace(**{axis: Special(f"%{name}.{axis}", "u32") for axis in "xyz"})


tid = _xyz("tid")
ntid = _xyz("ntid")
ctaid = _xyz("ctaid")
nctaid = _xyz("nctaid")
clusterid = _xyz("clusterid")
nclusterid = _xyz("nclusterid")
cluster_ctaid = _xyz("cluster_ctaid")
cluster_nctaid = _xyz("cluster_nctaid")
cluster_ctarank = Special("%cluster_ctarank", "u32")
cluster_nctarank = Special("%cluster_nctarank", "u32")
laneid = Special("%laneid", "u32")
warpid = Special("%warpid", "u32")
nwarpid = Special("%nwarpid", "u32")
smid = Special("%smid", "u32")
nsmid = Special("%nsmid", "u32")
clock64 = Special("%clock64", "u64")
globaltimer = Special("%globaltimer", "u64")
dynamic_smem_size = Special("%dynamic_smem_size", "u32")
lanemask_lt = Special("%lanemask_lt", "u32")  # the bits of the lanes below this one

# Base names of the special registers: a register of the same name would read as one.
NAMES = frozenset(
    "tid ntid ctaid nctaid clusterid nclusterid cluster_ctaid cluster_nctaid cluster_ctarank "
    "cluster_nctarank laneid warpid nwarpid smid nsmid clock clock64 globaltimer "
    "dynamic_smem_size gridid lanemask_eq lanemask_le lanemask_lt lanemask_ge lanemask_gt pm0 "
    "envreg0 total_smem_size aggr_smem_size current_graph_exec".split()
)
