"""The CUDA driver API through ctypes: just what the probes need, nothing compiled.

Loaded by name (``libcuda.so.1``), so under ``LD_PRELOAD=libvgpu.so`` every hooked function
resolves to the interposer's wrapper by its ``dlsym`` path, as it does for any Python framework.
The same module runs over the real driver (tests/gpu) and over native/'s fake driver
(tests/native/test_gpu_harness.py, which keeps this harness honest in CI).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Final

CUDA_SUCCESS: Final = 0
CUDA_ERROR_OUT_OF_MEMORY: Final = 2
ATTR_MULTIPROCESSOR_COUNT: Final = 16
ATTR_COOPERATIVE_LAUNCH: Final = 95
MEM_ATTACH_GLOBAL: Final = 1
ARRAY_FORMAT_FLOAT: Final = 0x20
MEM_ALLOCATION_TYPE_PINNED: Final = 1
MEM_LOCATION_TYPE_DEVICE: Final = 1
STREAM_CAPTURE_MODE_GLOBAL: Final = 0

# A kernel that does `iters` dependent FMAs per thread (work, not time: under time-slicing a
# clock-spinning kernel would finish on schedule whatever its share), and an empty one whose
# launches cost only the launch. PTX 7.0 for sm_70 is JIT-compiled by any newer driver.
PTX: Final = b"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry work(.param .u32 iters, .param .u64 out)
{
    .reg .pred p;
    .reg .b32 i, n;
    .reg .f32 x;
    .reg .b64 o;
    ld.param.u32 n, [iters];
    ld.param.u64 o, [out];
    mov.u32 i, 0;
    mov.f32 x, 0f3F800000;
LOOP:
    fma.rn.f32 x, x, 0f3F7FFFFF, 0f3A800000;
    add.u32 i, i, 1;
    setp.lt.u32 p, i, n;
    @p bra LOOP;
    setp.eq.u64 p, o, 0;
    @p bra DONE;
    st.global.f32 [o], x;
DONE:
    ret;
}

.visible .entry empty()
{
    ret;
}
"""


