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
