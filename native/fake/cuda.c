/* A fake libcuda.so.1 for machines without a GPU.
 *
 * Implements the driver entry points the interposer hooks and the tests call, with real
 * bookkeeping: device pointers come from a per-process fake address space, every allocation is
 * charged to its device in the shared state (so a device runs out of memory like a real one and
 * NVML in other processes sees the usage), contexts own their allocations, and cuGetProcAddress
 * maps base names to versioned entry points as the real driver does. Kernels are not run, but
 * they keep the fake GPU busy for a configured time, which NVML reports as utilization. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_types.h"
#include "fake.h"
#include "hamipy/export.h"

#define ADDRESS_BASE 0x0000100000000000ULL
#define ADDRESS_SPAN 0x0000010000000000ULL /* 1 TiB of fake addresses per device */
#define ALIGN 512
#define FAKE_CAPTURES 8

struct fake_ctx {
    int dev;
    int primary;
};

enum alloc_kind { A_PTR, A_ARRAY, A_MIPMAP, A_HANDLE };

struct alloc {
    uint64_t key;
    enum alloc_kind kind;
    int dev;
    uint64_t bytes;
    struct fake_ctx *ctx;
};

static struct {
    pthread_mutex_t mu;
    int initialized;
    CUresult init_rc;
    struct fake_config cfg;
    struct fake_state *st;
    uint64_t next_address[FAKE_MAX_GPUS];
    uint64_t next_handle;
    struct alloc *allocs;
    size_t nallocs, cap;
    struct fake_ctx primary[FAKE_MAX_GPUS];
    int primary_refs[FAKE_MAX_GPUS];
    CUstream capturing[FAKE_CAPTURES];
} F = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int captured(CUstream stream);

static __thread struct fake_ctx *current;

static CUresult ready(void) { return F.initialized ? F.init_rc : CUDA_ERROR_NOT_INITIALIZED; }

#define REQUIRE_INIT()                         \
    do {                                       \
        CUresult init_rc_ = ready();           \
        if (init_rc_ != CUDA_SUCCESS) return init_rc_; \
    } while (0)

static int valid_dev(CUdevice dev) { return dev >= 0 && dev < F.cfg.count; }

/* CUDA_VISIBLE_DEVICES, as the real driver reads it: indexes, GPU UUIDs and MIG UUIDs, in the
 * listed order, up to the first index or GPU UUID that names no device. A MIG UUID is looked up
 * in the shared state (fake_mig_resolve) like a configuration's `uuid=MIG-...` line: one that
 * names no instance is left out there, and the entries after it are kept. */
static void apply_visible_devices(void) {
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    if (env == NULL) return;
    struct fake_config *picked = malloc(sizeof *picked);
    if (picked == NULL) return;
    *picked = F.cfg;
    picked->count = 0;
    char list[1024];
    snprintf(list, sizeof list, "%s", env);
    for (char *save = NULL, *item = strtok_r(list, ",", &save); item != NULL && picked->count < FAKE_MAX_GPUS;
         item = strtok_r(NULL, ",", &save)) {
        while (*item == ' ') item++;
        char *end = NULL;
        long index = strtol(item, &end, 10);
        int found = -1;
        if (strncmp(item, "MIG-", 4) == 0) {
            struct fake_gpu *gpu = &picked->gpus[picked->count];
            memset(gpu, 0, sizeof *gpu);
            snprintf(gpu->uuid, sizeof gpu->uuid, "%s", item);
            gpu->gi = gpu->ci = -1;
            picked->count++;
            continue;
        }
        for (int i = 0; i < F.cfg.count && found < 0; i++) {
            if (strcmp(F.cfg.gpus[i].uuid, item) == 0) found = i;
        }
        if (found < 0 && end != item && *end == '\0' && index >= 0 && index < F.cfg.count) found = (int)index;
        if (found < 0) break;
        picked->gpus[picked->count++] = F.cfg.gpus[found];
    }
    F.cfg.count = picked->count;
    memcpy(F.cfg.gpus, picked->gpus, sizeof F.cfg.gpus);
    free(picked);
}

