/* Frees of memory the interposer never saw allocated reach the driver (and succeed), and never
 * push the region's counters below zero; a double free is the driver's error, passed through. */
#include "common.h"

CUdeviceptr fakecuda_alloc_unseen(int dev, size_t bytes);
unsigned long long fakecuda_process_used(int dev);

int main(void) {
    test_context();
    CUdeviceptr tracked = 0;
    CHECK_RC(cuMemAlloc_v2(&tracked, 8 * MiB), CUDA_SUCCESS);

    CUdeviceptr unseen = fakecuda_alloc_unseen(0, 32 * MiB);
    CHECK(unseen != 0);
    CHECK_EQ(fakecuda_process_used(0), 40 * MiB);
    CHECK_EQ(test_own_usage(0), 8 * MiB);

    CHECK_RC(cuMemFree_v2(unseen), CUDA_SUCCESS);
    CHECK_EQ(fakecuda_process_used(0), 8 * MiB);
    CHECK_EQ(test_own_usage(0), 8 * MiB);

    CUdeviceptr unseen_async = fakecuda_alloc_unseen(0, 16 * MiB);
    CHECK_RC(cuMemFreeAsync(unseen_async, NULL), CUDA_SUCCESS);
    CHECK_EQ(fakecuda_process_used(0), 8 * MiB);

    CHECK_RC(cuMemFree_v2(tracked), CUDA_SUCCESS);
    CHECK_EQ(test_own_usage(0), 0);
    CHECK_RC(cuMemFree_v2(tracked), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemFree_v2(0xdead0000ULL), CUDA_ERROR_INVALID_VALUE);
    CHECK_EQ(test_own_usage(0), 0);
    CHECK_EQ(fakecuda_process_used(0), 0);
    printf("ok\n");
    return 0;
}
