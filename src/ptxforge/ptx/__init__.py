"""The PTX builder: kernels are Python functions that emit PTX, one call per instruction."""

from . import sreg
from .builder import KernelBuilder, Label, LaunchShape, Param, SharedBuffer, TensorMap
from .operands import Address, NegPred, Reg, Special, Vector, addr, vec

__all__ = [
    "KernelBuilder", "Label", "LaunchShape", "Param", "SharedBuffer", "TensorMap", "Address", "NegPred", "Reg", "Special",
    "Vector", "addr", "vec", "sreg",
]
