/* The accounting wrappers: every allocation path reserves in the region before the driver is
 * called (so a refused request allocates nothing and two processes cannot both pass the limit),
 * and gives the reservation back if the driver fails. Frees always reach the driver; only what
 * this process recorded is given back. Memory queries report the container's view. */
#include <pthread.h>
#include <string.h>

#include "vgpu.h"

#define PITCH_ALIGN 512

static CUcontext current_ctx(void) {
    CUcontext ctx = NULL;
    if (REAL(cuCtxGetCurrent) != NULL && REAL(cuCtxGetCurrent)(&ctx) != CUDA_SUCCESS) ctx = NULL;
    return ctx;
}

static uint64_t mul3(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t ab = 0, abc = 0;
    if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc)) return UINT64_MAX;
    return abc;
}

/* After the driver answered an allocation: record it, or give the reservation back. */
static void settle(CUresult rc, enum vgpu_kind kind, uint64_t key, int idx, uint64_t bytes, CUcontext ctx) {
    if (rc != CUDA_SUCCESS) {
        vgpu_release(idx, bytes, VGPU_CHARGE_DATA);
        return;
    }
    if (idx < 0) return;
    struct vgpu_record rec = {.idx = idx, .bytes = bytes, .ctx = ctx};
    vgpu_track_add(kind, key, &rec);
    LOGD("device %d: +%llu bytes (%p)", idx, (unsigned long long)bytes, (void *)(uintptr_t)key);
}

/* After the driver answered a free of something we may have recorded (removed beforehand, so a
 * concurrent allocation that gets the same address back is not mistaken for it). */
static void after_free(CUresult rc, int known, enum vgpu_kind kind, uint64_t key, const struct vgpu_record *rec) {
    if (!known) return;
    if (rc == CUDA_SUCCESS) {
        vgpu_release(rec->idx, rec->bytes, VGPU_CHARGE_DATA);
        LOGD("device %d: -%llu bytes (%p)", rec->idx, (unsigned long long)rec->bytes, (void *)(uintptr_t)key);
    } else {
        vgpu_track_add(kind, key, rec);
    }
}

#define REFUSE_IF_OVER(idx, bytes) \
    if (vgpu_reserve((idx), (bytes), VGPU_CHARGE_DATA, 1) != 0) return CUDA_ERROR_OUT_OF_MEMORY

HAMI_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    cuMemAlloc_v2_fn real = REAL(cuMemAlloc_v2);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int idx = vgpu_current_index();
    REFUSE_IF_OVER(idx, bytesize);
    CUresult rc = real(dptr, bytesize);
    settle(rc, VGPU_PTR, rc == CUDA_SUCCESS ? *dptr : 0, idx, bytesize, current_ctx());
    return rc;
}

HAMI_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t widthInBytes, size_t height,
                                        unsigned int elementSizeBytes) {
    cuMemAllocPitch_v2_fn real = REAL(cuMemAllocPitch_v2);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int idx = vgpu_current_index();
    /* The pitch is the driver's choice: reserve for the usual alignment, then settle on the real one. */
    uint64_t row = widthInBytes > UINT64_MAX - PITCH_ALIGN ? UINT64_MAX : (widthInBytes + PITCH_ALIGN - 1) / PITCH_ALIGN * PITCH_ALIGN;
    uint64_t estimate = mul3(row, height, 1);
    REFUSE_IF_OVER(idx, estimate);
    CUresult rc = real(dptr, pPitch, widthInBytes, height, elementSizeBytes);
    if (rc != CUDA_SUCCESS) {
        vgpu_release(idx, estimate, VGPU_CHARGE_DATA);
        return rc;
    }
    uint64_t actual = mul3(*pPitch, height, 1);
    if (actual > estimate && vgpu_reserve(idx, actual - estimate, VGPU_CHARGE_DATA, 1) != 0) {
        if (REAL(cuMemFree_v2) != NULL) REAL(cuMemFree_v2)(*dptr);
        vgpu_release(idx, estimate, VGPU_CHARGE_DATA);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < estimate) vgpu_release(idx, estimate - actual, VGPU_CHARGE_DATA);
    settle(rc, VGPU_PTR, *dptr, idx, actual, current_ctx());
    return rc;
}

HAMI_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    cuMemAllocManaged_fn real = REAL(cuMemAllocManaged);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int idx = vgpu_current_index();
    REFUSE_IF_OVER(idx, bytesize);
    CUresult rc = real(dptr, bytesize, flags);
    settle(rc, VGPU_PTR, rc == CUDA_SUCCESS ? *dptr : 0, idx, bytesize, current_ctx());
    return rc;
}

