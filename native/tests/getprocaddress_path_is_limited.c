/* Allocation functions found through cuGetProcAddress (11.3 and 12+ forms, legacy and per-thread
 * stream flavours) and through dlsym are limited exactly like the exported symbols. 64 MiB limit. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "common.h"

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*getproc_fn)(const char *, void **, int, cuuint64_t);

static void check_limited(alloc_fn fn, free_fn release) {
    CUdeviceptr a = 0, b = 0;
    CHECK_RC(fn(&a, 40 * MiB), CUDA_SUCCESS);
    CHECK_EQ(test_own_usage(0), 40 * MiB);
    CHECK_RC(fn(&b, 40 * MiB), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_EQ(test_own_usage(0), 40 * MiB);
    CHECK_RC(release(a), CUDA_SUCCESS);
    CHECK_EQ(test_own_usage(0), 0);
}

int main(void) {
    test_context();
    void *fn = NULL, *fn_free = NULL;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;

    /* CUDA 11.3 form. */
    CHECK_RC(cuGetProcAddress("cuMemAlloc", &fn, 11030, CU_GET_PROC_ADDRESS_DEFAULT), CUDA_SUCCESS);
    CHECK_RC(cuGetProcAddress("cuMemFree", &fn_free, 11030, CU_GET_PROC_ADDRESS_DEFAULT), CUDA_SUCCESS);
    check_limited((alloc_fn)fn, (free_fn)fn_free);

    /* CUDA 12+ form with symbolStatus. */
    CHECK_RC(cuGetProcAddress_v2("cuMemAlloc", &fn, 12040, CU_GET_PROC_ADDRESS_DEFAULT, &status), CUDA_SUCCESS);
    CHECK_EQ(status, CU_GET_PROC_ADDRESS_SUCCESS);
    check_limited((alloc_fn)fn, (free_fn)fn_free);

    /* cuGetProcAddress found through cuGetProcAddress, then used. */
    void *getproc = NULL;
    CHECK_RC(cuGetProcAddress_v2("cuGetProcAddress", &getproc, 11030, 0, &status), CUDA_SUCCESS);
    CHECK_RC(((getproc_fn)getproc)("cuMemAlloc", &fn, 12000, 0), CUDA_SUCCESS);
    check_limited((alloc_fn)fn, (free_fn)fn_free);

    /* Per-thread default stream flavour. */
    CHECK_RC(cuGetProcAddress_v2("cuMemAllocAsync", &fn, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
                                 &status),
             CUDA_SUCCESS);
    CUdeviceptr a = 0, b = 0;
    CHECK_RC(((alloc_async_fn)fn)(&a, 40 * MiB, NULL), CUDA_SUCCESS);
    CHECK_RC(((alloc_async_fn)fn)(&b, 40 * MiB, NULL), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_RC(cuMemFreeAsync_ptsz(a, NULL), CUDA_SUCCESS);
    CHECK_EQ(test_own_usage(0), 0);

    /* dlopen + dlsym, as runtimes and ctypes do. */
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    CHECK(lib != NULL);
    check_limited((alloc_fn)dlsym(lib, "cuMemAlloc_v2"), (free_fn)dlsym(lib, "cuMemFree_v2"));

    /* A version too old for the symbol is the driver's answer, passed through. */
    CHECK_RC(cuGetProcAddress_v2("cuMemAllocAsync", &fn, 11000, 0, &status), CUDA_ERROR_NOT_FOUND);
    CHECK_EQ(status, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    printf("ok\n");
    return 0;
}
