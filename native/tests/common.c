#include "common.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

CUcontext test_context(void) {
    CUcontext ctx = NULL;
    CUdevice dev = 0;
    CHECK_RC(cuInit(0), CUDA_SUCCESS);
    CHECK_RC(cuDeviceGet(&dev, 0), CUDA_SUCCESS);
    CHECK_RC(cuCtxCreate_v2(&ctx, 0, dev), CUDA_SUCCESS);
    return ctx;
}

const struct hami_region *test_region(void) {
    static const struct hami_region *region;
    if (region != NULL) return region;
    const char *path = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    CHECK(path != NULL);
    int fd = open(path, O_RDONLY);
    CHECK(fd >= 0);
    void *mem = mmap(NULL, HAMI_REGION_FILE_SIZE, PROT_READ, MAP_SHARED, fd, 0);
    CHECK(mem != MAP_FAILED);
    close(fd);
    region = mem;
    return region;
}

uint64_t test_own_usage(int dev) {
    const struct hami_region *r = test_region();
    for (int i = 0; i < r->proc_num; i++) {
        if (r->procs[i].status != 0 && r->procs[i].pid == getpid()) return r->procs[i].used[dev].total;
    }
    return 0;
}

uint64_t test_container_usage(int dev) {
    const struct hami_region *r = test_region();
    uint64_t sum = 0;
    for (int i = 0; i < r->proc_num; i++) {
        if (r->procs[i].status != 0) sum += r->procs[i].used[dev].total;
    }
    return sum;
}