HAMI_EXPORT CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&F.mu);
    if (!F.initialized) {
        F.init_rc = CUDA_SUCCESS;
        if (fake_config_load(&F.cfg) != 0) F.init_rc = CUDA_ERROR_NO_DEVICE;
        if (F.init_rc == CUDA_SUCCESS && (F.st = fake_state_attach(&F.cfg, 1)) == NULL) F.init_rc = CUDA_ERROR_NO_DEVICE;
        if (F.init_rc == CUDA_SUCCESS) {
            apply_visible_devices();
            fake_mig_resolve(&F.cfg, F.st);
        }
        for (int i = 0; i < FAKE_MAX_GPUS; i++) {
            F.next_address[i] = ADDRESS_BASE + (uint64_t)i * ADDRESS_SPAN;
            F.primary[i] = (struct fake_ctx){.dev = i, .primary = 1};
        }
        F.next_handle = 0x1000;
        F.initialized = 1;
    }
    pthread_mutex_unlock(&F.mu);
    return F.init_rc;
}

HAMI_EXPORT CUresult cuDriverGetVersion(int *version) {
    if (version == NULL) return CUDA_ERROR_INVALID_VALUE;
    struct fake_config cfg;
    *version = F.initialized ? F.cfg.cuda_version : (fake_config_load(&cfg) == 0 ? cfg.cuda_version : 12040);
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuDeviceGetCount(int *count) {
    REQUIRE_INIT();
    if (count == NULL) return CUDA_ERROR_INVALID_VALUE;
    *count = F.cfg.count;
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    REQUIRE_INIT();
    if (device == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    REQUIRE_INIT();
    if (name == NULL || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "%s", F.cfg.gpus[dev].name);
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    REQUIRE_INIT();
    if (uuid == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    unsigned char bytes[16];
    if (fake_parse_uuid(F.cfg.gpus[dev].uuid, bytes) != 0) return CUDA_ERROR_UNKNOWN;
    memcpy(uuid->bytes, bytes, 16);
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid(uuid, dev); }

/* Only the multiprocessor count (16) and cooperative launch (95) are asked for; a fixed 108 SMs. */
HAMI_EXPORT CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    REQUIRE_INIT();
    if (pi == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if (attrib == 16) *pi = 108;
    else if (attrib == 95) *pi = 1;
    else return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    REQUIRE_INIT();
    if (bytes == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = F.cfg.gpus[dev].memory;
    return CUDA_SUCCESS;
}

/* ---- allocation records (caller holds F.mu) */

static void record(uint64_t key, enum alloc_kind kind, int dev, uint64_t bytes, struct fake_ctx *ctx) {
    if (F.nallocs == F.cap) {
        size_t cap = F.cap ? F.cap * 2 : 256;
        struct alloc *grown = realloc(F.allocs, cap * sizeof *grown);
        if (grown == NULL) abort();
        F.allocs = grown;
        F.cap = cap;
    }
    F.allocs[F.nallocs++] = (struct alloc){key, kind, dev, bytes, ctx};
}

static int forget(uint64_t key, enum alloc_kind kind) {
    for (size_t i = 0; i < F.nallocs; i++) {
        if (F.allocs[i].key == key && F.allocs[i].kind == kind) {
            fake_state_uncharge(F.st, F.allocs[i].dev, F.allocs[i].bytes);
            F.allocs[i] = F.allocs[--F.nallocs];
            return 1;
        }
    }
    return 0;
}

static void forget_context(struct fake_ctx *ctx) {
    for (size_t i = 0; i < F.nallocs;) {
        if (F.allocs[i].ctx == ctx) {
            fake_state_uncharge(F.st, F.allocs[i].dev, F.allocs[i].bytes);
            F.allocs[i] = F.allocs[--F.nallocs];
        } else {
            i++;
        }
    }
}

/* Charges bytes on dev and returns a fresh key (a device address for pointers). */
static CUresult allocate(int dev, uint64_t bytes, enum alloc_kind kind, struct fake_ctx *ctx, unsigned long long *key) {
    if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&F.mu);
    CUresult rc = CUDA_SUCCESS;
    if (fake_state_charge(F.st, dev, bytes, F.cfg.gpus[dev].memory) != 0) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        if (kind == A_PTR) {
            *key = F.next_address[dev];
            F.next_address[dev] += (bytes + ALIGN - 1) / ALIGN * ALIGN;
        } else {
            *key = F.next_handle;
            F.next_handle += 0x10;
        }
        record(*key, kind, dev, bytes, ctx);
    }
    pthread_mutex_unlock(&F.mu);
    return rc;
}

static CUresult release(uint64_t key, enum alloc_kind kind) {
    REQUIRE_INIT();
    pthread_mutex_lock(&F.mu);
    int found = forget(key, kind);
    pthread_mutex_unlock(&F.mu);
    return found ? CUDA_SUCCESS : (kind == A_PTR ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_INVALID_HANDLE);
}

#define REQUIRE_CTX()                                  \
    REQUIRE_INIT();                                    \
    if (current == NULL) return CUDA_ERROR_INVALID_CONTEXT

/* ---- contexts */

static CUresult context_charge(int dev) {
    if (F.cfg.context_memory == 0) return CUDA_SUCCESS;
    pthread_mutex_lock(&F.mu);
    int rc = fake_state_charge(F.st, dev, F.cfg.context_memory, F.cfg.gpus[dev].memory);
    pthread_mutex_unlock(&F.mu);
    return rc == 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

static void context_gone(struct fake_ctx *ctx) {
    pthread_mutex_lock(&F.mu);
    forget_context(ctx);
    if (F.cfg.context_memory != 0) fake_state_uncharge(F.st, ctx->dev, F.cfg.context_memory);
    pthread_mutex_unlock(&F.mu);
    if (current == ctx) current = NULL;
}

static CUresult create_context(CUcontext *pctx, CUdevice dev) {
    REQUIRE_INIT();
    if (pctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    CUresult rc = context_charge(dev);
    if (rc != CUDA_SUCCESS) return rc;
    struct fake_ctx *ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    ctx->dev = dev;
    current = ctx;
    *pctx = (CUcontext)ctx;
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    return create_context(pctx, dev);
}

HAMI_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *params, int numParams, unsigned int flags,
                                    CUdevice dev) {
    (void)params, (void)numParams, (void)flags;
    return create_context(pctx, dev);
}

HAMI_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev) {
    (void)params, (void)flags;
    return create_context(pctx, dev);
}

HAMI_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    REQUIRE_INIT();
    struct fake_ctx *c = (struct fake_ctx *)ctx;
    if (c == NULL || c->primary) return CUDA_ERROR_INVALID_CONTEXT;
    context_gone(c);
    free(c);
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    REQUIRE_INIT();
    if (pctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    *pctx = (CUcontext)current;
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    REQUIRE_INIT();
    current = (struct fake_ctx *)ctx;
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuCtxGetDevice(CUdevice *device) {
    REQUIRE_CTX();
    if (device == NULL) return CUDA_ERROR_INVALID_VALUE;
    *device = current->dev;
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuCtxSynchronize(void) {
    REQUIRE_CTX();
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    REQUIRE_INIT();
    if (pctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if (F.primary_refs[dev] == 0) {
        CUresult rc = context_charge(dev);
        if (rc != CUDA_SUCCESS) return rc;
    }
    F.primary_refs[dev]++;
    *pctx = (CUcontext)&F.primary[dev];
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    REQUIRE_INIT();
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if (F.primary_refs[dev] == 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (--F.primary_refs[dev] == 0) context_gone(&F.primary[dev]);
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    REQUIRE_INIT();
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    if (F.primary_refs[dev] != 0) context_gone(&F.primary[dev]);
    F.primary_refs[dev] = 0;
    return CUDA_SUCCESS;
}

/* ---- memory */

HAMI_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    REQUIRE_CTX();
    if (dptr == NULL) return CUDA_ERROR_INVALID_VALUE;
    return allocate(current->dev, bytesize, A_PTR, current, dptr);
}

HAMI_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t widthInBytes, size_t height,
                                        unsigned int elementSizeBytes) {
    REQUIRE_CTX();
    if (dptr == NULL || pPitch == NULL || widthInBytes == 0 || height == 0) return CUDA_ERROR_INVALID_VALUE;
    if (elementSizeBytes != 4 && elementSizeBytes != 8 && elementSizeBytes != 16) return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (widthInBytes + ALIGN - 1) / ALIGN * ALIGN;
    CUresult rc = allocate(current->dev, (uint64_t)pitch * height, A_PTR, current, dptr);
    if (rc == CUDA_SUCCESS) *pPitch = pitch;
    return rc;
}

HAMI_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    REQUIRE_CTX();
    if (dptr == NULL || (flags != 1 && flags != 2)) return CUDA_ERROR_INVALID_VALUE;
    return allocate(current->dev, bytesize, A_PTR, current, dptr);
}

HAMI_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream) {
    (void)stream;
    REQUIRE_CTX();
    if (dptr == NULL) return CUDA_ERROR_INVALID_VALUE;
    return allocate(current->dev, bytesize, A_PTR, current, dptr);
}

HAMI_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream) {
    return cuMemAllocAsync(dptr, bytesize, stream);
}

HAMI_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream) {
    (void)pool;
    return cuMemAllocAsync(dptr, bytesize, stream);
}