#define ALLOC_ASYNC(name)                                                                     \
    HAMI_EXPORT CUresult name(CUdeviceptr *dptr, size_t bytesize, CUstream stream) {          \
        name##_fn real = REAL(name);                                                          \
        if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;                                    \
        int idx = vgpu_current_index();                                                       \
        REFUSE_IF_OVER(idx, bytesize);                                                        \
        CUresult rc = real(dptr, bytesize, stream);                                           \
        settle(rc, VGPU_PTR, rc == CUDA_SUCCESS ? *dptr : 0, idx, bytesize, current_ctx());   \
        return rc;                                                                            \
    }
ALLOC_ASYNC(cuMemAllocAsync)
ALLOC_ASYNC(cuMemAllocAsync_ptsz)

#define ALLOC_FROM_POOL(name)                                                                           \
    HAMI_EXPORT CUresult name(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream) { \
        name##_fn real = REAL(name);                                                                    \
        if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;                                              \
        int idx = vgpu_current_index();                                                                 \
        REFUSE_IF_OVER(idx, bytesize);                                                                  \
        CUresult rc = real(dptr, bytesize, pool, stream);                                               \
        settle(rc, VGPU_PTR, rc == CUDA_SUCCESS ? *dptr : 0, idx, bytesize, current_ctx());             \
        return rc;                                                                                      \
    }
ALLOC_FROM_POOL(cuMemAllocFromPoolAsync)
ALLOC_FROM_POOL(cuMemAllocFromPoolAsync_ptsz)

HAMI_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    cuMemFree_v2_fn real = REAL(cuMemFree_v2);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    struct vgpu_record rec;
    int known = vgpu_track_remove(VGPU_PTR, dptr, &rec);
    CUresult rc = real(dptr);
    after_free(rc, known, VGPU_PTR, dptr, &rec);
    return rc;
}

#define FREE_ASYNC(name)                                                   \
    HAMI_EXPORT CUresult name(CUdeviceptr dptr, CUstream stream) {         \
        name##_fn real = REAL(name);                                       \
        if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;                 \
        struct vgpu_record rec;                                            \
        int known = vgpu_track_remove(VGPU_PTR, dptr, &rec);               \
        CUresult rc = real(dptr, stream);                                  \
        after_free(rc, known, VGPU_PTR, dptr, &rec);                       \
        return rc;                                                         \
    }
FREE_ASYNC(cuMemFreeAsync)
FREE_ASYNC(cuMemFreeAsync_ptsz)

HAMI_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                 unsigned long long flags) {
    cuMemCreate_fn real = REAL(cuMemCreate);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int idx = (prop != NULL && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
                  ? vgpu_cuda_device_index(prop->location.id)
                  : -1;
    REFUSE_IF_OVER(idx, size);
    CUresult rc = real(handle, size, prop, flags);
    /* Physical allocations belong to the device, not to a context. */
    settle(rc, VGPU_HANDLE, rc == CUDA_SUCCESS ? *handle : 0, idx, size, NULL);
    return rc;
}

HAMI_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    cuMemRelease_fn real = REAL(cuMemRelease);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    struct vgpu_record rec;
    int known = vgpu_track_remove(VGPU_HANDLE, handle, &rec);
    CUresult rc = real(handle);
    after_free(rc, known, VGPU_HANDLE, handle, &rec);
    return rc;
}

/* ---- arrays: bytes = width * height * depth * channels * element size, summed over mip levels */

static uint64_t element_bytes(CUarray_format format) {
    switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32: case CU_AD_FORMAT_SIGNED_INT32: case CU_AD_FORMAT_FLOAT: return 4;
    default: return 16; /* formats we do not model are over-counted, never under-counted */
    }
}

static uint64_t array_bytes(uint64_t w, uint64_t h, uint64_t d, CUarray_format format, unsigned channels,
                            unsigned flags, unsigned levels) {
    uint64_t sum = 0;
    if (levels == 0) levels = 1;
    for (unsigned l = 0; l < levels && l < 64; l++) {
        uint64_t lw = w >> l ? w >> l : 1, lh = h >> l ? h >> l : 1;
        uint64_t ld = (flags & CUDA_ARRAY3D_LAYERED) ? (d ? d : 1) : (d >> l ? d >> l : 1);
        uint64_t level = mul3(mul3(lw, lh, ld), channels, element_bytes(format));
        if (__builtin_add_overflow(sum, level, &sum)) return UINT64_MAX;
    }
    return sum;
}

HAMI_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc) {
    cuArrayCreate_v2_fn real = REAL(cuArrayCreate_v2);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    if (desc == NULL) return real(pHandle, desc);
    int idx = vgpu_current_index();
    uint64_t bytes = array_bytes(desc->Width, desc->Height, 1, desc->Format, desc->NumChannels, 0, 1);
    REFUSE_IF_OVER(idx, bytes);
    CUresult rc = real(pHandle, desc);
    settle(rc, VGPU_ARRAY, rc == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*pHandle : 0, idx, bytes, current_ctx());
    return rc;
}

