/* Internal interface of libvgpu.so (not installed; everything here is hidden). */
#ifndef HAMIPY_VGPU_H
#define HAMIPY_VGPU_H

#include <stdint.h>

#include "cuda_types.h"
#include "hamipy/export.h"
#include "hamipy/region.h"
#include "nvml_types.h"

/* ---- logging (log.c): LIBCUDA_LOG_LEVEL 0 silent, 1 error, 2 warn (default), 3 info, 4 debug */
enum { VGPU_ERROR = 1, VGPU_WARN = 2, VGPU_INFO = 3, VGPU_DEBUG = 4 };
void vgpu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define LOGE(...) vgpu_log(VGPU_ERROR, __VA_ARGS__)
#define LOGW(...) vgpu_log(VGPU_WARN, __VA_ARGS__)
#define LOGI(...) vgpu_log(VGPU_INFO, __VA_ARGS__)
#define LOGD(...) vgpu_log(VGPU_DEBUG, __VA_ARGS__)

/* ---- settings (settings.c): the limits file beside the library, or else the environment */
/* The limits file's name in the directory libvgpu.so was loaded from (hamipy.protocol's LIMITS_FILE). */
#define HAMI_LIMITS_FILE "limits"
/* A setting's value (NULL: unset): from the limits file while it exists, else getenv(name). */
const char *vgpu_setting(const char *name);
/* The limits file exists but could not be read whole: every memory limit is 1 byte. */
int vgpu_settings_broken(void);
/* The settings come from the limits file. */
int vgpu_settings_from_file(void);

/* ---- environment (env.c) */
int vgpu_parse_bytes(const char *text, uint64_t *out);
/* Limits for every device from CUDA_DEVICE_MEMORY_LIMIT[_n] / CUDA_DEVICE_SM_LIMIT[_n] (vgpu_setting),
 * parsed once. */
void vgpu_env_limits(uint64_t mem[HAMI_MAX_DEVICES], uint64_t sm[HAMI_MAX_DEVICES]);
int vgpu_env_priority(void);

/* ---- real entry points (hooks.c) */
enum vgpu_fn_id {
#define HOOK_CU(n, b, v, p) VGPU_FN_##n,
#define HOOK_NVML(n) VGPU_FN_##n,
#include "hamipy/hooks.def"
#undef HOOK_CU
#undef HOOK_NVML
    VGPU_HOOK_COUNT,
#define AUX_CU(n) VGPU_FN_##n,
#define AUX_NVML(n) VGPU_FN_##n,
#include "aux.def"
#undef AUX_CU
#undef AUX_NVML
    VGPU_FN_COUNT
};

#define HOOK_CU(n, b, v, p) typedef __typeof__(&n) n##_fn;
#define HOOK_NVML(n) typedef __typeof__(&n) n##_fn;
#include "hamipy/hooks.def"
#undef HOOK_CU
#undef HOOK_NVML
#define AUX_CU(n) typedef __typeof__(&n) n##_fn;
#define AUX_NVML(n) typedef __typeof__(&n) n##_fn;
#include "aux.def"
#undef AUX_CU
#undef AUX_NVML

/* The driver's (or NVML's) own function, or NULL when the library lacks it. */
void *vgpu_real(enum vgpu_fn_id id);
#define REAL(n) ((n##_fn)vgpu_real(VGPU_FN_##n))

/* ---- region (region.c) */
enum vgpu_charge { VGPU_CHARGE_DATA, VGPU_CHARGE_CONTEXT };
/* Region index of a CUDA device, or -1. */
int vgpu_cuda_device_index(CUdevice dev);
/* Region index of the current context's device, or -1 (no context). */
int vgpu_current_index(void);
/* Region index of an NVML device, or -1. */
int vgpu_nvml_device_index(nvmlDevice_t dev);
/* Reserve bytes on a region device for this process; enforce=0 charges without a limit check.
 * Returns 0, or -1 when the container's usage would pass the limit. */
int vgpu_reserve(int idx, uint64_t bytes, enum vgpu_charge kind, int enforce);
/* Give back bytes (clamped at zero: never underflows). */
void vgpu_release(int idx, uint64_t bytes, enum vgpu_charge kind);
/* The virtual memory view of a device: total = min(limit, physical), used = container usage,
 * free = total - used (0 when used > total). */
void vgpu_mem_view(int idx, uint64_t physical, uint64_t *total, uint64_t *free, uint64_t *used);
/* Device-wide used memory as NVML sees it (for context footprints); 0 when unknown. */
uint64_t vgpu_nvml_used(int idx);
/* NVML handle of a region device, or NULL (no NVML, or the device is not there). */
nvmlDevice_t vgpu_nvml_handle(int idx);

/* For compute limiting (launch.c). The mapped region (shared, or this process's private one). */
struct hami_region *vgpu_region_map(void);
/* Takes this process's slot if it has none yet, so the container's process list includes it. */
void vgpu_region_join(void);
/* The container's live processes as NVML numbers them (hostpid, or pid where hostpid is 0);
 * *own is the index of this process in pids, or -1. Returns how many. */
int vgpu_container_pids(int *pids, int max, int *own);
/* Publishes this process's SM utilization of a device (device_util[idx].sm_util). */
void vgpu_set_sm_util(int idx, uint64_t percent);
/* Learning this process's host pid: NVML's compute processes on the device before and after the
 * process creates a context; a single new one is this process. */
#define VGPU_PROBE_PIDS 256
struct vgpu_pidprobe {
    int count; /* -1: nothing to learn */
    unsigned pids[VGPU_PROBE_PIDS];
};
void vgpu_pidprobe_begin(int idx, struct vgpu_pidprobe *probe);
void vgpu_pidprobe_end(int idx, const struct vgpu_pidprobe *probe);

/* ---- allocation records (track.c) */
enum vgpu_kind { VGPU_PTR = 1, VGPU_ARRAY, VGPU_MIPMAP, VGPU_HANDLE };
struct vgpu_record {
    int idx;
    uint64_t bytes;
    CUcontext ctx;
};
void vgpu_track_add(enum vgpu_kind kind, uint64_t key, const struct vgpu_record *rec);
int vgpu_track_remove(enum vgpu_kind kind, uint64_t key, struct vgpu_record *out);
/* Drop every record of a context (the driver freed them with it); returns bytes per index. */
void vgpu_track_drop_context(CUcontext ctx, uint64_t freed[HAMI_MAX_DEVICES]);
void vgpu_track_reset_after_fork(void);

#endif