HAMI_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                  CUstream stream) {
    (void)pool;
    return cuMemAllocAsync(dptr, bytesize, stream);
}

HAMI_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) { return release(dptr, A_PTR); }

HAMI_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    (void)stream;
    return release(dptr, A_PTR);
}

HAMI_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream) {
    (void)stream;
    return release(dptr, A_PTR);
}

HAMI_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                 unsigned long long flags) {
    REQUIRE_INIT();
    if (handle == NULL || prop == NULL || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_NOT_SUPPORTED;
    if (!valid_dev(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
    return allocate(prop->location.id, size, A_HANDLE, NULL, handle);
}

HAMI_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) { return release(handle, A_HANDLE); }

static uint64_t element_bytes(CUarray_format format) {
    switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8: case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16: case CU_AD_FORMAT_SIGNED_INT16: case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32: case CU_AD_FORMAT_SIGNED_INT32: case CU_AD_FORMAT_FLOAT: return 4;
    default: return 0;
    }
}

static CUresult array_size(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels, uint64_t *bytes) {
    uint64_t elem = element_bytes(d->Format);
    if (elem == 0 || d->Width == 0 || (d->NumChannels != 1 && d->NumChannels != 2 && d->NumChannels != 4))
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t sum = 0;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        uint64_t w = d->Width >> l ? d->Width >> l : 1, h = d->Height >> l ? d->Height >> l : 1;
        uint64_t z = (d->Flags & CUDA_ARRAY3D_LAYERED) ? (d->Depth ? d->Depth : 1) : (d->Depth >> l ? d->Depth >> l : 1);
        sum += w * h * z * d->NumChannels * elem;
    }
    *bytes = sum;
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc) {
    REQUIRE_CTX();
    if (pHandle == NULL || desc == NULL) return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR d = {desc->Width, desc->Height, 0, desc->Format, desc->NumChannels, 0};
    uint64_t bytes = 0;
    unsigned long long key = 0;
    CUresult rc = array_size(&d, 1, &bytes);
    if (rc == CUDA_SUCCESS) rc = allocate(current->dev, bytes, A_ARRAY, current, &key);
    if (rc == CUDA_SUCCESS) *pHandle = (CUarray)(uintptr_t)key;
    return rc;
}

