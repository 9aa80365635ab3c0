"""A kernel's cubin loaded on a device, and its launchers."""

from __future__ import annotations

from .. import arch
from .driver import ContextScope, bindings, call, primary_context
from .launch import Launcher


class LoadedModule:
    """A cubin loaded into one device's primary context, with its single entry function."""

    def __init__(self, cubin: bytes, entry: str, device_index: int, params, target: str):
        self.device_index = device_index
        with ContextScope(device_index):
            self.module = call("cuModuleLoadData", cubin)
            self.function = call("cuModuleGetFunction", self.module, entry.encode())
        self._attr = bindings().CUfunction_attribute
        self._params, self._entry = params, entry
        # A function's limit until raised by attribute: launches under it need no driver call.
        self._dynamic_shared_limit = arch.get(target).default_shared_memory_per_block

    def attribute(self, name: str) -> int:
        return call("cuFuncGetAttribute", getattr(self._attr, name), self.function)

    def launcher(self, shape) -> Launcher:
        """A launcher for ``shape`` (a ``LaunchShape``), raising the shared-memory limit if
        it needs to."""
        self.allow_dynamic_shared(shape.shared_bytes)
        return Launcher(self.function, self._params, self._entry, shape,
                        context=primary_context(self.device_index))

    def max_active_clusters(self, shape) -> int:
        """How many clusters of ``shape.cluster`` CTAs can run at once on the device: SMs of
        a GPC that cannot hold a whole cluster stay out, so this can be less than SMs /
        cluster."""
        cu = bindings()
        self.allow_dynamic_shared(shape.shared_bytes)
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = shape.cluster, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = shape.block, 1, 1
        config.sharedMemBytes = shape.shared_bytes
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = shape.cluster, 1, 1
        config.attrs, config.numAttrs = [attr], 1
        with ContextScope(self.device_index):
            return call("cuOccupancyMaxActiveClusters", self.function, config)

    def allow_dynamic_shared(self, nbytes: int) -> None:
        """Raise the function's dynamic shared-memory limit (needed above the target's
        ``default_shared_memory_per_block``)."""
        if nbytes > self._dynamic_shared_limit:
            call("cuFuncSetAttribute", self.function,
                 self._attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
            self._dynamic_shared_limit = nbytes
