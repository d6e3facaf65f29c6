/* Every allocation path: within the limit it succeeds and is accounted exactly; past the limit it
 * returns CUDA_ERROR_OUT_OF_MEMORY and allocates nothing; its free gives everything back.
 * Usage: alloc_past_limit_returns_oom <path>, with a 64 MiB limit on device 0. */
#include <string.h>

#include "common.h"

unsigned long long fakecuda_process_used(int dev);

struct handle {
    CUdeviceptr ptr;
    CUarray array;
    CUmipmappedArray mipmap;
    CUmemGenericAllocationHandle generic;
};

/* Allocates `mib` MiB by `path`; returns the driver's answer. */
static CUresult alloc(const char *path, unsigned long long mib, struct handle *h) {
    size_t bytes = mib * MiB, pitch = 0;
    memset(h, 0, sizeof *h);
    if (strcmp(path, "cuMemAlloc_v2") == 0) return cuMemAlloc_v2(&h->ptr, bytes);
    if (strcmp(path, "cuMemAllocPitch_v2") == 0) {
        CUresult rc = cuMemAllocPitch_v2(&h->ptr, &pitch, 1024, mib * 1024, 4);
        if (rc == CUDA_SUCCESS) CHECK_EQ(pitch, 1024);
        return rc;
    }
    if (strcmp(path, "cuMemAllocManaged") == 0) return cuMemAllocManaged(&h->ptr, bytes, CU_MEM_ATTACH_GLOBAL);
    if (strcmp(path, "cuMemAllocAsync") == 0) return cuMemAllocAsync(&h->ptr, bytes, NULL);
    if (strcmp(path, "cuMemAllocAsync_ptsz") == 0) return cuMemAllocAsync_ptsz(&h->ptr, bytes, NULL);
    if (strcmp(path, "cuMemAllocFromPoolAsync") == 0) return cuMemAllocFromPoolAsync(&h->ptr, bytes, NULL, NULL);
    if (strcmp(path, "cuMemAllocFromPoolAsync_ptsz") == 0)
        return cuMemAllocFromPoolAsync_ptsz(&h->ptr, bytes, NULL, NULL);
    if (strcmp(path, "cuMemCreate") == 0) {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        return cuMemCreate(&h->generic, bytes, &prop, 0);
    }
    if (strcmp(path, "cuArrayCreate_v2") == 0) {
        CUDA_ARRAY_DESCRIPTOR d = {.Width = 1024, .Height = mib * 256, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
        return cuArrayCreate_v2(&h->array, &d);
    }
    if (strcmp(path, "cuArray3DCreate_v2") == 0) {
        CUDA_ARRAY3D_DESCRIPTOR d = {.Width = 512, .Height = 256, .Depth = mib * 2, .Format = CU_AD_FORMAT_HALF,
                                     .NumChannels = 2, .Flags = 0};
        return cuArray3DCreate_v2(&h->array, &d);
    }
    if (strcmp(path, "cuMipmappedArrayCreate") == 0) {
        CUDA_ARRAY3D_DESCRIPTOR d = {.Width = 4096, .Height = mib * 256, .Depth = 0,
                                     .Format = CU_AD_FORMAT_UNSIGNED_INT8, .NumChannels = 1, .Flags = 0};
        return cuMipmappedArrayCreate(&h->mipmap, &d, 1);
    }
    fprintf(stderr, "unknown path %s\n", path);
    exit(2);
}

static CUresult release(const char *path, const struct handle *h) {
    if (strcmp(path, "cuMemCreate") == 0) return cuMemRelease(h->generic);
    if (strncmp(path, "cuArray", 7) == 0) return cuArrayDestroy(h->array);
    if (strcmp(path, "cuMipmappedArrayCreate") == 0) return cuMipmappedArrayDestroy(h->mipmap);
    if (strcmp(path, "cuMemAllocAsync_ptsz") == 0 || strcmp(path, "cuMemAllocFromPoolAsync_ptsz") == 0)
        return cuMemFreeAsync_ptsz(h->ptr, NULL);
    if (strncmp(path, "cuMemAlloc", 10) == 0 && strstr(path, "Async") != NULL) return cuMemFreeAsync(h->ptr, NULL);
    return cuMemFree_v2(h->ptr);
}

int main(int argc, char **argv) {
    CHECK(argc == 2);
    const char *path = argv[1];
    test_context();
    struct handle first, second, whole;

    CHECK_RC(alloc(path, 48, &first), CUDA_SUCCESS);
    CHECK_EQ(test_own_usage(0), 48 * MiB);
    CHECK_EQ(fakecuda_process_used(0), 48 * MiB);

    /* 48 + 32 > 64: refused, and nothing reached the driver. */
    CHECK_RC(alloc(path, 32, &second), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_EQ(test_own_usage(0), 48 * MiB);
    CHECK_EQ(fakecuda_process_used(0), 48 * MiB);

    /* 48 + 16 == 64: the limit itself is allowed. */
    CHECK_RC(alloc(path, 16, &second), CUDA_SUCCESS);
    CHECK_EQ(test_own_usage(0), 64 * MiB);
    CHECK_RC(alloc(path, 1, &whole), CUDA_ERROR_OUT_OF_MEMORY);

    CHECK_RC(release(path, &first), CUDA_SUCCESS);
    CHECK_RC(release(path, &second), CUDA_SUCCESS);
    CHECK_EQ(test_own_usage(0), 0);
    CHECK_EQ(fakecuda_process_used(0), 0);

    CHECK_RC(alloc(path, 64, &whole), CUDA_SUCCESS);
    CHECK_EQ(test_own_usage(0), 64 * MiB);
    CHECK_RC(release(path, &whole), CUDA_SUCCESS);
    CHECK_EQ(test_own_usage(0), 0);
    printf("ok %s\n", path);
    return 0;
}