HAMI_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    REQUIRE_CTX();
    if (pHandle == NULL || desc == NULL) return CUDA_ERROR_INVALID_VALUE;
    uint64_t bytes = 0;
    unsigned long long key = 0;
    CUresult rc = array_size(desc, 1, &bytes);
    if (rc == CUDA_SUCCESS) rc = allocate(current->dev, bytes, A_ARRAY, current, &key);
    if (rc == CUDA_SUCCESS) *pHandle = (CUarray)(uintptr_t)key;
    return rc;
}

HAMI_EXPORT CUresult cuArrayDestroy(CUarray array) { return release((uint64_t)(uintptr_t)array, A_ARRAY); }

HAMI_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                            unsigned int numMipmapLevels) {
    REQUIRE_CTX();
    if (pHandle == NULL || desc == NULL || numMipmapLevels == 0) return CUDA_ERROR_INVALID_VALUE;
    uint64_t bytes = 0;
    unsigned long long key = 0;
    CUresult rc = array_size(desc, numMipmapLevels, &bytes);
    if (rc == CUDA_SUCCESS) rc = allocate(current->dev, bytes, A_MIPMAP, current, &key);
    if (rc == CUDA_SUCCESS) *pHandle = (CUmipmappedArray)(uintptr_t)key;
    return rc;
}

