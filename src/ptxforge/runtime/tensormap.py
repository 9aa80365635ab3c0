"""TMA descriptors (CUtensorMap) for torch tensors, encoded once and cached.

Encoding through cuda.bindings costs about 1.6 us per map on an H200; a kernel with four
maps would spend most of its host budget re-encoding them. (Where the C launcher is built,
``native.py``, a miss is one call into it instead.) The cache key is everything the
descriptor encodes (address, shape, strides, box, swizzle), so a hit is always the same
bytes.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict

from ..arch import tma_alignment
from . import native
from .driver import bindings, call, check

_DTYPE_CODES = {  # torch dtype name -> CUtensorMapDataType name
    "float8_e4m3fn": "CU_TENSOR_MAP_DATA_TYPE_UINT8",
    "float8_e5m2": "CU_TENSOR_MAP_DATA_TYPE_UINT8",
    "uint8": "CU_TENSOR_MAP_DATA_TYPE_UINT8",
    "bfloat16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
    "float16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16",
    "float32": "CU_TENSOR_MAP_DATA_TYPE_FLOAT32",
    "int32": "CU_TENSOR_MAP_DATA_TYPE_INT32",
}
_SWIZZLE = {0: "CU_TENSOR_MAP_SWIZZLE_NONE", 32: "CU_TENSOR_MAP_SWIZZLE_32B",
            64: "CU_TENSOR_MAP_SWIZZLE_64B", 128: "CU_TENSOR_MAP_SWIZZLE_128B"}

_cache: OrderedDict = OrderedDict()
_lock = threading.Lock()
_CACHE_ENTRIES = 4096


def encode(tensor_map, address: int, shape: tuple, strides_bytes: tuple) -> bytes:
    """The descriptor a kernel's ``TensorMap`` parameter asks for, over the tensor at
    ``address`` of ``shape`` (innermost first) and byte ``strides_bytes`` (dimensions 1..)."""
    return encode_tiled(address, tensor_map.dtype, shape, strides_bytes, tensor_map.box,
                        tensor_map.swizzle)


def encode_tiled(address: int, dtype_name: str, shape: tuple, strides_bytes: tuple, box: tuple,
                 swizzle: int = 0, oob_fill_nan: bool = False) -> bytes:
    """The 128-byte descriptor of a tiled view. ``shape``/``box`` innermost first; ``strides_bytes``
    are the byte strides of dimensions 1.. (dimension 0 is contiguous)."""
    key = (address, dtype_name, shape, strides_bytes, box, swizzle, oob_fill_nan)
    with _lock:
        blob = _cache.get(key)
        if blob is not None:
            _cache.move_to_end(key)
            return blob
    encoding = driver_encoding(dtype_name, box, swizzle, oob_fill_nan)
    alignment = tma_alignment()
    if address % alignment:
        raise ValueError(f"TMA needs a {alignment}-byte aligned base address, got {address:#x}")
    if any(s % alignment for s in strides_bytes):
        raise ValueError(f"TMA needs {alignment}-byte multiple strides, got {strides_bytes}")
    cu = bindings()
    extension = native.module()
    if extension is not None:
        blob = extension.encode_tiled(address, shape, strides_bytes, encoding)
        if type(blob) is int:  # the driver's error
            check(cu, cu.CUresult(blob), "cuTensorMapEncodeTiled")
    else:
        data_type, _, swizzle_mode, l2_promotion, oob_fill, _ = encoding
        rank = len(shape)
        tmap = call(
            "cuTensorMapEncodeTiled", cu.CUtensorMapDataType(data_type), rank, address,
            [cu.cuuint64_t(s) for s in shape], [cu.cuuint64_t(s) for s in strides_bytes],
            [cu.cuuint32_t(b) for b in box], [cu.cuuint32_t(1)] * rank,
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle(swizzle_mode), cu.CUtensorMapL2promotion(l2_promotion),
            cu.CUtensorMapFloatOOBfill(oob_fill))
        blob = struct.pack("<16Q", *[int(v) for v in tmap.opaque])
    with _lock:
        _cache[key] = blob
        if len(_cache) > _CACHE_ENTRIES:
            _cache.popitem(last=False)
    return blob


def driver_encoding(dtype_name: str, box: tuple, swizzle: int = 0,
                    oob_fill_nan: bool = False) -> tuple:
    """What cuTensorMapEncodeTiled takes besides the tensor's address, shape and strides, as
    the C launcher reads it: (data type, box, swizzle, L2 promotion, OOB fill, the address and
    stride alignment TMA needs), the enums as the driver numbers them."""
    from cuda.bindings import driver as cu  # its enums: no driver needed

    if dtype_name not in _DTYPE_CODES:
        raise ValueError(f"no TMA data type for {dtype_name}; supported: {sorted(_DTYPE_CODES)}")
    oob_fill = (cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
                if oob_fill_nan else cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    return (int(getattr(cu.CUtensorMapDataType, _DTYPE_CODES[dtype_name])), tuple(box),
            int(getattr(cu.CUtensorMapSwizzle, _SWIZZLE[swizzle])),
            int(cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B), int(oob_fill),
            tma_alignment())
