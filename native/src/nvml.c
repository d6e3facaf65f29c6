/* NVML memory queries, virtualised like cuMemGetInfo: a device of the container reports
 * total = min(limit, physical) and the container's usage, so nvidia-smi, pynvml and frameworks
 * see the same slice the driver wrappers enforce. Devices outside the region pass through. */
#include "vgpu.h"

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    nvmlDeviceGetMemoryInfo_fn real = REAL(nvmlDeviceGetMemoryInfo);
    if (real == NULL) return NVML_ERROR_NOT_SUPPORTED;
    nvmlReturn_t rc = real(device, memory);
    int idx = rc == NVML_SUCCESS ? vgpu_nvml_device_index(device) : -1;
    if (idx < 0) return rc;
    uint64_t t = 0, f = 0, u = 0;
    vgpu_mem_view(idx, memory->total, &t, &f, &u);
    memory->total = t;
    memory->free = f;
    memory->used = u;
    return rc;
}

HAMI_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    nvmlDeviceGetMemoryInfo_v2_fn real = REAL(nvmlDeviceGetMemoryInfo_v2);
    if (real == NULL) return NVML_ERROR_NOT_SUPPORTED;
    nvmlReturn_t rc = real(device, memory);
    int idx = rc == NVML_SUCCESS ? vgpu_nvml_device_index(device) : -1;
    if (idx < 0) return rc;
    uint64_t t = 0, f = 0, u = 0;
    vgpu_mem_view(idx, memory->total, &t, &f, &u);
    memory->total = t;
    memory->reserved = 0;
    memory->free = f;
    memory->used = u;
    return rc;
}