HAMI_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray array) {
    return release((uint64_t)(uintptr_t)array, A_MIPMAP);
}

HAMI_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
    REQUIRE_CTX();
    if (free == NULL || total == NULL) return CUDA_ERROR_INVALID_VALUE;
    uint64_t physical = F.cfg.gpus[current->dev].memory, used = fake_state_used(F.st, current->dev);
    *total = physical;
    *free = used < physical ? physical - used : 0;
    return CUDA_SUCCESS;
}

/* ---- the rest */

/* ---- modules and launches: the fake GPU's time (see fake.h) */

static char fake_module, fake_function;

HAMI_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    REQUIRE_CTX();
    if (module == NULL || image == NULL) return CUDA_ERROR_INVALID_VALUE;
    *module = (CUmodule)(void *)&fake_module;
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    REQUIRE_CTX();
    if (hfunc == NULL || name == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (hmod != (CUmodule)(void *)&fake_module) return CUDA_ERROR_INVALID_HANDLE;
    *hfunc = (CUfunction)(void *)&fake_function;
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuModuleUnload(CUmodule hmod) {
    REQUIRE_INIT();
    return hmod == (CUmodule)(void *)&fake_module ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Queues ns of GPU time on the current context's device, waiting while the queue is full. */
static CUresult run(uint64_t ns) {
    if (ns == 0) return CUDA_SUCCESS;
    uint64_t wait;
    while ((wait = fake_state_launch(F.st, current->dev, ns, F.cfg.launch_queue_ns)) != 0) {
        struct timespec pause = {(time_t)(wait / 1000000000ULL), (long)(wait % 1000000000ULL)};
        nanosleep(&pause, NULL);
    }
    return CUDA_SUCCESS;
}

static CUresult run_kernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                           unsigned bz, CUstream stream) {
    REQUIRE_CTX();
    if (f == NULL) return CUDA_ERROR_INVALID_HANDLE;
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    if (stream != NULL && captured(stream)) return CUDA_SUCCESS;
    double threads = (double)gx * gy * gz * bx * by * bz;
    return run((uint64_t)(threads / 1024.0 * F.cfg.kilothread_ns));
}

HAMI_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                    unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                    unsigned int sharedMemBytes, CUstream stream, void **kernelParams, void **extra) {
    (void)sharedMemBytes, (void)kernelParams, (void)extra;
    return run_kernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, stream);
}

HAMI_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                         unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                         unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream stream,
                                         void **kernelParams, void **extra) {
    (void)sharedMemBytes, (void)kernelParams, (void)extra;
    return run_kernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, stream);
}

HAMI_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra) {
    (void)kernelParams, (void)extra;
    if (config == NULL) return CUDA_ERROR_INVALID_VALUE;
    return run_kernel(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX, config->blockDimY,
                      config->blockDimZ, config->hStream);
}

HAMI_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                           void **extra) {
    return cuLaunchKernelEx(config, f, kernelParams, extra);
}

HAMI_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                               unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                               unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream stream,
                                               void **kernelParams) {
    (void)sharedMemBytes, (void)kernelParams;
    return run_kernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, stream);
}