HAMI_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    cuArray3DCreate_v2_fn real = REAL(cuArray3DCreate_v2);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    if (desc == NULL) return real(pHandle, desc);
    int idx = vgpu_current_index();
    uint64_t bytes = array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels, desc->Flags, 1);
    REFUSE_IF_OVER(idx, bytes);
    CUresult rc = real(pHandle, desc);
    settle(rc, VGPU_ARRAY, rc == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*pHandle : 0, idx, bytes, current_ctx());
    return rc;
}

HAMI_EXPORT CUresult cuArrayDestroy(CUarray array) {
    cuArrayDestroy_fn real = REAL(cuArrayDestroy);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    struct vgpu_record rec;
    int known = vgpu_track_remove(VGPU_ARRAY, (uint64_t)(uintptr_t)array, &rec);
    CUresult rc = real(array);
    after_free(rc, known, VGPU_ARRAY, (uint64_t)(uintptr_t)array, &rec);
    return rc;
}

HAMI_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                            unsigned int numMipmapLevels) {
    cuMipmappedArrayCreate_fn real = REAL(cuMipmappedArrayCreate);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    if (desc == NULL) return real(pHandle, desc, numMipmapLevels);
    int idx = vgpu_current_index();
    uint64_t bytes = array_bytes(desc->Width, desc->Height, desc->Depth, desc->Format, desc->NumChannels, desc->Flags,
                                 numMipmapLevels);
    REFUSE_IF_OVER(idx, bytes);
    CUresult rc = real(pHandle, desc, numMipmapLevels);
    settle(rc, VGPU_MIPMAP, rc == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*pHandle : 0, idx, bytes, current_ctx());
    return rc;
}

HAMI_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray array) {
    cuMipmappedArrayDestroy_fn real = REAL(cuMipmappedArrayDestroy);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    struct vgpu_record rec;
    int known = vgpu_track_remove(VGPU_MIPMAP, (uint64_t)(uintptr_t)array, &rec);
    CUresult rc = real(array);
    after_free(rc, known, VGPU_MIPMAP, (uint64_t)(uintptr_t)array, &rec);
    return rc;
}

/* ---- memory queries */

HAMI_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
    cuMemGetInfo_v2_fn real = REAL(cuMemGetInfo_v2);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real(free, total);
    int idx = rc == CUDA_SUCCESS ? vgpu_current_index() : -1;
    if (idx < 0) return rc;
    uint64_t t = 0, f = 0, u = 0;
    vgpu_mem_view(idx, *total, &t, &f, &u);
    *total = t;
    *free = f;
    return rc;
}

HAMI_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    cuDeviceTotalMem_v2_fn real = REAL(cuDeviceTotalMem_v2);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real(bytes, dev);
    int idx = rc == CUDA_SUCCESS ? vgpu_cuda_device_index(dev) : -1;
    if (idx < 0) return rc;
    uint64_t t = 0, f = 0, u = 0;
    vgpu_mem_view(idx, *bytes, &t, &f, &u);
    *bytes = t;
    return rc;
}

/* ---- contexts: each context's own footprint is charged to the device (never refused: a
 * context that does not fit leaves free at 0, and the allocations are what is refused). It is
 * measured as the change of the device's used memory (NVML) across the driver call. */

#define MAX_CONTEXTS 256
#define MAX_ORDINALS 64

static struct {
    pthread_mutex_t mu;
    struct { CUcontext ctx; int idx; uint64_t bytes; } ctxs[MAX_CONTEXTS];
    int primary_refs[MAX_ORDINALS];
    uint64_t primary_bytes[MAX_ORDINALS];
    CUcontext primary_ctx[MAX_ORDINALS];
} cx = {.mu = PTHREAD_MUTEX_INITIALIZER};

static uint64_t footprint(uint64_t before, uint64_t after) { return after > before ? after - before : 0; }

static void drop_context_records(CUcontext ctx) {
    uint64_t freed[HAMI_MAX_DEVICES];
    vgpu_track_drop_context(ctx, freed);
    for (int i = 0; i < HAMI_MAX_DEVICES; i++) vgpu_release(i, freed[i], VGPU_CHARGE_DATA);
}

static void context_created(CUcontext ctx, int idx, uint64_t bytes) {
    vgpu_reserve(idx, bytes, VGPU_CHARGE_CONTEXT, 0);
    pthread_mutex_lock(&cx.mu);
    for (int i = 0; i < MAX_CONTEXTS; i++) {
        if (cx.ctxs[i].ctx == NULL) {
            cx.ctxs[i].ctx = ctx;
            cx.ctxs[i].idx = idx;
            cx.ctxs[i].bytes = bytes;
            break;
        }
    }
    pthread_mutex_unlock(&cx.mu);
    LOGD("device %d: context %p, footprint %llu bytes", idx, (void *)ctx, (unsigned long long)bytes);
}

