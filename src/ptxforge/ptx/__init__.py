"""The PTX builder: kernels are Python functions that emit PTX, one call per instruction."""

from . import sreg
from .builder import KernelBuilder, Label, Param, SharedBuffer
from .operands import Address, NegPred, Reg, Special, Vector, addr, vec

__all__ = [
    "KernelBuilder", "Label", "Param", "SharedBuffer", "Address", "NegPred", "Reg", "Special",
    "Vector", "addr", "vec", "sreg",
]