HAMI_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                    unsigned int gridDimZ, unsigned int blockDimX,
                                                    unsigned int blockDimY, unsigned int blockDimZ,
                                                    unsigned int sharedMemBytes, CUstream stream,
                                                    void **kernelParams) {
    (void)sharedMemBytes, (void)kernelParams;
    return run_kernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, stream);
}

/* Any captured graph instantiates to an exec handle that cuGraphLaunch runs as graph_ns. */
HAMI_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags) {
    (void)flags;
    REQUIRE_CTX();
    if (phGraphExec == NULL || hGraph == NULL) return CUDA_ERROR_INVALID_VALUE;
    *phGraphExec = (CUgraphExec)(uintptr_t)0x6c000;
    return CUDA_SUCCESS;
}

/* The exec handle is not inspected: any non-NULL one is a graph of graph_ns. */
HAMI_EXPORT CUresult cuGraphLaunch(CUgraphExec graphExec, CUstream stream) {
    (void)stream;
    REQUIRE_CTX();
    if (graphExec == NULL) return CUDA_ERROR_INVALID_VALUE;
    return run(F.cfg.graph_ns);
}

HAMI_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec graphExec, CUstream stream) {
    return cuGraphLaunch(graphExec, stream);
}

HAMI_EXPORT CUresult cuStreamCreate(CUstream *stream, unsigned int flags) {
    (void)flags;
    REQUIRE_CTX();
    if (stream == NULL) return CUDA_ERROR_INVALID_VALUE;
    *stream = (CUstream)(uintptr_t)0x5000;
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuStreamDestroy_v2(CUstream stream) {
    (void)stream;
    REQUIRE_CTX();
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuStreamSynchronize(CUstream stream) {
    (void)stream;
    REQUIRE_CTX();
    return CUDA_SUCCESS;
}

/* Stream capture: launches into a capturing stream are recorded, not run (no GPU time). */
HAMI_EXPORT CUresult cuStreamBeginCapture_v2(CUstream stream, CUstreamCaptureMode mode) {
    REQUIRE_CTX();
    if (stream == NULL || stream == (CUstream)0x1 || (unsigned)mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&F.mu);
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < FAKE_CAPTURES && rc != CUDA_SUCCESS; i++) {
        if (F.capturing[i] == NULL) {
            F.capturing[i] = stream;
            rc = CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&F.mu);
    return rc;
}

static int captured(CUstream stream) {
    int found = 0;
    pthread_mutex_lock(&F.mu);
    for (int i = 0; i < FAKE_CAPTURES; i++) found |= stream != NULL && F.capturing[i] == stream;
    pthread_mutex_unlock(&F.mu);
    return found;
}

HAMI_EXPORT CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status) {
    REQUIRE_CTX();
    if (status == NULL) return CUDA_ERROR_INVALID_VALUE;
    *status = captured(stream) ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuStreamEndCapture(CUstream stream, CUgraph *graph) {
    REQUIRE_CTX();
    if (graph == NULL) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&F.mu);
    for (int i = 0; i < FAKE_CAPTURES; i++) {
        if (stream != NULL && F.capturing[i] == stream) {
            F.capturing[i] = NULL;
            rc = CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&F.mu);
    if (rc == CUDA_SUCCESS) *graph = (CUgraph)(uintptr_t)0x6b000;
    return rc;
}

HAMI_EXPORT CUresult cuGetErrorName(CUresult error, const char **str) {
    if (str == NULL) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS: *str = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *str = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *str = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *str = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_NO_DEVICE: *str = "CUDA_ERROR_NO_DEVICE"; break;
    case CUDA_ERROR_INVALID_DEVICE: *str = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *str = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_INVALID_HANDLE: *str = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_NOT_FOUND: *str = "CUDA_ERROR_NOT_FOUND"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *str = "CUDA_ERROR_NOT_SUPPORTED"; break;
    case CUDA_ERROR_DEINITIALIZED: case CUDA_ERROR_UNKNOWN: default: *str = "CUDA_ERROR_UNKNOWN"; break;
    }
    return CUDA_SUCCESS;
}

HAMI_EXPORT CUresult cuGetErrorString(CUresult error, const char **str) { return cuGetErrorName(error, str); }

/* Test hook, not part of CUDA: allocates on a device behind the interposer's back, standing for
 * memory allocated before the interposer was loaded. Returns the address, 0 on failure. */
HAMI_EXPORT CUdeviceptr fakecuda_alloc_unseen(int dev, size_t bytes);
HAMI_EXPORT CUdeviceptr fakecuda_alloc_unseen(int dev, size_t bytes) {
    unsigned long long key = 0;
    if (ready() != CUDA_SUCCESS || !valid_dev(dev)) return 0;
    return allocate(dev, bytes, A_PTR, NULL, &key) == CUDA_SUCCESS ? key : 0;
}

/* Test hook: bytes this process holds on a device according to the fake driver. */
HAMI_EXPORT unsigned long long fakecuda_process_used(int dev);
HAMI_EXPORT unsigned long long fakecuda_process_used(int dev) {
    unsigned long long sum = 0;
    pthread_mutex_lock(&F.mu);
    for (size_t i = 0; i < F.nallocs; i++) {
        if (F.allocs[i].dev == dev) sum += F.allocs[i].bytes;
    }
    pthread_mutex_unlock(&F.mu);
    return sum;
}

/* Test hook: GPU time this process's launches on a device have executed by now (ns). */
HAMI_EXPORT unsigned long long fakecuda_executed_ns(int dev);
HAMI_EXPORT unsigned long long fakecuda_executed_ns(int dev) {
    if (ready() != CUDA_SUCCESS || !valid_dev(dev)) return 0;
    return fake_state_executed(F.st, dev);
}

/* ---- cuGetProcAddress: base name + cudaVersion + stream flavour -> versioned entry point */

struct proc {
    const char *base;
    int min_version;
    int per_thread;
    void *fn;
};

#define P(base, ver, ptds, fn) {#base, ver, ptds, (void *)&fn}
static const struct proc procs[] = {
    P(cuInit, 2000, 0, cuInit), P(cuDriverGetVersion, 2020, 0, cuDriverGetVersion),
    P(cuDeviceGet, 2000, 0, cuDeviceGet), P(cuDeviceGetCount, 2000, 0, cuDeviceGetCount),
    P(cuDeviceGetName, 2000, 0, cuDeviceGetName), P(cuDeviceGetUuid, 9020, 0, cuDeviceGetUuid),
    P(cuDeviceGetUuid, 11040, 0, cuDeviceGetUuid_v2), P(cuDeviceTotalMem, 3020, 0, cuDeviceTotalMem_v2),
    P(cuCtxCreate, 3020, 0, cuCtxCreate_v2), P(cuCtxCreate, 11040, 0, cuCtxCreate_v3),
    P(cuCtxCreate, 12050, 0, cuCtxCreate_v4), P(cuCtxDestroy, 4000, 0, cuCtxDestroy_v2),
    P(cuCtxGetCurrent, 4000, 0, cuCtxGetCurrent), P(cuCtxSetCurrent, 4000, 0, cuCtxSetCurrent),
    P(cuCtxGetDevice, 2000, 0, cuCtxGetDevice), P(cuCtxSynchronize, 2000, 0, cuCtxSynchronize),
    P(cuDevicePrimaryCtxRetain, 7000, 0, cuDevicePrimaryCtxRetain),
    P(cuDevicePrimaryCtxRelease, 11000, 0, cuDevicePrimaryCtxRelease_v2),
    P(cuDevicePrimaryCtxReset, 11000, 0, cuDevicePrimaryCtxReset_v2),
    P(cuMemAlloc, 3020, 0, cuMemAlloc_v2), P(cuMemAllocPitch, 3020, 0, cuMemAllocPitch_v2),
    P(cuMemAllocManaged, 6000, 0, cuMemAllocManaged), P(cuMemAllocAsync, 11020, 0, cuMemAllocAsync),
    P(cuMemAllocAsync, 11020, 1, cuMemAllocAsync_ptsz),
    P(cuMemAllocFromPoolAsync, 11020, 0, cuMemAllocFromPoolAsync),
    P(cuMemAllocFromPoolAsync, 11020, 1, cuMemAllocFromPoolAsync_ptsz), P(cuMemFree, 3020, 0, cuMemFree_v2),
    P(cuMemFreeAsync, 11020, 0, cuMemFreeAsync), P(cuMemFreeAsync, 11020, 1, cuMemFreeAsync_ptsz),
    P(cuMemCreate, 10020, 0, cuMemCreate), P(cuMemRelease, 10020, 0, cuMemRelease),
    P(cuArrayCreate, 3020, 0, cuArrayCreate_v2), P(cuArray3DCreate, 3020, 0, cuArray3DCreate_v2),
    P(cuArrayDestroy, 2000, 0, cuArrayDestroy), P(cuMipmappedArrayCreate, 5000, 0, cuMipmappedArrayCreate),
    P(cuMipmappedArrayDestroy, 5000, 0, cuMipmappedArrayDestroy), P(cuMemGetInfo, 3020, 0, cuMemGetInfo_v2),
    P(cuLaunchKernel, 4000, 0, cuLaunchKernel), P(cuLaunchKernel, 7000, 1, cuLaunchKernel_ptsz),
    P(cuLaunchKernelEx, 11060, 0, cuLaunchKernelEx), P(cuLaunchKernelEx, 11060, 1, cuLaunchKernelEx_ptsz),
    P(cuLaunchCooperativeKernel, 9000, 0, cuLaunchCooperativeKernel),
    P(cuLaunchCooperativeKernel, 9000, 1, cuLaunchCooperativeKernel_ptsz),
    P(cuGraphLaunch, 10000, 0, cuGraphLaunch), P(cuGraphLaunch, 10000, 1, cuGraphLaunch_ptsz),
    P(cuModuleLoadData, 2000, 0, cuModuleLoadData), P(cuModuleGetFunction, 2000, 0, cuModuleGetFunction),
    P(cuModuleUnload, 2000, 0, cuModuleUnload), P(cuStreamCreate, 2000, 0, cuStreamCreate),
    P(cuStreamDestroy, 4000, 0, cuStreamDestroy_v2), P(cuStreamSynchronize, 2000, 0, cuStreamSynchronize),
    P(cuStreamIsCapturing, 10000, 0, cuStreamIsCapturing), P(cuStreamBeginCapture, 10010, 0, cuStreamBeginCapture_v2),
    P(cuStreamEndCapture, 10000, 0, cuStreamEndCapture),
    P(cuGetErrorName, 6000, 0, cuGetErrorName), P(cuGetErrorString, 6000, 0, cuGetErrorString),
    P(cuGetProcAddress, 11030, 0, cuGetProcAddress), P(cuGetProcAddress, 12000, 0, cuGetProcAddress_v2),
};
#undef P

HAMI_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                         CUdriverProcAddressQueryResult *symbolStatus) {
    if (symbol == NULL || pfn == NULL) return CUDA_ERROR_INVALID_VALUE;
    int want_ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const struct proc *best = NULL;
    int known = 0;
    for (int pass = 0; pass < 2 && best == NULL; pass++) {
        for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
            const struct proc *p = &procs[i];
            if (strcmp(p->base, symbol) != 0) continue;
            known = 1;
            if (p->min_version > cudaVersion || p->per_thread != (pass == 0 ? want_ptds : 0)) continue;
            if (best == NULL || p->min_version > best->min_version) best = p;
        }
        if (!want_ptds) break;
    }
    *pfn = best != NULL ? best->fn : NULL;
    if (symbolStatus != NULL)
        *symbolStatus = best != NULL ? CU_GET_PROC_ADDRESS_SUCCESS
                        : known      ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                                     : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return best != NULL ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

HAMI_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}

__attribute__((destructor)) static void fake_cuda_exit(void) {
    /* Give this process's bytes back at exit, as the real driver does when a process ends. */
    if (F.st != NULL) fake_state_leave(F.st);
}