#define CTX_CREATE(name, params, args)                                   \
    HAMI_EXPORT CUresult name params {                                   \
        name##_fn real = REAL(name);                                     \
        if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;               \
        int idx = vgpu_cuda_device_index(dev);                           \
        struct vgpu_pidprobe probe;                                      \
        vgpu_pidprobe_begin(idx, &probe);                                \
        uint64_t before = vgpu_nvml_used(idx);                           \
        CUresult rc = real args;                                         \
        if (rc == CUDA_SUCCESS && idx >= 0) {                            \
            context_created(*pctx, idx, footprint(before, vgpu_nvml_used(idx))); \
            vgpu_pidprobe_end(idx, &probe);                              \
        }                                                                \
        return rc;                                                       \
    }
CTX_CREATE(cuCtxCreate_v2, (CUcontext * pctx, unsigned int flags, CUdevice dev), (pctx, flags, dev))
CTX_CREATE(cuCtxCreate_v3,
           (CUcontext * pctx, CUexecAffinityParam *params, int numParams, unsigned int flags, CUdevice dev),
           (pctx, params, numParams, flags, dev))
CTX_CREATE(cuCtxCreate_v4, (CUcontext * pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev),
           (pctx, params, flags, dev))

HAMI_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    cuCtxDestroy_v2_fn real = REAL(cuCtxDestroy_v2);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real(ctx);
    if (rc != CUDA_SUCCESS || ctx == NULL) return rc;
    drop_context_records(ctx);
    int idx = -1;
    uint64_t bytes = 0;
    pthread_mutex_lock(&cx.mu);
    for (int i = 0; i < MAX_CONTEXTS; i++) {
        if (cx.ctxs[i].ctx == ctx) {
            idx = cx.ctxs[i].idx;
            bytes = cx.ctxs[i].bytes;
            cx.ctxs[i].ctx = NULL;
            break;
        }
    }
    pthread_mutex_unlock(&cx.mu);
    vgpu_release(idx, bytes, VGPU_CHARGE_CONTEXT);
    return rc;
}

HAMI_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    cuDevicePrimaryCtxRetain_fn real = REAL(cuDevicePrimaryCtxRetain);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    if (dev < 0 || dev >= MAX_ORDINALS) return real(pctx, dev);
    int idx = vgpu_cuda_device_index(dev);
    pthread_mutex_lock(&cx.mu);
    int first = cx.primary_refs[dev] == 0;
    struct vgpu_pidprobe probe = {.count = -1};
    if (first) vgpu_pidprobe_begin(idx, &probe);
    uint64_t before = first ? vgpu_nvml_used(idx) : 0;
    CUresult rc = real(pctx, dev);
    uint64_t bytes = 0;
    if (rc == CUDA_SUCCESS) {
        cx.primary_refs[dev]++;
        if (first) {
            bytes = footprint(before, vgpu_nvml_used(idx));
            cx.primary_bytes[dev] = bytes;
            cx.primary_ctx[dev] = *pctx;
            vgpu_pidprobe_end(idx, &probe);
        }
    }
    pthread_mutex_unlock(&cx.mu);
    if (bytes != 0) vgpu_reserve(idx, bytes, VGPU_CHARGE_CONTEXT, 0);
    return rc;
}

/* The primary context went away (last release or reset): give back its footprint and records. */
static void primary_gone(CUdevice dev, int reset) {
    pthread_mutex_lock(&cx.mu);
    uint64_t bytes = 0;
    CUcontext ctx = NULL;
    if (cx.primary_refs[dev] > 0) cx.primary_refs[dev]--;
    if (reset) cx.primary_refs[dev] = 0;
    if (cx.primary_refs[dev] == 0) {
        bytes = cx.primary_bytes[dev];
        ctx = cx.primary_ctx[dev];
        cx.primary_bytes[dev] = 0;
        cx.primary_ctx[dev] = NULL;
    }
    pthread_mutex_unlock(&cx.mu);
    if (ctx != NULL) drop_context_records(ctx);
    vgpu_release(vgpu_cuda_device_index(dev), bytes, VGPU_CHARGE_CONTEXT);
}

HAMI_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    cuDevicePrimaryCtxRelease_v2_fn real = REAL(cuDevicePrimaryCtxRelease_v2);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real(dev);
    if (rc == CUDA_SUCCESS && dev >= 0 && dev < MAX_ORDINALS) primary_gone(dev, 0);
    return rc;
}

HAMI_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    cuDevicePrimaryCtxReset_v2_fn real = REAL(cuDevicePrimaryCtxReset_v2);
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = real(dev);
    if (rc == CUDA_SUCCESS && dev >= 0 && dev < MAX_ORDINALS) primary_gone(dev, 1);
    return rc;
}
