"""Running assembled kernels: the CUDA driver, modules loaded per device, TMA descriptors,
and launches bound by parameter name.

    module = compiled.load(device_index)          # jit.CompiledKernel -> LoadedModule
    launch = module.launcher(compiled.launch)     # a Launcher for the kernel's LaunchShape
    launch(grid, stream, x=x_ptr, rows=m)         # per call: a few microseconds

Imports run one way: ``jit`` (assemble, cache) uses this package to load cubins and for the
driver's PTX JIT; nothing here imports ``jit`` (the knobs come from ``ptxforge.settings``).
"""

from .driver import CudaError
from .launch import Launcher
from .module import LoadedModule
from .tensormap import encode_tiled

__all__ = ["CudaError", "Launcher", "LoadedModule", "encode_tiled"]
