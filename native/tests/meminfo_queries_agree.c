/* cuMemGetInfo_v2, cuDeviceTotalMem_v2, nvmlDeviceGetMemoryInfo and _v2 agree, before and after
 * an allocation: total = min(limit, physical), free = total - used, never negative.
 * Usage: meminfo_queries_agree <expected total bytes> <MiB to allocate>; prints the views. */
#include "common.h"
#include "nvml_types.h"

static void check_agree(unsigned long long want_total, const char *when) {
    size_t free_cu = 0, total_cu = 0, total_dev = 0;
    CHECK_RC(cuMemGetInfo_v2(&free_cu, &total_cu), CUDA_SUCCESS);
    CHECK_RC(cuDeviceTotalMem_v2(&total_dev, 0), CUDA_SUCCESS);
    nvmlDevice_t dev = NULL;
    nvmlMemory_t m1;
    nvmlMemory_v2_t m2 = {.version = nvmlMemory_v2};
    CHECK(nvmlInit_v2() == NVML_SUCCESS);
    CHECK(nvmlDeviceGetHandleByIndex_v2(0, &dev) == NVML_SUCCESS);
    CHECK(nvmlDeviceGetMemoryInfo(dev, &m1) == NVML_SUCCESS);
    CHECK(nvmlDeviceGetMemoryInfo_v2(dev, &m2) == NVML_SUCCESS);
    printf("%s: cuMemGetInfo free=%zu total=%zu cuDeviceTotalMem=%zu nvml total=%llu free=%llu used=%llu "
           "nvml_v2 total=%llu free=%llu used=%llu container=%llu\n",
           when, free_cu, total_cu, total_dev, m1.total, m1.free, m1.used, m2.total, m2.free, m2.used,
           (unsigned long long)test_container_usage(0));
    CHECK_EQ(total_cu, want_total);
    CHECK_EQ(total_dev, want_total);
    CHECK_EQ(m1.total, want_total);
    CHECK_EQ(m2.total, want_total);
    CHECK_EQ(m1.free, free_cu);
    CHECK_EQ(m2.free, free_cu);
    CHECK_EQ(m1.used, m2.used);
    CHECK(free_cu <= total_cu);
    unsigned long long used = test_container_usage(0);
    CHECK_EQ(m1.used, used);
    CHECK_EQ(free_cu, used < want_total ? want_total - used : 0);
}

int main(int argc, char **argv) {
    CHECK(argc == 3);
    unsigned long long want_total = strtoull(argv[1], NULL, 10), mib = strtoull(argv[2], NULL, 10);
    test_context();
    check_agree(want_total, "before");
    CUdeviceptr p = 0;
    if (mib != 0) CHECK_RC(cuMemAlloc_v2(&p, mib * MiB), CUDA_SUCCESS);
    check_agree(want_total, "after");
    if (p != 0) CHECK_RC(cuMemFree_v2(p), CUDA_SUCCESS);
    check_agree(want_total, "freed");
    return 0;
}