class CudaError(RuntimeError):
    """A driver call that did not return CUDA_SUCCESS."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call}: {name} ({code})")
        self.call = call
        self.code = code
        self.name = name

    @property
    def out_of_memory(self) -> bool:
        return self.code == CUDA_ERROR_OUT_OF_MEMORY


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", ctypes.c_ubyte * 8),
    ]


class _ArrayDescriptor(ctypes.Structure):
    _fields_ = [
        ("Width", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
        ("Format", ctypes.c_int),
        ("NumChannels", ctypes.c_uint),
    ]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p),
        ("numAttrs", ctypes.c_uint),
    ]


@dataclass(frozen=True)
class Allocation:
    """One live allocation: how to free it."""

    kind: str
    handle: int


class Driver:
    """The primary context of one device, made current on this thread."""

    def __init__(self, device: int = 0) -> None:
        self.lib: Any = ctypes.CDLL("libcuda.so.1")
        self._check("cuInit", self.lib.cuInit(0))
        dev = ctypes.c_int()
        self._check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(dev), device))
        self.device = dev.value
        ctx = ctypes.c_void_p()
        self._check("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        self._check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(ctx))
        self._module: ctypes.c_void_p | None = None

    def _check(self, call: str, code: int) -> None:
        if code != CUDA_SUCCESS:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(text))
            raise CudaError(call, code, (text.value or b"?").decode())

    # ---- the device

    def attribute(self, attribute: int) -> int:
        value = ctypes.c_int()
        self._check(
            "cuDeviceGetAttribute", self.lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, self.device)
        )
        return value.value

    def mem_info(self) -> tuple[int, int]:
        """(free, total) in bytes, as cuMemGetInfo answers."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check("cuMemGetInfo_v2", self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
        return free.value, total.value

    def total_mem(self) -> int:
        total = ctypes.c_size_t()
        self._check("cuDeviceTotalMem_v2", self.lib.cuDeviceTotalMem_v2(ctypes.byref(total), self.device))
        return total.value

    def synchronize(self) -> None:
        self._check("cuCtxSynchronize", self.lib.cuCtxSynchronize())

    # ---- allocation paths

    def allocate(self, path: str, nbytes: int) -> Allocation:
        """`nbytes` by one of the driver's allocation paths (see ALLOCATION_PATHS)."""
        if path == "array":
            return self._array(nbytes)
        if path == "vmm":
            return self._vmm(nbytes)
        ptr = ctypes.c_uint64()
        size = ctypes.c_size_t(nbytes)
        if path == "malloc":
            self._check("cuMemAlloc_v2", self.lib.cuMemAlloc_v2(ctypes.byref(ptr), size))
        elif path == "managed":
            self._check(
                "cuMemAllocManaged", self.lib.cuMemAllocManaged(ctypes.byref(ptr), size, MEM_ATTACH_GLOBAL)
            )
        elif path == "async":
            self._check("cuMemAllocAsync", self.lib.cuMemAllocAsync(ctypes.byref(ptr), size, None))
            self.synchronize()
        elif path == "pitch":
            pitch = ctypes.c_size_t()
            width = 1 << 20
            self._check(
                "cuMemAllocPitch_v2",
                self.lib.cuMemAllocPitch_v2(
                    ctypes.byref(ptr),
                    ctypes.byref(pitch),
                    ctypes.c_size_t(width),
                    ctypes.c_size_t(nbytes // width),
                    16,
                ),
            )
        else:
            raise ValueError(f"unknown allocation path {path!r}")
        return Allocation("async" if path == "async" else "ptr", ptr.value)

    def _array(self, nbytes: int) -> Allocation:
        texel = 16  # 4 float channels
        width = 16384
        desc = _ArrayDescriptor(width, max(1, nbytes // (width * texel)), ARRAY_FORMAT_FLOAT, 4)
        handle = ctypes.c_void_p()
        self._check("cuArrayCreate_v2", self.lib.cuArrayCreate_v2(ctypes.byref(handle), ctypes.byref(desc)))
        return Allocation("array", handle.value or 0)

    def _vmm(self, nbytes: int) -> Allocation:
        prop = _AllocationProp()
        prop.type = MEM_ALLOCATION_TYPE_PINNED
        prop.location = _Location(MEM_LOCATION_TYPE_DEVICE, self.device)
        handle = ctypes.c_uint64()
        self._check(
            "cuMemCreate",
            self.lib.cuMemCreate(
                ctypes.byref(handle), ctypes.c_size_t(nbytes), ctypes.byref(prop), ctypes.c_uint64(0)
            ),
        )
        return Allocation("vmm", handle.value)

    def free(self, allocation: Allocation) -> None:
        handle = allocation.handle
        if allocation.kind == "array":
            self._check("cuArrayDestroy", self.lib.cuArrayDestroy(ctypes.c_void_p(handle)))
        elif allocation.kind == "vmm":
            self._check("cuMemRelease", self.lib.cuMemRelease(ctypes.c_uint64(handle)))
        elif allocation.kind == "async":
            self._check("cuMemFreeAsync", self.lib.cuMemFreeAsync(ctypes.c_uint64(handle), None))
            self.synchronize()
        else:
            self._check("cuMemFree_v2", self.lib.cuMemFree_v2(ctypes.c_uint64(handle)))

    # ---- kernels

    def function(self, name: str) -> ctypes.c_void_p:
        if self._module is None:
            module = ctypes.c_void_p()
            self._check("cuModuleLoadData", self.lib.cuModuleLoadData(ctypes.byref(module), PTX))
            self._module = module
        func = ctypes.c_void_p()
        self._check(
            "cuModuleGetFunction",
            self.lib.cuModuleGetFunction(ctypes.byref(func), self._module, name.encode()),
        )
        return func

    def stream(self) -> ctypes.c_void_p:
        stream = ctypes.c_void_p()
        self._check("cuStreamCreate", self.lib.cuStreamCreate(ctypes.byref(stream), 0))
        return stream

    def stream_synchronize(self, stream: ctypes.c_void_p) -> None:
        self._check("cuStreamSynchronize", self.lib.cuStreamSynchronize(stream))

    def launch(
        self,
        func: ctypes.c_void_p,
        grid: int,
        block: int,
        params: ctypes.Array[ctypes.c_void_p] | None,
        stream: ctypes.c_void_p | None = None,
        how: str = "plain",
    ) -> None:
        """One launch by `how`: plain (cuLaunchKernel), ex (cuLaunchKernelEx) or coop
        (cuLaunchCooperativeKernel)."""
        if how == "ex":
            config = _LaunchConfig(grid, 1, 1, block, 1, 1, 0, stream, None, 0)
            self._check(
                "cuLaunchKernelEx", self.lib.cuLaunchKernelEx(ctypes.byref(config), func, params, None)
            )
        elif how == "coop":
            self._check(
                "cuLaunchCooperativeKernel",
                self.lib.cuLaunchCooperativeKernel(func, grid, 1, 1, block, 1, 1, 0, stream, params),
            )
        else:
            self._check(
                "cuLaunchKernel",
                self.lib.cuLaunchKernel(func, grid, 1, 1, block, 1, 1, 0, stream, params, None),
            )

    def capture_graph(self, stream: ctypes.c_void_p, record: Any) -> ctypes.c_void_p:
        """An instantiated graph of what `record()` launches on `stream`."""
        self._check(
            "cuStreamBeginCapture_v2", self.lib.cuStreamBeginCapture_v2(stream, STREAM_CAPTURE_MODE_GLOBAL)
        )
        record()
        graph = ctypes.c_void_p()
        self._check("cuStreamEndCapture", self.lib.cuStreamEndCapture(stream, ctypes.byref(graph)))
        executable = ctypes.c_void_p()
        self._check(
            "cuGraphInstantiateWithFlags",
            self.lib.cuGraphInstantiateWithFlags(ctypes.byref(executable), graph, ctypes.c_uint64(0)),
        )
        return executable

    def graph_launch(self, executable: ctypes.c_void_p, stream: ctypes.c_void_p) -> None:
        self._check("cuGraphLaunch", self.lib.cuGraphLaunch(executable, stream))


ALLOCATION_PATHS: Final = ("malloc", "pitch", "managed", "async", "vmm", "array")
"""The driver's allocation paths the probe drives (the runtime's and frameworks' go through
these: cudaMalloc is cuMemAlloc, cudaMallocAsync and pools are cuMemAlloc[FromPool]Async...)."""


def kernel_params(*values: ctypes.c_uint32 | ctypes.c_uint64) -> ctypes.Array[ctypes.c_void_p]:
    """cuLaunchKernel's `kernelParams`: an array of pointers to each argument (kept alive by the
    returned array's `_keep`)."""
    array = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values))
    array._keep = values  # type: ignore[attr-defined]
    return array
